"""Requests and the rows they run in: the waiting queue, the rows being prefilled and running by slot, cancellations,
and finished rows kept for later requests sharing their prefix (the prefix cache), each scoped (a tenant's cache is
never another's).

A radix tree (`PrefixIndex`) holds the tokens of every kept, running and prefilling row. A new request starts from
the longest prefix its prompt shares with one of them (at least MIN_REUSED tokens): the rows' caches of it are copied
into its own row (the target's, and the drafter's state: a drafter declaring `copies_prefixes`), the source
unchanged; a kept row whose whole content the prompt extends is taken over instead. Where the longest shared prefix
is another row's still being prefilled, the request waits for that row to get past it and then copies it, instead of
prefilling it again. Kept rows are bounded in rows and in tokens (`keep_rows`, `keep_tokens`), least recently used
out first.

The scheduler owns the slots of the target's cache and the drafter's state: it decides which request runs where,
which row a new one copies, and which kept row is forgotten to make room; the engine prefills and decodes in the
slots it is given. Requests may be added and cancelled from other threads; everything else runs on the engine's
thread between rounds.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict, deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from specsample.config import SamplingParams
from specsample.drafters.base import Drafter, common_prefix, prefix_copier, prefix_keeper
from specsample.models.base import ModelCache
from specsample.prefix_index import PrefixIndex
from specsample.processors import RowProcessors
from specsample.verification.coupled import NoiseStream

MIN_REUSED = 16  # a request starts from another row's prefix where it shares at least this many leading tokens


@dataclass
class Request:
    """A request and, once admitted, its row."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    seed: int
    generator: torch.Generator
    speculative: bool  # whether it drafts at all (the engine speculates and the request did not turn it off)
    gamma: int | None  # a fixed gamma it asked for; None: the planner's choice
    cache_scope: str = ""  # a kept row's cache is reused only by a request of the same scope
    noise: NoiseStream | None = None  # coupled sampling, not greedy: its per-position noise
    processors: RowProcessors | None = None  # penalties, logit bias, grammar: None when the params have none
    slot: int = -1
    output: list[int] = field(default_factory=list)
    prefilled: int = 0  # leading prompt tokens its row's target cache holds (all but the last once it runs)
    reused: int = 0  # of them, those copied or taken from another row instead of prefilled
    donor: Request | None = None  # a row being prefilled whose first `shared` tokens it waits to copy
    shared: int = 0
    features: list[Tensor] = field(default_factory=list)  # the target's features of prompt positions features_from..
    features_from: int = 0
    draft_work: int | None = None  # units of the drafter's prefill work left (`ChunkedPrefill`); None: not started
    prefill_rounds: int = 0  # rounds that prefilled part of its prompt

    @property
    def remaining(self) -> int:
        return self.params.max_new_tokens - len(self.output)

    @property
    def last_token(self) -> int:
        return self.output[-1] if self.output else self.prompt[-1]

    def cut(self, new: list[int], eos_token_ids: frozenset[int]) -> tuple[list[int], str | None]:
        """`new` tokens cut after the first end-of-sequence token ("stop"; not with `ignore_eos`) or at the request's
        budget ("length")."""
        for i, token in enumerate(new):
            if token in eos_token_ids and not self.params.ignore_eos:
                return new[: i + 1], "stop"
        if len(new) >= self.remaining:
            return new[: self.remaining], "length"
        return new, None


@dataclass(frozen=True)
class Admission:
    """Requests whose prompts finished prefilling this round (they run from now on), per request how many leading
    prompt tokens its row took from another's cache instead of prefilling them, and the prompt tokens the round
    prefilled (theirs and those of prompts still being prefilled)."""

    requests: tuple[Request, ...]
    reused: tuple[int, ...]
    prefilled: int = 0

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens the target's cache takes (all but the last of each)."""
        return sum(len(r.prompt) - 1 for r in self.requests)

    def counters(self) -> dict[str, int]:
        """The round's admission counters (`RoundStats`): requests that started, their prompt tokens cached, those
        that reused another row's prefix, the tokens reused, and the prompt tokens prefilled."""
        return {
            "admitted": len(self.requests),
            "admitted_tokens": self.prompt_tokens,
            "prefix_hits": sum(n > 0 for n in self.reused),
            "reused_tokens": sum(self.reused),
            "prefilled_tokens": self.prefilled,
        }


