"""Hybrid drafting: prompt lookup where the context repeats itself, the draft model elsewhere."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specsample.config import SamplingParams
from specsample.drafters.base import Proposal
from specsample.drafters.model import ModelDrafter
from specsample.drafters.ngram import NgramDrafter, find_continuation
from specsample.sampling import one_hot_like


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
                generators: Sequence[torch.Generator], stop_threshold: float = 0.0) -> Proposal:
        lookups = [find_continuation(self.ngram.history[s], min(gamma, m), self.ngram.min_n, self.ngram.max_n)
                   for s, m in zip(slots, max_drafts)]
        use_ngram = [n >= self.min_match and len(found) > 0 for found, n in lookups]
        model_rows = [i for i, u in enumerate(use_ngram) if not u]
        tokens = torch.zeros(len(slots), gamma, dtype=torch.long)
        probs = torch.zeros(len(slots), gamma, self.vocab_size)
        confidence = torch.ones(len(slots), gamma)
        drafted = torch.zeros(len(slots), dtype=torch.long)
        if model_rows:
            sub = self.model.propose([slots[i] for i in model_rows], gamma, [max_drafts[i] for i in model_rows],
                                     [params[i] for i in model_rows], [generators[i] for i in model_rows],
                                     stop_threshold)
            index = torch.tensor(model_rows)
            tokens[index], drafted[index] = sub.tokens, sub.num_drafted
            probs[index] = sub.probs.to(probs.dtype)
            if sub.confidence is not None:
                confidence[index] = sub.confidence
        for i, ((found, _), u) in enumerate(zip(lookups, use_ngram)):
            if u:
                row = torch.tensor(found, dtype=torch.long)
                tokens[i, : len(found)] = row
                probs[i, : len(found)] = one_hot_like(row, probs[i, : len(found)])  # deterministic draft
                drafted[i] = len(found)
        return Proposal(tokens=tokens, probs=probs, num_drafted=drafted, confidence=confidence)

    def commit(self, slots: Sequence[int], committed: Sequence[Sequence[int]]) -> None:
        self.model.commit(slots, committed)
        self.ngram.commit(slots, committed)
