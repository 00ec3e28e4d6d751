"""The tensors one forward pass reads: the contract between the model runner and the model.

The model runner flattens every scheduled sequence's new tokens into one batch::

    input_ids:  | seq 0 new tokens | seq 1 new tokens | ... |      (T tokens in all)
                ^ query_start_loc[0]  ^ query_start_loc[1]       query_start_loc[B] == T

Sequence ``i`` has ``seq_lens[i]`` tokens of context *after* this step, of which the last
``query_start_loc[i+1] - query_start_loc[i]`` are new; the earlier ones are already in the
paged KV cache. Its KV lives in the blocks ``block_tables[group][i, :]``: token ``p`` of the
sequence is at block ``block_tables[group][i, p // block_size]``, offset ``p % block_size``.
The new tokens' KV is written to the flat slots ``slot_mapping[group]`` (``block * block_size +
offset``) before attention reads the context.

A cache group holds the layers of one attention type (``"full"`` or ``"sliding"``). For a sliding
group, entries of a block table that lie wholly before the window of the sequence's first new
token may be stale (those blocks were freed): attention never reads them.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from replicas.model.paged_attention import PagedAttentionMetadata


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, position of each token in its sequence
    query_start_loc: list[int]  # [B + 1] offsets of each sequence's new tokens in input_ids
    seq_lens: list[int]  # [B] context length of each sequence including its new tokens
    block_tables: dict[str, torch.Tensor]  # group -> [B, max_blocks] int64
    slot_mapping: dict[str, torch.Tensor]  # group -> [T] int64 flat slot of each new token
    logits_indices: torch.Tensor  # [B'] int64 rows of the hidden states to turn into logits
    # The last ``num_solo_seqs`` sequences (one new token each: draft tokens being verified)
    # attend each alone over exactly its keys, as the decode it stands for would when alone,
    # not padded into the group of the other decodes (padding changes the rounding).
    num_solo_seqs: int = 0
    # On a GPU, each group's metadata for the paged attention kernels, built by the model
    # runner as device tensors (``replicas.model.paged_attention``); then the host lists above
    # are not read by the forward, which a CUDA graph may replay.
    paged: "dict[str, PagedAttentionMetadata] | None" = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)
