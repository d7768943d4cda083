"""Adaptive speculation: choose gamma per request online, gate drafting by confidence, fall back.

Every decision depends only on the past (acceptance counts and timings of earlier rounds, and the
draft's own probability of a token it already drew), so the verifier's guarantee still holds: the
output is distributed exactly as sampling from the target.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from specsample.theory import expected_speedup

log = logging.getLogger("specsample.controller")


@dataclass(frozen=True)
class ControllerConfig:
    """Knobs of the gamma controller (defaults chosen on the tiny models; see docs/adaptive.md)."""

    min_gamma: int = 1
    max_gamma: int = 8
    decay: float = 0.96  # forgetting per observed draft trial (a memory of about 25 trials)
    prior_alpha: float = 0.5
    prior_weight: float = 2.0  # pseudo-trials behind the prior
    hysteresis: float = 0.03  # switch gamma only for a > 3% better predicted speedup
    fallback_below: float = 1.0  # predicted speedup under which a request stops drafting
    resume_above: float = 1.05  # ...and over which it drafts again (hysteresis against thrash)
    probe_every: int = 16  # rounds between probes while in fallback
    gate: bool = True  # stop a round early after a low-confidence draft token
    gate_min_samples: int = 200
    prior_cost_ratio: float = 0.05

    def __post_init__(self) -> None:
        if not 1 <= self.min_gamma <= self.max_gamma:
            raise ValueError(f"need 1 <= min_gamma <= max_gamma, got {self.min_gamma}, {self.max_gamma}")
        if not 0 < self.decay < 1:
            raise ValueError(f"decay must be in (0, 1), got {self.decay}")


@dataclass
class _RequestState:
    successes: float
    failures: float
    gamma: int
    fallback: bool = False
    rounds_since_probe: int = 0

    @property
    def alpha(self) -> float:
        return self.successes / (self.successes + self.failures)


@dataclass
class _Ewma:
    value: float | None = None

    def add(self, x: float, weight: float = 0.2) -> None:
        self.value = x if self.value is None else (1 - weight) * self.value + weight * x


BINS = 10  # confidence bins for the gate's calibration


@dataclass
class GammaController:
    """Per-request gamma from the theory's E(alpha, gamma) / (1 + gamma c), with fallback and a gate."""

    config: ControllerConfig = field(default_factory=ControllerConfig)

    def __post_init__(self) -> None:
        self._requests: dict[str, _RequestState] = {}
        self._draft_step: dict[int, _Ewma] = {}  # batch size -> seconds per draft step
        self._target_step: dict[int, _Ewma] = {}  # batch size -> seconds per target forward
        self._gate_trials = [0] * BINS
        self._gate_accepts = [0] * BINS
        self.switches: list[tuple[str, str]] = []  # (request id, "off" | "on"), for stats and tests

    # ----- estimates ------------------------------------------------------------------------

    def alpha(self, request_id: str) -> float:
        """Current acceptance-rate estimate for a request (the prior before it has drafted)."""
        return self._state(request_id).alpha

    def cost_ratio(self, batch_size: int) -> float:
        """Measured draft-step / target-step time at the nearest batch size seen (a prior before any)."""
        sizes = [b for b in self._target_step if self._draft_step.get(b, _Ewma()).value is not None]
        if not sizes:
            return self.config.prior_cost_ratio
        nearest = min(sizes, key=lambda b: abs(b - batch_size))
        return self._draft_step[nearest].value / max(self._target_step[nearest].value, 1e-9)

    def best_gamma(self, alpha: float, cost_ratio: float) -> tuple[int, float]:
        """Gamma in the configured range maximising the predicted speedup, and that speedup."""
        candidates = range(self.config.min_gamma, self.config.max_gamma + 1)
        best = max(candidates, key=lambda g: (expected_speedup(alpha, g, cost_ratio), -g))
        return best, expected_speedup(alpha, best, cost_ratio)

    # ----- decisions ------------------------------------------------------------------------

    def plan(self, request_ids: list[str], batch_size: int) -> list[int]:
        """Drafts each request may propose this round (0 = decode without drafting)."""
        c = self.cost_ratio(batch_size)
        out = []
        for rid in request_ids:
            state = self._state(rid)
            best, speedup = self.best_gamma(state.alpha, c)
            current = expected_speedup(state.alpha, state.gamma, c)
            if speedup > current * (1 + self.config.hysteresis):
                state.gamma = best
            if not state.fallback and speedup < self.config.fallback_below:
                state.fallback, state.rounds_since_probe = True, 0
                self._switch(rid, "off", state.alpha, c, speedup)
            elif state.fallback and speedup > self.config.resume_above:
                state.fallback = False
                self._switch(rid, "on", state.alpha, c, speedup)
            if state.fallback:
                state.rounds_since_probe += 1
                probe = state.rounds_since_probe >= self.config.probe_every
                if probe:
                    state.rounds_since_probe = 0
                # a probe round refreshes alpha; a few drafts tell more than one
                out.append(max(state.gamma, min(4, self.config.max_gamma)) if probe else 0)
            else:
                out.append(state.gamma)
        return out

    def gate_threshold(self, batch_size: int) -> float:
        """Confidence below which a round stops after the drawn token (0 = no gate yet).

        A draft token drawn with confidence q is accepted with probability a(q), estimated per bin
        from past rounds; once the chain is that likely to break, drafting more costs c per token for
        less than c expected gain. The threshold is the top of the highest bin where a(q) < c / a_mean.
        """
        trials = sum(self._gate_trials)
        if not self.config.gate or trials < self.config.gate_min_samples:
            return 0.0
        mean = sum(self._gate_accepts) / trials
        if mean <= 0:
            return 0.0
        bar = self.cost_ratio(batch_size) / mean
        threshold = 0.0
        for b in range(BINS):
            if self._gate_trials[b] >= 10:
                if self._gate_accepts[b] / self._gate_trials[b] < bar:
                    threshold = (b + 1) / BINS
                else:
                    break
        return threshold

    # ----- observations ---------------------------------------------------------------------

    def observe(self, request_id: str, num_drafted: int, num_accepted: int,
                confidences: list[float] | None = None) -> None:
        """Record one round of a request: counts, and the confidence of each drafted token."""
        if num_drafted <= 0:
            return
        state = self._state(request_id)
        rejected = int(num_accepted < num_drafted)
        # forget per trial, not per round: a long round must not outweigh many short ones
        factor = self.config.decay ** (num_accepted + rejected)
        state.successes = factor * state.successes + num_accepted
        state.failures = factor * state.failures + rejected
        for i, q in enumerate((confidences or [])[: min(num_accepted + 1, num_drafted)]):
            if q != q:  # NaN: a deterministic (n-gram) draft has no confidence to calibrate on
                continue
            b = min(int(q * BINS), BINS - 1)
            self._gate_trials[b] += 1
            self._gate_accepts[b] += int(i < num_accepted)

    def observe_timing(self, batch_size: int, gamma: int, draft_seconds: float, target_seconds: float) -> None:
        """Record one round's draft and target time at a batch size."""
        if gamma > 0:
            self._draft_step.setdefault(batch_size, _Ewma()).add(draft_seconds / gamma)
        self._target_step.setdefault(batch_size, _Ewma()).add(target_seconds)

    def release(self, request_id: str) -> None:
        """Forget a finished request."""
        self._requests.pop(request_id, None)

    def in_fallback(self, request_id: str) -> bool:
        return self._state(request_id).fallback

    def _state(self, request_id: str) -> _RequestState:
        if request_id not in self._requests:
            w, a = self.config.prior_weight, self.config.prior_alpha
            start = min(max(self.config.max_gamma // 2, self.config.min_gamma), self.config.max_gamma)
            self._requests[request_id] = _RequestState(successes=w * a, failures=w * (1 - a), gamma=start)
        return self._requests[request_id]

    def _switch(self, rid: str, to: str, alpha: float, c: float, speedup: float) -> None:
        self.switches.append((rid, to))
        log.info("request %s: speculation %s (alpha %.2f, cost ratio %.3f, predicted speedup %.2f)",
                 rid, to, alpha, c, speedup)
