"""Acceptance estimates: a request's own trials behind a prior, the pool new requests start from (and its ageing),
the prior its drafts' confidences predict, and positions' acceptance probabilities counted in place of coins."""

from __future__ import annotations

import random

import pytest
from planner_driver import accepted, batch, calibrate_confidence, learn, scorings, simulate, untimed

from specsample import Engine, ModelDrafter, SamplingParams, SpecConfig
from specsample.planner import GammaController
from specsample.planner import acceptance as acceptance_module
from specsample.planner import costs as cost_model
from specsample.planner.acceptance import Acceptance
from specsample.planner.base import RoundOutcome, RowOutcome, RowState


def test_new_requests_start_from_the_pooled_acceptance() -> None:
    controller = untimed()
    assert controller.acceptance.alpha("first") == pytest.approx(0.5)  # the constant prior before any data
    simulate(controller, 0.2, 100, rid="first", rng=random.Random(3))
    controller.forget("first")
    assert "first" not in controller.acceptance.requests and "first" not in controller.choices
    assert controller.acceptance.alpha("second") == pytest.approx(0.2, abs=0.08)


def test_a_request_counts_each_positions_acceptance_probability_in_place_of_its_coin() -> None:
    acceptance = Acceptance()
    with pytest.raises(ValueError, match="one probability per position reached"):
        acceptance.observe("r", 3, 1, False, None, (0.5, 0.5, 0.5))  # reached: the accepted draft and the rejected one
    with pytest.raises(ValueError, match="num_accepted must be in 0..num_drafted"):
        acceptance.observe("r", 2, 3, False)
    acceptance.observe("r", 3, 1, False, None, (0.9, 0.2))
    assert acceptance.alpha("r") == pytest.approx((1.1 + 8 * 0.5) / (2 + 8))  # 1.1 successes in 2 trials


def _falls_back_within(alpha: float, expected: bool, seed: int, rounds: int = 40) -> int | None:
    """Drafting rounds before a request whose every draft is accepted with probability `alpha` falls back
    (None: it drafted all `rounds`), told each position's acceptance probability or only its coin."""
    controller, rng = untimed(), random.Random(seed)
    for r in range(rounds):
        state = batch("r")
        plan = controller.plan(state)
        if controller.in_fallback("r"):
            return r
        gamma = plan.rows[0].drafts
        taken = accepted(rng, alpha, gamma)
        reached = min(taken + 1, gamma)
        learn(controller, plan, state, RowOutcome("r", gamma, taken, None, (alpha,) * reached if expected else None))
    return None


