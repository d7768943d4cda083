"""What one serving process holds (`SpecServer`): the engine, its runner thread, the tokenizer, the grammar pool and
the metrics. The app's lifespan starts and stops it (server/app.py); every route and the middleware reach it through
`request.app.state.server`."""

from __future__ import annotations

import time
from dataclasses import replace

from specsample.drafters.routed import RoutedDrafter
from specsample.drafters.suffix import SuffixCacheStats, suffix_cache_holder
from specsample.planner import GammaController
from specsample.rounds import RoundResult
from specsample.server.compile_behind import CompileBehind
from specsample.server.grammar_pool import GrammarPool
from specsample.server.metrics import ServerMetrics
from specsample.server.options import ServerOptions
from specsample.server.runner import EngineRunner
from specsample.speculator import Speculator


class SpecServer:
    """The engine, its runner thread, the tokenizer and the metrics of one serving process."""

    def __init__(
        self, speculator: Speculator, options: ServerOptions, compile_behind: CompileBehind | None = None
    ) -> None:
        """`compile_behind`: the compiled steps being built apart, switched to between rounds once built (default:
        a build of the speculator's `pending_compile` models, where it has any)."""
        if compile_behind is None and speculator.pending_compile:
            compile_behind = CompileBehind(list(speculator.pending_compile), replace(speculator.options, compile=True))
        target = speculator.pair.target
        if target.tokenizer is None:
            raise ValueError(f"{target.spec} has no tokenizer; serving text needs one")
        self.speculator, self.options, self.tokenizer = speculator, options, target.tokenizer
        drafter = RoutedDrafter(speculator.drafter) if speculator.drafter is not None else None
        self.engine = speculator.engine(
            options.max_batch_size,
            options.max_seq_len,
            drafter=drafter,
            prefix_cache_rows=options.prefix_cache_rows,
            prefix_cache_tokens=options.prefix_cache_tokens,
            prefill_chunk_tokens=options.prefill_chunk_tokens or None,
            prefill_time_ratio=options.prefill_time_ratio or None,
        )
        self.draft = speculator.draft  # the draft in use (/admin/draft replaces it)
        labels = {"replica": options.replica_id} if options.replica_id else {}
        self.metrics = ServerMetrics(options.min_acceptance, labels=labels | options.extra_labels)
        self.metrics.watch_suffix_cache(self._suffix_cache)
        self.metrics.watch_prefix_cache(self.engine.scheduler.usage)
        self.metrics.show_step_path(speculator.step_path)
        self.metrics.watch_planner(self._planner_summary)
        self.compile_behind = compile_behind
        if compile_behind is not None:
            self.metrics.watch_compile(compile_behind.status)
        self.runner = EngineRunner(self.engine, self._observe, self._between_rounds if compile_behind else None)
        grammars = self.engine.grammars
        self.grammar_pool = (
            GrammarPool(grammars, options.grammar_workers, options.grammar_compile_timeout)
            if grammars is not None
            else None
        )
        self.created = int(time.time())
        self.metrics_text = self.metrics.render  # replaced by the aggregate of all replicas under Ray Serve
        self.active = 0  # requests being answered (all routes but /health and /metrics)
        self.draining = False  # shutting down: new requests get 503 (server/serve.py)
        self.ended = False  # the shutdown limit passed: requests still running were ended

    def _suffix_cache(self) -> SuffixCacheStats | None:
        """What the engine's drafters' shared suffix caches hold (None without one)."""
        holder = suffix_cache_holder(self.engine.drafter)
        return holder.suffix_cache() if holder is not None else None

    def _planner_summary(self) -> tuple:
        """The planner's view per batch size (none for a fixed gamma)."""
        planner = self.engine.planner
        return planner.summary() if isinstance(planner, GammaController) else ()

    def _between_rounds(self) -> None:
        """On the engine thread, before a round: switch to the compiled steps once built (`CompileBehind.poll`)."""
        assert self.compile_behind is not None
        if self.compile_behind.state == "compiling" and self.compile_behind.poll():
            self.metrics.show_step_path(self.speculator.step_path)

    def _observe(self, result: RoundResult) -> None:
        self.metrics.observe_round(result, self.engine.num_running, self.engine.num_waiting)

    def start(self) -> None:
        self.runner.start()

    def stop(self) -> None:
        self.runner.stop()
        if isinstance(self.engine.planner, GammaController):
            self.engine.planner.save()  # a replica started later begins from what this one measured
        if self.compile_behind is not None:
            self.compile_behind.stop()
        if self.grammar_pool is not None:
            self.grammar_pool.close()

    def end_all(self) -> None:
        """End every request still running (the shutdown limit passed): streams end with an error event and
        [DONE], other responses with 503."""
        self.ended = True
        self.runner.end_all("shutdown")
        if self.grammar_pool is not None:
            self.grammar_pool.close()
