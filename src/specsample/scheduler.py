"""Requests and the rows they run in: the waiting queue, the running rows by slot, cancellations, and finished rows
kept for a later request sharing their prefix (prefix reuse), each scoped (a tenant's cache is never another's).

The scheduler owns the slots of the target's cache and the drafter's state: it decides which request runs where,
which kept row a new request takes over, and which kept row is forgotten to make room; the engine prefills and
decodes in the slots it is given. Requests may be added and cancelled from other threads; everything else runs on
the engine's thread between rounds.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict, deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch

from specsample.config import SamplingParams
from specsample.drafters.base import Drafter, common_prefix, prefix_keeper
from specsample.models.base import ModelCache
from specsample.processors import RowProcessors
from specsample.verification.coupled import NoiseStream

MIN_REUSED = 16  # a kept row is taken over by a request sharing at least this many leading tokens with it


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
    """Requests that got a row this round, and per request how many leading prompt tokens its slot's target cache
    already holds (a kept row's shared prefix; 0: a fresh row)."""

    requests: tuple[Request, ...]
    reused: tuple[int, ...]

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens the target's cache takes (all but the last of each prompt)."""
        return sum(len(r.prompt) - 1 for r in self.requests)

    def counters(self) -> dict[str, int]:
        """The round's admission counters (`RoundStats`): requests admitted, their prompt tokens cached, those that
        reused a kept row's prefix and the tokens reused."""
        return {
            "admitted": len(self.requests),
            "admitted_tokens": self.prompt_tokens,
            "prefix_hits": sum(n > 0 for n in self.reused),
            "reused_tokens": sum(self.reused),
        }


class Scheduler:
    """Slots for `max_running` running requests and up to `keep_rows` kept ones; see the module docstring."""

    def __init__(self, cache: ModelCache, drafter: Drafter, max_running: int, keep_rows: int) -> None:
        self.cache, self.drafter = cache, drafter
        self.max_running, self.keep_rows = max_running, keep_rows
        self._free = list(range(max_running + keep_rows))
        # finished rows whose caches are kept for a request sharing their prefix: slot -> (their cache scope, the
        # tokens the target's cache holds), least recently finished first
        self._kept: OrderedDict[int, tuple[str, list[int]]] = OrderedDict()
        self._waiting: deque[Request] = deque()
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
        return len(self._waiting)

    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    # ----- between rounds -------------------------------------------------------------------

    def running(self) -> list[Request]:
        """The running requests in slot order."""
        return [self._running[s] for s in sorted(self._running)]

    def by_slot(self) -> dict[int, Request]:
        """The running requests by the slot they run in."""
        return dict(self._running)

    @property
    def kept(self) -> tuple[int, ...]:
        """The slots of finished rows kept for prefix reuse, least recently finished first."""
        return tuple(self._kept)

    @property
    def free(self) -> tuple[int, ...]:
        """The slots no request runs in and no row is kept in."""
        return tuple(self._free)

    def take_cancelled(self) -> tuple[list[Request], list[Request]]:
        """The cancelled requests still waiting (dropped from the queue) and running (still in their rows: end them
        with `finish`)."""
        with self._lock:
            cancelled, self._cancelled = self._cancelled, set()
            waiting = [r for r in self._waiting if r.request_id in cancelled]
            for request in waiting:
                self._waiting.remove(request)
        return waiting, [r for r in self._running.values() if r.request_id in cancelled]

    def admit(self) -> Admission:
        """Rows for waiting requests, up to `max_running` running: a request whose prompt starts with what a kept row
        of its scope holds takes that row (its target cache truncated to the shared prefix), else a free row, else
        the least recently kept row is forgotten for it (fresh rows are reset). The caller prefills them and calls
        `started`, or `unwind` if that fails."""
        with self._lock:
            admitted: list[Request] = []
            while self._waiting and len(self._running) + len(admitted) < self.max_running:
                admitted.append(self._waiting.popleft())
        if not admitted:
            return Admission((), ())
        reused = [self._take_slot(request) for request in admitted]
        slots = torch.tensor([r.slot for r in admitted], dtype=torch.long)
        self.cache.reset(slots[torch.tensor([n == 0 for n in reused])])
        if any(reused):
            self.cache.truncate(slots, torch.tensor(reused, dtype=torch.long))  # the shared prefix stays
        return Admission(tuple(admitted), tuple(reused))

    def started(self, admission: Admission) -> None:
        for request in admission.requests:
            self._running[request.slot] = request

    def unwind(self, admission: Admission) -> None:
        """Give the rows of an admission that failed to prefill back (their requests are dropped)."""
        slots = [r.slot for r in admission.requests]
        self.cache.reset(torch.tensor(slots, dtype=torch.long))
        self.drafter.release_rows(slots)
        with self._lock:
            self._free = sorted(self._free + slots)

    def finish(self, requests: Sequence[Request], keep: Collection[str] = frozenset()) -> None:
        """Free finished or cancelled rows. Rows named in `keep` (requests that ended well) keep their caches for a
        later request sharing their prefix, the least recently finished forgotten beyond `keep_rows`; kept only where
        the drafter can keep its own state too (a `PrefixKeeper`)."""
        if not requests:
            return
        keeper = prefix_keeper(self.drafter)
        keeping = self.keep_rows > 0 and keeper is not None
        kept = [r for r in requests if keeping and r.request_id in keep]
        dropped = [r for r in requests if r not in kept]
        if dropped:
            slots = [r.slot for r in dropped]
            self.cache.reset(torch.tensor(slots, dtype=torch.long))
            self.drafter.release_rows(slots)
        if kept and keeper is not None:
            keeper.park_rows([r.slot for r in kept])
            for request in kept:
                tokens = request.prompt + request.output
                held = min(int(self.cache.lengths[request.slot]), len(tokens))  # entries past an EOS cut are dropped
                self.cache.truncate(torch.tensor([request.slot]), torch.tensor([held]))
                self._kept[request.slot] = (request.cache_scope, tokens[:held])
            while len(self._kept) > self.keep_rows:
                slot, _ = self._kept.popitem(last=False)
                self._forget(slot)
                with self._lock:
                    self._free.append(slot)
        with self._lock:
            for request in requests:
                del self._running[request.slot]
            self._free.extend(r.slot for r in dropped)
            self._free.sort()

    def _take_slot(self, request: Request) -> int:
        """Give `request` a slot; return how many leading prompt tokens that slot's target cache already holds. The kept
        row of its scope sharing the longest prefix with its prompt (at least MIN_REUSED tokens) is taken; else a free
        slot; else the least recently kept row is forgotten for it."""
        cacheable = request.prompt[:-1]  # the last prompt token is scored in the first round
        best, shared = None, 0
        for slot, (scope, tokens) in self._kept.items():
            if scope != request.cache_scope:
                continue
            n = common_prefix(tokens, cacheable)
            if n > shared:
                best, shared = slot, n
        if best is not None and shared >= MIN_REUSED:
            del self._kept[best]
            request.slot = best
            return shared
        with self._lock:
            free = self._free.pop(0) if self._free else None
        if free is None:
            free, _ = self._kept.popitem(last=False)
            self._forget(free)
        request.slot = free
        return 0

    def _forget(self, slot: int) -> None:
        """Empty a row's caches (the target's and the drafter's)."""
        self.cache.reset(torch.tensor([slot], dtype=torch.long))
        self.drafter.release_rows([slot])
