"""Hybrid drafting: a lookup (suffix drafting by default) where the text repeats, the draft model elsewhere."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from torch import Tensor

from specsample.config import SamplingParams, TreeShape
from specsample.drafters.base import (
    Abilities,
    Drafter,
    DraftRequest,
    Proposal,
    backlog_scorer,
    chunked_prefill,
    feature_drafter,
    merge_proposals,
    prefix_copier,
    prefix_keeper,
)
from specsample.drafters.suffix import SuffixCacheStats, SuffixDrafter, suffix_cache_holder
from specsample.planner.base import DraftSource


class Lookup(Drafter, Protocol):
    """A drafter without a model that proposes from committed text (`SuffixDrafter`, `NgramDrafter`)."""

    def offer(self, slot: int, max_tokens: int) -> tuple[int, int]:
        """Tokens it would propose for the row, up to `max_tokens`, and the length of the match they come from."""
        ...

    def park_rows(self, slots: Sequence[int]) -> None: ...

    def copy_prefix(self, source: int, slot: int, tokens: Sequence[int]) -> int: ...


class HybridDrafter:
    """Per row and round: the lookup's draft if its match is at least `min_match` tokens long, otherwise the draft
    model. Which one a row uses depends only on its history (and, for a suffix lookup sharing a cache, on other
    requests' committed text).

    Under gamma auto the planner chooses per row between lookup and model, pricing each: it is offered matches from
    `offer_match` tokens on (default min(2, min_match)), which it takes only where it predicts them faster than
    the model; a fixed gamma takes only matches of `min_match` tokens on its own."""

    def __init__(
        self, model: Drafter, lookup: Lookup | None = None, min_match: int = 3, offer_match: int | None = None
    ) -> None:
        offer_match = min(2, min_match) if offer_match is None else offer_match
        if not 1 <= offer_match <= min_match:
            raise ValueError(
                f"need 1 <= offer_match <= min_match, got offer_match={offer_match}, min_match={min_match}"
            )
        self.model = model
        self.lookup = lookup if lookup is not None else SuffixDrafter()
        self.min_match, self.offer_match = min_match, offer_match
        self.vocab_size = model.vocab_size
        self._unprefilled: dict[int, tuple[int, int]] = {}  # started rows: the model's and the lookup's work left

    @property
    def abilities(self) -> Abilities:
        """Lookups, and what its draft model declares besides (backlogs, features); it keeps prefixes whatever the
        model does (a model that cannot lets its parked rows go), and copies them where the model does or can start
        a copied row afresh (a model that reads the target's features cannot: the target computes none it copies)."""
        own = Abilities(
            looks_up=True,
            keeps_prefixes=True,
            holds_suffix_cache=self.lookup.abilities.holds_suffix_cache,
            chunks_prefill=True,
        )
        model = self.model.abilities
        return own | Abilities(
            scores_backlog=model.scores_backlog,
            reads_features=model.reads_features,
            copies_prefixes=model.copies_prefixes or not model.reads_features,
        )

    def allocate(self, num_slots: int, max_len: int) -> None:
        self.model.allocate(num_slots, max_len)
        self.lookup.allocate(num_slots, max_len)
        self._unprefilled.clear()

    def add_rows(self, slots: Sequence[int], prompts: Sequence[Sequence[int]]) -> None:
        """The model and the lookup each start the rows, or finish what `start_rows` started."""
        self.model.add_rows(slots, prompts)
        self.lookup.add_rows(slots, prompts)
        for slot in slots:
            self._unprefilled.pop(slot, None)

    def start_rows(self, slots: Sequence[int], prompts: Sequence[Sequence[int]]) -> list[int]:
        """The model and the lookup start the rows where they prefill a part at a time (the other does its work whole
        at `add_rows`): per row, their units of work together."""
        model, lookup = chunked_prefill(self.model), chunked_prefill(self.lookup)
        none = [0] * len(slots)
        left = zip(
            model.start_rows(slots, prompts) if model is not None else none,
            lookup.start_rows(slots, prompts) if lookup is not None else none,
        )
        self._unprefilled.update(zip(slots, left))
        return [a + b for a, b in (self._unprefilled[slot] for slot in slots)]

    def prefill_rows(self, slots: Sequence[int], units: Sequence[int]) -> None:
        """Per row, `units[i]` of the model's and the lookup's work, each doing the same share of what it has left (a
        row's mix of work, and so its cost per unit, stays even)."""
        model_units, lookup_units = [], []
        for slot, count in zip(slots, units):
            model_left, lookup_left = self._unprefilled[slot]
            total = model_left + lookup_left
            to_model = min(model_left, round(count * model_left / total)) if total else 0
            to_lookup = min(lookup_left, count - to_model)
            to_model = min(model_left, count - to_lookup)
            model_units.append(to_model)
            lookup_units.append(to_lookup)
            self._unprefilled[slot] = (model_left - to_model, lookup_left - to_lookup)
        for part, counts in ((self.model, model_units), (self.lookup, lookup_units)):
            chunked = chunked_prefill(part)
            rows = [i for i, n in enumerate(counts) if n > 0]
            if chunked is not None and rows:
                chunked.prefill_rows([slots[i] for i in rows], [counts[i] for i in rows])

    def release_rows(self, slots: Sequence[int]) -> None:
        self.model.release_rows(slots)
        self.lookup.release_rows(slots)
        for slot in slots:
            self._unprefilled.pop(slot, None)

    def park_rows(self, slots: Sequence[int]) -> None:
        """The model keeps its rows for reuse where it can (`PrefixKeeper`); lookups re-index at `add_rows`."""
        keeper = prefix_keeper(self.model)
        if keeper is not None:
            keeper.park_rows(slots)
        else:
            self.model.release_rows(slots)
        self.lookup.park_rows(slots)

    def copy_prefix(self, source: int, slot: int, tokens: Sequence[int]) -> int:
        """The model copies the row where it declares it (`PrefixCopier`), else starts it afresh at `add_rows` (then
        the target copies none of a feature draft's tokens: it would compute no features for them)."""
        self.lookup.copy_prefix(source, slot, tokens)
        copier = prefix_copier(self.model)
        if copier is not None:
            return copier.copy_prefix(source, slot, tokens)
        self.model.release_rows([slot])
        return 0 if self.model.abilities.reads_features else len(tokens)

    def _offer(self, slot: int, max_tokens: int, shortest: int) -> int:
        """Tokens the row's lookup proposes (up to `max_tokens`) if its match is at least `shortest` long, else 0."""
        tokens, match = self.lookup.offer(slot, max_tokens) if max_tokens > 0 else (0, 0)
        return tokens if match >= shortest else 0

    def lookup_lengths(self, slots: Sequence[int], max_tokens: Sequence[int]) -> list[int]:
        """Tokens a lookup offers the controller per row, up to `max_tokens[i]` (0: no match of `offer_match`
        tokens)."""
        return [self._offer(s, m, self.offer_match) for s, m in zip(slots, max_tokens)]

    def drafts_otherwise(self, slots: Sequence[int]) -> list[bool]:
        """Every row can draft with the model instead of its lookup."""
        return [True] * len(slots)

    def propose(self, request: DraftRequest) -> Proposal:
        """Rows sent to their lookup (`DraftSource.LOOKUP`) propose it (the offer of `lookup_lengths`), rows sent to
        the model (MODEL) draft with the model; the rest (EITHER) use the lookup where its match is at least
        `min_match` tokens.
        Only rows sent to the model may be extended past their plan (a lookup's length is its reach)."""
        rows = range(len(request.slots))
        request.refuse_extension(
            [i for i in rows if request.source_of(i) is not DraftSource.MODEL],
            "only rows sent to the draft model (DraftSource.MODEL) can be extended",
        )
        looked_up = [
            i
            for i, (slot, reach) in enumerate(zip(request.slots, request.reach))
            if request.source_of(i) is not DraftSource.MODEL
            and self._offer(
                slot,
                min(request.width, reach),
                self.offer_match if request.source_of(i) is DraftSource.LOOKUP else self.min_match,
            )
            > 0
        ]
        model_rows = [i for i in rows if i not in looked_up and request.source_of(i) is not DraftSource.LOOKUP]
        parts = []
        if model_rows:
            parts.append((model_rows, self.model.propose(request.select(model_rows))))
        if looked_up:
            parts.append((looked_up, self.lookup.propose(request.select(looked_up))))
        return merge_proposals(parts, len(request.slots), request.width)

    def suffix_cache(self) -> SuffixCacheStats | None:
        """What the lookup's shared cache holds (None without one)."""
        holder = suffix_cache_holder(self.lookup)
        return holder.suffix_cache() if holder is not None else None

    @property
    def tree(self) -> TreeShape | None:
        """The token tree its draft model drafts by preference (Medusa heads'), None: chains."""
        return getattr(self.model, "tree", None)

    def add_features(self, slots: Sequence[int], features: Sequence[Tensor]) -> None:
        reader = feature_drafter(self.model)
        if reader is not None:
            reader.add_features(slots, features)

    def score_backlog(
        self, slots: Sequence[int], counts: Sequence[int], params: Sequence[SamplingParams]
    ) -> list[list[float]]:
        """The draft model scores the tokens it missed (`ModelDrafter.score_backlog`): under gamma auto a
        lookup round is not one of the model's, so its estimate in fallback comes from these as for a model. Only
        where the model declares it (`abilities`)."""
        scorer = backlog_scorer(self.model)
        if scorer is None:
            raise ValueError("the hybrid's draft model scores no backlogs")
        return scorer.score_backlog(slots, counts, params)

    def commit(self, slots: Sequence[int], committed: Sequence[Sequence[int]]) -> None:
        self.model.commit(slots, committed)
        self.lookup.commit(slots, committed)
