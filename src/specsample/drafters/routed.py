"""Route rows to drafters by slot, so a draft can be replaced while requests run.

Rows admitted before a swap keep the drafter they started with until they finish; rows admitted
after it use the new one. An old drafter is dropped (and its memory freed) once its last row ends.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

from torch import Tensor

from specsample.config import SamplingParams
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
    prompt_lookup,
)
from specsample.drafters.suffix import SuffixCacheStats, combined, suffix_cache_holder

D = TypeVar("D")  # a drafter seen through one of its abilities
R = TypeVar("R")  # what that ability answers per row


class RoutedDrafter:
    """A drafter made of generations of drafters; `replace()` makes a new generation current."""

    def __init__(self, drafter: Drafter) -> None:
        self.current = drafter
        self.vocab_size = drafter.vocab_size
        self._owner: dict[int, Drafter] = {}
        self._parked: set[int] = set()  # finished rows kept for reuse (`park_rows`): their drafter drafts no more
        self._size: tuple[int, int] | None = None
        self._lock = threading.Lock()

    def replace(self, drafter: Drafter) -> None:
        """Make `drafter` serve rows added from now on (thread-safe; caches allocated here)."""
        if None not in (drafter.vocab_size, self.vocab_size) and drafter.vocab_size != self.vocab_size:
            raise ValueError(
                f"draft vocabulary ({drafter.vocab_size}) differs from the running one ({self.vocab_size})"
            )
        if self._size is not None:
            drafter.allocate(*self._size)
        with self._lock:
            self.current = drafter
            if self.vocab_size is None:  # an n-gram drafter gives way to a model
                self.vocab_size = drafter.vocab_size

    @property
    def generations(self) -> int:
        """Distinct drafters still serving rows (plus the current one)."""
        return len(self._serving())

    @property
    def abilities(self) -> Abilities:
        """What the drafters still serving rows (and the current one) declare between them, read afresh: a drafter
        that replaced another brings its own, and the old one's go with its last row. It keeps prefixes whatever they
        do (a drafter that cannot lets its parked rows go), and starts rows a part at a time whatever they do (one
        that cannot does its work whole at `add_rows`). New rows are the current drafter's: it copies prefixes where
        that one does or can start a copied row afresh (one reading the target's features cannot)."""
        drafting = self._serving(parked=False)
        serving = functools.reduce(operator.or_, (d.abilities for d in drafting), Abilities(keeps_prefixes=True))
        current = self.current.abilities
        return dataclasses.replace(
            serving, copies_prefixes=current.copies_prefixes or not current.reads_features, chunks_prefill=True
        )

    def _serving(self, parked: bool = True) -> list[Drafter]:
        """The drafters still serving rows (with `parked`, kept ones too) and the current one (a snapshot: other
        threads read it too)."""
        owners = [d for s, d in list(self._owner.items()) if parked or s not in self._parked]
        return list(({id(d): d for d in owners} | {id(self.current): self.current}).values())

    def allocate(self, num_slots: int, max_len: int) -> None:
        self._size = (num_slots, max_len)
        self.current.allocate(num_slots, max_len)

    def add_rows(self, slots: Sequence[int], prompts: Sequence[Sequence[int]]) -> None:
        """The current drafter starts the rows, or finishes those it started (`start_rows`; rows an earlier one
        started start afresh)."""
        self._take(slots).add_rows(slots, prompts)

    def start_rows(self, slots: Sequence[int], prompts: Sequence[Sequence[int]]) -> list[int]:
        """The current drafter starts the rows where it prefills a part at a time (else it does its work whole at
        `add_rows`: no work now)."""
        chunked = chunked_prefill(self._take(slots))
        return chunked.start_rows(slots, prompts) if chunked is not None else [0] * len(slots)

    def prefill_rows(self, slots: Sequence[int], units: Sequence[int]) -> None:
        """Each started row's drafter does its next `units[i]` of work."""
        for drafter, rows in self._groups(list(range(len(slots))), slots):
            chunked = chunked_prefill(drafter)
            if chunked is not None:
                chunked.prefill_rows([slots[i] for i in rows], [units[i] for i in rows])

    def _take(self, slots: Sequence[int]) -> Drafter:
        """The current drafter, now owning `slots` (rows an earlier one kept or started are let go there)."""
        with self._lock:
            drafter = self.current
        replaced = [s for s in slots if s in self._owner and self._owner[s] is not drafter]
        for slot in replaced:  # a row kept by an earlier drafter: that drafter lets it go
            self._owner.pop(slot).release_rows([slot])
        for slot in slots:
            self._owner[slot] = drafter
            self._parked.discard(slot)
        return drafter

    def release_rows(self, slots: Sequence[int]) -> None:
        for drafter, rows in self._groups(list(range(len(slots))), slots):
            drafter.release_rows([slots[i] for i in rows])
        for slot in slots:
            self._owner.pop(slot, None)
            self._parked.discard(slot)

    def park_rows(self, slots: Sequence[int]) -> None:
        """Each row's drafter keeps it where it can (`PrefixKeeper`), else lets it go; the row stays its drafter's
        until it is reused or released."""
        for drafter, rows in self._groups(list(range(len(slots))), slots):
            keeper = prefix_keeper(drafter)
            if keeper is not None:
                keeper.park_rows([slots[i] for i in rows])
            else:
                drafter.release_rows([slots[i] for i in rows])
        self._parked.update(slots)

    def copy_prefix(self, source: int, slot: int, tokens: Sequence[int]) -> int:
        """The current drafter copies the row where the source is its own and it declares copying (`PrefixCopier`):
        the row is then kept by it until `add_rows`. Otherwise the row starts afresh at `add_rows` (and the target
        copies none of a feature draft's tokens: it would compute no features for them)."""
        with self._lock:
            drafter = self.current
        previous = self._owner.pop(slot, None)
        self._parked.discard(slot)
        if previous is not None:
            previous.release_rows([slot])
        copier = prefix_copier(drafter)
        if copier is not None and self._owner.get(source) is drafter:
            self._owner[slot] = drafter
            self._parked.add(slot)
            return copier.copy_prefix(source, slot, tokens)
        return 0 if drafter.abilities.reads_features else len(tokens)

    def propose(self, request: DraftRequest) -> Proposal:
        groups = self._groups(list(range(len(request.slots))), request.slots)
        if len(groups) == 1:
            return groups[0][0].propose(request)
        parts = [(rows, drafter.propose(request.select(rows))) for drafter, rows in groups]
        return merge_proposals(parts, len(request.slots), request.width)

    def lookup_lengths(self, slots: Sequence[int], max_tokens: Sequence[int]) -> list[int]:
        """Each row's drafter's prompt lookup (0 for rows whose drafter has none)."""
        found = self._per_row(
            slots,
            prompt_lookup,
            lambda drafter, rows: drafter.lookup_lengths([slots[i] for i in rows], [max_tokens[i] for i in rows]),
        )
        return [found.get(i, 0) for i in range(len(slots))]

    def drafts_otherwise(self, slots: Sequence[int]) -> list[bool]:
        """Rows whose drafter has no lookup draft as always; others as their drafter says."""
        found = self._per_row(
            slots, prompt_lookup, lambda drafter, rows: drafter.drafts_otherwise([slots[i] for i in rows])
        )
        return [found.get(i, True) for i in range(len(slots))]

    def suffix_cache(self) -> SuffixCacheStats | None:
        """What the shared suffix caches of the drafters still serving rows (and the current one) hold together (read
        from another thread)."""
        holders = [suffix_cache_holder(d) for d in self._serving()]
        return combined(h.suffix_cache() for h in holders if h is not None)

    def add_features(self, slots: Sequence[int], features: Sequence[Tensor]) -> None:
        """Each row's features to its drafter, where that drafter reads them."""
        for drafter, rows in self._groups(list(range(len(slots))), slots):
            reader = feature_drafter(drafter)
            if reader is not None:
                reader.add_features([slots[i] for i in rows], [features[i] for i in rows])

    def score_backlog(
        self, slots: Sequence[int], counts: Sequence[int], params: Sequence[SamplingParams]
    ) -> list[list[float]]:
        """Each row's drafter scores its backlog where it can (a model draft); other rows score nothing."""
        found = self._per_row(
            slots,
            backlog_scorer,
            lambda drafter, rows: drafter.score_backlog(
                [slots[i] for i in rows], [counts[i] for i in rows], [params[i] for i in rows]
            ),
        )
        return [found.get(i, []) for i in range(len(slots))]

    def commit(self, slots: Sequence[int], committed: Sequence[Sequence[int]]) -> None:
        for drafter, rows in self._groups(list(range(len(slots))), slots):
            drafter.commit([slots[i] for i in rows], [committed[i] for i in rows])

    def _per_row(
        self, slots: Sequence[int], able: Callable[[Drafter], D | None], call: Callable[[D, list[int]], list[R]]
    ) -> dict[int, R]:
        """`call(drafter, rows)` for each group of rows whose drafter has the ability `able` sees it through (a view
        such as `prompt_lookup`), its answers by row index."""
        found: dict[int, R] = {}
        for drafter, rows in self._groups(list(range(len(slots))), slots):
            view = able(drafter)
            if view is not None:
                found.update(zip(rows, call(view, rows)))
        return found

    def _groups(self, rows: list[int], slots: Sequence[int]) -> list[tuple[Drafter, list[int]]]:
        out: dict[int, tuple[Drafter, list[int]]] = {}
        for row in rows:
            drafter = self._owner.get(slots[row], self.current)
            out.setdefault(id(drafter), (drafter, []))[1].append(row)
        return list(out.values())
