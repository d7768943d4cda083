"""When a request that stopped drafting checks whether drafting would pay again.

A request falls back to plain decoding when even a generous acceptance estimate predicts a loss. From then on
it learns its acceptance either by probes (a drafting round now and then) or, where its draft model can score
what plain rounds committed, by backlog scorings (one teacher-forced draft forward, no drafts). Both are spaced
so their expected cost stays within PROBE_BUDGET of decode time.
"""

from __future__ import annotations

from dataclasses import dataclass

from specsample.planner.acceptance import Acceptance
from specsample.planner.chain import ChainPolicy
from specsample.planner.costs import CostModel
from specsample.theory import expected_tokens_per_round

FALLBACK_BELOW = 1.0  # predicted speedup under which a request stops drafting...
MARGIN = 1.0  # ...even at alpha this many standard errors above its estimate...
RESUME_ABOVE = 1.02  # ...and over which it drafts again (a gap against thrashing)
PROBE_EVERY = 4  # fewest rounds between probes or scorings in fallback
MAX_PROBE_EVERY = 256  # most rounds between them (how late a recovery can be noticed)
PROBE_BUDGET = 0.01  # share of decode time the expected loss of probing may cost
PROBE_HORIZON = 32  # no probes with fewer tokens left: a recovery then cannot pay for them
SCORE_MIN_TOKENS = 4  # backlog tokens a scoring waits for


@dataclass
class RequestChoice:
    """What gamma auto chose for one request, and where it stands in fallback. A plan works on a copy, which
    learning the round keeps."""

    gamma: int = 0  # the gamma it drafts at (0: not chosen yet)
    fallback: bool = False
    rounds_since_probe: int = 0
    scorings: int = 0  # backlog scorings since it last fell back
    planned: int | None = None  # drafts planned last round (None: none planned yet)


def probe_interval(alpha: float, gamma: int, round_cost: float) -> int:
    """Rounds between fallback probes: sparse enough that their expected loss stays within PROBE_BUDGET of decode
    time, within [PROBE_EVERY, MAX_PROBE_EVERY]. A probe takes `round_cost` plain rounds for E(alpha, gamma)
    tokens; priced at a generous alpha, near break-even it costs nothing and runs often."""
    loss = max(round_cost - expected_tokens_per_round(alpha, max(gamma, 1)), 0.0)  # in plain rounds' time
    interval = int(loss / PROBE_BUDGET) + 1
    return int(min(max(interval, PROBE_EVERY), MAX_PROBE_EVERY))


def score_interval(cost: float, done: int, remaining: int | None) -> int:
    """Rounds between backlog scorings that add `cost` plain rounds each: within PROBE_BUDGET of decode time, within
    [PROBE_EVERY, MAX_PROBE_EVERY]; the first (`done` 0) after at most 2 PROBE_EVERY rounds where it costs within
    PROBE_BUDGET of the `remaining` tokens (None: unknown). A request falls back on a few rounds' evidence, so the
    first scoring comes early; where a scoring is dear, that one early scoring is paid from the same budget."""
    interval = int(cost / PROBE_BUDGET) + 1
    if done == 0 and (remaining is None or cost <= PROBE_BUDGET * remaining):
        interval = min(interval, 2 * PROBE_EVERY)
    return min(max(interval, PROBE_EVERY), MAX_PROBE_EVERY)


def worth_probing(remaining: int | None) -> bool:
    """Whether a request with `remaining` tokens left may still probe: a recovery noticed with fewer than
    PROBE_HORIZON tokens left comes too late to repay its probes."""
    return remaining is None or remaining >= PROBE_HORIZON


class FallbackPolicy:
    """Per request: whether it drafts, falls back to plain decoding, probes or scores its backlog."""

    def __init__(self, chain: ChainPolicy, acceptance: Acceptance, costs: CostModel) -> None:
        self.chain, self.acceptance, self.costs = chain, acceptance, costs

    def generous_speedup(self, request_id: str, batch_size: int) -> float:
        """The best predicted speedup at alpha MARGIN standard errors above the request's estimate."""
        return self.chain.best_gamma(self.acceptance.alpha_upper(request_id, MARGIN), batch_size)[1]

    def decide(
        self,
        request_id: str,
        choice: RequestChoice,
        remaining: int,
        backlog: int,
        can_score: bool,
        batch_size: int,
        exploring: bool,
    ) -> tuple[int, bool, str | None]:
        """One row's drafts from its model (before lookups), whether its draft scores its backlog of `backlog`
        tokens, and the switch it makes ("off", "on" or None). Updates `choice`, the plan's copy."""
        alpha = self.acceptance.alpha(request_id)
        choice.gamma, speedup = self.chain.keep_or_switch(alpha, choice.gamma, batch_size)
        switch = None
        # stop drafting only when even a generous alpha predicts a loss: at the ~25 trials the estimate remembers,
        # its noise near break-even sent requests that gained by drafting into fallback
        if (
            not choice.fallback
            and speedup < FALLBACK_BELOW
            and not self.costs.settling(batch_size)
            and self.generous_speedup(request_id, batch_size) < FALLBACK_BELOW
        ):
            choice.fallback, choice.rounds_since_probe, choice.scorings, switch = True, 0, 0, "off"
        elif choice.fallback and speedup > RESUME_ABOVE:
            choice.fallback, switch = False, "on"
        if not choice.fallback:
            return (self.chain.neighbour(choice.gamma, batch_size) if exploring else choice.gamma), False, switch
        choice.rounds_since_probe += 1
        if can_score:  # the draft scores its backlog (once it holds SCORE_MIN_TOKENS) instead of drafting
            cost = self.costs.scoring_cost(batch_size)
            interval = score_interval(cost, choice.scorings, remaining)
            # while a generous alpha says drafting may pay, keep the first scoring's cadence: the next scoring may
            # end a fallback that a slow start began
            first = score_interval(cost, 0, remaining)
            if (
                first <= choice.rounds_since_probe < interval
                and self.generous_speedup(request_id, batch_size) > RESUME_ABOVE
            ):
                interval = first
            if backlog < SCORE_MIN_TOKENS:
                interval = max(interval, choice.rounds_since_probe + 1)  # not yet: wait for a backlog
        else:  # probes are priced at the generous alpha too: while alpha is uncertain they are worth running
            interval = probe_interval(
                self.acceptance.alpha_upper(request_id, MARGIN),
                choice.gamma,
                self.costs.round_cost(batch_size, choice.gamma),
            )
        if choice.rounds_since_probe < interval or not worth_probing(remaining):
            return 0, False, switch
        choice.rounds_since_probe = 0
        if can_score:
            choice.scorings += 1
            return 0, True, switch
        return choice.gamma, False, switch  # a probe drafts the gamma the formula picks for the current alpha
