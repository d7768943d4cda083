"""What rounds cost, measured: per batch size and per round length, from medians that settle, with stalls capped,
at one pace; catch-up forwards charged to nobody; plain rounds planned to time plain decoding."""

from __future__ import annotations

import random

import pytest
from planner_driver import batch, learn, timed

from specsample.planner import GammaController
from specsample.planner import costs as cost_model
from specsample.planner.base import RoundOutcome, RoundPlan, RowOutcome, RowPlan, RowState
from specsample.planner.costs import CostModel, RoundCosts, RoundKind
from specsample.theory import expected_speedup, optimal_gamma


def _time(
    costs: CostModel,
    batch_size: int,
    drafts: int,
    draft: float,
    target: float,
    verify: float = 0.0,
    rows: tuple[str, ...] = (),
) -> None:
    """Record one model round (plain where `drafts` is 0) of the requests `rows` (none: not a planned round)."""
    costs.record(batch_size, RoundKind(drafts), rows, 0, draft, target, verify)


def _time_unplanned(
    controller: GammaController, batch_size: int, drafts: int, draft: float, target: float, verify: float = 0.0
) -> None:
    """Learn one round gamma auto chose nothing in (rows with a gamma of their own drafted `drafts`)."""
    plan = RoundPlan(rows=(RowPlan(drafts, drafts),) * batch_size)
    outcome = RoundOutcome(
        tuple(RowOutcome(f"fixed{i}", 0, 0) for i in range(batch_size)), drafts, draft, target, verify
    )
    controller.learn(plan, outcome)


def test_cost_ratio_is_measured_per_batch_size() -> None:
    costs = CostModel()
    assert costs.cost_ratio(1) == cost_model.PRIOR_COST_RATIO
    for _ in range(30):
        _time(costs, 1, 4, draft=0.004, target=0.02)  # 1 ms / 20 ms
        _time(costs, 8, 4, draft=0.02, target=0.05)  # 5 ms / 50 ms
    assert costs.cost_ratio(1) == pytest.approx(0.05)
    assert costs.cost_ratio(8) == pytest.approx(0.1)
    assert costs.cost_ratio(6) == pytest.approx(0.1)  # nearest measured batch size


def test_whole_rounds_are_charged_once_a_plain_round_is_timed(monkeypatch) -> None:
    """Scoring gamma + 1 tokens and verifying them cost too: c is a drafted position's share of a round, k the rest
    of a drafting round beyond a plain one. Plain rounds are planned to time plain decoding: the first once a
    drafting round was timed, two more soon, then one every CALIBRATE_EVERY rounds."""
    monkeypatch.setattr(cost_model, "CALIBRATE_EVERY", 50)
    controller = GammaController(8)
    state = batch("r")
    drafting = (0.004, 0.024, 0.004)  # rounds of gamma 4 take 32 ms, 4 of them drafting
    plan = controller.plan(state)
    assert plan.rows[0].drafts > 0  # nothing timed yet: no plain round planned
    _time_unplanned(controller, 1, 4, *drafting)
    assert controller.costs.cost_ratio(1) == pytest.approx(1 / 24)  # draft step / target forward, until...
    plan = controller.plan(state)
    assert plan.rows[0].drafts == 0 and not controller.in_fallback("r")  # ...a plain round is planned
    learn(controller, plan, state, seconds=(0.0, 0.018, 0.002))
    for _ in range(60):  # a plain round takes 20 ms
        _time_unplanned(controller, 1, 4, *drafting)
    assert controller.costs.cost_ratio(1) == pytest.approx(0.05, rel=0.01)  # a 1 ms draft step per 20 ms
    assert controller.costs.overhead(1) == pytest.approx(0.4, rel=0.01)  # the other 8 ms, whatever gamma
    plain_rounds = []
    for i in range(120):
        plan = controller.plan(state)
        if plan.rows[0].drafts == 0:
            plain_rounds.append(i)
            learn(controller, plan, state, seconds=(0.0, 0.018, 0.002))
        else:
            gamma = plan.rows[0].drafts
            learn(controller, plan, state, RowOutcome("r", gamma, gamma), seconds=drafting)
    # two more soon (SETTLE 3: one stalled timing must not price drafting), then every CALIBRATE_EVERY rounds
    steps = [b - a for a, b in zip(plain_rounds, plain_rounds[1:])]
    assert len(plain_rounds) == 4 and steps[0] == cost_model.SETTLE_EVERY and steps[1:] == [50, 50], plain_rounds


