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
    probe_every: int = 4  # fewest rounds between probes while in fallback (near break-even they cost ~nothing)
    max_probe_every: int = 256  # most rounds between probes (how late a recovery can be noticed)
    probe_budget: float = 0.01  # share of decode time the expected loss of probing may cost in fallback
    gate: bool = True  # stop a round early after a low-confidence draft token
    gate_min_samples: int = 200
    prior_cost_ratio: float = 0.05
    calibrate_every: int = 128  # rounds per batch size between plain rounds that time plain decoding
    pool_decay: float = 0.99  # forgetting of the acceptance pooled over requests (a new request's prior)

    def __post_init__(self) -> None:
        if not 1 <= self.min_gamma <= self.max_gamma:
            raise ValueError(f"need 1 <= min_gamma <= max_gamma, got {self.min_gamma}, {self.max_gamma}")
        if not 0 < self.decay < 1:
            raise ValueError(f"decay must be in (0, 1), got {self.decay}")
        if not 0 < self.pool_decay < 1:
            raise ValueError(f"pool_decay must be in (0, 1), got {self.pool_decay}")
        if self.calibrate_every < 1:
            raise ValueError(f"calibrate_every must be >= 1, got {self.calibrate_every}")
        if not 1 <= self.probe_every <= self.max_probe_every:
            raise ValueError(f"need 1 <= probe_every <= max_probe_every, got {self.probe_every}, "
                             f"{self.max_probe_every}")
        if not 0 < self.probe_budget <= 1:
            raise ValueError(f"probe_budget must be in (0, 1], got {self.probe_budget}")


