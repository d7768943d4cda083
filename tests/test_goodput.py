"""The goodput policy: the whole batch decodes plainly where speculation is expected to commit fewer tokens per second,
and speculates again where it pays; a plan changes nothing until its round is learnt."""

from __future__ import annotations

import copy
import dataclasses
import logging
import random

import pytest
from planner_driver import UNLIMITED, accepted, batch, learn

from specsample.planner import GammaController, goodput, profile
from specsample.planner.base import DraftSource, RowOutcome, RowState

BASE = 0.010  # seconds a target forward costs whatever it scores (weights read once)...
PER_TOKEN = 0.0015  # ...and per row and token scored (B rows x (k + 1) tokens)
DRAFT_STEP = 0.0003  # one batched draft step


def run(controller: GammaController, alphas: dict[str, float], rounds: int, rng: random.Random) -> list[int]:
    """Rounds of the rows `alphas` names (each draft accepted i.i.d. at its alpha) on a virtual clock: a round of width
    k over B rows takes BASE + PER_TOKEN B (k + 1) + k DRAFT_STEP seconds. The round widths planned."""
    widths = []
    for _ in range(rounds):
        state = batch(*alphas)
        plan = controller.plan(state)
        width = max(r.drafts for r in plan.rows)
        widths.append(width)
        target = BASE + PER_TOKEN * len(alphas) * (width + 1)
        outcomes = [
            RowOutcome(rid, row.drafts, accepted(rng, alphas[rid], row.drafts))
            for rid, row in zip(alphas, plan.rows)
            if row.drafts > 0
        ]
        learn(controller, plan, state, *outcomes, seconds=(width * DRAFT_STEP, target, 0.0))
    return widths


def one_good_row_beside(bad: int) -> dict[str, float]:
    """A request whose drafts are accepted at 0.9, beside `bad` whose drafts are rarely accepted."""
    return {"good": 0.9, **{f"bad{i}": 0.1 for i in range(bad)}}


def test_speculation_that_loses_at_batch_8_is_turned_off_and_comes_back_as_load_falls() -> None:
    """At one row a round of 3 drafts costs 1.4 plain rounds for 3.4 tokens: speculation pays. At 8 rows every round
    scores 8 x (k + 1) tokens: the good row alone still gains by drafting (its own speedup over 1), so it never falls
    back, but the batch commits fewer tokens per second than plain decoding would. The goodput policy turns
    speculation off for the batch; with 2 rows it pays again, and it comes back."""
    controller, rng = GammaController(4), random.Random(0)
    assert sum(w > 0 for w in run(controller, {"good": 0.9}, 60, rng)) > 50
    eight = run(controller, one_good_row_beside(7), 300, rng)
    assert not controller.speculating(8) and not controller.in_fallback("good")
    assert sum(w > 0 for w in eight[-200:]) < 10  # probes only
    report = controller.goodput.reports[8]
    assert report.plain_rounds > 0 and report.expected.value is not None and report.measured.value is not None
    two = run(controller, one_good_row_beside(1), 100, rng)
    assert controller.speculating(2) and sum(w > 0 for w in two[-50:]) > 40


def test_without_the_goodput_policy_the_batch_of_8_keeps_speculating(monkeypatch) -> None:
    """The twin: a policy that never turns speculation off leaves the batch drafting for its one good row."""
    monkeypatch.setattr(goodput, "OFF_BELOW", 0.0)
    controller, rng = GammaController(4), random.Random(0)
    run(controller, {"good": 0.9}, 60, rng)
    eight = run(controller, one_good_row_beside(7), 300, rng)
    assert controller.speculating(8) and sum(w > 0 for w in eight[-200:]) > 150


class Optimistic(goodput.GoodputPolicy):
    """Prices speculation at three times what the costs say: a prediction the rounds do not bear out."""

    def price(self, batch_size, rows, width, generous=False):
        return 3 * super().price(batch_size, rows, width, generous)


