"""Prometheus metrics of the server (all under `specsample_`), with vLLM's definitions.

Counters: requests (by finish status), prompt and generation tokens, drafts (row-rounds that drafted),
draft tokens, accepted tokens, emitted tokens, accepted tokens per draft position.
Histograms: time to first token, time per output token, end-to-end latency.
Gauges: running batch size, queue depth, recent acceptance rate and mean acceptance length
(1 + accepted / drafts over the last rounds). Histogram of the batch size per round. Prefix reuse: requests
admitted and those that started from another request's cached prefix (running, or finished and kept), with their
prompt tokens, the tokens reused and those prefilled; what the kept rows hold (rows, tokens, bytes of the target's
cache, the token budget), read at every scrape.
The shared suffix cache (suffix drafting with scope global): tokens, requests' outputs and bytes held, its capacity,
outputs dropped for room (read at every scrape).
Compiled models: graphs compiled after start-up (recompiles) and cached forwards run eagerly instead (fallbacks); while
the compiled steps build behind the serving (server/compile_behind.py): graphs ready of the total, the estimated seconds
left, and whether the build failed (read at every scrape).
The planner (gamma auto), per batch size, read at every scrape: whether speculation is on, rounds that drafted and
that decoded plainly, the goodput expected against the goodput measured, and the costs it plans with.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics import MetricWrapperBase

from specsample.drafters.suffix import SuffixCacheStats
from specsample.engine import RoundResult
from specsample.planner.goodput import BatchSizeSummary
from specsample.scheduler import PrefixCacheStats

log = logging.getLogger("specsample.server")
M = TypeVar("M", bound=MetricWrapperBase)
NO_SUFFIX_CACHE = SuffixCacheStats(0, 0, 0, 0, 0)
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _stat(read: Callable[[], SuffixCacheStats | None], name: str) -> float:
    """Field `name` of what `read()` says a suffix cache holds (0 without one)."""
    return float(getattr(read() or NO_SUFFIX_CACHE, name))


def _prefix_stat(read: Callable[[], PrefixCacheStats], name: str) -> float:
    """Field `name` of what `read()` says the prefix cache's kept rows hold (a budget of None: -1)."""
    value = getattr(read(), name)
    return -1.0 if value is None else float(value)


