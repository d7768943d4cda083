"""Hybrid drafting: prompt lookup where the context repeats itself, the draft model elsewhere."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from specsample.config import SamplingParams
from specsample.drafters.base import DraftRequest, Drafter, FeatureDrafter, PrefixKeeper, Proposal, merge_proposals
from specsample.drafters.ngram import NgramDrafter


class HybridDrafter:
    """Per row and round: an n-gram continuation if the longest match is at least `min_match`
    tokens long, otherwise the draft model. Which one a row uses depends only on its history.

    Under gamma auto the planner chooses per row between lookup and model, pricing each: it is offered matches from
    `offer_match` tokens on (default min(2, min_match)), which it takes only where it predicts them faster than
    the model; a fixed gamma takes only matches of `min_match` tokens on its own."""

    def __init__(self, model: Drafter, ngram: NgramDrafter | None = None, min_match: int = 3,
                 offer_match: int | None = None) -> None:
        offer_match = min(2, min_match) if offer_match is None else offer_match
        if not 1 <= offer_match <= min_match:
            raise ValueError(f"need 1 <= offer_match <= min_match, got offer_match={offer_match}, min_match={min_match}")
        self.model = model
        self.ngram = ngram or NgramDrafter(min_n=offer_match, max_n=max(min_match, 4))
        self.min_match, self.offer_match = min_match, offer_match
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

    def park_rows(self, slots: Sequence[int]) -> None:
        """The model keeps its rows for reuse where it can (`PrefixKeeper`); lookups re-index at `add_rows`."""
        if isinstance(self.model, PrefixKeeper):
            self.model.park_rows(slots)
        else:
            self.model.release_rows(slots)
        self.ngram.park_rows(slots)

    def _lookup(self, slot: int, max_tokens: int, shortest: int) -> list[int]:
        """The row's n-gram continuation (up to `max_tokens`) if its match is at least `shortest` long, else []."""
        found, n = self.ngram.continuation(slot, max_tokens)
        return found if n >= shortest else []

    def lookup_lengths(self, slots: Sequence[int], max_tokens: Sequence[int]) -> list[int]:
        """Tokens an n-gram lookup offers the controller per row, up to `max_tokens[i]` (0: no match of
        `offer_match` tokens)."""
        return [len(self._lookup(s, m, self.offer_match)) if m > 0 else 0 for s, m in zip(slots, max_tokens)]

    def drafts_otherwise(self, slots: Sequence[int]) -> list[bool]:
        """Every row can draft with the model instead of its lookup."""
        return [True] * len(slots)

    def propose(self, request: DraftRequest) -> Proposal:
        """Rows sent to their lookup (source True) propose it (the offer of `lookup_lengths`), rows sent to the model
        (False) draft with the model; the rest (None) use an n-gram match of `min_match` tokens where there is one.
        Only rows sent to the model may be extended past their plan (a lookup's length is its reach)."""
        rows = range(len(request.slots))
        request.refuse_extension([i for i in rows if request.source_of(i) is not False],
                                 "only rows sent to the draft model (source False) can be extended")
        lookups = [self._lookup(slot, min(request.width, reach), self.offer_match if request.source_of(i)
                                else self.min_match) if request.source_of(i) is not False else []
                   for i, (slot, reach) in enumerate(zip(request.slots, request.reach))]
        ngram_rows = [i for i in rows if lookups[i]]
        model_rows = [i for i in rows if not lookups[i] and request.source_of(i) is not True]
        parts = []
        if model_rows:
            parts.append((model_rows, self.model.propose(request.select(model_rows))))
        if ngram_rows and request.tree is not None:  # the matched continuations as branches of a trie
            parts.append((ngram_rows, self.ngram.propose(request.select(ngram_rows))))
        elif ngram_rows:
            tokens = torch.zeros(len(ngram_rows), request.width, dtype=torch.long)
            for j, i in enumerate(ngram_rows):
                tokens[j, : len(lookups[i])] = torch.tensor(lookups[i], dtype=torch.long)
            counts = torch.tensor([len(lookups[i]) for i in ngram_rows], dtype=torch.long)
            parts.append((ngram_rows, Proposal(tokens=tokens, probs=None, num_drafted=counts)))
        return merge_proposals(parts, len(request.slots), request.width)

    @property
    def wants_features(self) -> bool:
        """Whether its draft model drafts from the target's hidden states (a feature draft)."""
        return isinstance(self.model, FeatureDrafter) and self.model.wants_features

    def add_features(self, slots: Sequence[int], features: Sequence[Tensor]) -> None:
        if self.wants_features:
            self.model.add_features(slots, features)

    def score_backlog(self, slots: Sequence[int], counts: Sequence[int],
                      params: Sequence[SamplingParams]) -> list[list[float]]:
        """The draft model scores the tokens it missed (`ModelDrafter.score_backlog`): under gamma auto a
        lookup round is not one of the model's, so its estimate in fallback comes from these as for a model."""
        return self.model.score_backlog(slots, counts, params)

    def commit(self, slots: Sequence[int], committed: Sequence[Sequence[int]]) -> None:
        self.model.commit(slots, committed)
        self.ngram.commit(slots, committed)
