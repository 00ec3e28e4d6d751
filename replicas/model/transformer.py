"""A decoder-only transformer (Llama / Qwen2 / Qwen3 family) over the block KV cache.

The model knows nothing of requests or cache policy: it reads and writes KV only through the
block tables and slot mappings of a ForwardBatch. Shapes: ``T`` tokens in the batch, ``H`` query
heads, ``Hkv`` KV heads, ``D`` head dim.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from replicas.model.attention import AttentionMetadata, cached_attention, strata_attends
from replicas.model.batch import ForwardBatch
from replicas.model.compiled import CompiledLayers, run_layers
from replicas.model.config import KVCacheSpec, ModelArgs
from replicas.model.gpu_layers import run_paged_layers
from replicas.model.kv_format import KVFormat, kv_format
from replicas.model.native_stack import NativeStack


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalised in float32 whatever the model dtype, as the reference implementations do:
        # rms_norm computes in float32 and rounds once to x's dtype, as x.float() -> rms_norm
        # -> .to(x.dtype) does, bit for bit, in two ops fewer.
        return self.weight * F.rms_norm(x, x.shape[-1:], eps=self.eps)


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """[D/2] float32 inverse frequencies, with llama3 long-context scaling when configured."""
    dim = args.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (args.rope_theta**exponents)
    if args.rope_type != "llama3":
        return inv_freq
    scaling = args.rope_scaling or {}
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context_len = scaling.get("original_max_position_embeddings", args.max_position_embeddings)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are stretched by `factor`, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos, sin: [T, 1, D]. Rotates the two halves of D (the HF layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, group: str, layer_in_group: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            args.num_heads,
            args.num_kv_heads,
            args.head_dim,
        )
        self.group = group
        self.layer_in_group = layer_in_group
        q_dim, kv_dim = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        self.wq = nn.Linear(args.hidden_size, q_dim, bias=args.attention_bias)
        self.wk = nn.Linear(args.hidden_size, kv_dim, bias=args.attention_bias)
        self.wv = nn.Linear(args.hidden_size, kv_dim, bias=args.attention_bias)
        self.wo = nn.Linear(q_dim, args.hidden_size, bias=False)
        self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        # q, k and v as one product, in place of wq, wk and wv (``replicas.model.quant``).
        self.wqkv: nn.Module | None = None
        self.qkv_sizes = (q_dim, kv_dim, kv_dim)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, 1, D]
        sin: torch.Tensor,
        kv_cache: torch.Tensor,  # [num_blocks, layers_in_group, 2, block_size, Hkv, D]
        meta: AttentionMetadata | None,  # None: in a compiled graph (``replicas.model.compiled``)
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        heads = (self.num_heads, self.num_kv_heads)
        if self.wqkv is not None and self.q_norm is None:
            # q and k side by side in one product: one rotation for both heads' worth.
            qkv = self.wqkv(x)
            qk_dim = self.qkv_sizes[0] + self.qkv_sizes[1]
            qk = qkv[:, :qk_dim].view(num_tokens, sum(heads), self.head_dim)
            q, k = apply_rope(qk, cos, sin).split(heads, dim=1)  # [T, H, D], [T, Hkv, D]
            v = qkv[:, qk_dim:].view(num_tokens, self.num_kv_heads, self.head_dim)
        else:
            if self.wqkv is None:
                q, k, v = self.wq(x), self.wk(x), self.wv(x)
            else:
                q, k, v = self.wqkv(x).split(self.qkv_sizes, dim=-1)
            q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, H, D]
            k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
            v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
            if self.q_norm is not None and self.k_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if meta is None:
            out = torch.ops.strata.cached_attention(
                q, k, v, kv_cache, self.layer_in_group, self.group
            )
        else:
            out = cached_attention(q, k, v, kv_cache, self.layer_in_group, meta)  # [T, H, D]
        return self.wo(out.reshape(num_tokens, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)  # gate
        self.w3 = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)  # up
        self.w2 = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)  # down
        # gate and up as one product, in place of w1 and w3 (``replicas.model.quant``).
        self.w13: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w13 is None:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, group: str, layer_in_group: int) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.attention = Attention(args, group, layer_in_group)
        self.ffn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata | None,
    ) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, kv_cache, meta)
        return x + self.feed_forward(self.ffn_norm(x))


def _embedding(num: int, dim: int) -> nn.Embedding:
    """``nn.Embedding(num, dim)``, not initialized where it is built on the meta device: a meta
    tensor has no values, and drawing them loads torch's decompositions (about a second, once
    per process), which a loader building the model's shape on meta never needs."""
    if torch.empty(0).device.type == "meta":
        return nn.Embedding(num, dim, _weight=torch.empty(num, dim))
    return nn.Embedding(num, dim)