def test_rounds_affine_in_gamma_are_charged_a_fixed_overhead_and_a_per_draft_cost(monkeypatch) -> None:
    """Rounds cost plain * (1 + k + gamma c): gamma is chosen on that, not on a per-draft c from whole
    rounds, which charges k to every draft (at gamma 1: c 0.25) and then prefers gamma 1 at alpha 0.5."""
    monkeypatch.setattr(cost_model, "CALIBRATE_EVERY", 20)
    controller = GammaController(8)
    chosen = timed(controller, 0.5, 400, random.Random(4))
    assert controller.costs.cost_ratio(1) == pytest.approx(0.15, rel=0.01)
    assert controller.costs.overhead(1) == pytest.approx(0.1, rel=0.01)
    settled = [g for g in chosen[200:] if g > 0]
    assert optimal_gamma(0.5, 0.15, overhead=0.1) == 2 and optimal_gamma(0.5, 0.25) == 1
    assert max(set(settled), key=settled.count) == 2, settled[-20:]


def test_round_costs_are_measured_per_gamma_not_extrapolated(monkeypatch) -> None:
    """Where a round of one draft costs about what one of two does (a CPU's matrix kernels can run 2 rows slower
    than 3), rounds modelled as 1 + k + gamma c, fitted where gamma auto drafts (gamma 1), charge that to k and make
    gamma 2 look dear: at alpha 0.35 that model falls back to plain decoding, though gamma 2 runs 5% faster. Each
    round length is timed (neighbours explored now and then) and gamma 2 is chosen."""
    monkeypatch.setattr(cost_model, "CALIBRATE_EVERY", 20)
    extra = {1: 0.12}
    assert optimal_gamma(0.35, 0.15, overhead=0.1 + extra[1]) == 1
    assert expected_speedup(0.35, 1, 0.15, overhead=0.22) < 1 < expected_speedup(0.35, 2, 0.15, overhead=0.1)
    controller = GammaController(8)
    chosen = timed(controller, 0.35, 600, random.Random(5), extra=extra)
    assert controller.costs.round_cost(1, 1) == pytest.approx(1.37, rel=0.02)
    assert controller.costs.round_cost(1, 2) == pytest.approx(1.40, rel=0.02)
    settled = chosen[200:]
    assert settled.count(2) > 0.6 * len(settled), settled[-40:]


def test_catch_up_after_plain_rounds_is_not_charged_to_drafting(monkeypatch) -> None:
    """A probe in fallback (and the round after a calibration round) pays for the draft catching up on what plain
    rounds committed; timed into c and k, that would make drafting look twice as dear and keep requests in
    fallback."""
    monkeypatch.setattr(cost_model, "CALIBRATE_EVERY", 20)
    controller = GammaController(8)
    rng = random.Random(6)
    timed(controller, 0.5, 100, rng)
    low = timed(controller, 0.05, 300, rng)
    assert controller.in_fallback("r") and 0 < sum(g > 0 for g in low[-200:]) < 100
    assert controller.costs.cost_ratio(1) == pytest.approx(0.15, rel=0.02)
    assert controller.costs.overhead(1) == pytest.approx(0.1, rel=0.05)
    timed(controller, 0.5, 200, rng)  # and alpha's recovery is noticed at the true costs
    assert not controller.in_fallback("r")
    # the mark is the plan's: a catching-up round prices nothing, the next round without it is timed
    steps = controller.costs.draft_step[1].value
    catching_up = RoundPlan(rows=(RowPlan(2, 2),), chosen_ids=("r",), catching_up=True, model_drafting=True)
    controller.learn(catching_up, RoundOutcome((RowOutcome("r", 2, 0),), 2, 0.1, 0.020, 0.002))
    assert controller.costs.draft_step[1].value == steps
    _time_unplanned(controller, 1, 2, 0.1, 0.020, 0.002)
    assert controller.costs.draft_step[1].value > steps


def _drafting_share(alpha: float, skip: int, **kwargs) -> tuple[float, list[int]]:
    chosen = timed(GammaController(8), alpha, 300, random.Random(kwargs.pop("seed")), **kwargs)
    return sum(g > 0 for g in chosen[skip:]) / len(chosen[skip:]), chosen


def test_a_stalled_first_plain_round_does_not_keep_a_dear_draft_drafting(monkeypatch) -> None:
    """Drafting rounds cost 1.7 plain rounds and acceptance is 0.3, so drafting loses; the first plain round timed
    was stalled 5x. Taken alone, that timing would put drafting at a third of a plain round and, re-timed once in
    64 rounds and averaged in, keep the request drafting for hundreds of rounds. The first SETTLE timings give
    their median and come every SETTLE_EVERY rounds."""

    def share() -> float:
        drafting, chosen = _drafting_share(0.3, 40, seed=7, overhead=0.4, cost=0.3, stalls={1: 5.0})
        assert chosen[1] == 0  # the stalled round is the first plain round timed
        return drafting

    assert share() < 0.15  # fallback probes only
    monkeypatch.setattr(cost_model, "SETTLE", 1)
    assert share() > 0.8  # the first timing alone: it keeps drafting


