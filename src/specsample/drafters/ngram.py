"""Prompt-lookup / n-gram drafting: propose what followed the longest recent repeat of the context.

Deterministic (one-hot draft probabilities), so it needs no draft model and the verifier's
rejection rule reduces to "accept with the target's probability of the proposed token".
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from specsample.config import SamplingParams
from specsample.drafters.base import Proposal


def find_continuation(history: Sequence[int] | np.ndarray, max_tokens: int, min_n: int = 1,
                      max_n: int = 4) -> tuple[list[int], int]:
    """Tokens that followed the most recent earlier occurrence of the longest suffix n-gram.

    Tries n = max_n down to min_n; the longest matching n wins, the most recent occurrence wins
    among equals. Returns `(continuation, n)`; `([], 0)` when nothing matches.
    """
    tokens = np.asarray(history, dtype=np.int64)
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = tokens[-n:]
        windows = sliding_window_view(tokens[:-1], n)  # every earlier n-gram with a next token
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start:start + max_tokens].tolist(), n
    return [], 0


class NgramDrafter:
    """Drafts by prompt lookup over each row's prompt and output so far."""

    vocab_size = None  # proposes token ids from the context: works with any vocabulary

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.history: dict[int, list[int]] = {}

    def allocate(self, num_slots: int, max_len: int) -> None:
        self.history.clear()

    def add_rows(self, slots: Sequence[int], prompts: Sequence[Sequence[int]]) -> None:
        for slot, prompt in zip(slots, prompts):
            self.history[slot] = list(prompt)

    def release_rows(self, slots: Sequence[int]) -> None:
        for slot in slots:
            self.history.pop(slot, None)

    def propose(self, slots: Sequence[int], gamma: int, max_drafts: Sequence[int],
                params: Sequence[SamplingParams], generators: Sequence[torch.Generator],
                stop_thresholds: Sequence[float] = ()) -> Proposal:
        tokens = torch.zeros(len(slots), gamma, dtype=torch.long)
        counts = []
        for row, (slot, limit) in enumerate(zip(slots, max_drafts)):
            found, _ = find_continuation(self.history[slot], min(gamma, limit), self.min_n, self.max_n)
            tokens[row, : len(found)] = torch.tensor(found, dtype=torch.long)
            counts.append(len(found))
        return Proposal(tokens=tokens, probs=None, num_drafted=torch.tensor(counts, dtype=torch.long))

    def commit(self, slots: Sequence[int], committed: Sequence[Sequence[int]]) -> None:
        for slot, new in zip(slots, committed):
            self.history[slot].extend(new)
