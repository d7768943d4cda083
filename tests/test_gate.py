"""The confidence gate (a round stops after a draft its confidence bin says is unlikely to pay) and the extension
(a round draws past its plan while its drafts were likely all accepted), from gamma auto's plan to the drafters."""

from __future__ import annotations

import pytest
import torch
from model_factory import draft_request
from planner_driver import batch, calibrate_confidence, untimed

from specsample import ModelDrafter, SamplingParams, SpecConfig, generate
from specsample.drafters.base import Extension
from specsample.drafters.hybrid import HybridDrafter
from specsample.drafters.ngram import NgramDrafter
from specsample.planner import acceptance as acceptance_module
from specsample.planner import adaptive
from specsample.planner import costs as cost_model
from specsample.planner.base import BatchState, DraftSource, RoundPlan, RowPlan, RowState
from specsample.planner.costs import RoundKind


@pytest.fixture
def calibrated_early(monkeypatch) -> None:
    """Bins read after 100 binned drafts, drafting priced at c 0.2."""
    monkeypatch.setattr(acceptance_module, "CALIBRATED", 100)
    monkeypatch.setattr(cost_model, "PRIOR_COST_RATIO", 0.2)


def test_gate_thresholds_from_calibration(calibrated_early) -> None:
    controller = untimed(4)
    plan = controller.plan(batch("r"))
    assert plan.rows[0].drafts > 0 and plan.stop_thresholds == () and plan.extension is None  # not calibrated yet
    calibrate_confidence(controller)
    thresholds = controller.plan(batch("r")).stop_thresholds
    assert len(thresholds) == 3 and len(set(thresholds)) == 1  # affine costs: one more draft costs c anywhere
    assert 0.0 < thresholds[0] < 0.6
    plain = controller.plan(batch(RowState("p", 100, speculative=False)))  # nothing drafts: no gate
    assert plain.stop_thresholds == () and plain.extension is None


def test_gate_follows_the_measured_cost_of_one_more_draft(calibrated_early) -> None:
    """Where a second draft costs almost nothing (rounds of 1 and 2 drafts take the same time), a round
    never stops after its first draft; after the second, one more draft costs a full step and it may."""
    controller = untimed(4)
    controller.costs = cost_model.CostModel()
    for _ in range(cost_model.SETTLE):  # plain rounds timed often enough to be re-timed rarely
        controller.costs.record(1, RoundKind(0), (), 0, 0.0, 0.020, 0.0)
    for _ in range(10):
        for drafts, seconds in ((1, 0.026), (2, 0.0262), (3, 0.030), (4, 0.034)):
            controller.costs.record(1, RoundKind(drafts), (), 0, 0.003 * drafts, seconds - 0.003 * drafts, 0.0)
    assert [round(controller.costs.round_cost(1, d), 2) for d in (1, 2, 3, 4)] == [1.3, 1.31, 1.5, 1.7]
    calibrate_confidence(controller)
    thresholds = controller.plan(batch("r")).stop_thresholds
    assert thresholds[0] == 0.0 and thresholds[1] > 0.0 and thresholds[1] == thresholds[2]
    controller.round = adaptive.EXPLORE_EVERY - 1
    exploring = controller.plan(batch("r"))  # a round that tries a neighbouring gamma...
    assert exploring.exploring and exploring.rows[0].drafts in (1, 3)
    assert exploring.stop_thresholds == () and exploring.extension is None  # ...drafts it in full, or its cost
    # would never be timed


def test_the_extension_prices_one_more_draft_as_the_gate_does(calibrated_early) -> None:
    """Past the planned gamma one more draft pays where all drafts so far were accepted with at least
    S (R(j + 1) - R(j)) / a_mean: the gate's bar, against the product of the drafts' bins' acceptance."""
    controller = untimed(4)
    calibrate_confidence(controller)
    plan = controller.plan(batch("r"))
    assert plan.rows[0].drafts < plan.rows[0].reach == 4  # the extension lets the row reach max_gamma
    acceptance, bars = plan.extension.bin_acceptance, plan.extension.bars
    assert len(acceptance) == 10 and len(bars) == 3
    assert acceptance[0] < 0.15 and acceptance[9] > 0.85  # the calibration's acceptance grows with confidence
    pool = controller.acceptance
    mean = sum(pool.bin_accepts) / sum(pool.bin_trials)
    rate = max(controller.best_gamma(pool.pooled_alpha(), 1)[1], 1.0)
    assert bars[0] == pytest.approx(rate * 0.2 / mean)  # one more draft at c = 0.2 plain rounds (no timings)
    # the gate stops below the first bin that reaches the same bar
    assert plan.stop_thresholds[0] == pytest.approx(next(b for b, a in enumerate(acceptance) if a >= bars[0]) / 10)