class Transformer(nn.Module):
    """Embeddings, decoder blocks, final norm and LM head.

    Layer ``i`` belongs to cache group ``args.layer_types[i]`` and uses index ``i``'s rank among
    the layers of that group in the group's cache tensor.
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = _embedding(args.vocab_size, args.hidden_size)
        ranks = {group: 0 for group in args.layer_types}
        layers = []
        for group in args.layer_types:
            layers.append(TransformerBlock(args, group, ranks[group]))
            ranks[group] += 1
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.output = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.tie_weights()
        # float32 on purpose and not a buffer, so that casting the model cannot round it.
        self._inv_freq = rope_inv_freq(args)  # [D/2]
        self.compiled: CompiledLayers | None = None  # set by ``compile_layers``
        self.native: NativeStack | None = None  # set by ``use_native_stack``

    def compile_layers(self) -> None:
        """Run the decoder stack compiled from the next forward on (``replicas.model.compiled``;
        not ``nn.Module.compile``, which would trace attention's host-side metadata too)."""
        self.compiled = CompiledLayers(self.layers, self.norm)

    def use_native_stack(self, on: bool = True) -> None:
        """Run the decoder stack natively from the next forward on where the forward allows
        (``replicas.model.native_stack``; its library loaded); ``on=False``: eager again."""
        self.native = NativeStack() if on else None

    def tie_weights(self) -> None:
        """Shares the embedding matrix with the LM head when the model ties them.

        Called again after moving parameters off the meta device, which unties them. A
        quantized LM head keeps its own quantized copy of the matrix.
        """
        if self.args.tie_word_embeddings and isinstance(self.output, nn.Linear):
            self.output.weight = self.tok_embeddings.weight

    def kv_cache_specs(
        self, dtype: torch.dtype, kv_cache_dtype: str = "auto"
    ) -> dict[str, KVCacheSpec]:
        """One spec per cache group that has layers, "full" first, computing in ``dtype`` and
        storing K and V as ``kv_cache_dtype`` says (``replicas.model.kv_format``)."""
        fmt = kv_format(kv_cache_dtype, dtype)
        specs = {}
        for group in ("full", "sliding"):
            num_layers = self.args.layer_types.count(group)
            if num_layers:
                specs[group] = KVCacheSpec(
                    group=group,
                    num_layers=num_layers,
                    num_kv_heads=self.args.num_kv_heads,
                    head_dim=self.args.head_dim,
                    sliding_window=self.args.sliding_window if group == "sliding" else None,
                    dtype=dtype,
                    kv_format=fmt,
                )
        return specs

    def forward(
        self,
        batch: ForwardBatch,
        kv_caches: dict[str, torch.Tensor],
        kv_format: KVFormat | None = None,
    ) -> torch.Tensor:
        """Returns the final-norm hidden states [T, hidden] of every token of the batch.
        ``kv_format``: how the caches store K and V (``KVCacheSpec.kv_format``); None: as
        values in each cache's dtype."""
        x = self.tok_embeddings(batch.input_ids)  # [T, hidden]
        cos, sin = self._rope(batch.positions, x.dtype)  # [T, 1, D]
        if batch.paged is not None:  # on a GPU (``replicas.model.gpu_layers``)
            return run_paged_layers(self.layers, self.norm, x, cos, sin, kv_caches, batch.paged)
        metas = {
            group: AttentionMetadata.build(
                batch,
                group,
                block_size=cache.shape[3],
                sliding_window=self.args.sliding_window if group == "sliding" else None,
                kv_format=kv_format,
                whole_spans=strata_attends(x.device, kv_format, self.args.head_dim),
            )
            for group, cache in kv_caches.items()
            if group in self.args.layer_types
        }
        if self.compiled is not None:
            return self.compiled(x, cos, sin, kv_caches, metas)
        if self.native is not None and (meta := self.native.accepts(metas)) is not None:
            return self.native(self, x, cos, sin, kv_caches["full"], meta)
        return run_layers(self.layers, self.norm, x, cos, sin, kv_caches, metas)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> logits [N, vocab] float32."""
        return self.output(hidden).float()

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self._inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)
