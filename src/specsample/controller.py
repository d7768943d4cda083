"""Adaptive speculation: choose gamma per request online, gate drafting by confidence, fall back.

Every decision depends only on the past (acceptance counts and timings of earlier rounds, and the
draft's own probability of a token it already drew), so the verifier's guarantee still holds: the
output is distributed exactly as sampling from the target.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from specsample.theory import expected_tokens_per_round

log = logging.getLogger("specsample.controller")


@dataclass(frozen=True)
class ControllerConfig:
    """Knobs of the gamma controller (defaults chosen on the tiny models; see docs/adaptive.md)."""

    min_gamma: int = 1
    max_gamma: int = 8
    decay: float = 0.96  # forgetting per observed draft trial (a memory of about 25 trials)
    prior_alpha: float = 0.5
    prior_weight: float = 8.0  # pseudo-trials at the pooled alpha behind every request's estimate
    hysteresis: float = 0.03  # switch gamma only for a > 3% better predicted speedup
    fallback_below: float = 1.0  # predicted speedup under which a request stops drafting...
    fallback_margin: float = 1.0  # ...even at alpha this many standard errors above its estimate...
    scored_fallback_margin: float = 1.0  # ...or this many where its draft can score what it missed (`plan`'s
    # scorable). 0.5 helped translation 0.3-0.5% in replays, but cost others more (interleaved: ~1% overall)
    resume_above: float = 1.02  # ...and over which it drafts again (with the margin: hysteresis against thrash)
    probe_every: int = 4  # fewest rounds between probes while in fallback (near break-even they cost ~nothing)
    max_probe_every: int = 256  # most rounds between probes (how late a recovery can be noticed)
    probe_budget: float = 0.01  # share of decode time the expected loss of probing may cost in fallback
    probe_horizon: int = 32  # no probes with fewer tokens left in a request's budget: a recovery then cannot pay
    probe_backoff: float = 1.0  # each probe in a row with nothing accepted multiplies the next interval by this (1: off;
    # 2 cut probes on unhelpable requests by half, but a request near break-even that fell back then rarely returns)
    score_backlog: bool = True  # in fallback, learn alpha by having the draft score the tokens it missed...
    score_min_tokens: int = 4  # ...once this many (where the drafter can: a model draft), instead of drafting
    hopeful_scoring: bool = True  # ...every 2 probe_every rounds while alpha a margin up would resume drafting
    stall_costs: bool = False  # price measured round lengths with what the caps cut off their timings: an experiment
    # (session 36's GPU stalled a third to half of its drafting rounds by ~45 ms and few plain ones; capped means
    # held drafting's typical cost, ~60% of its mean); off, as OS stalls on a shared box cost every kind alike
    priced_first_scoring: bool = True  # ...the first early only where it costs within probe_budget of the tokens the
    # request has left (False: always, as before session 36, when it cost a 64-token reply 6% on a GPU)
    gate: bool = True  # stop a round early after a low-confidence draft token
    extend: bool = True  # ...and draft past the planned gamma while the drafts so far were likely all accepted
    gate_min_samples: int = 200
    prior_cost_ratio: float = 0.05
    calibrate_every: int = 64  # rounds per batch size between plain rounds that time plain decoding
    explore_every: int = 16  # rounds between tries of a neighbouring gamma, so round costs are measured
    cost_min_rounds: int = 2  # rounds of a length timed before their cost replaces the affine 1 + k + gamma c
    gate_min_rounds: int = 8  # ...and before the gate prices one more draft by it (a difference of two noisy means)
    pool_decay: float = 0.99  # forgetting of the acceptance pooled over requests (a new request's prior)...
    pool_round_decay: float = 0.995  # ...and per round planned, drafted or not: a pool fed by drafting alone froze
    # when every request fell back (after one bad first reply, every later one started in fallback; session 25)
    confidence_prior: bool = True  # centre a request's prior on the acceptance its drafts' confidences predict...
    confidence_weight: float = 2.0  # ...behind this many pseudo-trials at the pooled alpha
    expected_acceptance: bool = True  # learn from each reached position's acceptance probability (beta), not its coin
    lookup_cost: float = 0.04  # what one more prompt-lookup token adds to a round (plain rounds) until timed: the
    # target scoring one more position (on this CPU 1.018 / 1.059 / 1.225 plain rounds for 1 / 2 / 5 tokens)
    settle_timings: int = 3  # every timed mean starts as the median of its first this many timings, plain rounds are
    # re-timed every probe_every rounds until this many were, and no request falls back on costs timed fewer times
    # (1: the first timing stands alone, as before session 36, when one stalled round on a GPU priced drafting at
    # half a plain round for the rest of the run)

    def __post_init__(self) -> None:
        if not 1 <= self.min_gamma <= self.max_gamma:
            raise ValueError(f"need 1 <= min_gamma <= max_gamma, got {self.min_gamma}, {self.max_gamma}")
        if not 0 < self.decay < 1:
            raise ValueError(f"decay must be in (0, 1), got {self.decay}")
        if not 0 < self.pool_decay < 1:
            raise ValueError(f"pool_decay must be in (0, 1), got {self.pool_decay}")
        if not 0 < self.pool_round_decay <= 1:
            raise ValueError(f"pool_round_decay must be in (0, 1] (1: no forgetting per round), got {self.pool_round_decay}")
        if self.calibrate_every < 1:
            raise ValueError(f"calibrate_every must be >= 1, got {self.calibrate_every}")
        if min(self.explore_every, self.cost_min_rounds, self.gate_min_rounds) < 1:
            raise ValueError(f"explore_every, cost_min_rounds and gate_min_rounds must be >= 1, got "
                             f"{self.explore_every}, {self.cost_min_rounds}, {self.gate_min_rounds}")
        if min(self.fallback_margin, self.scored_fallback_margin) < 0:
            raise ValueError(f"fallback_margin and scored_fallback_margin must be >= 0 (standard errors), got "
                             f"{self.fallback_margin}, {self.scored_fallback_margin}")
        if not 1 <= self.probe_every <= self.max_probe_every:
            raise ValueError(f"need 1 <= probe_every <= max_probe_every, got {self.probe_every}, "
                             f"{self.max_probe_every}")
        if self.probe_backoff < 1:
            raise ValueError(f"probe_backoff must be >= 1 (1: no backoff), got {self.probe_backoff}")
        if self.score_min_tokens < 1:
            raise ValueError(f"score_min_tokens must be >= 1, got {self.score_min_tokens}")
        if self.probe_horizon < 0:
            raise ValueError(f"probe_horizon must be >= 0 (tokens), got {self.probe_horizon}")
        if not 0 < self.probe_budget <= 1:
            raise ValueError(f"probe_budget must be in (0, 1], got {self.probe_budget}")
        if self.prior_weight <= 0:
            raise ValueError(f"prior_weight must be > 0 (pseudo-trials), got {self.prior_weight}")
        if self.confidence_weight <= 0:
            raise ValueError(f"confidence_weight must be > 0 (pseudo-trials), got {self.confidence_weight}")
        if self.lookup_cost < 0:
            raise ValueError(f"lookup_cost must be >= 0 (plain rounds per token), got {self.lookup_cost}")
        if self.settle_timings < 1:
            raise ValueError(f"settle_timings must be >= 1 (timings), got {self.settle_timings}")


@dataclass
class _RequestState:
    gamma: int
    successes: float = 0.0  # the request's own accepted drafts (decayed)
    failures: float = 0.0  # ...and rounds ended by a rejection
    squares: float = 0.0  # ...and the sum of its trials' squared outcomes (decayed): their spread, for the margin
    fallback: bool = False
    rounds_since_probe: int = 0
    failed_probes: int = 0  # probes in a row, since it last fell back, whose drafts were all rejected
    scorings: int = 0  # backlog scorings since it last fell back
    planned: int | None = None  # drafts planned last round (None: none planned yet)
    predicted: float = 0.0  # acceptance its drafts' confidences predict, summed over its trials (decayed)...
    predicted_trials: float = 0.0  # ...over this many of them (those with a confidence in a calibrated bin)
    lookup_successes: float = 0.0  # its prompt-lookup drafts accepted (decayed), apart from the draft model's...
    lookup_failures: float = 0.0  # ...and its lookup rounds ended by a rejection


def _closest(sizes: list[int], batch_size: int) -> int | None:
    """The batch size in `sizes` nearest `batch_size` (None if there is none): it stands in for one not measured."""
    return min(sizes, key=lambda b: abs(b - batch_size)) if sizes else None


@dataclass
class _Ewma:
    value: float | None = None
    count: int = 0  # observations so far
    settle: int = 1  # the first this many observations give their median (the lower of two middles)...
    first: list[float] = field(default_factory=list)  # ...kept here until then

    def add(self, x: float, weight: float = 0.2, spike: float | None = None) -> None:
        """Average in `x` (after the first `settle` values' median, a plain mean up to 1 / weight values, so the
        first ones do not linger); with `spike`, first cap it at that multiple of the current value. A spike cap
        cannot help the first value: a stalled one, as a mean's start, outweighed the few timings that follow
        a round length tried once in 64 rounds."""
        if self.value is not None and spike is not None:
            x = min(x, spike * self.value)
        self.count += 1
        if self.count <= self.settle:
            self.first.append(x)
            self.value = sorted(self.first)[(len(self.first) - 1) // 2]
            return
        weight = max(weight, 1.0 / self.count)
        self.value = (1 - weight) * self.value + weight * x


POOL_MIN_TRIALS = 10.0  # pooled trials from which the pool, not prior_alpha, sets a new request's prior
BINS = 10  # confidence bins for the gate's calibration
BIN_MIN_TRIALS = 10  # drafts a bin needs before its acceptance is read
RELATIVE_DECAY = 0.995  # forgetting of relative round costs per round timed (a memory of about 200 rounds)
RELATIVE_WEIGHT = 0.1  # most weight one timed round has in its length's relative cost...
RELATIVE_SPIKE = 1.2  # ...counted at most 1.2x that cost: a 2x stall of a length timed once in 64 rounds, at
# 1 - 0.995^64 = 0.27 and 1.5x, moved the plain round's cost 13% and with it every drafting round's ratio
SPIKE = 1.5  # a round timed over 1.5x its running mean counts as 1.5x: on a shared box the OS stalls
# single rounds by 2x and more, and one such stall moved a rarely timed round length's mean by ~10%


@dataclass
class _RoundCosts:
    """Round times at one batch size as pace x relative cost: the pace (seconds per unit) follows the
    box and the context quickly, every round; each round length's relative cost moves slowly. Lengths
    timed minutes apart (a neighbour is tried every 16 rounds, a plain round every 64) are then compared
    like with like: the box's pace drifts by 10% and more over minutes, more than what separates
    neighbouring gammas, and comparing raw means made the cheaper length look dearer half the time."""

    settle: int = 1  # the timings each mean starts from as their median (ControllerConfig.settle_timings)
    stalls: bool = False  # ratios count what the caps cut off (ControllerConfig.stall_costs)
    pace: _Ewma = field(init=False)  # seconds per unit of relative cost (set in __post_init__: copies start afresh)
    relative: dict[int, _Ewma] = field(default_factory=dict)  # drafts in the round (0: plain) -> cost in pace units
    rounds: int = 0  # rounds timed
    last: dict[int, int] = field(default_factory=dict)  # drafts -> when such a round was last timed
    excess: dict[int, _Ewma] = field(default_factory=dict)  # drafts -> mean time the cap cut off (pace units)

    def __post_init__(self) -> None:
        self.pace = _Ewma(settle=self.settle)

    def add(self, drafts: int, seconds: float, new_batch: bool = False) -> None:
        """Time one round of `drafts` drafts. `new_batch`: the rows changed since the last round timed (at
        batch 1, a new request): its context may be far from the last one's, so this round only re-seeds
        the pace. Timed against the last request's pace, the first round of a length seldom timed carried
        that request's context into its cost (tests/test_adaptive.py: alternating long and short requests
        bias gamma 1's cost by over 5% without this)."""
        if seconds <= 0:
            return  # a clock that did not move says nothing about cost
        if new_batch and drafts in self.relative:
            self.pace = _Ewma(settle=self.settle)
            self.pace.add(seconds / self.relative[drafts].value)
            return
        seeding = self.pace.value is None
        if seeding:
            self.pace.add(seconds)  # the first round timed sets the unit
        self.rounds += 1
        # relative costs forget per round timed, not per observation: a length timed every round must not
        # follow the pace (that is the pace's job), one tried every 16 rounds must not freeze
        elapsed = self.rounds - self.last.get(drafts, self.rounds - 1)
        self.last[drafts] = self.rounds
        cost = self.relative.setdefault(drafts, _Ewma(settle=self.settle))
        weight = min(1 - RELATIVE_DECAY**elapsed, RELATIVE_WEIGHT)
        timed = seconds / self.pace.value  # at the pace so far
        if self.stalls:  # what the cap below cuts off this timing (nothing off a length's first)
            cut = max(timed - RELATIVE_SPIKE * cost.value, 0.0) if cost.value is not None else 0.0
            self.excess.setdefault(drafts, _Ewma()).add(cut, weight=weight)
        cost.add(timed, weight=weight, spike=RELATIVE_SPIKE)
        if not (seeding and self.settle > 1):  # counted twice, the first round would be the median of three
            self.pace.add(seconds / cost.value, spike=RELATIVE_SPIKE)

    def count(self, drafts: int) -> int:
        return self.relative[drafts].count if drafts in self.relative else 0

    def since(self, drafts: int) -> int:
        """Rounds timed since a round of `drafts` was (all of them if never)."""
        return self.rounds - self.last.get(drafts, 0)

    def ratio(self, drafts: int, min_rounds: int) -> float | None:
        """A round of `drafts` over a plain round, once `min_rounds` such rounds and a plain one were timed."""
        if self.count(drafts) < min_rounds or self.count(0) < 1:
            return None
        if self.stalls:  # each length at its mean, stalls included
            mean = {d: self.relative[d].value + (self.excess[d].value if d in self.excess else 0.0)
                    for d in (drafts, 0)}
            return mean[drafts] / max(mean[0], 1e-12)
        return self.relative[drafts].value / max(self.relative[0].value, 1e-12)


