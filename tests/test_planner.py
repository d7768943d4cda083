"""Planners: what a round's plan holds (fixed gamma, gamma auto), the plan/learn contract, and gamma auto's choice
of gamma on simulated acceptance streams."""

from __future__ import annotations

import dataclasses

import pytest
from planner_driver import UNLIMITED, batch, calibrate_confidence, drafts, learn, lookups, simulate, untimed

from specsample import Engine, ModelDrafter, SamplingParams, SpecConfig, generate
from specsample.drafters.hybrid import HybridDrafter
from specsample.drafters.ngram import NgramDrafter
from specsample.planner import FixedGamma, GammaController, chain
from specsample.planner import costs as cost_model
from specsample.planner.acceptance import POOL_DECAY
from specsample.planner.base import BatchState, DraftSource, RowOutcome, RowState
from specsample.theory import expected_speedup, optimal_gamma


def test_fixed_gamma_plans_every_row_its_gamma_within_its_budget() -> None:
    planner = FixedGamma(4)
    state = BatchState(
        (
            RowState("a", UNLIMITED),
            RowState("own", UNLIMITED, gamma=2),
            RowState("greedy-own", UNLIMITED, gamma=9),
            RowState("plain", UNLIMITED, speculative=False),
            RowState("short", 3),
            RowState("last", 1),
        )
    )
    plan = planner.plan(state)
    # its own gamma, never past the planner's; none without speculation; never the last token of a budget
    assert drafts(plan) == [4, 2, 4, 0, 2, 0]
    assert [r.reach for r in plan.rows] == drafts(plan) and plan.extension is None and plan.stop_thresholds == ()
    assert plan.chosen_ids == () and not any(r.fallback for r in plan.rows) and plan.width == 4


@pytest.mark.parametrize("make", [FixedGamma, GammaController])
def test_planners_need_a_gamma_of_at_least_one(make) -> None:
    for bad in (0, -1, 2.5):
        with pytest.raises(ValueError, match="gamma must be an integer >= 1"):
            make(bad)


def test_a_plan_is_a_value_learnt_as_it_was_made() -> None:
    """A plan is frozen, and learning reads the plan it is handed: a round planned as a lookup is learnt as one
    even where another plan was made since."""
    controller = untimed(4)
    lookup_state = batch(RowState("r", UNLIMITED, lookup=3), offers_lookups=True)
    as_lookup = controller.plan(lookup_state)
    assert lookups(as_lookup, lookup_state) == {"r": 3}
    with pytest.raises(dataclasses.FrozenInstanceError):
        as_lookup.rows[0].drafts = 1  # type: ignore[misc]
    model_state = batch("r")
    as_model = controller.plan(model_state)
    assert as_model.rows[0].source is DraftSource.EITHER and as_model.rows[0].drafts > 0
    model_alpha, lookup_alpha = controller.acceptance.alpha("r"), controller.acceptance.lookup_alpha("r")
    learn(controller, as_lookup, lookup_state, RowOutcome("r", 3, 3))
    assert controller.acceptance.alpha("r") == model_alpha  # the model's estimate did not move...
    assert controller.acceptance.lookup_alpha("r") > lookup_alpha  # ...the lookup's did
    learn(controller, as_model, model_state, RowOutcome("r", 2, 0))
    assert controller.acceptance.alpha("r") < model_alpha


def test_requests_that_finished_are_forgotten_once_their_last_round_is_learnt() -> None:
    controller = untimed(4)
    state = batch("done", "going")
    plan = controller.plan(state)
    learn(controller, plan, state, RowOutcome("done", plan.rows[0].drafts, 0), finished=("done",))
    assert "done" not in controller.choices and "done" not in controller.acceptance.requests
    assert "going" in controller.choices
    assert controller.acceptance.pooled[1] == 1.0  # its last round still taught the pool


def test_a_round_without_rows_to_choose_for_leaves_gamma_auto_as_it_was() -> None:
    """Rows with a gamma of their own, or none speculating: gamma auto plans them as fixed gamma does, counts no
    round and ages no pool, but still learns the round's drafts and time."""
    controller = GammaController(4)
    controller.acceptance.pooled = [6.0, 6.0]
    state = batch(RowState("fixed", UNLIMITED, gamma=3), RowState("plain", UNLIMITED, speculative=False))
    plan = controller.plan(state)
    assert drafts(plan) == drafts(FixedGamma(4).plan(state)) == [3, 0]
    assert plan.chosen_ids == () and not plan.exploring and not any(r.fallback for r in plan.rows)
    assert controller.round == 0 and controller.acceptance.pooled == [6.0, 6.0] and controller.choices == {}
    learn(controller, plan, state, RowOutcome("fixed", 3, 1), seconds=(0.003, 0.02, 0.002))
    kept = 6.0 * POOL_DECAY**2  # two trials: one accepted draft, one rejected
    assert controller.acceptance.pooled == pytest.approx([kept + 1.0, kept + 1.0])
    assert controller.costs.drafting[2].count(3) == 1 and controller.costs.draft_step[2].value == pytest.approx(0.001)