def test_acceptance_probabilities_keep_requests_that_gain_from_falling_back_on_bad_luck(monkeypatch) -> None:
    """At alpha 0.45 against a break-even of 0.3 drafting gains; learnt from coins, runs of rejections send
    some such requests into fallback in their first rounds (35 of 300 here), learnt from each position's
    acceptance probability none. Where drafting loses (alpha 0.1) both fall back, the probabilities no later."""
    monkeypatch.setattr(cost_model, "PRIOR_COST_RATIO", 0.3)  # a round of one draft: 1.3 plain rounds
    coins = [_falls_back_within(0.45, False, seed) for seed in range(300)]
    told = [_falls_back_within(0.45, True, seed) for seed in range(300)]
    assert sum(r is not None for r in coins) >= 15 and all(r is None for r in told)
    lost_coins = [_falls_back_within(0.1, False, seed) for seed in range(100)]
    lost_told = [_falls_back_within(0.1, True, seed) for seed in range(100)]
    assert None not in lost_coins and None not in lost_told
    assert max(lost_told) <= sorted(lost_coins)[len(lost_coins) // 2]


def test_the_engine_tells_gamma_auto_each_positions_acceptance_probability(tiny_target, tiny_draft) -> None:
    """Sampled rows report, per position their round reached, the probability its draft was accepted with;
    greedy rows (whose accept-or-not is already certain) report none."""
    seen: list[RowOutcome] = []

    class Spy(GammaController):
        def read_outcome(self, plan, outcome: RoundOutcome):
            rows = super().read_outcome(plan, outcome)
            seen.extend(r for r in rows if r.num_drafted > 0)
            return rows

    engine = Engine(tiny_target, ModelDrafter(tiny_draft), SpecConfig(max_batch_size=2), planner=Spy(4))
    engine.add_request([1, 2, 3], SamplingParams(temperature=1.0, max_new_tokens=40, seed=1), request_id="sampled")
    engine.add_request([4, 5, 6], SamplingParams(temperature=0, max_new_tokens=40), request_id="greedy")
    for _ in engine.stream():
        pass
    sampled = [r.acceptance for r in seen if r.request_id == "sampled"]
    assert sampled and any(r.request_id == "greedy" for r in seen)
    assert all(r.acceptance is None for r in seen if r.request_id == "greedy")
    for row in seen:
        if row.request_id == "sampled":
            assert len(row.acceptance) == min(row.num_accepted + 1, row.num_drafted)
            assert all(0.0 <= b <= 1.0 for b in row.acceptance)
            assert row.confidence is not None and len(row.confidence) == row.num_drafted
    assert 0.0 < sum(sum(e) for e in sampled) < sum(len(e) for e in sampled)  # probabilities, not coins


def _rounds_before_fallback(confidence: float, alpha: float = 0.02, seed: int = 0) -> int:
    """Drafting rounds a request takes to fall back when its drafts are accepted with `alpha` and the
    draft's confidence in each is `confidence`, after a calibration where acceptance grows with it."""
    controller = untimed()
    calibrate_confidence(controller)
    rng = random.Random(seed)
    for rounds in range(1, 200):
        state = batch("r")
        plan = controller.plan(state)
        gamma = plan.rows[0].drafts
        if gamma == 0:
            return rounds - 1
        learn(controller, plan, state, RowOutcome("r", gamma, accepted(rng, alpha, gamma), (confidence,) * gamma))
    return 200


def test_a_draft_unsure_of_its_tokens_falls_back_sooner(monkeypatch) -> None:
    """Drafts accepted 2% of the time: when the draft is unsure of them (confidence 0.05, a bin accepted
    ~5% of the time in calibration) the request's prior moves to that and it falls back within a few
    rounds; a draft confidently wrong (0.6) is caught only by its rejections, as without the prior."""
    monkeypatch.setattr(cost_model, "PRIOR_COST_RATIO", 0.2)
    monkeypatch.setattr(acceptance_module, "CALIBRATED", 100)
    unsure = [_rounds_before_fallback(0.05, seed=s) for s in range(5)]
    confident = [_rounds_before_fallback(0.6, seed=s) for s in range(5)]
    assert max(unsure) <= 8 < 20 <= min(confident)
    # centred on the pool alone, confidence does not enter
    monkeypatch.setattr(Acceptance, "prior_centre", lambda self, state: self.pooled_alpha())
    assert [_rounds_before_fallback(0.05, seed=s) for s in range(5)] == confident


def test_a_good_request_with_unsure_drafts_keeps_drafting(monkeypatch) -> None:
    """Acceptance 0.5 with the draft's confidence spread as in calibration: the confidence prior agrees
    with the acceptance and the request drafts on (a prior from confidence alone is not a verdict)."""
    monkeypatch.setattr(cost_model, "PRIOR_COST_RATIO", 0.2)
    monkeypatch.setattr(acceptance_module, "CALIBRATED", 100)
    controller = untimed()
    calibrate_confidence(controller)
    rng = random.Random(4)
    chosen = []
    for _ in range(300):
        state = batch("r")
        plan = controller.plan(state)
        gamma = plan.rows[0].drafts
        chosen.append(gamma)
        confidences = [rng.random() for _ in range(gamma)]
        taken = 0
        while taken < gamma and rng.random() < confidences[taken]:
            taken += 1
        learn(controller, plan, state, RowOutcome("r", gamma, taken, tuple(confidences)))
    assert controller.acceptance.requests["r"].predicted_trials > 0  # the confidence prior was in play
    assert chosen.count(0) < 0.05 * len(chosen)


def _drafting_share_after_a_bad_first_reply(replies: int = 6, seed: int = 0) -> float:
    """Share of rounds drafted by `replies` 64-round requests accepted at 0.35 (drafts sampled, backlogs scored at
    that rate), after a first request whose drafting rounds were all rejected before it fell back. Drafting gains
    there (round of one draft 1.26 plain rounds, from the prior c: 1.35 tokens for 1.26 rounds)."""
    controller, rng = untimed(), random.Random(seed)
    while not controller.in_fallback("bad"):
        state = batch(RowState("bad", 1000), can_score=True)
        plan = controller.plan(state)
        learn(controller, plan, state, RowOutcome("bad", plan.rows[0].drafts, 0))
    for _ in range(50):  # the rest of the bad reply, plain
        state = batch(RowState("bad", 1000), can_score=True)
        learn(controller, controller.plan(state), state)
    controller.forget("bad")
    drafted = total = 0
    for reply in range(replies):
        rid, backlog = f"r{reply}", 0
        for left in range(64, 0, -1):
            backlog += 1
            state = batch(RowState(rid, left, backlog=backlog), can_score=True)
            plan = controller.plan(state)
            gamma = plan.rows[0].drafts
            wanted = scorings(plan, state).get(rid, 0)
            scores = (0.35,) * min(wanted, backlog) if wanted else None
            learn(controller, plan, state, RowOutcome(rid, gamma, accepted(rng, 0.35, gamma), backlog_scores=scores))
            if wanted or gamma:
                backlog = 0
            drafted += gamma > 0
            total += 1
        controller.forget(rid)
    return drafted / total


def test_a_pool_set_low_by_one_bad_reply_is_forgotten(monkeypatch) -> None:
    """The pooled acceptance learns only from drafting and sets each new request's prior: kept as it was after a
    first reply whose drafts were all rejected, it sits near 0.01, every later request starts in fallback, and its
    own scorings (about 25 remembered trials at 0.35 behind 8 pseudo-trials at 0.01) never predict enough to
    resume, so nothing drafts again and the pool never moves. Aged per round, the pool gives way to the prior
    within the bad reply's remaining rounds and the requests after it draft."""
    monkeypatch.setattr(cost_model, "PRIOR_COST_RATIO", 0.26)
    shares = [_drafting_share_after_a_bad_first_reply(seed=s) for s in range(3)]
    monkeypatch.setattr(acceptance_module, "POOL_ROUND_DECAY", 1.0)  # the pool kept as it was
    frozen = [_drafting_share_after_a_bad_first_reply(seed=s) for s in range(3)]
    assert max(frozen) < 0.05 < 0.3 < min(shares)  # 0.50-0.85 aged (some fall back at 0.35), 0.0 kept


def test_pools_age_only_in_rounds_gamma_auto_plans() -> None:
    controller = untimed()
    controller.acceptance.pooled = [10.0, 10.0]
    controller.acceptance.lookup_pooled = [4.0, 2.0]
    fixed = batch(RowState("fixed", 100, gamma=2))
    learn(controller, controller.plan(fixed), fixed)  # nothing to choose for: no round
    assert controller.acceptance.pooled == [10.0, 10.0]
    chosen = batch("r")
    plan = controller.plan(chosen)
    assert controller.acceptance.pooled == [10.0, 10.0]  # planning changes nothing...
    learn(controller, plan, chosen)  # ...the round is counted once learnt
    decay = acceptance_module.POOL_ROUND_DECAY
    assert controller.acceptance.pooled == pytest.approx([10.0 * decay] * 2)
    assert controller.acceptance.lookup_pooled == pytest.approx([4.0 * decay, 2.0 * decay])
