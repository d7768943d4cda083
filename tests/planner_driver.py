"""Drive gamma auto round by round without models: batch states in, simulated outcomes and timings back."""

from __future__ import annotations

import random

from specsample.config import TreeShape
from specsample.planner import FixedGamma, GammaController
from specsample.planner.base import BatchState, DraftSource, RoundOutcome, RoundPlan, RowOutcome, RowState
from specsample.planner.costs import CostModel

UNLIMITED = 10**6  # a budget no test runs out of


class Untimed(CostModel):
    """Round costs never told a round's time: every price stays the prior's (an engine that reports no time)."""

    def record(self, *args, **kwargs) -> None:
        return None


def untimed(max_gamma: int = 8) -> GammaController:
    """Gamma auto whose rounds are never timed: it prices drafting at PRIOR_COST_RATIO throughout."""
    controller = GammaController(max_gamma)
    controller.costs = Untimed()
    return controller


def batch(
    *rows: str | RowState, can_score: bool = False, offers_lookups: bool = False, can_tree: bool = False
) -> BatchState:
    """A batch state; a bare request id is a row gamma auto chooses for, with an unlimited budget."""
    states = tuple(RowState(r, UNLIMITED) if isinstance(r, str) else r for r in rows)
    return BatchState(states, can_score=can_score, offers_lookups=offers_lookups, can_tree=can_tree)


def drafts(plan: RoundPlan) -> list[int]:
    return [r.drafts for r in plan.rows]


def lookups(plan: RoundPlan, state: BatchState) -> dict[str, int]:
    """Requests the plan sends to their prompt lookup, and how many tokens."""
    return {s.request_id: r.drafts for s, r in zip(state.rows, plan.rows) if r.source is DraftSource.LOOKUP}


def scorings(plan: RoundPlan, state: BatchState) -> dict[str, int]:
    """Requests whose draft the plan has score its backlog, and how many tokens."""
    return {s.request_id: r.score_backlog for s, r in zip(state.rows, plan.rows) if r.score_backlog > 0}


def accepted(rng: random.Random, alpha: float, drafted: int) -> int:
    """Drafts accepted of `drafted` when each is accepted with probability `alpha` until the first rejection."""
    count = 0
    while count < drafted and rng.random() < alpha:
        count += 1
    return count


def learn(
    controller: GammaController,
    plan: RoundPlan,
    state: BatchState,
    *rows: RowOutcome,
    seconds: tuple[float, float, float] = (0.0, 0.0, 0.0),
    width: int | None = None,
    finished: tuple[str, ...] = (),
) -> None:
    """Tell the controller how `plan`'s round of `state` went: `rows` for the rows that drafted or scored (every
    other row drafted nothing), the round's draft, target and verify seconds; `width` defaults to the most drafts
    of a row."""
    given = {r.request_id: r for r in rows}
    outcomes = tuple(given.get(s.request_id, RowOutcome(s.request_id, 0, 0)) for s in state.rows)
    if width is None:
        width = max((r.num_drafted for r in outcomes), default=0)
    controller.learn(plan, RoundOutcome(outcomes, width, *seconds, finished=finished))


def simulate(
    controller: GammaController,
    alpha: float,
    rounds: int,
    rid: str = "r",
    rng: random.Random | None = None,
    remaining: int = UNLIMITED,
) -> list[int]:
    """Rounds of one request at batch 1 whose drafts are accepted i.i.d. with probability `alpha`, never timed
    (an `untimed` controller); the drafts planned each round."""
    assert isinstance(controller.costs, Untimed), "an untimed simulation needs an untimed controller"
    rng = rng or random.Random(0)
    chosen = []
    for _ in range(rounds):
        state = batch(RowState(rid, remaining))
        plan = controller.plan(state)
        gamma = plan.rows[0].drafts
        chosen.append(gamma)
        learn(controller, plan, state, RowOutcome(rid, gamma, accepted(rng, alpha, gamma)))
    return chosen


def timed(
    controller: GammaController,
    alpha: float,
    rounds: int,
    rng: random.Random,
    plain: float = 0.020,
    overhead: float = 0.1,
    cost: float = 0.15,
    extra: dict[int, float] | None = None,
    stalls: dict[int, float] | None = None,
) -> list[int]:
    """Rounds of one request on a simulated engine; the drafts planned each round. A plain round takes `plain`
    seconds, a drafting one plain * (1 + overhead + gamma cost + extra[gamma]), plus one more draft step when it
    follows a plain round (the model draft catches up on the tokens it missed); acceptance i.i.d. Bernoulli(alpha).
    `stalls`: round index -> how many times its usual time that round takes (every phase alike)."""
    chosen: list[int] = []
    previous = None
    for i in range(rounds):
        state = batch("r")
        plan = controller.plan(state)
        gamma = plan.rows[0].drafts
        chosen.append(gamma)
        stall = (stalls or {}).get(i, 1.0)
        if gamma == 0:
            learn(controller, plan, state, seconds=(0.0, 0.9 * plain * stall, 0.1 * plain * stall))
        else:
            steps = gamma + (previous == 0)
            target = (0.9 + overhead + (extra or {}).get(gamma, 0.0)) * plain
            learn(
                controller,
                plan,
                state,
                RowOutcome("r", gamma, accepted(rng, alpha, gamma)),
                seconds=(steps * cost * plain * stall, target * stall, 0.1 * plain * stall),
            )
        previous = gamma
    return chosen


def calibrate_confidence(controller: GammaController, rounds: int = 2000) -> None:
    """Drafting rounds of another request whose acceptance grows with the draft's confidence: enough to read
    every confidence bin (two drafts a round, each accepted with probability its confidence)."""
    rng = random.Random(0)
    for _ in range(rounds):
        q = rng.random()
        first = rng.random() < q
        controller.acceptance.observe("x", 2, int(first) + int(first and rng.random() < q), False, (q, q))


def fall_back(
    controller: GammaController, rid: str = "r", can_score: bool = False, remaining: int = UNLIMITED, limit: int = 1000
) -> int:
    """Plan rounds of `rid` whose every draft is rejected until it falls back; the rounds that took."""
    for rounds in range(1, limit + 1):
        state = batch(RowState(rid, remaining), can_score=can_score)
        plan = controller.plan(state)
        learn(controller, plan, state, RowOutcome(rid, plan.rows[0].drafts, 0))
        if controller.in_fallback(rid):
            return rounds
    raise AssertionError(f"{rid} did not fall back in {limit} rounds")


class AlternatingTrees(FixedGamma):
    """A round of `tree`, then a chain round of 3 drafts, and so on: a tree's commit is followed by a chain's and
    back."""

    def __init__(self, tree: TreeShape) -> None:
        super().__init__(3, tree=tree)
        self.rounds = 0

    def plan(self, batch):
        self.rounds += 1
        return super().plan(batch) if self.rounds % 2 else FixedGamma(3).plan(batch)