def test_gamma_auto_clips_every_plan_to_the_rows_budget() -> None:
    """No row drafts past max_gamma, nor the last token of its budget: model drafts, lookups and extensions alike."""
    controller = untimed(6)
    calibrate_confidence(controller)  # confident drafts are accepted: the plan may extend past its drafts
    controller.acceptance.pooled = [60.0, 40.0]  # at c 0.05 the formula plans 4 drafts
    state = batch(
        RowState("long", UNLIMITED),
        RowState("short", 3),
        RowState("last", 1),
        RowState("mid", 5),
        RowState("lookup", 4, lookup=3, drafts_otherwise=False),
        offers_lookups=True,
    )
    plan = controller.plan(state)
    assert drafts(plan) == [4, 2, 0, 4, 3]
    assert not any(r.fallback for r in plan.rows)  # a budget's end is not a fallback
    assert plan.extension is not None and [r.reach for r in plan.rows] == [6, 2, 0, 4, 3]
    # a row with its own gamma does not extend (nor does a lookup): with no row left to extend, no extension
    own = controller.plan(dataclasses.replace(state, rows=(RowState("long", UNLIMITED, gamma=2), *state.rows[1:])))
    assert own.extension is None and [r.reach for r in own.rows] == drafts(own) == [2, 2, 0, 4, 3]


def test_rows_with_a_gamma_of_their_own_draft_it_beside_chosen_rows() -> None:
    """A request's own gamma is drafted as asked (up to max_gamma and its budget), is not planned by gamma auto,
    and its drafts still teach the pooled acceptance that new requests start from."""
    controller = untimed(4)
    state = batch("auto", RowState("two", UNLIMITED, gamma=2), RowState("nine", 6, gamma=9))
    plan = controller.plan(state)
    assert drafts(plan)[1:] == [2, 4] and plan.chosen_ids == ("auto",)
    assert controller.choices == {}  # planning changes nothing; learning the round keeps the plan's choices
    learn(controller, plan, state)
    assert set(controller.choices) == {"auto"}
    for _ in range(10):
        learn(controller, plan, state, RowOutcome("two", 2, 0), RowOutcome("nine", 4, 0))
    assert controller.acceptance.pooled_alpha() < 0.05


@pytest.mark.parametrize("alpha, cost", [(0.9, 0.05), (0.7, 0.05), (0.5, 0.2), (0.8, 0.02)])
def test_gamma_auto_converges_to_the_formula(monkeypatch, alpha: float, cost: float) -> None:
    monkeypatch.setattr(cost_model, "PRIOR_COST_RATIO", cost)
    chosen = simulate(untimed(12), alpha, 400)
    expected = optimal_gamma(alpha, cost, max_gamma=12)
    settled = chosen[200:]
    mode = max(set(settled), key=settled.count)
    assert abs(mode - expected) <= 1, (expected, settled[-20:])
    # the speedup curve is flat near its peak, so a noisy alpha estimate may wander a little: what
    # matters is that the gammas chosen give (almost) the best throughput the formula predicts
    achieved = sum(expected_speedup(alpha, g, cost) for g in settled) / len(settled)
    assert achieved >= 0.97 * expected_speedup(alpha, expected, cost)
    switches = sum(a != b for a, b in zip(settled, settled[1:]))
    assert switches <= 0.1 * len(settled)  # hysteresis: no thrash


def test_hysteresis_keeps_gamma_from_thrashing(monkeypatch) -> None:
    """Near the peak of a flat speedup curve the best gamma flips with every round's noise; gamma switches only
    for a clear (HYSTERESIS) predicted gain."""
    monkeypatch.setattr(cost_model, "PRIOR_COST_RATIO", 0.05)

    def switches() -> int:
        settled = simulate(untimed(12), 0.7, 400)[200:]
        return sum(a != b for a, b in zip(settled, settled[1:]))

    assert switches() <= 20
    monkeypatch.setattr(chain, "HYSTERESIS", 0.0)
    assert switches() > 20


def test_the_engine_tells_gamma_auto_each_rows_budget_left(tiny_target, tiny_draft) -> None:
    """Beside a fixed-gamma row and a plain one with other budgets, gamma auto sees the rows it chooses for, each
    with its own request id and budget left, in every round."""
    seen: list[dict[str, int]] = []

    class Spy(GammaController):
        def plan(self, batch: BatchState):
            seen.append({r.request_id: r.remaining for r in batch.rows if r.chosen})
            return super().plan(batch)

    engine = Engine(tiny_target, ModelDrafter(tiny_draft), SpecConfig(max_batch_size=4), planner=Spy(4))
    budgets = {"auto-a": 12, "fixed": 20, "plain": 7, "auto-b": 9}
    for rid, budget in budgets.items():
        engine.add_request(
            [1, 2, 3],
            SamplingParams(temperature=0, max_new_tokens=budget),
            request_id=rid,
            speculative=rid != "plain",
            gamma=2 if rid == "fixed" else None,
        )
    left, expected = dict(budgets), []
    for result in engine.stream():
        expected.append({rid: n for rid, n in left.items() if rid.startswith("auto") and n > 0})
        for update in result.rows:
            left[update.request_id] -= len(update.new_tokens)
    assert seen == expected and {} in seen and not any(left.values())


def test_greedy_output_is_the_targets_with_every_drafter_and_planner(tiny_target, tiny_draft) -> None:
    prompts = [[1, 2, 3, 1, 2], [4, 5, 6, 7, 4, 5, 6], [3], [10, 11, 10, 11, 10]]
    params = SamplingParams(temperature=0, max_new_tokens=30)
    plain = [c.token_ids for c in generate(tiny_target, prompts, params).completions]
    drafters = {
        "ngram": lambda: NgramDrafter(min_n=1),
        "hybrid": lambda: HybridDrafter(ModelDrafter(tiny_draft), NgramDrafter(min_n=1), min_match=2),
        "model": lambda: ModelDrafter(tiny_draft),
    }
    for name, make in drafters.items():
        for planner in (FixedGamma(4), GammaController(8)):
            out = generate(tiny_target, prompts, params, draft=make(), planner=planner)
            assert [c.token_ids for c in out.completions] == plain, (name, planner)
