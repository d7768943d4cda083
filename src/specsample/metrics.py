"""Aggregate round results into the statistics users read: acceptance, tokens per round, TTFT, TPOT.

Definitions follow vLLM: acceptance rate = accepted / drafted; mean acceptance length =
1 + accepted / drafts, where a *draft* is one row proposing tokens in one round.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from specsample.engine import RoundResult
from specsample.theory import acceptance_rate, estimate_alpha, mean_accepted_length


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation; 0.0 for no values."""
    if not values:
        return 0.0
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


@dataclass
class _RequestTiming:
    started: float
    first_token: float | None = None
    finished: float | None = None
    tokens: int = 0


@dataclass
class StatsCollector:
    """Feed it every `RoundResult` (and request start times); read `summary()` at any point."""

    rounds: int = 0
    drafts: int = 0  # (row, round) pairs that proposed at least one token
    row_rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    accepted_per_draft: list[int] = field(default_factory=list)
    drafted_per_draft: list[int] = field(default_factory=list)
    gammas: list[int] = field(default_factory=list)
    fallback_row_rounds: int = 0
    backlog_scorings: int = 0
    lookup_row_rounds: int = 0
    extended_row_rounds: int = 0
    tree_row_rounds: int = 0
    tree_budgets: dict[int, int] = field(default_factory=dict)  # tree budget -> rounds that drafted it
    recompiles: int = 0  # graphs compiled past the start-up warm-up (RoundStats.recompiles)
    eager_fallbacks: int = 0  # cached forwards a compiled model ran eagerly (RoundStats.eager_fallbacks)
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    verify_seconds: float = 0.0
    requests: dict[str, _RequestTiming] = field(default_factory=dict)

    def request_started(self, request_id: str, at: float) -> None:
        """Record when a request was submitted (TTFT counts from here)."""
        self.requests[request_id] = _RequestTiming(started=at)

    def observe(self, result: RoundResult) -> None:
        """Add one round."""
        s = result.stats
        if s.batch_size == 0:
            return
        self.rounds += 1
        self.recompiles += s.recompiles
        self.eager_fallbacks += s.eager_fallbacks
        self.row_rounds += s.batch_size
        self.drafted += s.drafted
        self.accepted += s.accepted
        self.emitted += s.emitted
        self.gammas.append(s.gamma)
        self.fallback_row_rounds += s.fallback_rows
        self.backlog_scorings += s.scored_rows
        self.lookup_row_rounds += s.lookup_rows
        self.extended_row_rounds += s.extended_rows
        self.tree_row_rounds += s.tree_rows
        if s.tree_nodes:
            self.tree_budgets[s.tree_nodes] = self.tree_budgets.get(s.tree_nodes, 0) + 1
        _add_into(self.drafted_per_position, s.drafted_per_position)
        _add_into(self.accepted_per_position, s.accepted_per_position)
        self.prefill_seconds += s.prefill_seconds
        self.draft_seconds += s.draft_seconds
        self.target_seconds += s.target_seconds
        self.verify_seconds += s.verify_seconds
        for update in result.rows:
            if update.num_drafted > 0:
                self.drafts += 1
                self.accepted_per_draft.append(update.num_accepted)
                self.drafted_per_draft.append(update.num_drafted)
            timing = self.requests.get(update.request_id)
            if timing is None:
                continue
            if update.new_tokens and timing.first_token is None:
                timing.first_token = result.finished_at
            timing.tokens += len(update.new_tokens)
            if update.finish_reason is not None:
                timing.finished = result.finished_at

    def ttfts(self) -> list[float]:
        """Seconds from submission to first token, per request that produced one."""
        return [t.first_token - t.started for t in self.requests.values() if t.first_token is not None]

    def tpots(self) -> list[float]:
        """Seconds per output token after the first, per finished request with 2+ tokens."""
        return [
            (t.finished - t.first_token) / (t.tokens - 1)
            for t in self.requests.values()
            if t.finished is not None and t.first_token is not None and t.tokens > 1
        ]

    def summary(self) -> dict[str, Any]:
        """All statistics as a JSON-ready dict."""
        ttfts, tpots = self.ttfts(), self.tpots()
        starts = [t.started for t in self.requests.values()]
        ends = [t.finished for t in self.requests.values() if t.finished is not None]
        wall = (max(ends) - min(starts)) if starts and ends else 0.0
        return {
            "new_tokens": self.emitted,
            "rounds": self.rounds,
            "wall_seconds": wall,
            "tokens_per_second": self.emitted / wall if wall > 0 else 0.0,
            "ttft_seconds": statistics.median(ttfts) if ttfts else 0.0,
            "tpot_seconds": statistics.median(tpots) if tpots else 0.0,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": acceptance_rate(self.accepted, self.drafted),
            "alpha_mle": estimate_alpha(self.accepted_per_draft, self.drafted_per_draft),
            "mean_accepted_length": mean_accepted_length(self.accepted, self.drafts),
            "accepted_per_round": self.accepted / self.drafts if self.drafts else 0.0,
            "tokens_per_round": self.emitted / self.row_rounds if self.row_rounds else 0.0,
            "acceptance_per_position": [
                a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)
            ],
            "drafts": self.drafts,
            "rejections": sum(int(a < d) for a, d in zip(self.accepted_per_draft, self.drafted_per_draft)),
            "accepted_per_position_counts": list(self.accepted_per_position),
            "drafted_per_position_counts": list(self.drafted_per_position),
            "gamma_mean": statistics.fmean(self.gammas) if self.gammas else 0.0,
            "gamma_history": _run_lengths(self.gammas),
            "fallback_row_rounds": self.fallback_row_rounds,
            "backlog_scorings": self.backlog_scorings,
            "lookup_row_rounds": self.lookup_row_rounds,
            "extended_row_rounds": self.extended_row_rounds,
            "tree_row_rounds": self.tree_row_rounds,
            "tree_budgets": {str(nodes): rounds for nodes, rounds in sorted(self.tree_budgets.items())},
            "recompiles": self.recompiles,
            "eager_fallbacks": self.eager_fallbacks,
            "prefill_seconds": self.prefill_seconds,
            "draft_seconds": self.draft_seconds,
            "target_seconds": self.target_seconds,
            "verify_seconds": self.verify_seconds,
        }


def _run_lengths(values: list[int]) -> list[list[int]]:
    """[[value, repeats], ...]: gamma over time, compactly."""
    out: list[list[int]] = []
    for v in values:
        if out and out[-1][0] == v:
            out[-1][1] += 1
        else:
            out.append([v, 1])
    return out


def _add_into(total: list[int], values: tuple[int, ...]) -> None:
    if len(values) > len(total):
        total.extend([0] * (len(values) - len(total)))
    for i, v in enumerate(values):
        total[i] += v
