"""Preallocated KV caches with a length per row; rollback lowers the length (O(1)).

Entries past a row's length are stale and never read: attention masks keys at positions beyond each
query's own position, so a rejected suffix is simply overwritten by the next round.
"""

from __future__ import annotations

import torch
from torch import Tensor


class RowLengths:
    """Per-row valid lengths: the bookkeeping every model cache shares (rollback is an integer)."""

    lengths: Tensor  # [num_slots] long, on CPU

    @property
    def num_slots(self) -> int:
        """Number of rows the cache can hold."""
        return self.lengths.shape[0]

    def truncate(self, slots: Tensor, lengths: Tensor) -> None:
        """Roll `slots` back to `lengths` tokens: the O(1) rollback of rejected drafts."""
        lengths = lengths.to(torch.long).cpu()
        if bool((lengths > self.lengths[slots.cpu()]).any()) or bool((lengths < 0).any()):
            raise ValueError("truncate can only shorten a row")
        self.lengths[slots.cpu()] = lengths

    def reset(self, slots: Tensor) -> None:
        """Empty the given rows so a new request can use them."""
        self.lengths[slots.cpu()] = 0


class KVCache(RowLengths):
    """Keys and values for `num_slots` rows of up to `max_len` tokens, per layer.

    Layout per layer: `[num_slots, kv_heads, max_len, head_dim]` (a row's keys per head are
    contiguous, as attention reads them). `lengths[slot]` counts the valid tokens in that slot.
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        max_len: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        # one tensor per kind, allocated as [1 + layers * slots, ...]: a compiled step reads that (it has no base, so
        # its guards hold for any number of slots, 1 included); everything else reads the 5-d views. Row 0 is
        # spare, never written or read: the rows a compiled step reads as a view then never start the tensor (where
        # they did, inductor's overlap analysis would take a graph of its own for that case)
        flat = (1 + num_layers * num_slots, kv_heads, max_len, head_dim)
        self.flat_keys = torch.zeros(flat, dtype=dtype, device=device)
        self.flat_values = torch.zeros(flat, dtype=dtype, device=device)
        shape = (num_layers, num_slots, kv_heads, max_len, head_dim)
        self.key_store, self.value_store = self.flat_keys[1:].view(shape), self.flat_values[1:].view(shape)
        self.keys = list(self.key_store.unbind(0))  # per-layer views
        self.values = list(self.value_store.unbind(0))
        self.lengths = torch.zeros(num_slots, dtype=torch.long)  # on CPU: bookkeeping, not math
        self.max_len = max_len

    @property
    def bytes_per_token(self) -> int:
        """Memory one token's keys and values take, every layer."""
        layers, _, heads, _, dim = self.key_store.shape
        return 2 * layers * heads * dim * self.key_store.element_size()

    def reserve(self, slots: Tensor, num_new: int) -> Tensor:
        """Check room for `num_new` tokens in each slot; return their start positions `[b]`."""
        starts = self.lengths[slots.cpu()]
        if bool((starts + num_new > self.max_len).any()):
            raise ValueError(
                f"KV cache full: a row would need {int(starts.max()) + num_new} positions, "
                f"the cache holds {self.max_len}"
            )
        return starts

    def copy_prefix(self, source: int, slot: int, length: int) -> None:
        """Make row `slot` hold the first `length` entries of row `source` (every layer's keys and values); `source`
        is unchanged. Both runtimes read these stores (the fused step through `flat_keys`, a view of them)."""
        if not 0 <= length <= int(self.lengths[source]):
            raise ValueError(f"row {source} holds {int(self.lengths[source])} entries, cannot copy {length}")
        if slot != source:
            self.key_store[:, slot, :, :length] = self.key_store[:, source, :, :length]
            self.value_store[:, slot, :, :length] = self.value_store[:, source, :, :length]
        self.lengths[slot] = length

    def keep_path(self, slot: int, start: int, indices: list[int]) -> None:
        """Keep, of a block appended at `start` in row `slot`, the entries at block `indices` (increasing: the pending
        token's and an accepted path's), moved to `start`, `start + 1`, ...; the row's length becomes
        `start + len(indices)`. Each entry moves down or stays, so the moves never overwrite one still to be read."""
        for i, index in enumerate(indices):
            if index < i:
                raise ValueError(f"block indices {indices} must be increasing")
            if index != i:
                self.key_store[:, slot, :, start + i] = self.key_store[:, slot, :, start + index]
                self.value_store[:, slot, :, start + i] = self.value_store[:, slot, :, start + index]
        self.lengths[slot] = start + len(indices)
