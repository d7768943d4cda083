"""Suffix drafting (SuffixDecoding, Oliaro et al. 2024, arXiv:2411.04975): drafts from where the text continued
before, in the request itself and in what recent requests wrote, with no model.

Per row, a `SuffixIndex` over its prompt and output; with `suffix_cache_scope` "global", one more shared by every
row of the drafter's engine over the outputs of recent requests (each led in by the last LEAD_IN tokens of its prompt,
so a reply's first tokens can be matched), at most `capacity` tokens, the oldest requests dropped first. Both grow as
tokens commit. Each round a row asks both for a draft (`suffix_index.best_draft`) and takes the one of higher score
(its own on ties): a token tree of frequent continuations whose size follows the match length and the
continuations' frequencies; a chain (the path of most frequent children) where the round drafts chains.

A draft is deterministic and reads only committed tokens (the row's own, and other rows' from earlier rounds), so
the verifier keeps the output exact: each proposed token is accepted with the target's probability of it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, cast

import torch

from specsample.drafters.base import Abilities, Drafter, DraftRequest, Proposal, finish_rows, take_parts
from specsample.drafters.suffix_index import LEVELS, Draft, Occurrence, SuffixIndex, best_draft
from specsample.planner.base import DraftSource

# what a row's drafts may come from: its own text, or recent requests' outputs too
SUFFIX_CACHE_SCOPES = ("request", "global")
SHARED_TOKENS = 65536  # tokens the shared cache holds by default (about 28 MiB: docs/results/suffix_cost)
LEAD_IN = 8  # prompt tokens kept before each output in the shared cache, to match a reply's first tokens
SPEC_FACTOR = 1.0  # a match of m tokens drafts up to SPEC_FACTOR x m + SPEC_OFFSET tokens...
SPEC_OFFSET = 2.0
MIN_PROB = 0.1  # ...each with an estimated probability of at least MIN_PROB


@dataclass(frozen=True)
class SuffixCacheStats:
    """What a drafter's shared cache holds (`/metrics`)."""

    tokens: int  # tokens held (outputs and their lead-ins)
    sequences: int  # requests' outputs held
    bytes: int  # memory held, estimated (`SuffixIndex.nbytes`)
    capacity: int  # the most tokens it holds
    evicted: int  # requests' outputs dropped for room, since the engine started


class SuffixCacheHolder(Drafter, Protocol):
    """A drafter that holds (or wraps one that holds) a shared suffix cache (`Abilities.holds_suffix_cache`)."""

    def suffix_cache(self) -> SuffixCacheStats | None:
        """What its shared cache holds; None without one."""
        ...


def suffix_cache_holder(drafter: Drafter) -> SuffixCacheHolder | None:
    """`drafter` where it declares a shared suffix cache (`Abilities.holds_suffix_cache`), else None."""
    return cast(SuffixCacheHolder, drafter) if drafter.abilities.holds_suffix_cache else None


def combined(stats: Iterable[SuffixCacheStats | None]) -> SuffixCacheStats | None:
    """The sum of several caches' stats (a server's drafters while one replaces another); None when none has one."""
    held = [s for s in stats if s is not None]
    if not held:
        return None
    return SuffixCacheStats(*(sum(getattr(s, name) for s in held) for name in SuffixCacheStats.__dataclass_fields__))


def _own(tokens: Sequence[int]) -> SuffixIndex:
    index = SuffixIndex(LEVELS)
    index.add(0, tokens)
    return index