def test_a_stalled_first_drafting_round_does_not_send_a_cheap_draft_into_fallback(monkeypatch) -> None:
    """Drafting pays (rounds of 1.05 + 0.1 gamma plain rounds, acceptance 0.8) and the first drafting round was
    stalled 20x. Alone it would price drafting at 20 plain rounds: the request would fall back at once, and a cost
    timed once is only re-timed by the rare probes it prices. No request falls back on costs timed fewer than
    SETTLE times."""

    def share() -> float:
        drafting, chosen = _drafting_share(0.8, 20, seed=8, overhead=0.05, cost=0.1, stalls={0: 20.0})
        assert chosen[0] > 0
        return drafting

    assert share() > 0.9
    monkeypatch.setattr(cost_model, "SETTLE", 1)
    assert share() < 0.2  # the first timing alone: fallback


def test_a_stalled_first_round_does_not_set_the_unit_round_costs_are_read_in(monkeypatch) -> None:
    """The first round a batch size times sets the pace every round's relative cost is read against. Stalled 5x,
    alone it would make rounds of one draft 1.67 plain rounds where they cost 1.3; from the first SETTLE timings'
    median (the first round counted once) the ratio is right."""

    def ratio() -> float | None:
        costs = RoundCosts()
        costs.add(1, 0.130)
        for i in range(6):
            costs.add(1, 0.026)
            if i % 2 == 0:
                costs.add(0, 0.020)
        return costs.ratio(1, 2)

    assert ratio() == pytest.approx(1.3)
    monkeypatch.setattr(cost_model, "SETTLE", 1)
    assert ratio() > 1.5


def test_plain_rounds_that_rows_draft_through_are_not_re_planned_every_few_rounds() -> None:
    """Plain rounds come every SETTLE_EVERY rounds until SETTLE were timed, but a row with a fixed gamma drafts
    through every one of them (no plain round is timed): counted in attempts, the fast cadence ends."""
    controller = GammaController(8)
    controller.costs.record(2, RoundKind(4), (), 0, 0.004, 0.020, 0.0)
    controller.costs.record(2, RoundKind(0), (), 0, 0.0, 0.020, 0.0)  # one plain round timed at batch 2
    state = batch("r", RowState("fixed", 10**6, gamma=4))
    planned = 0
    for _ in range(200):
        plan = controller.plan(state)
        assert plan.rows[1].drafts == 4
        planned += plan.rows[0].drafts == 0
        learn(controller, plan, state, seconds=(0.004, 0.020, 0.0), width=4)  # the fixed row drafted: timed
    assert controller.costs.plain_round[2].count == 1
    assert planned <= 3 + 200 // cost_model.CALIBRATE_EVERY + 1


def test_timed_means_start_from_the_median_of_their_first_timings() -> None:
    costs = CostModel()
    for seconds in (0.100, 0.020, 0.022):  # a stalled first plain round
        _time(costs, 1, 0, 0.0, seconds)
    assert costs.plain_round[1].value == pytest.approx(0.022)
    _time(costs, 1, 0, 0.0, 0.020)
    assert costs.plain_round[1].value == pytest.approx(0.75 * 0.022 + 0.25 * 0.020)  # then a mean


