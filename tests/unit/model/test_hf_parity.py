"""Our transformer over the block KV cache against transformers' reference implementation."""

import pytest
import torch

from replicas.model import load_model

transformers = pytest.importorskip("transformers")

BLOCK_SIZE = 4
NUM_BLOCKS = 24
ATOL = 1e-4
CPU = torch.device("cpu")


def llama_config():
    return transformers.LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=[2, 3],
    )


def qwen3_config(**kwargs):
    return transformers.Qwen3Config(
        architectures=["Qwen3ForCausalLM"],
        vocab_size=64,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
        eos_token_id=2,
        **kwargs,
    )


def qwen2_config(**kwargs):
    return transformers.Qwen2Config(
        architectures=["Qwen2ForCausalLM"],
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        eos_token_id=2,
        **kwargs,
    )


CONFIGS = {
    "llama-gqa-llama3rope-sharded": (llama_config, "40KB"),
    "qwen3-qknorm-tied": (qwen3_config, None),
    "qwen2-bias-mqa": (qwen2_config, None),
}


def hybrid_qwen3():
    return qwen3_config(
        use_sliding_window=True,
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    )


def hybrid_qwen2():
    return qwen2_config(use_sliding_window=True, sliding_window=6, max_window_layers=1)


def reference_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float()  # [T, vocab]


def new_caches(model) -> dict[str, torch.Tensor]:
    specs = model.kv_cache_specs(torch.float32)
    return {g: torch.zeros(s.shape(NUM_BLOCKS, BLOCK_SIZE)) for g, s in specs.items()}


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, 64, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_chunks(model, caches, make_batch, chunks) -> list[torch.Tensor]:
    """One forward of ``chunks``; the logits of every new token, split per chunk."""
    batch = make_batch(chunks, BLOCK_SIZE)
    with torch.no_grad():
        logits = model.compute_logits(model(batch, caches))
    q = batch.query_start_loc
    return [logits[q[i] : q[i + 1]] for i in range(len(chunks))]


@pytest.mark.parametrize("case", list(CONFIGS))
def test_full_prompt_matches_transformers(case, hf_checkpoint, make_batch, chunk):
    make_config, shard_size = CONFIGS[case]
    directory, hf_model = hf_checkpoint(make_config(), max_shard_size=shard_size)
    if shard_size:
        assert len(list(directory.glob("*.safetensors"))) > 1
    loaded = load_model(str(directory), CPU)
    tokens = prompt(21, seed=1)
    table = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(0)).tolist()
    tables = {g: table for g in loaded.model.kv_cache_specs(torch.float32)}
    [ours] = run_chunks(
        loaded.model, new_caches(loaded.model), make_batch, [chunk(tokens, 0, 21, tables)]
    )
    torch.testing.assert_close(ours, reference_logits(hf_model, tokens), atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("case", list(CONFIGS))
def test_chunked_prefill_then_decode_matches_transformers(case, hf_checkpoint, make_batch, chunk):
    make_config, shard_size = CONFIGS[case]
    directory, hf_model = hf_checkpoint(make_config(), max_shard_size=shard_size)
    model = load_model(str(directory), CPU).model
    tokens = prompt(23, seed=2)
    expected = reference_logits(hf_model, tokens)
    shuffled = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(3)).tolist()
    tables = {g: shuffled[:6] for g in model.kv_cache_specs(torch.float32)}
    caches = new_caches(model)
    schedule = [(0, 7), (7, 8)] + [(p, 1) for p in range(15, 23)]
    for start, num_new in schedule:
        [ours] = run_chunks(model, caches, make_batch, [chunk(tokens, start, num_new, tables)])
        torch.testing.assert_close(ours, expected[start : start + num_new], atol=ATOL, rtol=1e-4)