class SuffixDrafter:
    """Drafts token trees (or chains) from suffix matches in each row's own text and, with `suffix_cache_scope`
    "global", in recent requests' outputs (see the module docstring). `factor`, `offset` and `min_prob` size a draft;
    `capacity` bounds the shared cache in tokens."""

    vocab_size = None  # proposes token ids from committed text: works with any vocabulary
    abilities = Abilities(
        looks_up=True, keeps_prefixes=True, copies_prefixes=True, holds_suffix_cache=True, chunks_prefill=True
    )

    def __init__(
        self,
        suffix_cache_scope: str = "global",
        capacity: int = SHARED_TOKENS,
        factor: float = SPEC_FACTOR,
        offset: float = SPEC_OFFSET,
        min_prob: float = MIN_PROB,
    ) -> None:
        if suffix_cache_scope not in SUFFIX_CACHE_SCOPES:
            raise ValueError(
                f"suffix_cache_scope must be one of {', '.join(SUFFIX_CACHE_SCOPES)}, got {suffix_cache_scope!r}"
            )
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"the suffix cache's capacity must be a number of tokens >= 1, got {capacity!r}")
        if factor <= 0 or offset < 0 or not 0 < min_prob <= 1:
            raise ValueError(f"need factor > 0, offset >= 0 and min_prob in (0, 1], got {factor}, {offset}, {min_prob}")
        self.suffix_cache_scope, self.capacity = suffix_cache_scope, capacity
        self.factor, self.offset, self.min_prob = factor, offset, min_prob
        self.rows: dict[int, SuffixIndex] = {}  # slot -> its prompt and output
        self._unindexed: dict[int, list[int]] = {}  # started rows (`start_rows`): the prompt tokens not indexed yet
        self.shared = SuffixIndex(LEVELS, capacity) if suffix_cache_scope == "global" else None
        self._sequence: dict[int, int] = {}  # slot -> its output's sequence id in the shared cache
        self._next_sequence = 0
        # slot -> the indexes' versions, the occurrences found in each, the drafts made from them by what was asked
        self._memo: dict[int, tuple[tuple[int, int], list[Occurrence], list[Occurrence], dict]] = {}
        # row drafts proposed: from the row's own text, from the shared cache, and those that branched (trees)
        self.proposed = {"own": 0, "shared": 0, "trees": 0}

    # ----- rows -----------------------------------------------------------------------------

    def allocate(self, num_slots: int, max_len: int) -> None:
        """A new engine: no rows, and an empty shared cache (drafts are shared within one engine's requests)."""
        self.rows.clear()
        self._unindexed.clear()
        self._sequence.clear()
        self._memo.clear()
        if self.shared is not None:
            self.shared = SuffixIndex(LEVELS, self.capacity)

    def add_rows(self, slots: Sequence[int], prompts: Sequence[Sequence[int]]) -> None:
        """Index each new row's prompt (a row `start_rows` started: what it has left); its output will follow the
        prompt's last LEAD_IN tokens in the shared cache."""
        finish_rows(self, self._unindexed, slots, prompts)
        for slot, prompt in zip(slots, prompts):
            if self.shared is not None:
                sequence = self._sequence[slot] = self._next_sequence
                self._next_sequence = (sequence + 1) % (1 << 31)
                self.shared.drop(sequence)  # an id from 2**31 requests ago, if it is still held
                self.shared.add(sequence, [int(t) for t in prompt[-LEAD_IN:]])

    def start_rows(self, slots: Sequence[int], prompts: Sequence[Sequence[int]]) -> list[int]:
        """Start rows with empty indexes: per row, the prompt tokens left to index (`prefill_rows`, in order)."""
        for slot, prompt in zip(slots, prompts):
            self.rows[slot] = _own([])
            self._unindexed[slot] = [int(t) for t in prompt]
            self._memo.pop(slot, None)
        return [len(self._unindexed[slot]) for slot in slots]

    def prefill_rows(self, slots: Sequence[int], units: Sequence[int]) -> None:
        """Index each started row's next `units[i]` prompt tokens."""
        for slot, part in zip(slots, take_parts(self._unindexed, slots, units)):
            self.rows[slot].extend(0, part)

    def release_rows(self, slots: Sequence[int]) -> None:
        """The rows' own indexes go; their outputs stay in the shared cache until evicted."""
        for slot in slots:
            self.rows.pop(slot, None)
            self._unindexed.pop(slot, None)
            self._sequence.pop(slot, None)
            self._memo.pop(slot, None)

    def park_rows(self, slots: Sequence[int]) -> None:
        """Nothing to keep: `add_rows` indexes a prompt at a few microseconds per token."""
        self.release_rows(slots)

    def copy_prefix(self, source: int, slot: int, tokens: Sequence[int]) -> int:
        """Nothing to copy: `add_rows` indexes the whole prompt."""
        return len(tokens)

    def commit(self, slots: Sequence[int], committed: Sequence[Sequence[int]]) -> None:
        for slot, new in zip(slots, committed):
            new = [int(t) for t in new]
            self.rows[slot].extend(0, new)
            if self.shared is not None:
                self.shared.extend(self._sequence[slot], new)

    # ----- drafts ---------------------------------------------------------------------------

    def draft(self, slot: int, nodes: int, depth: int, chain: bool) -> Draft:
        """The row's draft of at most `nodes` tokens, `depth` deep (a chain with `chain`): its own index's or the
        shared cache's, whichever scores higher (its own on ties). Asked again before anything commits, it answers
        from memory (the planner asks what a row offers, then has it proposed)."""
        own = self.rows[slot]
        versions = (own.version, self.shared.version if self.shared is not None else 0)
        memo = self._memo.get(slot)
        if memo is None or memo[0] != versions:
            context = own.tokens(0)
            memo = self._memo[slot] = (
                versions,
                own.find(context),
                self.shared.find(context) if self.shared is not None else [],
                {},
            )
        _, own_found, shared_found, drafts = memo
        asked = (nodes, depth, chain)
        if asked not in drafts:
            best = best_draft(own, own_found, nodes, depth, self.factor, self.offset, self.min_prob, chain)
            if shared_found and self.shared is not None:
                shared = best_draft(
                    self.shared, shared_found, nodes, depth, self.factor, self.offset, self.min_prob, chain
                )
                if shared.score > best.score:
                    best = Draft(shared.tokens, shared.parents, shared.probs, shared.match, shared=True)
            drafts[asked] = best
        return drafts[asked]

    def offer(self, slot: int, max_tokens: int) -> tuple[int, int]:
        """Tokens the row's chain (its path of most frequent continuations) holds, up to `max_tokens`, and the match it
        came from (0: none). A round that lets lookups branch spends as many tokens on a tree."""
        if max_tokens <= 0:
            return 0, 0
        found = self.draft(slot, max_tokens, max_tokens, chain=True)
        return len(found), found.match

    def lookup_lengths(self, slots: Sequence[int], max_tokens: Sequence[int]) -> list[int]:
        """Per row, the tokens its draft offers, up to `max_tokens[i]` (0: no match)."""
        return [self.offer(s, m)[0] for s, m in zip(slots, max_tokens)]

    def drafts_otherwise(self, slots: Sequence[int]) -> list[bool]:
        """No row can draft without its lookup: there is no model."""
        return [False] * len(slots)

    def propose(self, request: DraftRequest) -> Proposal:
        """Each row's draft: with `request.tree`, a tree `drafts[i]` deep of `reach[i]` nodes; where the round lets
        lookups draft trees (`lookup_trees`), a tree of `reach[i]` nodes; else a chain of `reach[i]` tokens. Rows
        sent away from their lookup (DraftSource.MODEL) propose nothing. Parents are given where a row branched (every
        row of a tree round)."""
        rows = range(len(request.slots))
        request.refuse_extension(
            [i for i in rows if request.source_of(i) is not DraftSource.MODEL],
            "a suffix draft has no confidence to extend by",
        )
        width = max(request.width, 1)
        chain = list(range(-1, width - 1))
        tokens, parents, counts, branched = [], [], [], request.tree is not None
        for i in rows:  # [rows, width] as lists: one tensor each at the end (a round's cost is mostly per call)
            found = self.row_draft(request, i)
            tokens.append(list(found.tokens) + [0] * (width - len(found)))
            parents.append(list(found.parents) + chain[len(found) :])
            counts.append(len(found))
            branched |= not found.is_chain
            if found.tokens:
                self.proposed["shared" if found.shared else "own"] += 1
                self.proposed["trees"] += not found.is_chain
        return Proposal(
            tokens=torch.tensor(tokens, dtype=torch.long),
            probs=None,
            num_drafted=torch.tensor(counts, dtype=torch.long),
            parents=torch.tensor(parents, dtype=torch.long) if branched else None,
        )

    def row_draft(self, request: DraftRequest, i: int) -> Draft:
        """Row i's draft for the request (see `propose`)."""
        reach = min(request.reach[i], max(request.width, 1))
        if request.source_of(i) is DraftSource.MODEL or reach <= 0:
            return Draft()
        if request.tree is not None:
            return self.draft(request.slots[i], reach, request.drafts[i], chain=False)
        return self.draft(request.slots[i], reach, reach, chain=not request.lookup_trees)

    # ----- the shared cache -----------------------------------------------------------------

    def suffix_cache(self) -> SuffixCacheStats | None:
        """What the shared cache holds (None with `suffix_cache_scope` "request")."""
        if self.shared is None:
            return None
        return SuffixCacheStats(
            self.shared.held, self.shared.sequences, self.shared.nbytes(), self.capacity, self.shared.evicted
        )