def test_round_lengths_timed_at_different_moments_are_compared_at_one_pace() -> None:
    """The machine runs 30% slower in alternate stretches of 32 rounds; the plain rounds happened to be timed
    in slow stretches, the rounds of 2 drafts in fast ones. Raw mean times would put a round of 2
    drafts at 1.04 plain rounds; as pace x relative cost each length keeps its own cost."""
    costs = CostModel()
    for i in range(1280):
        pace = 1.3 if (i // 32) % 2 else 1.0
        if i % 64 == 52:
            _time(costs, 1, 0, 0.0, 0.020 * pace)
        drafts = 2 if i % 64 == 20 else 1
        seconds = 0.020 * (1.30 if drafts == 1 else 1.35) * pace
        _time(costs, 1, drafts, 0.003 * drafts * pace, seconds - 0.003 * drafts * pace)
    assert costs.round_cost(1, 1) == pytest.approx(1.30, rel=0.03)
    assert costs.round_cost(1, 2) == pytest.approx(1.35, rel=0.03)


def test_exploration_keeps_both_neighbours_fresh_and_a_frozen_clock_is_ignored() -> None:
    controller = GammaController(8)
    costs = controller.costs
    _time(costs, 1, 1, 0.0, 0.0)  # a round the clock did not see: no division by zero, no relative cost
    assert 1 not in costs.drafting or costs.drafting[1].count(1) == 0
    for _ in range(20):
        _time(costs, 1, 3, 0.009, 0.020)
    for _ in range(500):  # a long stretch at gamma 1, then gamma 2 is chosen
        _time(costs, 1, 1, 0.003, 0.020)
    assert controller._neighbour(2, 1) == 3  # timed least recently, though far less often
    _time(costs, 1, 3, 0.009, 0.020)
    assert controller._neighbour(2, 1) == 1  # now gamma 1's cost is the staler one
    assert controller._neighbour(1, 1) == 2 and controller._neighbour(8, 1) == 7  # the only neighbour


def test_a_stalled_round_barely_moves_the_cost_of_its_length() -> None:
    """Rounds of a length tried only now and then keep a slow mean: one round the OS stalled 5x (common
    on a shared machine) would move it by 40%. It counts as at most RELATIVE_SPIKE (1.2x) the mean, at a weight of
    at most RELATIVE_WEIGHT (0.1): a move under 2%."""
    costs = CostModel()
    _time(costs, 1, 0, 0.0, 0.020)
    for _ in range(10):
        _time(costs, 1, 2, 0.006, 0.020)
    before = costs.round_cost(1, 2)
    _time(costs, 1, 2, 0.006, 0.124)  # 130 ms against 26 ms
    assert before < costs.round_cost(1, 2) < 1.02 * before


def test_a_stalled_calibration_round_leaves_the_drafting_costs_alone() -> None:
    """Plain rounds are timed once in 64 rounds while a request drafts, so each weighs 1 - 0.995^64 = 0.27 in the
    plain round's cost: one stalled 2x (counted as 1.5x) would put every drafting round 12% cheaper (gamma 1 at
    1.11 plain rounds for 1.26), enough to keep requests drafting at acceptance 0.1."""
    costs = CostModel()
    for i in range(2000):
        if i % 64 == 0:
            stall = 2.0 if i == 1920 else 1.0
            _time(costs, 1, 0, 0.0, 0.020 * stall)
        else:
            _time(costs, 1, 1, 0.003, 0.020 * 1.26 - 0.003)
    assert costs.round_cost(1, 1) == pytest.approx(1.26, rel=0.02)


def test_a_new_request_re_seeds_the_pace_of_round_costs() -> None:
    """At batch 1 each request has its own context: after a long prompt's request (every round 1.6x
    dearer) fell back to plain rounds, the next, short one drafts. Its first rounds, timed against the
    long request's pace, would look cheap and, being rarely timed, weigh heavily: the request's first
    round timed only re-seeds the pace."""

    def run(tell_requests: bool) -> float:
        costs = CostModel()
        for request in range(40):
            scale = 1.6 if request % 2 else 1.0
            rounds = [1] * 30 + [0] * 30 if request % 2 else [1] * 60
            for drafts in rounds:
                seconds = 0.020 * scale * (1.26 if drafts else 1.0)
                _time(
                    costs,
                    1,
                    drafts,
                    0.003 * drafts,
                    seconds - 0.003 * drafts,
                    rows=(f"r{request}",) if tell_requests else (),
                )
        return costs.round_cost(1, 1)

    assert run(tell_requests=True) == pytest.approx(1.26, rel=0.02)
    assert not run(tell_requests=False) == pytest.approx(1.26, rel=0.05)  # the stale pace: a biased cost


def test_gamma_auto_tells_its_cost_model_which_requests_a_round_ran() -> None:
    """The requests a plan chose for reach the cost model with the round's time (a new request re-seeds the pace);
    a round it chose nothing in names none."""
    controller = GammaController(8)
    state = batch("a")
    learn(controller, controller.plan(state), state, RowOutcome("a", 1, 0), seconds=(0.003, 0.020, 0.0))
    assert controller.costs.rows[1] == ("a",)
    _time_unplanned(controller, 1, 1, 0.003, 0.020)
    assert controller.costs.rows[1] == ("a",)
    state = batch("b")
    learn(controller, controller.plan(state), state, RowOutcome("b", 1, 0), seconds=(0.003, 0.020, 0.0))
    assert controller.costs.rows[1] == ("b",)


def test_a_round_the_clock_did_not_see_prices_nothing() -> None:
    """A round timed at 0 s says nothing about cost: no plain round, draft step or target step of 0 s (which would
    price drafting at c = 0, or divide a later scoring round's time by zero)."""
    costs = CostModel()
    _time(costs, 1, 0, 0.0, 0.0)
    _time(costs, 1, 2, 0.0, 0.0)
    assert costs.plain_round == {} and costs.draft_step == {} and costs.target_step == {}
    costs.record(1, RoundKind(0, scoring=True), (), 0, 0.0, 0.0, 0.0)
    assert costs.scoring == {}
    _time(costs, 1, 0, 0.0, 0.02)
    costs.record(1, RoundKind(0, scoring=True), (), 0, 0.0, 0.0, 0.0)  # no division by a 0 s plain round either
    assert costs.plain_round[1].value == pytest.approx(0.02)


def test_gamma_auto_plans_an_empty_batch() -> None:
    assert GammaController(4).plan(batch()).rows == ()