def test_speculation_that_measures_slower_than_predicted_is_turned_off(monkeypatch) -> None:
    """Where the batch's speculative rounds commit fewer tokens per second than its plain rounds, measured, speculation
    stops whatever the prediction says; the twin, without the measured rule, keeps drafting."""
    widths = {}
    for measured in (True, False):
        if not measured:
            monkeypatch.setattr(goodput.GoodputPolicy, "measured_loss", lambda self, batch_size: False)
        controller, rng = GammaController(4), random.Random(0)
        controller.goodput = Optimistic(controller.costs)
        run(controller, {"good": 0.9}, 60, rng)
        widths[measured] = run(controller, one_good_row_beside(7), 300, rng)[-200:]
        assert controller.speculating(8) != measured
    assert sum(w > 0 for w in widths[True]) < 200 // goodput.PROBE_EVERY and sum(w > 0 for w in widths[False]) > 150


def test_the_goodput_policy_narrows_the_round_where_a_narrower_one_commits_more_per_second() -> None:
    """Rows that would each draft 4 at batch 8, where every draft widens the round for all 8 rows: the policy prices
    every width and drafts the best one, never wider than the rows planned."""
    controller = GammaController(4)
    policy = controller.goodput
    rows = [goodput.Drafting(4, 0.6)] * 8
    prices = {k: policy.price(8, rows, k) for k in range(1, 5)}
    choice, _ = policy.choose(8, rows, 1)
    assert 1 <= choice.width <= 4 and prices[choice.width] >= max(prices.values()) / (1 + goodput.HYSTERESIS)


def state_of(controller: GammaController) -> dict:
    """Everything the controller and its estimates hold (prices memoised between timings aside)."""
    return copy.deepcopy(
        {
            **{k: v for k, v in vars(controller).items() if isinstance(v, (int, list, dict))},
            "acceptance": vars(controller.acceptance),
            "costs": {k: v for k, v in vars(controller.costs).items() if k != "_memo"},
            "goodput": controller.goodput.memory,
            "trees": controller.trees_policy.memory,
        }
    )


def test_plan_changes_nothing_that_later_plans_read() -> None:
    """Planning twice gives the same plan and leaves the planner as it was; learning the plan keeps its decisions."""
    controller, rng = GammaController(4), random.Random(1)
    run(controller, one_good_row_beside(3), 40, rng)
    state = batch("good", *(f"bad{i}" for i in range(3)), RowState("new", UNLIMITED))
    before = state_of(controller)
    first, second = controller.plan(state), controller.plan(state)
    assert first == second
    assert state_of(controller) == before
    learn(controller, first, state)
    assert controller.round == before["round"] + 1 and "new" in controller.choices


def test_a_rows_source_is_one_of_three() -> None:
    """Where the drafter offers lookups, each drafting row is sent to its lookup or its model; else the drafter's
    own rule decides."""
    controller = GammaController(4)
    plan = controller.plan(batch(RowState("l", UNLIMITED, lookup=3), "m", offers_lookups=True))
    assert {r.source for r in plan.rows} <= {DraftSource.LOOKUP, DraftSource.MODEL}
    assert controller.plan(batch("m")).rows[0].source is DraftSource.EITHER


def test_a_profile_saved_by_one_process_is_loaded_by_the_next(tmp_path) -> None:
    """Costs and acceptance priors measured by one planner are where a new one with the same key starts, so it
    prices drafting from the first round; another key's profile is not read."""
    key = profile.ProfileKey("cpu", "target + draft", "fused-amx", "torch.bfloat16", "int4/auto")
    first, rng = GammaController(4, profile=profile.ProfileStore(key, tmp_path)), random.Random(2)
    run(first, one_good_row_beside(7), 120, rng)
    first.save()
    second = GammaController(4, profile=profile.ProfileStore(key, tmp_path))
    assert second.profile_loaded and second.costs.timed_drafting(8)
    assert second.costs.round_cost(8, 2) == pytest.approx(first.costs.round_cost(8, 2), rel=1e-6)
    assert second.acceptance.pooled_alpha() == pytest.approx(first.acceptance.pooled_alpha(), rel=1e-6)
    assert sum(second.acceptance.pooled) <= profile.PRIOR_TRIALS + 1e-9  # a prior, worth a few trials
    other = dataclasses.replace(key, runtime="torch")
    assert not GammaController(4, profile=profile.ProfileStore(other, tmp_path)).profile_loaded