@dataclass
class _Memo:
    """What a plan computes from the timings, kept until the next timing or plan: a plan prices every round
    length for every row, and in fallback that arithmetic was most of gamma auto's own work in a plain round."""

    nearest: dict[int, int | None] = field(default_factory=dict)  # batch size -> _nearest
    costs: dict[tuple[int, int], float] = field(default_factory=dict)  # (batch size, drafts) -> round_cost
    affine: dict[int, tuple[float, float]] = field(default_factory=dict)  # batch size -> (overhead k, cost ratio c)


@dataclass
class GammaController:
    """Per-request gamma maximising the theory's E(alpha, gamma) over the measured cost of a round of
    gamma drafts (1 + k + gamma c until rounds of that length were timed), with fallback and a gate."""

    config: ControllerConfig = field(default_factory=ControllerConfig)

    def __post_init__(self) -> None:
        self._requests: dict[str, _RequestState] = {}
        self._draft_step: dict[int, _Ewma] = {}  # batch size -> seconds per draft step
        self._target_step: dict[int, _Ewma] = {}  # batch size -> seconds per target forward
        self._plain_round: dict[int, _Ewma] = {}  # batch size -> seconds per round without drafts
        self._overhead: dict[int, _Ewma] = {}  # batch size -> seconds a drafting round costs beyond plain + drafts
        self._scoring: dict[int, _Ewma] = {}  # batch size -> what a backlog scoring adds to a plain round (plain rounds)
        self._costs: dict[int, _RoundCosts] = {}  # batch size -> round times by draft count
        self._lookup_costs: dict[int, _RoundCosts] = {}  # batch size -> times of prompt-lookup rounds (and plain ones)
        self._lookups: dict[str, int] = {}  # request id -> prompt-lookup tokens it proposes this round
        self._model_drafting = False  # this round some row drafts with the draft model
        self.lookup_rounds = 0  # row-rounds that proposed a prompt lookup, for stats and tests
        self._lookup_pooled = [0.0, 0.0]  # lookup successes, failures over all requests (decayed)
        self._memo = _Memo()  # costs move only with timings: between two, a plan prices each length once
        self._round = 0  # rounds planned so far
        self._exploring = False  # this round tries neighbouring gammas: no gate, so it drafts them in full
        self._catching_up = False  # this round a row drafts after a plain round: its draft first catches up
        self._last_plain: dict[int, int] = {}  # batch size -> round of the last plain round (or attempt)
        self._calibrations: dict[int, int] = {}  # batch size -> plain rounds planned to time plain decoding
        self._rows: dict[int, tuple[str, ...]] = {}  # batch size -> the requests of the last round timed there
        self._planned_rows: tuple[str, ...] = ()  # the requests planned this round
        self._scores: dict[str, int] = {}  # request id -> backlog tokens the draft scores this round
        self.scored = 0  # backlog scorings run (fallback probes that drafted nothing), for stats and tests
        self._pooled = [0.0, 0.0]  # successes, failures over all requests (decayed): new requests' prior
        self._gate_trials = [0] * BINS
        self._gate_accepts = [0] * BINS
        self.switches: list[tuple[str, str]] = []  # (request id, "off" | "on"), for stats and tests

    # ----- estimates ------------------------------------------------------------------------

    def alpha(self, request_id: str) -> float:
        """Current acceptance-rate estimate for a request: its own decayed counts behind `prior_weight`
        pseudo-trials at its prior centre (`_prior_centre`: what its drafts' confidences predict, or the
        acceptance pooled over requests before it has drafted).

        The prior stays: on its own, a request's ~25 remembered trials near break-even (alpha ~0.3 on
        the shipped pair) are noisy enough to send requests that gain by drafting into fallback.
        """
        state = self._state(request_id)
        weight = self.config.prior_weight
        return (state.successes + weight * self._prior_centre(state)) / (state.successes + state.failures + weight)

    def _alpha_upper(self, request_id: str, margin: float | None = None) -> float:
        """Alpha `margin` (default `fallback_margin`) standard errors above the estimate (its trials are its
        sample size)."""
        state, alpha = self._state(request_id), self.alpha(request_id)
        weight = self.config.prior_weight
        trials = state.successes + state.failures + weight
        # the prior's pseudo-trials count as coins (second moment = mean); trials that are acceptance
        # probabilities (`observe`'s expected) spread less than coins, so their margin is narrower
        second = (state.squares + weight * self._prior_centre(state)) / trials
        variance = max(second - alpha * alpha, 0.0)
        margin = self.config.fallback_margin if margin is None else margin
        return min(alpha + margin * (variance / trials) ** 0.5, 1.0)

    def _nearest(self, batch_size: int) -> int | None:
        """The batch size nearest `batch_size` where drafting rounds were timed."""
        if batch_size not in self._memo.nearest:
            self._memo.nearest[batch_size] = _closest(
                [b for b, step in self._draft_step.items() if step.value is not None and b in self._target_step],
                batch_size)
        return self._memo.nearest[batch_size]

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

        With c it prices round lengths not timed yet (`round_cost`): a single per-draft c from whole
        rounds would charge this fixed part to every draft and make long rounds look dear.
        """
        nearest = self._nearest(batch_size)
        plain, extra = self._plain_round.get(nearest), self._overhead.get(nearest)
        if plain is None or extra is None:
            return 0.0
        return max(extra.value, 0.0) / max(plain.value, 1e-9)

    def round_cost(self, batch_size: int, drafts: int) -> float:
        """What a round drafting `drafts` tokens costs, in plain rounds' time, at the nearest batch size
        measured: its measured mean once `cost_min_rounds` such rounds were timed, else 1 + k + drafts c.

        Measured rounds are affine in gamma only roughly: on this CPU the target's matrix kernels run 2
        rows slower than 3, so a round of one draft is dear and a second draft cheap; the affine line
        fitted where the controller drafts made gamma 2 look dear.
        """
        if drafts == 0:
            return 1.0
        memo = self._memo.costs.get((batch_size, drafts))
        if memo is not None:
            return memo
        nearest = self._nearest(batch_size)
        cost = self._costs[nearest].ratio(drafts, self.config.cost_min_rounds) if nearest in self._costs else None
        if cost is None:
            if batch_size not in self._memo.affine:
                self._memo.affine[batch_size] = (self.overhead(batch_size), self.cost_ratio(batch_size))
            overhead, ratio = self._memo.affine[batch_size]
            cost = 1.0 + overhead + drafts * ratio
        self._memo.costs[(batch_size, drafts)] = cost
        return cost

    def speedup(self, alpha: float, gamma: int, batch_size: int) -> float:
        """Predicted speedup over plain decoding: E(alpha, gamma) tokens per round over the round's cost."""
        return expected_tokens_per_round(alpha, gamma) / self.round_cost(batch_size, gamma)

    def best_gamma(self, alpha: float, batch_size: int) -> tuple[int, float]:
        """Gamma in the configured range maximising the predicted speedup, and that speedup."""
        best, best_speedup = self.config.min_gamma, -1.0
        for gamma in range(self.config.min_gamma, self.config.max_gamma + 1):
            speedup = self.speedup(alpha, gamma, batch_size)
            if speedup > best_speedup:  # strictly: on a tie the shorter round wins
                best, best_speedup = gamma, speedup
        return best, best_speedup

    # ----- decisions ------------------------------------------------------------------------

    def plan(self, request_ids: list[str], batch_size: int, remaining: list[int] | None = None,
             scorable: list[int] | None = None, lookup: list[int] | None = None,
             otherwise: list[bool] | None = None) -> list[int]:
        """Drafts each request may propose this round (0 = decode without drafting); `remaining`: tokens
        left in each request's budget; `scorable`: tokens each could have its draft score teacher-forced
        (committed by plain rounds since it last drafted; None or 0: it cannot). Requests whose scoring is
        due are in `scores_planned()`.

        `lookup`: tokens of prompt lookup each request's drafter offers now (0: none), `otherwise`: whether it
        could draft with a model instead (default: yes). A request with an offer proposes `lookup_length` of
        those tokens where that is predicted faster than what the model's plan for it predicts (a plain round
        in fallback) or where it has no model; such requests are in `lookups_planned()`."""
        self._round += 1
        self._memo = _Memo()
        self._forget_pools()
        self._planned_rows = tuple(request_ids)
        self._scores = {}
        self._lookups = {}
        left = dict(zip(request_ids, remaining, strict=True)) if remaining is not None else {}
        backlog = dict(zip(request_ids, scorable, strict=True)) if scorable is not None else {}
        # where the draft can score the tokens it misses, fallback is cheaper to leave (a draft forward now and
        # then measures alpha on every token): scored_fallback_margin may be set lower
        can_score = scorable is not None and self.config.score_backlog
        margin = self.config.scored_fallback_margin if can_score else self.config.fallback_margin
        if self._calibration_due(batch_size):
            # time one round without drafts (needed for c); a choice from the past alone, so still exact
            self._last_plain[batch_size] = self._round
            self._calibrations[batch_size] = self._calibrations.get(batch_size, 0) + 1
            self._exploring = False
            return self._planned(request_ids, [0] * len(request_ids))
        # exploring is only worth its cost where rounds are timed (the engine reports timings)
        exploring = self._round % self.config.explore_every == 0 and batch_size in self._target_step
        self._exploring = False
        out = []
        for rid in request_ids:
            state, alpha = self._state(rid), self.alpha(rid)
            best, speedup = self.best_gamma(alpha, batch_size)
            # a new request starts at the best gamma for the pooled alpha; later, switch only for a clear gain
            if not state.gamma or speedup > self.speedup(alpha, state.gamma, batch_size) * (1 + self.config.hysteresis):
                state.gamma = best
            # stop drafting only when even a generous alpha predicts a loss: at the ~25 trials the estimate
            # remembers, its noise near break-even (alpha ~0.3 on the shipped pair) sent requests that
            # gained 5% by drafting into fallback, where only sparse probes can bring them back
            if (not state.fallback and speedup < self.config.fallback_below and not self._costs_settling(batch_size)
                    and self.best_gamma(self._alpha_upper(rid, margin), batch_size)[1] < self.config.fallback_below):
                state.fallback, state.rounds_since_probe, state.failed_probes, state.scorings = True, 0, 0, 0
                self._switch(rid, "off", alpha, batch_size, speedup)
            elif state.fallback and speedup > self.config.resume_above:
                state.fallback = False
                self._switch(rid, "on", alpha, batch_size, speedup)
            if state.fallback:
                state.rounds_since_probe += 1
                if can_score:  # the draft scores its backlog (once it holds score_min_tokens) instead of drafting
                    interval = self.score_interval(batch_size, state.scorings, left.get(rid))
                    # while a generous alpha says drafting may pay, keep the first scoring's cadence: the next
                    # scoring may end a fallback that a slow start began (humanities, session 28); priced only
                    # once that cadence is due, as it is the one round it can change
                    first = self.score_interval(batch_size, 0, left.get(rid)) if self.config.hopeful_scoring else interval
                    if (first <= state.rounds_since_probe < interval
                            and self.best_gamma(self._alpha_upper(rid, margin), batch_size)[1] > self.config.resume_above):
                        interval = first
                    if backlog.get(rid, 0) < self.config.score_min_tokens:
                        interval = max(interval, state.rounds_since_probe + 1)  # not yet: wait for a backlog
                else:  # probes are priced at the generous alpha too: while alpha is uncertain they are worth running
                    cost = self.round_cost(batch_size, state.gamma)
                    interval = self.probe_interval(self._alpha_upper(rid), state.gamma, cost, state.failed_probes)
                probe = state.rounds_since_probe >= interval and self._worth_probing(left.get(rid))
                if probe:
                    state.rounds_since_probe = 0
                    if can_score:
                        self._scores[rid] = backlog[rid]
                        state.scorings += 1
                # a probe drafts the gamma the formula picks for the current alpha (short at a low alpha)
                out.append(state.gamma if probe and not can_score else 0)
            else:
                out.append(self._neighbour(state.gamma, batch_size) if exploring else state.gamma)
                self._exploring |= exploring
        if lookup is not None:
            can_model = otherwise if otherwise is not None else [True] * len(request_ids)
            for i, (rid, available, model) in enumerate(zip(request_ids, lookup, can_model, strict=True)):
                if available <= 0:
                    if not model:  # no lookup and no model to draft with: a plain round, not an empty drafting one
                        out[i] = 0
                    continue
                tokens, speedup = self.lookup_length(rid, available, batch_size)
                # the model's plan at its own estimate: a plain round (1) in fallback or calibration
                planned = self.speedup(self.alpha(rid), out[i], batch_size) if out[i] > 0 else 1.0
                if not model or (tokens > 0 and speedup >= planned):
                    out[i] = tokens
                    if tokens > 0:
                        self._lookups[rid] = tokens
            self.lookup_rounds += len(self._lookups)
        return self._planned(request_ids, out)

    def lookup_alpha(self, request_id: str) -> float:
        """Acceptance estimate of a request's prompt-lookup drafts: its own decayed counts behind
        `prior_weight` pseudo-trials at the lookup acceptance pooled over requests (`prior_alpha` before
        there is any). Kept apart from the draft model's: a copied span is accepted wholesale or not at all,
        and mixing the two made the model look good on requests where only lookups were (translation)."""
        state, weight = self._state(request_id), self.config.prior_weight
        centre = self._pooled_alpha(self._lookup_pooled)
        return (state.lookup_successes + weight * centre) / (state.lookup_successes + state.lookup_failures + weight)

    def lookup_cost(self, batch_size: int, tokens: int) -> float:
        """A round proposing `tokens` prompt-lookup tokens, in plain rounds: measured once `cost_min_rounds`
        such rounds were timed at the nearest batch size, else 1 + tokens `lookup_cost` (no draft model runs:
        the target only scores more positions)."""
        nearest = _closest(list(self._lookup_costs), batch_size)
        measured = (self._lookup_costs[nearest].ratio(tokens, self.config.cost_min_rounds)
                    if nearest is not None else None)
        return measured if measured is not None else 1.0 + tokens * self.config.lookup_cost

    def lookup_length(self, request_id: str, available: int, batch_size: int) -> tuple[int, float]:
        """Lookup tokens to propose out of `available`, and the predicted speedup: the count maximising
        E(alpha, n) over the round's cost at the request's lookup acceptance (0 and 1.0 when none is predicted
        to beat a plain round). Never in fallback as such: at ~0.02-0.04 plain rounds per token a lookup pays
        from an acceptance of a few percent."""
        alpha, best, best_speedup = self.lookup_alpha(request_id), 0, 1.0
        for tokens in range(1, min(available, self.config.max_gamma) + 1):
            speedup = expected_tokens_per_round(alpha, tokens) / self.lookup_cost(batch_size, tokens)
            if speedup > best_speedup:
                best, best_speedup = tokens, speedup
        return best, best_speedup

    def lookups_planned(self) -> dict[str, int]:
        """Requests proposing a prompt lookup this round (see `plan`), and how many tokens."""
        return dict(self._lookups)

    def _neighbour(self, gamma: int, batch_size: int) -> int:
        """The gamma next to `gamma` timed least recently (one more on ties): an exploring round measures
        it, so a cost the affine model overstates is found, and both neighbours stay fresh (a choice from
        the past alone)."""
        timed = self._costs.get(batch_size, self._round_costs())
        options = [g for g in (gamma + 1, gamma - 1) if self.config.min_gamma <= g <= self.config.max_gamma]
        return max(options, key=timed.since) if options else gamma

    def _planned(self, request_ids: list[str], drafts: list[int]) -> list[int]:
        """Note which rows draft right after a plain round: a model draft then first feeds itself the
        tokens it missed (one more forward, or at batch 1 a wider first forward), a cost of the plain
        rounds, not of drafting. Timed into c and k, it doubled the draft step of every fallback probe
        and kept requests in fallback."""
        self._catching_up = self._model_drafting = False
        for rid, n in zip(request_ids, drafts):
            state = self._state(rid)
            if rid in self._lookups:  # the draft model sits this round out: its next round catches up
                state.planned = 0
                continue
            self._catching_up |= n > 0 and state.planned == 0
            self._model_drafting |= n > 0
            state.planned = n
        return drafts

    def probe_interval(self, alpha: float, gamma: int, round_cost: float, failed: int = 0) -> int:
        """Rounds between fallback probes: sparse enough that their expected loss stays within
        `probe_budget` of decode time, at least `probe_every` times `probe_backoff` to the power of
        `failed` (probes in a row that had nothing accepted), at most `max_probe_every`.

        A probe round takes `round_cost` plain rounds' time for E(alpha, gamma) tokens; a plain round
        gives one token per unit. When verification is dear (a compiled plain step, a slow draft) a
        probe loses most of a round, so it runs rarely; near break-even it costs nothing and runs often.
        The loss is priced at a generous alpha, which near break-even says probes are free: on requests
        the draft cannot help (alpha ~0.05) probes every 4 rounds cost ~0.3 rounds each, 3-4% of a
        64-token reply. The backoff spaces them out while they keep failing; one accepted draft resets it.
        """
        loss = max(round_cost - expected_tokens_per_round(alpha, max(gamma, 1)), 0.0)  # in plain rounds' time
        interval = int(loss / self.config.probe_budget) + 1
        floor = self.config.probe_every * self.config.probe_backoff ** min(failed, 32)
        return int(min(max(interval, floor), self.config.max_probe_every))

    def scoring_cost(self, batch_size: int) -> float:
        """What a backlog scoring adds to a plain round, in plain rounds, at the nearest batch size where
        one was timed; c (one draft step) before. A scoring forward feeds 8-20 tokens: on the shipped pair at
        batch 1 it added 0.19-0.26 plain rounds where a draft step costs 0.16 (docs/adaptive.md, session 21)."""
        nearest = _closest([b for b, e in self._scoring.items() if e.value is not None], batch_size)
        return self.cost_ratio(batch_size) if nearest is None else self._scoring[nearest].value

    def score_interval(self, batch_size: int, done: int = 0, remaining: int | None = None) -> int:
        """Rounds between backlog scorings in fallback: one draft forward (`scoring_cost` plain rounds)
        within `probe_budget` of decode time, within [probe_every, max_probe_every]; the first
        (`done` 0) after at most 2 probe_every rounds where it costs within `probe_budget` of the `remaining`
        tokens of the request (None: unknown). Unlike a probe it drafts nothing, so it costs the same
        whatever alpha is, and it measures every token it scores. The first comes early because a request
        falls back on a few rounds' evidence: one the draft helps (a math reply after two early rejections)
        otherwise waited ~17 rounds for it, and past the probe horizon never drafted again. Where a scoring
        is dear (4-5 plain rounds on the GPU of session 36, against 0.2-0.3 on the dev CPU), that one early
        scoring per request cost a 64-token reply 6%: it is paid from the same budget as the later ones."""
        cost = self.scoring_cost(batch_size)
        interval = int(cost / self.config.probe_budget) + 1
        affordable = (not self.config.priced_first_scoring or remaining is None
                      or cost <= self.config.probe_budget * remaining)
        if done == 0 and affordable:
            interval = min(interval, 2 * self.config.probe_every)
        return min(max(interval, self.config.probe_every), self.config.max_probe_every)

    def scores_planned(self) -> dict[str, int]:
        """Requests whose draft scores its backlog this round (see `plan`), and how many tokens."""
        return dict(self._scores)

    def _worth_probing(self, remaining: int | None) -> bool:
        """Whether a request with `remaining` tokens left in its budget (None: unknown) may still probe.

        A probe pays only through the drafting it brings back, and a request resumes only after several
        probes at least `probe_every` rounds apart have lifted its estimate: with under `probe_horizon`
        tokens left, a recovery noticed comes too late to repay them. On the tuning set's 64-token
        translation requests (docs/adaptive.md) probes fell from 6-7 per reply to about 3; a long
        generation near break-even keeps its probes while it has tokens left."""
        return remaining is None or remaining >= self.config.probe_horizon

    def _calibration_due(self, batch_size: int) -> bool:
        """A plain round is due once drafting rounds were timed at this batch size and no plain round
        was run (or attempted: rows with a fixed gamma may draft anyway) in `calibrate_every` rounds, or in
        `probe_every` while fewer than `settle_timings` plain rounds were timed there (and planned)."""
        if batch_size not in self._target_step:
            return False  # nothing timed here yet (or a caller that never reports timings)
        last = self._last_plain.get(batch_size)
        if last is None:
            return True
        plain = self._plain_round.get(batch_size)
        timed = plain.count if plain is not None else 0
        # the first plain timings come soon: one stalled round must not price every drafting round for 64 rounds;
        # counted in attempts too, as rows with a fixed gamma may draft through every one of them
        settle = self.config.settle_timings
        soon = 0 < timed < settle and self._calibrations.get(batch_size, 0) < settle
        return self._round - last >= (self.config.probe_every if soon else self.config.calibrate_every)

    def _costs_settling(self, batch_size: int) -> bool:
        """Whether drafting rounds were timed at the nearest batch size, but fewer than `settle_timings` times:
        their cost is then one or two timings, which a stall can make any size."""
        nearest = self._nearest(batch_size)
        return nearest is not None and self._draft_step[nearest].count < self.config.settle_timings

    def gate_thresholds(self, batch_size: int) -> list[float]:
        """The gate's thresholds of `gate` (this round's: it reads and clears whether the round explores)."""
        return self.gate(batch_size)[0]

    def gate(self, batch_size: int) -> tuple[list[float], tuple[tuple[float, ...], tuple[float, ...]] | None]:
        """This round's confidence gate and extension; an exploring round has neither (it times its gamma in
        full). Called once per round: it reads and clears whether the round explores.

        The extension (None: none) is per confidence bin its past acceptance a(q), and per draft position j
        (index j - 1) the bar S (R(j + 1) - R(j)) / a_mean below: past the planned gamma a round draws draft
        j + 1 while a(q_1) ... a(q_j) reaches it, as one more draft adds tokens only if every draft so far is
        accepted (within the plan, the gate judges a draft by its own bin alone).

        The gate, per draft position j (list index j - 1): the confidence below which a round stops after its
        j-th draft ([] = no gate yet).

        A draft drawn with confidence q is accepted with probability a(q), estimated per bin from past
        rounds. One more draft then adds about a(q) * a_mean tokens for R(j + 1) - R(j) plain rounds'
        time (the measured round costs); that is worth it while it beats the S tokens per plain round
        that drafting makes anyway (S: the best predicted speedup at the pooled alpha, at least 1). The
        threshold is the top of the highest bin where a(q) < S (R(j + 1) - R(j)) / a_mean.
        """
        exploring, self._exploring = self._exploring, False  # it describes this round only
        trials = sum(self._gate_trials)
        if not (self.config.gate or self.config.extend) or not self._gate_calibrated() or exploring:
            return [], None  # an exploring round measures the cost of its gamma in full (else a gate at 1 hides it)
        mean = sum(self._gate_accepts) / trials
        if mean <= 0:
            return [], None
        rate = max(self.best_gamma(self._pooled_alpha(), batch_size)[1], 1.0)
        bars = [rate * self._one_more_draft(batch_size, j) / mean for j in range(1, self.config.max_gamma)]
        thresholds = [self._threshold(bar) for bar in bars] if self.config.gate else []
        if not self.config.extend:
            return thresholds, None
        # a bin not yet read counts as never accepted: no extension on a confidence without a past
        acceptance = tuple(self._bin_acceptance(b) or 0.0 for b in range(BINS))
        return thresholds, (acceptance, tuple(bars))

    def _one_more_draft(self, batch_size: int, drafts: int) -> float:
        """R(drafts + 1) - R(drafts) from the timings once both lengths were timed `gate_min_rounds` times
        (a difference of two noisy means), else a draft step c."""
        nearest = self._nearest(batch_size)
        costs = self._costs.get(nearest) if nearest is not None else None
        if costs is not None:
            before, after = (costs.ratio(d, self.config.gate_min_rounds) for d in (drafts, drafts + 1))
            if before is not None and after is not None:
                return max(after - before, 0.0)
        return self.cost_ratio(batch_size)

    def _threshold(self, bar: float) -> float:
        """Top of the highest confidence bin, counting up, whose acceptance stays under `bar`."""
        threshold = 0.0
        for b in range(BINS):
            accepted = self._bin_acceptance(b)
            if accepted is not None:
                if accepted < bar:
                    threshold = (b + 1) / BINS
                else:
                    break
        return threshold

    def _gate_calibrated(self) -> bool:
        """Enough drafts binned by confidence (`gate_min_samples`) for the gate and the confidence prior."""
        return sum(self._gate_trials) >= self.config.gate_min_samples

    def _bin_acceptance(self, b: int) -> float | None:
        """Past acceptance of drafts in confidence bin `b`, once it holds BIN_MIN_TRIALS of them."""
        trials = self._gate_trials[b]
        return self._gate_accepts[b] / trials if trials >= BIN_MIN_TRIALS else None

    # ----- observations ---------------------------------------------------------------------

    def observe(self, request_id: str, num_drafted: int, num_accepted: int,
                confidences: list[float] | None = None, expected: list[float] | None = None) -> None:
        """Record one round of a request: counts, and the confidence of each drafted token.

        `expected`: per position the round reached (its accepted drafts and the first rejected one), the
        probability a draft there is accepted, sum over tokens of min(target, draft) (Leviathan et al.'s beta).
        Counted in place of each position's accepted-or-not: the same trials with the coin's noise taken out
        (its expectation given the past): a run of unlucky coins no longer sends a request that gains by drafting
        into fallback (tests/test_adaptive.py), and one that loses falls back after fewer drafts (docs/adaptive.md)."""
        if num_drafted <= 0:
            return
        if not 0 <= num_accepted <= num_drafted:
            raise ValueError(f"num_accepted must be in 0..num_drafted ({num_drafted}), got {num_accepted}")
        state = self._state(request_id)
        reached = min(num_accepted + 1, num_drafted)
        if expected is not None and len(expected) != reached:
            raise ValueError(f"expected holds one probability per position reached ({reached}), got {len(expected)}")
        outcomes = ([min(max(float(b), 0.0), 1.0) for b in expected]
                    if expected is not None and self.config.expected_acceptance
                    else [1.0] * num_accepted + [0.0] * (reached - num_accepted))
        successes, failures = sum(outcomes), reached - sum(outcomes)
        # forget per trial, not per round: a long round must not outweigh many short ones
        factor = self.config.decay ** reached
        pool = self.config.pool_decay ** reached
        if request_id in self._lookups:  # a prompt lookup: its own estimate, not the draft model's
            state.lookup_successes = factor * state.lookup_successes + successes
            state.lookup_failures = factor * state.lookup_failures + failures
            self._lookup_pooled = [pool * self._lookup_pooled[0] + successes, pool * self._lookup_pooled[1] + failures]
            return
        if state.fallback:  # a probe: the backoff grows while probes find nothing
            state.failed_probes = 0 if num_accepted > 0 else state.failed_probes + 1
        state.successes = factor * state.successes + successes
        state.squares = factor * state.squares + sum(x * x for x in outcomes)
        state.failures = factor * state.failures + failures
        self._pooled = [pool * self._pooled[0] + successes, pool * self._pooled[1] + failures]
        state.predicted *= factor
        state.predicted_trials *= factor
        calibrated = self._gate_calibrated()
        for i, q in enumerate((confidences or [])[:reached]):
            if q != q:  # NaN: a deterministic (n-gram) draft has no confidence to calibrate on
                continue
            b = min(int(q * BINS), BINS - 1)
            accepted = self._bin_acceptance(b) if calibrated else None
            if accepted is not None:
                state.predicted += accepted
                state.predicted_trials += 1
            self._gate_trials[b] += 1
            self._gate_accepts[b] += int(i < num_accepted)

    def observe_scores(self, request_id: str, acceptance: list[float]) -> None:
        """Record a backlog scoring: per token the target committed in plain rounds, the probability that a
        draft there would have been accepted (min(1, q / p) of the committed token: unbiased for it, since
        the token was drawn from p). Counted as trials of the request's acceptance, not the pool's: they
        are ungated (every position, where drafting trials stop at a low-confidence draft) and come from
        requests in fallback, so pooled they pulled the prior of the requests after a run of translations
        down and sent requests the draft helps into fallback after two rejections."""
        state = self._state(request_id)
        self.scored += 1
        for accepted in acceptance:  # forget per trial, as `observe` does
            accepted = min(max(float(accepted), 0.0), 1.0)
            state.successes = self.config.decay * state.successes + accepted
            state.squares = self.config.decay * state.squares + accepted * accepted
            state.failures = self.config.decay * state.failures + 1.0 - accepted
        factor = self.config.decay ** len(acceptance)
        state.predicted *= factor
        state.predicted_trials *= factor

    def observe_timing(self, batch_size: int, gamma: int, draft_seconds: float, target_seconds: float,
                       verify_seconds: float = 0.0) -> None:
        """Record one round's draft, target and verify-and-commit time at a batch size (gamma 0: a plain round)."""
        total = draft_seconds + target_seconds + verify_seconds
        self._memo = _Memo()
        catching_up, self._catching_up = self._catching_up, False  # it describes this round only
        rows, self._planned_rows = self._planned_rows, ()
        scoring, self._scores = bool(self._scores), {}
        lookups, model_drafting = bool(self._lookups), self._model_drafting
        self._model_drafting = False
        new_batch = bool(rows) and self._rows.get(batch_size) != rows
        if rows:
            self._rows[batch_size] = rows
        if lookups and gamma > 0:  # a lookup round prices lookups only; one where a model drafted too, nothing
            if not (scoring or model_drafting or catching_up):
                self._lookup_costs.setdefault(batch_size, self._round_costs()).add(gamma, total, new_batch)
            return
        if scoring:  # the round also ran a draft forward over a backlog: neither a plain round's time nor a drafting one's
            plain = self._plain_round.get(batch_size)
            if gamma == 0 and plain is not None:  # but what it adds to a plain round prices the next scorings
                self._scoring.setdefault(batch_size, self._ewma()).add(max(total / plain.value - 1.0, 0.0), spike=SPIKE)
            return
        if gamma == 0:
            self._plain_round.setdefault(batch_size, self._ewma()).add(total, spike=SPIKE)
            self._costs.setdefault(batch_size, self._round_costs()).add(0, total, new_batch)
            self._lookup_costs.setdefault(batch_size, self._round_costs()).add(0, total, new_batch)
            self._last_plain[batch_size] = self._round
            return
        if catching_up:
            return  # the catch-up forward would be charged to drafting (see _planned)
        self._costs.setdefault(batch_size, self._round_costs()).add(gamma, total, new_batch)
        step = self._draft_step.setdefault(batch_size, self._ewma())
        step.add(draft_seconds / gamma, spike=SPIKE)
        self._target_step.setdefault(batch_size, self._ewma()).add(target_seconds, spike=SPIKE)
        plain = self._plain_round.get(batch_size)
        if plain is not None:
            extra = total - plain.value - gamma * step.value
            self._overhead.setdefault(batch_size, self._ewma()).add(extra, weight=0.1)

    def _ewma(self) -> _Ewma:
        return _Ewma(settle=self.config.settle_timings)

    def _round_costs(self) -> _RoundCosts:
        return _RoundCosts(settle=self.config.settle_timings, stalls=self.config.stall_costs)

    def release(self, request_id: str) -> None:
        """Forget a finished request."""
        self._requests.pop(request_id, None)

    def in_fallback(self, request_id: str) -> bool:
        return self._state(request_id).fallback

    def _prior_centre(self, state: _RequestState) -> float:
        """Where a request's own prior sits: the acceptance its drafts' confidences predict (each draft's
        confidence bin's past acceptance over all requests), or the pooled acceptance before that exists.

        A draft model lost on a request (a language it barely knows) is unsure of its own tokens: on the
        stored greedy Spec-Bench traces its mean confidence in its drafts is 0.13 on translation against
        0.30-0.43 on most categories (docs/adaptive_replay.md). Confidences arrive with every draft,
        accepted or not, so the prior moves within a few rounds where 8 pseudo-trials at the pooled ~0.3
        took ~12 rejections. Only downwards (see `observe` for how a bin's acceptance is read)."""
        pooled = self._pooled_alpha()
        if not self.config.confidence_prior:
            return pooled
        weight = self.config.confidence_weight
        # only ever down: a draft confidently wrong must not keep a request drafting longer than its rejections would
        return min((state.predicted + weight * pooled) / (state.predicted_trials + weight), pooled)

    def _forget_pools(self) -> None:
        """Age both pooled acceptances by one round. The pools learn only from drafting: when every request
        is in fallback (each request's scorings stay its own, see `observe_scores`) a pool set low by a few
        bad rounds set every new request's prior low for good, and requests the draft helps never drafted
        (session 25: the benchmark's first reply had its 11 drafting rounds rejected, and the draft model's
        gamma auto decoded the 19 writing replies after it in fallback from their first round). Aged under
        POOL_MIN_TRIALS trials, the pool gives way to `prior_alpha` until a request drafts and refreshes it."""
        decay = self.config.pool_round_decay
        if decay < 1:
            self._pooled = [decay * x for x in self._pooled]
            self._lookup_pooled = [decay * x for x in self._lookup_pooled]

    def _pooled_alpha(self, pooled: list[float] | None = None) -> float:
        """Acceptance over earlier requests (decayed) from the draft model's pooled counts, or from `pooled`
        (the lookups'), or the prior before there is enough of it (or, aged per round, no longer is)."""
        successes, failures = self._pooled if pooled is None else pooled
        if successes + failures >= POOL_MIN_TRIALS:
            return min(max(successes / (successes + failures), 0.01), 0.99)
        return self.config.prior_alpha

    def _state(self, request_id: str) -> _RequestState:
        if request_id not in self._requests:
            self._requests[request_id] = _RequestState(gamma=0)  # chosen when the request is first planned
        return self._requests[request_id]

    def _switch(self, rid: str, to: str, alpha: float, batch_size: int, speedup: float) -> None:
        self.switches.append((rid, to))
        log.info("request %s: speculation %s (alpha %.2f, cost ratio %.3f, overhead %.3f, predicted speedup %.2f)",
                 rid, to, alpha, self.cost_ratio(batch_size), self.overhead(batch_size), speedup)