@dataclass
class _RequestState:
    successes: float
    failures: float
    gamma: int
    fallback: bool = False
    rounds_since_probe: int = 0
    planned: int | None = None  # drafts planned last round (None: none planned yet)

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
    """Per-request gamma from the theory's E(alpha, gamma) / (1 + k + gamma c), with fallback and a gate."""

    config: ControllerConfig = field(default_factory=ControllerConfig)

    def __post_init__(self) -> None:
        self._requests: dict[str, _RequestState] = {}
        self._draft_step: dict[int, _Ewma] = {}  # batch size -> seconds per draft step
        self._target_step: dict[int, _Ewma] = {}  # batch size -> seconds per target forward
        self._plain_round: dict[int, _Ewma] = {}  # batch size -> seconds per round without drafts
        self._overhead: dict[int, _Ewma] = {}  # batch size -> seconds a drafting round costs beyond plain + drafts
        self._round = 0  # rounds planned so far
        self._catching_up = False  # this round a row drafts after a plain round: its draft first catches up
        self._last_plain: dict[int, int] = {}  # batch size -> round of the last plain round (or attempt)
        self._pooled = [0.0, 0.0]  # successes, failures over all requests (decayed): new requests' prior
        self._gate_trials = [0] * BINS
        self._gate_accepts = [0] * BINS
        self.switches: list[tuple[str, str]] = []  # (request id, "off" | "on"), for stats and tests

    # ----- estimates ------------------------------------------------------------------------

    def alpha(self, request_id: str) -> float:
        """Current acceptance-rate estimate for a request (the prior before it has drafted)."""
        return self._state(request_id).alpha

    def _nearest(self, batch_size: int) -> int | None:
        sizes = [b for b in self._target_step if self._draft_step.get(b, _Ewma()).value is not None]
        return min(sizes, key=lambda b: abs(b - batch_size)) if sizes else None

    def cost_ratio(self, batch_size: int) -> float:
        """c at the nearest batch size measured: what one more draft step adds to a round's time, over
        the time of a round without drafts (a prior before any measurement; until a plain round has
        been timed there, draft step / target forward)."""
        nearest = self._nearest(batch_size)
        if nearest is None:
            return self.config.prior_cost_ratio
        plain = self._plain_round.get(nearest)
        base = plain.value if plain is not None else self._target_step[nearest].value
        return self._draft_step[nearest].value / max(base, 1e-9)

    def overhead(self, batch_size: int) -> float:
        """k at the nearest batch size measured: what a drafting round costs beyond a plain round and
        its draft steps, whatever its gamma (scoring gamma + 1 tokens instead of one, verifying them),
        over a plain round's time; 0 until a plain round has been timed.

        Measured rounds are affine in gamma (on the shipped pair about 1.03 + 0.14 gamma plain rounds),
        so a single per-draft c from whole rounds would charge the fixed part to every draft and make
        long rounds look dear: it made the controller pick gamma 1 where 2-3 were faster.
        """
        nearest = self._nearest(batch_size)
        plain, extra = self._plain_round.get(nearest), self._overhead.get(nearest)
        if plain is None or extra is None:
            return 0.0
        return max(extra.value, 0.0) / max(plain.value, 1e-9)

    def best_gamma(self, alpha: float, cost_ratio: float, overhead: float = 0.0) -> tuple[int, float]:
        """Gamma in the configured range maximising the predicted speedup, and that speedup."""
        candidates = range(self.config.min_gamma, self.config.max_gamma + 1)
        best = max(candidates, key=lambda g: (expected_speedup(alpha, g, cost_ratio, overhead), -g))
        return best, expected_speedup(alpha, best, cost_ratio, overhead)

    # ----- decisions ------------------------------------------------------------------------

    def plan(self, request_ids: list[str], batch_size: int) -> list[int]:
        """Drafts each request may propose this round (0 = decode without drafting)."""
        self._round += 1
        c, k = self.cost_ratio(batch_size), self.overhead(batch_size)
        if self._calibration_due(batch_size):
            # time one round without drafts (needed for c); a choice from the past alone, so still exact
            self._last_plain[batch_size] = self._round
            return self._planned(request_ids, [0] * len(request_ids))
        out = []
        for rid in request_ids:
            state = self._state(rid)
            best, speedup = self.best_gamma(state.alpha, c, k)
            current = expected_speedup(state.alpha, state.gamma, c, k)
            if speedup > current * (1 + self.config.hysteresis):
                state.gamma = best
            if not state.fallback and speedup < self.config.fallback_below:
                state.fallback, state.rounds_since_probe = True, 0
                self._switch(rid, "off", state.alpha, c, k, speedup)
            elif state.fallback and speedup > self.config.resume_above:
                state.fallback = False
                self._switch(rid, "on", state.alpha, c, k, speedup)
            if state.fallback:
                state.rounds_since_probe += 1
                probe = state.rounds_since_probe >= self.probe_interval(state.alpha, state.gamma, c, k)
                if probe:
                    state.rounds_since_probe = 0
                # a probe drafts the gamma the formula picks (1 at a low alpha): at the break-even alpha a
                # one-draft probe costs about what it returns, four drafts cost ~0.7 of a round (measured c)
                out.append(state.gamma if probe else 0)
            else:
                out.append(state.gamma)
        return self._planned(request_ids, out)

    def _planned(self, request_ids: list[str], drafts: list[int]) -> list[int]:
        """Note which rows draft right after a plain round: a model draft then first feeds itself the
        tokens it missed (one more forward), a cost of the plain rounds, not of drafting. Timed into c
        and k, it doubled the draft step of every fallback probe and kept requests in fallback."""
        self._catching_up = False
        for rid, n in zip(request_ids, drafts):
            state = self._state(rid)
            self._catching_up |= n > 0 and state.planned == 0
            state.planned = n
        return drafts

    def probe_interval(self, alpha: float, gamma: int, cost_ratio: float, overhead: float = 0.0) -> int:
        """Rounds between fallback probes: sparse enough that their expected loss stays within
        `probe_budget` of decode time, within [probe_every, max_probe_every].

        A probe round takes 1 + k + gamma c plain rounds' time for E(alpha, gamma) tokens; a plain round
        gives one token per unit. When verification is dear (a compiled plain step, a slow draft) a
        probe loses most of a round, so it runs rarely; near break-even it costs nothing and runs often.
        """
        speedup = expected_speedup(alpha, max(gamma, 1), cost_ratio, overhead)
        loss = (1 + overhead + max(gamma, 1) * cost_ratio) * max(1 - speedup, 0.0)  # in plain rounds' time
        interval = int(loss / self.config.probe_budget) + 1
        return min(max(interval, self.config.probe_every), self.config.max_probe_every)

    def _calibration_due(self, batch_size: int) -> bool:
        """A plain round is due once drafting rounds were timed at this batch size and no plain round
        was run (or attempted: rows with a fixed gamma may draft anyway) in `calibrate_every` rounds."""
        if batch_size not in self._target_step:
            return False  # nothing timed here yet (or a caller that never reports timings)
        last = self._last_plain.get(batch_size)
        return last is None or self._round - last >= self.config.calibrate_every

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
        pool = self.config.pool_decay ** (num_accepted + rejected)
        self._pooled = [pool * self._pooled[0] + num_accepted, pool * self._pooled[1] + rejected]
        for i, q in enumerate((confidences or [])[: min(num_accepted + 1, num_drafted)]):
            if q != q:  # NaN: a deterministic (n-gram) draft has no confidence to calibrate on
                continue
            b = min(int(q * BINS), BINS - 1)
            self._gate_trials[b] += 1
            self._gate_accepts[b] += int(i < num_accepted)

    def observe_timing(self, batch_size: int, gamma: int, draft_seconds: float, target_seconds: float,
                       verify_seconds: float = 0.0) -> None:
        """Record one round's draft, target and verify-and-commit time at a batch size (gamma 0: a plain round)."""
        total = draft_seconds + target_seconds + verify_seconds
        catching_up, self._catching_up = self._catching_up, False  # it describes this round only
        if gamma == 0:
            self._plain_round.setdefault(batch_size, _Ewma()).add(total)
            self._last_plain[batch_size] = self._round
            return
        if catching_up:
            return  # the catch-up forward would be charged to drafting (see _planned)
        step = self._draft_step.setdefault(batch_size, _Ewma())
        step.add(draft_seconds / gamma)
        self._target_step.setdefault(batch_size, _Ewma()).add(target_seconds)
        plain = self._plain_round.get(batch_size)
        if plain is not None:
            extra = total - plain.value - gamma * step.value
            self._overhead.setdefault(batch_size, _Ewma()).add(extra, weight=0.1)

    def release(self, request_id: str) -> None:
        """Forget a finished request."""
        self._requests.pop(request_id, None)

    def in_fallback(self, request_id: str) -> bool:
        return self._state(request_id).fallback

    def _state(self, request_id: str) -> _RequestState:
        if request_id not in self._requests:
            w, a = self.config.prior_weight, self.config.prior_alpha
            if sum(self._pooled) >= 10:  # earlier requests' acceptance is a better start than a constant
                a = min(max(self._pooled[0] / sum(self._pooled), 0.01), 0.99)
            start = min(max(self.config.max_gamma // 2, self.config.min_gamma), self.config.max_gamma)
            self._requests[request_id] = _RequestState(successes=w * a, failures=w * (1 - a), gamma=start)
        return self._requests[request_id]

    def _switch(self, rid: str, to: str, alpha: float, c: float, k: float, speedup: float) -> None:
        self.switches.append((rid, to))
        log.info("request %s: speculation %s (alpha %.2f, cost ratio %.3f, overhead %.3f, predicted speedup %.2f)",
                 rid, to, alpha, c, k, speedup)
