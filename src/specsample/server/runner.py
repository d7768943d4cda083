"""Drive the engine from a background thread; hand each request's updates to its asyncio queue.

Requests join and leave the running batch between rounds (the engine's own scheduling: up to
`max_batch_size` rows, the rest wait in arrival order). The thread is the only caller of
`engine.step()`; submissions, cancellations and draft swaps reach it through thread-safe calls.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from specsample.config import SamplingParams
from specsample.drafters.base import Drafter
from specsample.drafters.routed import RoutedDrafter
from specsample.engine import Engine, RoundResult, RowUpdate

log = logging.getLogger("specsample.server")


@dataclass
class RequestHandle:
    """One request's link to the engine: its `RowUpdate`s arrive on `queue`, the last with a finish_reason."""

    request_id: str
    prompt_tokens: int
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    submitted: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    finished: float | None = None
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    gamma_sum: int = 0


class EngineRunner:
    """Owns the engine loop thread. `observe` is called with every round (metrics)."""

    def __init__(
        self,
        engine: Engine,
        observe: Callable[[RoundResult], None] | None = None,
        between_rounds: Callable[[], None] | None = None,
    ) -> None:
        """`between_rounds`: called on the engine thread before each round and while idle (a switch of the models'
        steps, which only this thread may make)."""
        self.engine = engine
        self.observe = observe
        self.between_rounds = between_rounds
        self._handles: dict[str, RequestHandle] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="specsample-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        speculative: bool = True,
        gamma: int | None = None,
        cache_scope: str = "",
    ) -> RequestHandle:
        """Queue a request (raises ValueError for one the engine cannot run); it reuses only caches of its
        `cache_scope`."""
        loop = asyncio.get_running_loop()
        handle = RequestHandle("", len(prompt_ids), asyncio.Queue(), loop)
        with self._lock:  # register before the engine can emit for it
            handle.request_id = self.engine.add_request(
                prompt_ids, params, speculative=speculative, gamma=gamma, cache_scope=cache_scope
            )
            self._handles[handle.request_id] = handle
        self._wake.set()
        return handle

    def cancel(self, request_id: str) -> None:
        """Stop a request (client gone, stop string found); its slot frees at the next round."""
        if request_id in self._handles:
            self.engine.cancel(request_id)
            self._wake.set()

    def replace_drafter(self, drafter: Drafter) -> None:
        """Serve requests admitted from now on with `drafter`; running ones keep theirs."""
        current = self.engine.drafter
        if not isinstance(current, RoutedDrafter):
            raise ValueError("this server runs without a draft; start it with one to swap drafts")
        current.replace(drafter)

    @property
    def in_flight(self) -> int:
        return len(self._handles)

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.between_rounds is not None:
                try:
                    self.between_rounds()
                except Exception:  # the models keep the steps they had
                    log.exception("switching the models' steps between rounds failed")
                    self.between_rounds = None
            if not self.engine.has_work():
                self._wake.wait(timeout=0.05)
                self._wake.clear()
                continue
            try:
                result = self.engine.step()
            except Exception:  # a round that fails outside any one row's distributions: fail its requests
                log.exception("engine round failed; failing its requests")
                self._fail_all()
                continue
            try:
                if self.observe is not None:
                    self.observe(result)
                for update in result.rows:
                    self._deliver(update, result)
            except Exception:  # metrics or a closed client loop must never stop the engine thread
                log.exception("delivering a round's results failed")

    def _deliver(self, update: RowUpdate, result: RoundResult) -> None:
        with self._lock:
            handle = self._handles.get(update.request_id)
            if handle is not None and update.finish_reason is not None:
                del self._handles[update.request_id]
        if handle is None:
            return
        if update.new_tokens and handle.first_token is None:
            handle.first_token = result.finished_at
        handle.drafted += update.num_drafted
        handle.accepted += update.num_accepted
        handle.rounds += 1
        handle.gamma_sum += update.num_drafted
        if update.finish_reason is not None:
            handle.finished = result.finished_at
        handle.loop.call_soon_threadsafe(handle.queue.put_nowait, update)

    def end_all(self, finish_reason: str) -> None:
        """End every request, running or queued, with `finish_reason` (a shutdown); the engine frees their rows next
        round."""
        self._end(finish_reason, spare=set())

    def _fail_all(self) -> None:
        """End every request the failed round held (all but those still queued) with finish_reason "error"; the engine
        frees their rows next round."""
        self._end("error", spare=self.engine.waiting_ids())

    def _end(self, finish_reason: str, spare: set[str]) -> None:
        with self._lock:
            handles = [h for rid, h in self._handles.items() if rid not in spare]
            for handle in handles:
                del self._handles[handle.request_id]
        for handle in handles:
            self.engine.cancel(handle.request_id)
            handle.loop.call_soon_threadsafe(
                handle.queue.put_nowait, RowUpdate(handle.request_id, (), 0, 0, finish_reason)
            )
        self._wake.set()