@dataclass(frozen=True)
class PrefixCacheStats:
    """What the kept rows hold: rows, tokens, the target cache's bytes of those tokens, and the token budget (None:
    bounded by rows alone)."""

    rows: int
    tokens: int
    bytes: int
    capacity_tokens: int | None


class Scheduler:
    """Slots for `max_running` requests (running or being prefilled) and up to `keep_rows` kept rows holding at most
    `keep_tokens` tokens together (None: no bound but the rows; 0: no prefix is shared at all, not even a running
    row's); see the module docstring."""

    def __init__(
        self, cache: ModelCache, drafter: Drafter, max_running: int, keep_rows: int, keep_tokens: int | None = None
    ) -> None:
        self.cache, self.drafter = cache, drafter
        self.max_running, self.keep_rows, self.keep_tokens = max_running, keep_rows, keep_tokens
        self._free = list(range(max_running + keep_rows))
        # finished rows whose caches are kept for requests sharing their prefix: slot -> (their cache scope, the
        # tokens the target's cache holds), least recently used first
        self._kept: OrderedDict[int, tuple[str, list[int]]] = OrderedDict()
        self._index = PrefixIndex()  # the tokens of every kept, running and prefilling row
        self._waiting: deque[Request] = deque()
        self._prefilling: dict[int, Request] = {}  # by slot, oldest first
        self._running: dict[int, Request] = {}
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()
        self._ids = itertools.count()

    # ----- from any thread ------------------------------------------------------------------

    def new_id(self) -> str:
        return f"req-{next(self._ids)}"

    def add(self, request: Request) -> None:
        with self._lock:
            self._waiting.append(request)

    def cancel(self, request_id: str) -> None:
        with self._lock:
            self._cancelled.add(request_id)

    def waiting_ids(self) -> set[str]:
        with self._lock:
            return {r.request_id for r in self._waiting}

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Requests without a running row: queued, or being prefilled."""
        return len(self._waiting) + len(self._prefilling)

    def has_work(self) -> bool:
        return bool(self._running or self._waiting or self._prefilling)

    def usage(self) -> PrefixCacheStats:
        """What the kept rows hold now (read from any thread: a snapshot)."""
        kept = list(self._kept.values())
        tokens = sum(len(t) for _, t in kept)
        per_token = getattr(self.cache, "bytes_per_token", 0)
        return PrefixCacheStats(len(kept), tokens, tokens * per_token, self.keep_tokens)

    # ----- between rounds -------------------------------------------------------------------

    def running(self) -> list[Request]:
        """The running requests in slot order."""
        return [self._running[s] for s in sorted(self._running)]

    def by_slot(self) -> dict[int, Request]:
        """The running requests by the slot they run in."""
        return dict(self._running)

    @property
    def kept(self) -> tuple[int, ...]:
        """The slots of finished rows kept for prefix reuse, least recently used first."""
        return tuple(self._kept)

    @property
    def free(self) -> tuple[int, ...]:
        """The slots no request runs in and no row is kept in."""
        return tuple(self._free)

    def take_cancelled(self) -> tuple[list[Request], list[Request]]:
        """The cancelled requests still waiting (dropped from the queue) and holding rows (running or being
        prefilled: end them with `finish`)."""
        with self._lock:
            cancelled, self._cancelled = self._cancelled, set()
            waiting = [r for r in self._waiting if r.request_id in cancelled]
            for request in waiting:
                self._waiting.remove(request)
        active = [*self._running.values(), *self._prefilling.values()]
        return waiting, [r for r in active if r.request_id in cancelled]

    def admit(self) -> list[Request]:
        """Rows for waiting requests, up to `max_running` running or being prefilled; each starts from the longest
        prefix it shares with another row (see the module docstring). Returns the requests admitted; `prefilling`
        lists them with the others still being prefilled."""
        with self._lock:
            admitted: list[Request] = []
            while self._waiting and len(self._running) + len(self._prefilling) + len(admitted) < self.max_running:
                admitted.append(self._waiting.popleft())
        for request in admitted:
            self._place(request)
            self._prefilling[request.slot] = request
            self._index.add(request.slot, request.cache_scope, request.prompt[:-1])
        return admitted

    def prefilling(self) -> list[Request]:
        """The rows being prefilled, oldest first; a row waiting for another's prefix first copies it where that row
        holds it now (`Request.donor` None afterwards: its prefill goes on from there)."""
        for request in list(self._prefilling.values()):
            if request.donor is not None:
                self._resolve(request, request.donor)
        return list(self._prefilling.values())

    def started(self, requests: Sequence[Request]) -> None:
        """Prefilled rows run from now on."""
        for request in requests:
            del self._prefilling[request.slot]
            request.features = []
            self._running[request.slot] = request

    def unwind(self, requests: Sequence[Request]) -> None:
        """Give the rows of requests that failed to prefill back (the requests are dropped)."""
        slots = [r.slot for r in requests]
        self.cache.reset(torch.tensor(slots, dtype=torch.long))
        self.drafter.release_rows(slots)
        for request in requests:
            self._prefilling.pop(request.slot, None)
            self._index.remove(request.slot)
        with self._lock:
            self._free = sorted(self._free + slots)

    def finish(self, requests: Sequence[Request], keep: Collection[str] = frozenset()) -> None:
        """Free finished or cancelled rows. Running rows named in `keep` (requests that ended well) keep their caches
        for later requests sharing their prefix (a kept row whose tokens the new one's extend is forgotten), the least
        recently used forgotten beyond `keep_rows` or `keep_tokens`; kept only where the drafter can keep its own
        state too (a `PrefixKeeper`)."""
        if not requests:
            return
        keeper = prefix_keeper(self.drafter)
        keeping = self.keep_rows > 0 and keeper is not None
        kept = [r for r in requests if keeping and r.request_id in keep and self._running.get(r.slot) is r]
        dropped = [r for r in requests if r not in kept]
        for request in requests:
            self._running.pop(request.slot, None)
            self._prefilling.pop(request.slot, None)
            self._index.remove(request.slot)
        if dropped:
            slots = [r.slot for r in dropped]
            self.cache.reset(torch.tensor(slots, dtype=torch.long))
            self.drafter.release_rows(slots)
        forgotten = []
        if kept and keeper is not None:
            keeper.park_rows([r.slot for r in kept])
            for request in kept:
                tokens = request.prompt + request.output
                held = min(int(self.cache.lengths[request.slot]), len(tokens))  # entries past an EOS cut are dropped
                self.cache.truncate(torch.tensor([request.slot]), torch.tensor([held]))
                for slot, (scope, other) in list(self._kept.items()):  # rows this one holds all of
                    if (
                        scope == request.cache_scope
                        and len(other) <= held
                        and common_prefix(other, tokens) == len(other)
                    ):
                        del self._kept[slot]
                        forgotten.append(slot)
                self._kept[request.slot] = (request.cache_scope, tokens[:held])
                self._index.add(request.slot, request.cache_scope, tokens[:held])
            while self._kept and (len(self._kept) > self.keep_rows or self._over_budget()):
                slot, _ = self._kept.popitem(last=False)
                forgotten.append(slot)
        for slot in forgotten:
            self._forget(slot)
        with self._lock:
            self._free.extend([r.slot for r in dropped] + forgotten)
            self._free.sort()

    # ----- placing a request ----------------------------------------------------------------

    def _over_budget(self) -> bool:
        return self.keep_tokens is not None and sum(len(t) for _, t in self._kept.values()) > self.keep_tokens

    def _place(self, request: Request) -> None:
        """Give `request` a slot and start its row from the longest prefix it shares with another row of its scope:
        a kept row whose whole content it extends is taken over (as is any kept row where the drafter cannot copy);
        a running or kept one is copied; a prefilling one, sharing more, is waited for (`prefilling`)."""
        cacheable = request.prompt[:-1]  # the last prompt token is scored in the first round
        if self.keep_tokens == 0:  # prefix sharing is off
            slot = self._free_slot(keep=None)
            assert slot is not None  # admission leaves a free or kept row for every request it admits
            request.slot = slot
            self.cache.reset(torch.tensor([slot], dtype=torch.long))
            return
        copying = self.drafter.abilities.copies_prefixes
        scope = request.cache_scope
        source, shared = self._index.longest(scope, cacheable, set(self._kept) | set(self._running))
        pending, ahead = self._index.longest(scope, cacheable, set(self._prefilling)) if copying else (None, 0)
        if shared < MIN_REUSED:
            source, shared = None, 0
        if (
            source is not None
            and source in self._kept
            and ahead <= shared
            and (not copying or shared == len(self._kept[source][1]))
        ):
            self._take_over(request, source, shared)
            return
        slot = self._free_slot(keep=source)
        if slot is None:  # the only row to make room with is the source: take it over
            assert source is not None  # admission leaves a free or kept row for every request it admits
            self._take_over(request, source, shared)
            return
        request.slot = slot
        self.cache.reset(torch.tensor([slot], dtype=torch.long))
        donor = self._prefilling.get(pending) if pending is not None else None
        if donor is not None and ahead >= MIN_REUSED and ahead >= shared + MIN_REUSED and self._features_of(donor):
            request.donor, request.shared = donor, ahead
        elif copying and source is not None:
            self._copy(request, source, shared)

    def _take_over(self, request: Request, source: int, shared: int) -> None:
        """Give `request` the kept row `source`, its caches truncated to the `shared` prefix (which stays)."""
        del self._kept[source]
        self._index.remove(source)
        self.cache.truncate(torch.tensor([source]), torch.tensor([shared]))
        request.slot, request.prefilled, request.reused, request.features_from = source, shared, shared, shared

    def _copy(self, request: Request, source: int, shared: int) -> None:
        """Start `request`'s row with the first `shared` tokens of row `source` (running or kept): the drafter's state
        and the target's cache of them."""
        copier = prefix_copier(self.drafter)
        if copier is None:  # a drafter that stopped copying since the request was placed (a swap): it starts afresh
            return
        held = copier.copy_prefix(source, request.slot, request.prompt[:shared])
        self.cache.copy_prefix(source, request.slot, held)
        request.prefilled = request.reused = request.features_from = held
        if source in self._kept:
            self._kept.move_to_end(source)

    def _resolve(self, request: Request, donor: Request) -> None:
        """A row waiting for `donor`'s prefix: copy it once that row's cache holds it (from the row being prefilled:
        the target's cache and features; once it runs, as any running row); where that row went, start from the
        longest prefix the others offer."""
        if self._prefilling.get(donor.slot) is donor and self._features_of(donor):
            if donor.prefilled < request.shared:
                return  # not there yet
            self.cache.copy_prefix(donor.slot, request.slot, request.shared)
            if donor.features:
                request.features = [torch.cat(donor.features, dim=0)[: request.shared]]
            request.prefilled = request.reused = request.shared
        else:
            scope, cacheable = request.cache_scope, request.prompt[:-1]
            source, shared = self._index.longest(scope, cacheable, set(self._kept) | set(self._running))
            if source is not None and shared >= MIN_REUSED:
                self._copy(request, source, shared)
        request.donor, request.shared = None, 0

    def _features_of(self, donor: Request) -> bool:
        """Whether a row being prefilled can hand its prefix to another that starts afresh: it can unless the drafter
        reads the target's features and the row holds none of its first positions (it started from a copy)."""
        return donor.features_from == 0 or not self.drafter.abilities.reads_features

    def _free_slot(self, keep: int | None) -> int | None:
        """A free slot, else the least recently used kept row's but `keep`'s (forgotten); None if neither."""
        with self._lock:
            if self._free:
                return self._free.pop(0)
        for slot in self._kept:
            if slot != keep:
                del self._kept[slot]
                self._forget(slot)
                return slot
        return None

    def _forget(self, slot: int) -> None:
        """Empty a row's caches (the target's and the drafter's)."""
        self._index.remove(slot)
        self.cache.reset(torch.tensor([slot], dtype=torch.long))
        self.drafter.release_rows([slot])