class ServerMetrics:
    """One registry per server (tests run several in a process)."""

    def __init__(
        self, min_acceptance: float | None = None, window_rounds: int = 64, labels: dict | None = None
    ) -> None:
        self.registry = CollectorRegistry()
        names = list((labels or {}).keys())
        self._labels = labels or {}

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"specsample_{name}", doc, names + list(extra), registry=self.registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"specsample_{name}", doc, names, registry=self.registry)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(f"specsample_{name}", doc, names, buckets=LATENCY_BUCKETS, registry=self.registry)

        self.requests = counter("requests", "Finished requests by status", ("status",))
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("generation_tokens", "Generated tokens")
        self.num_drafts = counter("spec_decode_num_drafts", "Row-rounds that proposed at least one draft token")
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed")
        self.accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.emitted_tokens = counter("spec_decode_num_emitted_tokens", "Tokens emitted by speculative rounds")
        self.accepted_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted at each draft position", ("position",)
        )
        self.drafted_per_pos = counter(
            "spec_decode_num_draft_tokens_per_pos", "Draft tokens proposed at each draft position", ("position",)
        )
        # what gamma auto did beyond choosing gamma (the CLI's summary and the stats dict count the same)
        self.plain_rows = counter("controller_fallback_row_rounds", "Row-rounds gamma auto decoded without drafting")
        self.lookup_rows = counter("controller_lookup_row_rounds", "Row-rounds gamma auto drafted by prompt lookup")
        self.extended_rows = counter(
            "controller_extended_row_rounds", "Row-rounds that drafted past the gamma the controller planned"
        )
        self.scored_rows = counter(
            "controller_backlog_scorings", "Rows whose draft scored the tokens it missed (probes in fallback)"
        )
        self.prefix_queries = counter("prefix_cache_queries", "Requests admitted (each looks for a cached prefix)")
        self.prefix_hits = counter("prefix_cache_hits", "Admitted requests that reused a cached prefix")
        self.prefix_queried_tokens = counter(
            "prefix_cache_queried_tokens", "Prompt tokens of admitted requests the target's cache takes"
        )
        self.prefix_reused_tokens = counter(
            "prefix_cache_reused_tokens", "Prompt tokens taken from a cached prefix instead of prefilled"
        )
        self.prefix_prefilled_tokens = counter("prefix_cache_prefilled_tokens", "Prompt tokens the target prefilled")
        self.prefix_rows = gauge("prefix_cache_rows", "Finished requests' rows the prefix cache keeps")
        self.prefix_tokens = gauge("prefix_cache_tokens", "Tokens the prefix cache's kept rows hold")
        self.prefix_bytes = gauge("prefix_cache_bytes", "Memory of the target's cache the kept rows' tokens take")
        self.prefix_capacity = gauge(
            "prefix_cache_capacity_tokens", "Most tokens the kept rows may hold (-1: bounded by rows alone)"
        )
        self.suffix_tokens = gauge("suffix_cache_tokens", "Tokens the shared suffix cache holds (recent outputs)")
        self.suffix_sequences = gauge("suffix_cache_sequences", "Requests' outputs the shared suffix cache holds")
        self.suffix_bytes = gauge("suffix_cache_bytes", "Memory the shared suffix cache holds (estimated)")
        self.suffix_capacity = gauge("suffix_cache_capacity_tokens", "Most tokens the shared suffix cache holds")
        self.suffix_evicted = gauge(
            "suffix_cache_evicted_sequences", "Requests' outputs dropped from the shared suffix cache for room"
        )
        self.recompiles = counter(
            "compile_recompiles",
            "Graphs compiled after start-up (shapes the warm-up did not "
            "cover), each costing seconds to minutes of a round",
        )
        self.eager_fallbacks = counter(
            "compile_eager_fallbacks",
            "Cached forwards of a compiled model that ran eagerly (token trees, blocks past 16 tokens per row)",
        )
        self.step_path = Gauge(
            "specsample_step_path",
            "1 for the code that runs the target's forwards: fused-amx, fused-avx512, compiled, torch, transformers",
            [*names, "path"],
            registry=self.registry,
        )
        self.compile_ready = gauge("compile_graphs_ready", "Compiled graphs built so far (a build behind the serving)")
        self.compile_total = gauge("compile_graphs_total", "Compiled graphs the server switches to once built")
        self.compile_eta = gauge(
            "compile_eta_seconds", "Estimated seconds until the compiled graphs are built (NaN: unknown)"
        )
        self.compile_failed = gauge(
            "compile_failed", "1 once the build of the compiled graphs failed (serving goes on)"
        )
        self._path: str | None = None
        for metric in (self.recompiles, self.eager_fallbacks):  # shown at 0 from the start, labels included
            self._l(metric)
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token")
        self.tpot = histogram("time_per_output_token_seconds", "Time per output token after the first")
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency")
        self.batch_size = Histogram(
            "specsample_batch_size",
            "Rows decoded together per engine round",
            names,
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64),
            registry=self.registry,
        )
        self.running = gauge("num_requests_running", "Requests in the running batch")
        self.waiting = gauge("num_requests_waiting", "Requests queued for a batch slot")
        self.recent_acceptance = gauge(
            "spec_decode_recent_acceptance_rate", f"Accepted / drafted tokens over the last {window_rounds} rounds"
        )
        self.recent_mean_length = gauge(
            "spec_decode_recent_mean_acceptance_length", f"1 + accepted / drafts over the last {window_rounds} rounds"
        )
        self.max_batch_seen = 0
        self._window: deque[tuple[int, int, int]] = deque(maxlen=window_rounds)  # (accepted, drafted, drafts)
        self._min_acceptance = min_acceptance
        self._low_since: float | None = None
        self._last_warning = 0.0
        self._lock = threading.Lock()

    def show_step_path(self, path: str) -> None:
        """Say which code runs the target's forwards (`Speculator.step_path`); the one before, if another, goes to 0."""
        if self._path is not None and self._path != path:
            self._l(self.step_path, path=self._path).set(0)
        self._path = path
        self._l(self.step_path, path=path).set(1)

    def watch_compile(self, status: Callable[[], dict]) -> None:
        """Report, at every scrape, what `status()` says of the build behind the serving (`CompileBehind.status`)."""
        self._l(self.compile_ready).set_function(lambda: float(status()["graphs_ready"]))
        self._l(self.compile_total).set_function(lambda: float(status()["graphs_total"]))
        self._l(self.compile_eta).set_function(lambda: float("nan") if status()["eta_s"] is None else status()["eta_s"])
        self._l(self.compile_failed).set_function(lambda: float(status()["state"] == "failed"))

    def watch_suffix_cache(self, read: Callable[[], SuffixCacheStats | None]) -> None:
        """Report, at every scrape, what `read()` says the shared suffix cache holds (zeros without one)."""
        for gauge, name in (
            (self.suffix_tokens, "tokens"),
            (self.suffix_sequences, "sequences"),
            (self.suffix_bytes, "bytes"),
            (self.suffix_capacity, "capacity"),
            (self.suffix_evicted, "evicted"),
        ):
            self._l(gauge).set_function(functools.partial(_stat, read, name))

    def watch_planner(self, read: Callable[[], tuple[BatchSizeSummary, ...]]) -> None:
        """Report, at every scrape, the planner's view per batch size (`GammaController.summary`)."""
        self.registry.register(PlannerCollector(read, self._labels))

    def watch_prefix_cache(self, read: Callable[[], PrefixCacheStats]) -> None:
        """Report, at every scrape, what `read()` says the kept rows of the prefix cache hold."""
        for gauge, name in (
            (self.prefix_rows, "rows"),
            (self.prefix_tokens, "tokens"),
            (self.prefix_bytes, "bytes"),
            (self.prefix_capacity, "capacity_tokens"),
        ):
            self._l(gauge).set_function(functools.partial(_prefix_stat, read, name))

    def _l(self, metric: M, **extra: str) -> M:
        return metric.labels(**self._labels, **extra) if (self._labels or extra) else metric

    def observe_round(self, result: RoundResult, running: int, waiting: int) -> None:
        """Count one engine round (called from the engine thread)."""
        s = result.stats
        self._l(self.running).set(running)
        self._l(self.waiting).set(waiting)
        if s.admitted:
            self._l(self.prefix_queries).inc(s.admitted)
            self._l(self.prefix_hits).inc(s.prefix_hits)
            self._l(self.prefix_queried_tokens).inc(s.admitted_tokens)
            self._l(self.prefix_reused_tokens).inc(s.reused_tokens)
        if s.prefilled_tokens:
            self._l(self.prefix_prefilled_tokens).inc(s.prefilled_tokens)
        if s.recompiles:
            self._l(self.recompiles).inc(s.recompiles)
        if s.eager_fallbacks:
            self._l(self.eager_fallbacks).inc(s.eager_fallbacks)
        if s.batch_size == 0:
            return
        self.max_batch_seen = max(self.max_batch_seen, s.batch_size)
        self._l(self.batch_size).observe(s.batch_size)
        drafts = sum(1 for u in result.rows if u.num_drafted > 0)
        self._l(self.num_drafts).inc(drafts)
        self._l(self.draft_tokens).inc(s.drafted)
        self._l(self.accepted_tokens).inc(s.accepted)
        self._l(self.emitted_tokens).inc(sum(len(u.new_tokens) for u in result.rows if u.num_drafted > 0))
        self._l(self.generation_tokens).inc(s.emitted)
        self._l(self.plain_rows).inc(s.fallback_rows)
        self._l(self.lookup_rows).inc(s.lookup_rows)
        self._l(self.extended_rows).inc(s.extended_rows)
        self._l(self.scored_rows).inc(s.scored_rows)
        for pos, (acc, dr) in enumerate(zip(s.accepted_per_position, s.drafted_per_position)):
            self._l(self.accepted_per_pos, position=str(pos)).inc(acc)
            self._l(self.drafted_per_pos, position=str(pos)).inc(dr)
        with self._lock:
            self._window.append((s.accepted, s.drafted, drafts))
            accepted = sum(a for a, _, _ in self._window)
            drafted = sum(d for _, d, _ in self._window)
            n_drafts = sum(n for _, _, n in self._window)
        if drafted:
            rate = accepted / drafted
            self._l(self.recent_acceptance).set(rate)
            self._l(self.recent_mean_length).set(1 + accepted / max(n_drafts, 1))
            self._check_low_acceptance(rate, drafted)

    def _check_low_acceptance(self, rate: float, drafted: int) -> None:
        """Warn (at most once a minute) while the recent acceptance rate stays under the floor."""
        if self._min_acceptance is None or drafted < 50:
            return
        now = time.monotonic()
        if rate >= self._min_acceptance:
            self._low_since = None
            return
        self._low_since = self._low_since or now
        if now - self._low_since >= 5.0 and now - self._last_warning >= 60.0:
            self._last_warning = now
            log.warning(
                "recent acceptance rate %.2f has stayed below --min-acceptance %.2f for %.0f s: "
                "the draft no longer matches the target's traffic",
                rate,
                self._min_acceptance,
                now - self._low_since,
            )

    def observe_request(
        self, status: str, prompt_tokens: int, ttft: float | None, tpot: float | None, e2e: float
    ) -> None:
        """Count one finished request (called from the event loop)."""
        self._l(self.requests, status=status).inc()
        self._l(self.prompt_tokens).inc(prompt_tokens)
        if ttft is not None:
            self._l(self.ttft).observe(ttft)
        if tpot is not None:
            self._l(self.tpot).observe(tpot)
        self._l(self.e2e).observe(e2e)

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)