def test_a_stale_profile_corrects_itself_within_a_few_rounds(tmp_path) -> None:
    """A profile whose rounds were timed 3x slower than this machine runs them: the first rounds measured replace it."""
    key = profile.ProfileKey("cpu", "pair", "fused-amx", "bf16", "int4")
    store = profile.ProfileStore(key, tmp_path)
    stale = GammaController(4)
    run(stale, {"good": 0.9}, 60, random.Random(3))
    for table in (stale.costs.plain_round, stale.costs.draft_step, stale.costs.target_step):
        for ewma in table.values():
            ewma.value *= 3
    store.save(stale.costs, stale.acceptance)
    fresh = GammaController(4, profile=store)
    assert fresh.costs.plain_round[1].value > 2.5 * (BASE + 2 * PER_TOKEN)
    run(fresh, {"good": 0.9}, 40, random.Random(4))
    assert fresh.costs.plain_round[1].value == pytest.approx(BASE + 2 * PER_TOKEN, rel=0.2)


@pytest.mark.parametrize("content", ["{not json", '{"version": 1, "key": 3}', '{"version": 1}', ""])
def test_a_corrupt_profile_is_ignored_with_a_warning(tmp_path, caplog, content: str) -> None:
    key = profile.ProfileKey("cpu", "pair", "fused-amx", "bf16", "int4")
    store = profile.ProfileStore(key, tmp_path)
    store.path.parent.mkdir(parents=True)
    store.path.write_text(content)
    with caplog.at_level(logging.WARNING, logger="specsample.controller"):
        controller = GammaController(4, profile=store)
    assert not controller.profile_loaded and "corrupt" in caplog.text
    assert controller.costs.nearest(1) is None  # the priors, untouched
    controller.save()
    assert GammaController(4, profile=store).profile_loaded  # the next save replaces it


def test_metrics_show_where_speculation_is_off_with_goodput_and_costs() -> None:
    """/metrics reads the planner per batch size: on at 1 row, off at 8 (the batch of 8 loses on the virtual clock),
    the rounds by mode, expected and measured goodput, and the costs measured there."""
    from prometheus_client.parser import text_string_to_metric_families

    from specsample.server.metrics import ServerMetrics

    controller, rng = GammaController(4), random.Random(0)
    run(controller, {"good": 0.9}, 60, rng)
    run(controller, one_good_row_beside(7), 300, rng)
    metrics = ServerMetrics(labels={"replica": "r0"})
    metrics.watch_planner(controller.summary)
    samples = {
        (s.name, s.labels.get("batch_size"), s.labels.get("mode") or s.labels.get("drafts")): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
        if s.name.startswith("specsample_planner_")
    }
    assert samples["specsample_planner_speculating", "1", None] == 1.0
    assert samples["specsample_planner_speculating", "8", None] == 0.0
    report = controller.goodput.reports[8]
    assert samples["specsample_planner_rounds_total", "8", "plain"] == report.plain_rounds > 200
    assert samples["specsample_planner_rounds_total", "8", "speculative"] == report.speculative_rounds > 0
    expected = samples["specsample_planner_goodput_expected_tokens_per_second", "8", None]
    measured = samples["specsample_planner_goodput_measured_tokens_per_second", "8", None]
    assert expected == pytest.approx(measured, rel=0.25)  # plain rounds, priced from their own timings
    assert measured == pytest.approx(8 / (BASE + PER_TOKEN * 8), rel=0.15)
    assert samples["specsample_planner_plain_round_seconds", "8", None] == pytest.approx(BASE + PER_TOKEN * 8, rel=0.1)
    assert samples["specsample_planner_round_cost_ratio", "1", "4"] > 1.0
    assert all(
        s.labels["replica"] == "r0"
        for f in text_string_to_metric_families(metrics.render().decode())
        for s in f.samples
        if s.name.startswith("specsample_planner_")
    )