def test_mixed_batch_matches_separate_sequences(hf_checkpoint, make_batch, chunk):
    directory, hf_model = hf_checkpoint(llama_config())
    model = load_model(str(directory), CPU).model
    seq_a, seq_b = prompt(13, seed=4), prompt(12, seed=5)
    ref_a, ref_b = reference_logits(hf_model, seq_a), reference_logits(hf_model, seq_b)
    table_a = {"full": [9, 2, 17, 5]}
    table_b = {"full": [11, 0, 23]}
    caches = new_caches(model)
    steps = [
        [(seq_a, 0, 6, table_a), (seq_b, 0, 9, table_b)],  # two prefill chunks
        [(seq_a, 6, 5, table_a), (seq_b, 9, 1, table_b)],  # a chunk with context + a decode
        [(seq_b, 10, 1, table_b), (seq_a, 11, 1, table_a)],  # decodes only, in another order
    ]
    for step in steps:
        outs = run_chunks(model, caches, make_batch, [chunk(*s) for s in step])
        for (tokens, start, num_new, _), ours in zip(step, outs, strict=True):
            ref = ref_a if tokens is seq_a else ref_b
            torch.testing.assert_close(ours, ref[start : start + num_new], atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("make_config", [hybrid_qwen3, hybrid_qwen2], ids=["qwen3", "qwen2"])
def test_hybrid_sliding_window_never_reads_outside_the_window(
    make_config, hf_checkpoint, make_batch, chunk
):
    config = make_config()
    directory, hf_model = hf_checkpoint(config)
    loaded = load_model(str(directory), CPU)
    model, window = loaded.model, config.sliding_window
    assert loaded.args.sliding_window == window
    assert set(model.kv_cache_specs(torch.float32)) == {"full", "sliding"}
    tokens = prompt(26, seed=6)
    expected = reference_logits(hf_model, tokens)
    full_table = [20, 3, 15, 8, 1, 12, 6]
    sliding_table = [4, 19, 7, 0, 22, 10, 14]
    caches = new_caches(model)
    schedule = [(0, 9), (9, 7)] + [(p, 1) for p in range(16, 26)]
    for start, num_new in schedule:
        # Blocks wholly before the window of the first new token are freed: poison their
        # contents and their table entries, as a reused block and a stale table would be.
        first_kept = max(0, start - window + 1) // BLOCK_SIZE
        for block in sliding_table[:first_kept]:
            caches["sliding"][block] = float("nan")
        stale = [NUM_BLOCKS + 100] * first_kept + sliding_table[first_kept:]
        tables = {"full": full_table, "sliding": stale}
        [ours] = run_chunks(model, caches, make_batch, [chunk(tokens, start, num_new, tables)])
        torch.testing.assert_close(ours, expected[start : start + num_new], atol=ATOL, rtol=1e-4)


def test_hybrid_window_actually_limits_attention(hf_checkpoint, make_batch, chunk):
    """Tokens older than the window must not change the logits of sliding-only models."""
    config = qwen3_config(
        use_sliding_window=True, sliding_window=4, layer_types=["sliding_attention"] * 3
    )
    directory, _ = hf_checkpoint(config)
    model = load_model(str(directory), CPU).model
    tail = prompt(10, seed=7)
    a, b = prompt(6, seed=8) + tail, prompt(6, seed=9) + tail
    tables = {"sliding": list(range(5))}
    # With 3 sliding layers of window 4, the last token sees at most 3 * (4 - 1) = 9 tokens back.
    last_a = run_chunks(model, new_caches(model), make_batch, [chunk(a, 0, 16, tables)])[0][-1]
    last_b = run_chunks(model, new_caches(model), make_batch, [chunk(b, 0, 16, tables)])[0][-1]
    first_a = run_chunks(model, new_caches(model), make_batch, [chunk(a, 0, 11, tables)])[0][-1]
    first_b = run_chunks(model, new_caches(model), make_batch, [chunk(b, 0, 11, tables)])[0][-1]
    assert not torch.allclose(first_a, first_b)
    torch.testing.assert_close(last_a, last_b, atol=1e-5, rtol=1e-5)