class PlannerCollector:
    """The planner's view per batch size as Prometheus families, read at every scrape."""

    def __init__(self, read: Callable[[], tuple[BatchSizeSummary, ...]], labels: dict[str, str]) -> None:
        self.read, self.labels = read, labels

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        names, values = list(self.labels), list(self.labels.values())
        by_size = [*names, "batch_size"]

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"specsample_planner_{name}", doc, labels=by_size + list(extra))

        speculating = gauge(
            "speculating", "1 where the batch speculates at this batch size, 0 where it decodes plainly"
        )
        rounds = CounterMetricFamily(
            "specsample_planner_rounds",
            "Rounds at this batch size by what the goodput policy chose: speculative or plain",
            labels=[*by_size, "mode"],
        )
        expected = gauge(
            "goodput_expected_tokens_per_second", "Committed tokens/s the planner predicted for its recent rounds"
        )
        measured = gauge("goodput_measured_tokens_per_second", "Committed tokens/s those rounds measured")
        plain = gauge("plain_round_seconds", "Measured time of a round without drafts")
        step = gauge("draft_step_seconds", "Measured time of one batched draft step")
        cost = gauge(
            "round_cost_ratio", "Measured time of a round of this many drafts over a plain round's", ("drafts",)
        )
        for row in self.read():
            at = [*values, str(row.batch_size)]
            speculating.add_metric(at, float(row.speculating))
            rounds.add_metric([*at, "speculative"], row.speculative_rounds)
            rounds.add_metric([*at, "plain"], row.plain_rounds)
            for family, value in (
                (expected, row.expected),
                (measured, row.measured),
                (plain, row.plain_round_seconds),
                (step, row.draft_step_seconds),
            ):
                if value is not None:
                    family.add_metric(at, value)
            for drafts, ratio in row.round_costs:
                cost.add_metric([*at, str(drafts)], ratio)
        yield from (speculating, rounds, expected, measured, plain, step, cost)


def merge_expositions(texts: list[str]) -> str:
    """Merge Prometheus text expositions (one per replica, samples labelled by replica) into one."""
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, tuple[str, str, list]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            entry = families.setdefault(family.name, (family.documentation, family.type, []))
            entry[2].extend(family.samples)
    lines = []
    for name, (doc, kind, samples) in families.items():
        lines += [f"# HELP {name} {_escape(doc, help_text=True)}", f"# TYPE {name} {kind}"]
        for sample in samples:
            labels = ",".join(f'{k}="{_escape(v)}"' for k, v in sample.labels.items())
            lines.append(
                f"{sample.name}{{{labels}}} {_number(sample.value)}"
                if labels
                else f"{sample.name} {_number(sample.value)}"
            )
    return "\n".join(lines) + "\n"


def _escape(value: str, help_text: bool = False) -> str:
    value = value.replace("\\", "\\\\").replace("\n", "\\n")
    return value if help_text else value.replace('"', '\\"')


def _number(value: float) -> str:
    if value == float("inf"):
        return "+Inf"
    if value == float("-inf"):
        return "-Inf"
    return repr(float(value))