def test_an_extension_draws_on_while_its_drafts_were_likely_all_accepted() -> None:
    rule = Extension((0.0, 0.5, 0.9), (0.8, 0.6, 0.5))  # three bins; bars for drafts 1, 2, 3
    assert rule.draws_on(1, [0.9])  # 0.9 >= 0.8
    assert not rule.draws_on(1, [0.5])  # 0.5 < 0.8
    assert rule.draws_on(2, [0.9, 0.9])  # 0.81 >= 0.6
    assert not rule.draws_on(3, [0.9, 0.9])  # not yet its plan
    assert not rule.draws_on(0, [])  # nothing drawn: the plan comes first
    assert not rule.draws_on(1, [0.9, 0.9, 0.9, 0.9])  # past its bars
    assert not rule.draws_on(1, [float("nan")])  # a draft without a confidence says nothing
    with pytest.raises(ValueError, match="one probability per bin"):
        Extension((1.5,), (0.0,))


class _AlwaysExtends:
    """A planner of one draft a row that lets every row draw on to its reach (every bin accepted, no bar)."""

    max_gamma = 4
    tree = None
    most_drafts = 4

    def plan(self, batch: BatchState) -> RoundPlan:
        rows = tuple(RowPlan(min(1, r.remaining - 1), min(self.max_gamma, r.remaining - 1)) for r in batch.rows)
        return RoundPlan(rows, extension=Extension((1.0,) * 10, (0.0,) * (self.max_gamma - 1)))

    def learn(self, plan, outcome) -> None:
        return None

    def forget(self, request_id: str) -> None:
        return None


def test_greedy_output_is_the_targets_when_rounds_draft_past_their_plan(tiny_target, tiny_draft) -> None:
    prompts = [[1, 2, 3, 1, 2], [4, 5, 6, 7, 4, 5, 6], [3], [10, 11, 10, 11, 10]]
    params = SamplingParams(temperature=0, max_new_tokens=30)
    plain = [c.token_ids for c in generate(tiny_target, prompts, params).completions]
    out = generate(
        tiny_target, prompts, params, draft=ModelDrafter(tiny_draft), config=SpecConfig(), planner=_AlwaysExtends()
    )
    assert [c.token_ids for c in out.completions] == plain
    assert out.stats["drafted"] > 1.5 * out.stats["drafts"]  # planned one a round, drafted up to 4
    assert out.stats["extended_row_rounds"] >= out.stats["drafts"] // 2  # ...and the statistics say so


def _model_drafted(
    tiny_draft,
    extension: Extension | None,
    drafts: tuple[int, ...],
    reach: tuple[int, ...],
    thresholds: tuple[float, ...] = (),
) -> list[int]:
    drafter = ModelDrafter(tiny_draft)
    drafter.allocate(2, 64)
    drafter.add_rows([0, 1], [[1, 2, 3, 4], [5, 6, 7]])
    params = tuple(SamplingParams(temperature=1.0, seed=s) for s in range(2))
    generators = tuple(torch.Generator().manual_seed(s) for s in range(2))
    request = draft_request((0, 1), drafts, reach, params, generators, stop_thresholds=thresholds, extension=extension)
    return drafter.propose(request).num_drafted.tolist()


def test_a_model_drafter_extends_past_its_plan_only_as_the_rule_allows(tiny_draft) -> None:
    always = Extension((1.0,) * 10, (0.0,) * 7)
    never = Extension((0.0,) * 10, (0.5,) * 7)
    assert _model_drafted(tiny_draft, always, (1, 2), (4, 3)) == [4, 3]  # each row to its reach
    assert _model_drafted(tiny_draft, never, (1, 2), (4, 3)) == [1, 2]  # each row to its plan
    assert _model_drafted(tiny_draft, None, (4, 3), (4, 3)) == [4, 3]  # no extension: the reach is the plan
    # within the plan the gate stops (every confidence is under 1.0), past it only the extension judges
    assert _model_drafted(tiny_draft, always, (2, 0), (4, 3), thresholds=(1.0,) * 7) == [1, 3]
    with pytest.raises(ValueError, match="need 0 <= drafts <= reach"):
        _model_drafted(tiny_draft, always, (-1, 2), (4, 3))


def test_drafters_without_confidences_refuse_an_extension_past_the_plan(tiny_draft) -> None:
    rule = Extension((1.0,) * 10, (0.0,) * 7)
    generator = (torch.Generator().manual_seed(0),)
    params = (SamplingParams(temperature=1.0),)
    ngram = NgramDrafter(min_n=1)
    ngram.allocate(1, 64)
    ngram.add_rows([0], [[1, 2, 3, 1, 2]])
    with pytest.raises(ValueError, match="n-gram draft has no confidence"):
        ngram.propose(draft_request((0,), (1,), (3,), params, generator, extension=rule))
    assert ngram.propose(draft_request((0,), (3,), (3,), params, generator, extension=rule)).num_drafted.tolist() == [3]
    hybrid = HybridDrafter(ModelDrafter(tiny_draft), NgramDrafter(min_n=1), min_match=1)
    hybrid.allocate(1, 64)
    hybrid.add_rows([0], [[1, 2, 3, 1, 2]])
    for source in ((DraftSource.EITHER,), (DraftSource.LOOKUP,), ()):
        with pytest.raises(ValueError, match="only rows sent to the draft model"):
            hybrid.propose(draft_request((0,), (1,), (3,), params, generator, source=source, extension=rule))
    model_row = hybrid.propose(
        draft_request((0,), (1,), (3,), params, generator, source=(DraftSource.MODEL,), extension=rule)
    )
    assert model_row.num_drafted.tolist() == [3] and model_row.probs is not None
