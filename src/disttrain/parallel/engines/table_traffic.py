"""The bytes ``disttrain_recsys`` sends between ranks around its sharded tables, measured at the collectives.

Every lookup of a sharded table is all-to-alls: ids and lengths to the ranks holding their tables (integers), then
the pooled embeddings back (forward) and their gradients out again (backward), in the dtype of ``comm_precision``
(torchrec's quantized comms codecs encode them before the collective). :class:`TableTraffic` sees each
``all_to_all_single`` this process starts (:func:`disttrain.patches.count_all_to_all`) and adds what the call hands
to other ranks: the input tensor's bytes less the part this rank keeps.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from disttrain import patches


class TableTraffic:
    """Bytes this rank has handed to all-to-alls since it was made: ``sent["embeddings"]`` (floating point: pooled
    embeddings and their gradients) and ``sent["ids"]`` (integers: ids, lengths, split sizes)."""

    def __init__(self) -> None:
        self.sent = {"embeddings": 0, "ids": 0}
        patches.count_all_to_all(self)

    def total(self) -> int:
        return sum(self.sent.values())

    def add_all_to_all(self, input: torch.Tensor, input_split_sizes: Optional[list[int]], group: Any) -> None:
        rows = input.shape[0] if input.dim() else input.numel()
        if not rows:
            return
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        kept = input_split_sizes[rank] if input_split_sizes else rows // world
        row_bytes = input.numel() * input.element_size() // rows
        kind = "embeddings" if input.is_floating_point() else "ids"
        self.sent[kind] += (rows - kept) * row_bytes
