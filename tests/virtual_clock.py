"""A virtual clock that advances only when a model runs: timings, and so every decision gamma auto makes
from them, become a deterministic function of the work done, whatever the machine."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class VirtualClock:
    """Seconds of simulated work so far; pass `clock` where the engine reads the time."""

    now: float = 0.0

    def __call__(self) -> float:
        return self.now


class ClockedLM:
    """A model whose every forward advances `clock` by `base + per_token * rows * tokens` seconds."""

    def __init__(self, model, clock: VirtualClock, base: float, per_token: float) -> None:
        self.model, self.clock, self.base, self.per_token = model, clock, base, per_token
        self.vocab_size, self.max_seq_len = model.vocab_size, model.max_seq_len

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def output_subset(self) -> Tensor | None:
        return self.model.output_subset

    def _tick(self, tokens: Tensor) -> None:
        self.clock.now += self.base + self.per_token * tokens.shape[0] * tokens.shape[1]

    def new_cache(self, num_slots: int, max_len: int):
        return self.model.new_cache(num_slots, max_len)

    def forward_cached(self, tokens: Tensor, cache, slots: Tensor) -> Tensor:
        self._tick(tokens)
        return self.model.forward_cached(tokens, cache, slots)

    def forward_cached_last(self, tokens: Tensor, cache, slots: Tensor, last: Tensor) -> Tensor:
        self._tick(tokens)
        return self.model.forward_cached_last(tokens, cache, slots, last)

    def prefill(self, tokens: Tensor, cache, slots: Tensor) -> None:
        self._tick(tokens)
        self.model.prefill(tokens, cache, slots)
