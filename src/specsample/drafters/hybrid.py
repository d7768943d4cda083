"""Hybrid drafting: prompt lookup where the context repeats itself, the draft model elsewhere."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specsample.config import SamplingParams
from specsample.drafters.base import Proposal, merge_proposals
from specsample.drafters.model import ModelDrafter
from specsample.drafters.ngram import NgramDrafter, find_continuation


class HybridDrafter:
    """Per row and round: an n-gram continuation if the longest match is at least `min_match`
    tokens long, otherwise the draft model. Which one a row uses depends only on its history."""

    def __init__(self, model: ModelDrafter, ngram: NgramDrafter | None = None, min_match: int = 3) -> None:
        self.model = model
        self.ngram = ngram or NgramDrafter(min_n=min_match, max_n=max(min_match, 4))
        self.min_match = min_match
        self.vocab_size = model.vocab_size

    def allocate(self, num_slots: int, max_len: int) -> None:
        self.model.allocate(num_slots, max_len)
        self.ngram.allocate(num_slots, max_len)

    def add_rows(self, slots: Sequence[int], prompts: Sequence[Sequence[int]]) -> None:
        self.model.add_rows(slots, prompts)
        self.ngram.add_rows(slots, prompts)

    def release_rows(self, slots: Sequence[int]) -> None:
        self.model.release_rows(slots)
        self.ngram.release_rows(slots)

    def propose(self, slots: Sequence[int], gamma: int, max_drafts: Sequence[int], params: Sequence[SamplingParams],
                generators: Sequence[torch.Generator], stop_thresholds: Sequence[float] = ()) -> Proposal:
        lookups = [find_continuation(self.ngram.history[s], min(gamma, m), self.ngram.min_n, self.ngram.max_n)
                   for s, m in zip(slots, max_drafts)]
        ngram_rows = [i for i, (found, n) in enumerate(lookups) if n >= self.min_match and found]
        model_rows = [i for i in range(len(slots)) if i not in set(ngram_rows)]
        parts = []
        if model_rows:
            parts.append((model_rows, self.model.propose(
                [slots[i] for i in model_rows], gamma, [max_drafts[i] for i in model_rows],
                [params[i] for i in model_rows], [generators[i] for i in model_rows], stop_thresholds)))
        if ngram_rows:
            tokens = torch.zeros(len(ngram_rows), gamma, dtype=torch.long)
            for j, i in enumerate(ngram_rows):
                tokens[j, : len(lookups[i][0])] = torch.tensor(lookups[i][0], dtype=torch.long)
            counts = torch.tensor([len(lookups[i][0]) for i in ngram_rows], dtype=torch.long)
            parts.append((ngram_rows, Proposal(tokens=tokens, probs=None, num_drafted=counts)))
        return merge_proposals(parts, len(slots), gamma)

    def commit(self, slots: Sequence[int], committed: Sequence[Sequence[int]]) -> None:
        self.model.commit(slots, committed)
        self.ngram.commit(slots, committed)
