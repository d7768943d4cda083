"""Prompt lookup under gamma auto: lookup rows are sized by their own acceptance and cost, priced against the
draft model, run even where the draft model is in fallback, timed apart, and never feed the draft model's
estimates; what the drafters offer and propose; the engine running them."""

from __future__ import annotations

import random

import pytest
import torch
from model_factory import draft_request
from planner_driver import UNLIMITED, accepted, batch, drafts, learn, lookups, untimed

from specsample import Engine, ModelDrafter, SamplingParams, SpecConfig
from specsample.drafters.hybrid import HybridDrafter
from specsample.drafters.ngram import NgramDrafter
from specsample.drafters.routed import RoutedDrafter
from specsample.planner import GammaController
from specsample.planner import costs as cost_model
from specsample.planner.base import DraftSource, RowOutcome, RowState


def _offer(rid: str = "r", available: int = 0, model: bool = True, remaining: int = UNLIMITED) -> RowState:
    """A row whose drafter offers `available` lookup tokens; `model`: whether it could draft with a model instead."""
    return RowState(rid, remaining, lookup=available, drafts_otherwise=model)


def _lookup_round(controller: GammaController, available: int, taken: int | None = None, model: bool = True) -> int:
    """Plan a round of "r" with a lookup of `available` tokens on offer and learn it with `taken` drafts accepted
    (None: all); the drafts planned."""
    state = batch(_offer("r", available, model), offers_lookups=True)
    plan = controller.plan(state)
    n = plan.rows[0].drafts
    learn(controller, plan, state, RowOutcome("r", n, n if taken is None else min(taken, n)))
    return n


def _lookup_rounds(
    controller: GammaController,
    accept: float,
    rounds: int,
    available: int = 8,
    rng: random.Random | None = None,
    model: bool = True,
) -> list[int]:
    """Plan `rounds` rounds where a lookup of `available` tokens is on offer, each token accepted with
    probability `accept` (a rejection ends the round); return the lookup lengths planned. `model`: whether the
    drafter could draft with a model instead (if so, its probes in fallback are among the lengths)."""
    rng = rng or random.Random(0)
    planned = []
    for _ in range(rounds):
        state = batch(_offer("r", available, model), offers_lookups=True)
        plan = controller.plan(state)
        n = plan.rows[0].drafts
        planned.append(n)
        learn(controller, plan, state, RowOutcome("r", n, accepted(rng, accept, n)))
    return planned


def test_lookup_length_follows_the_lookups_own_acceptance() -> None:
    copying = untimed(8)
    assert _lookup_rounds(copying, 1.0, 40)[-1] == 8  # every token taken: the whole lookup
    assert copying.acceptance.lookup_alpha("r") > 0.9
    assert copying.acceptance.alpha("r") == pytest.approx(0.5)  # the draft model's estimate never moved
    failing = untimed(8)
    planned = _lookup_rounds(failing, 0.0, 120, model=False)
    # nothing taken: a plain round beats even one looked-up token (but for a retry now and then, as the pooled
    # lookup acceptance ages under 10 trials and gives way to the prior)
    assert planned[0] > 1 and planned[40:].count(0) >= 72
    middling = _lookup_rounds(untimed(8), 0.5, 200)
    assert 2 <= sorted(middling[100:])[50] <= 5  # at 0.04 per token E(0.5, n) / cost peaks at 3-4: not all 8


def test_lookup_offer_limits_and_no_offer_keeps_the_models_plan() -> None:
    controller = untimed(4)
    state = batch(_offer("a", 3), _offer("b", 0), offers_lookups=True)
    plan = controller.plan(state)
    model_plan = controller.plan(batch("b"))
    assert drafts(plan) == [3, model_plan.rows[0].drafts] and lookups(plan, state) == {"a": 3}
    assert plan.rows[1].source is DraftSource.MODEL  # b, offered nothing, drafts with its model
    assert lookups(model_plan, batch("b")) == {} and model_plan.rows[0].source is DraftSource.EITHER  # nothing offered
    for _ in range(10):  # a's lookups all taken
        state = batch(_offer("a", 4), offers_lookups=True)
        plan = controller.plan(state)
        learn(controller, plan, state, RowOutcome("a", plan.rows[0].drafts, plan.rows[0].drafts))
    state = batch(_offer("a", 9), offers_lookups=True)
    plan = controller.plan(state)
    assert drafts(plan) == [4] and lookups(plan, state) == {"a": 4}  # never past max_gamma
    assert drafts(controller.plan(batch(_offer("a", 2), offers_lookups=True))) == [2]  # nor past what is offered
    assert drafts(controller.plan(batch(_offer("a", 3, remaining=2), offers_lookups=True))) == [1]  # nor the budget


def test_lookups_run_while_the_model_is_in_fallback() -> None:
    controller = untimed(4)
    for _ in range(40):  # the draft model's drafts all rejected
        state = batch("r")
        plan = controller.plan(state)
        learn(controller, plan, state, RowOutcome("r", plan.rows[0].drafts, 0))
    assert controller.in_fallback("r")
    assert _lookup_round(controller, 3) == 3
    assert controller.in_fallback("r")  # a lookup accepted says nothing about the model
    assert _lookup_round(controller, 0) == 0


def test_a_request_takes_whichever_of_lookup_and_model_predicts_more() -> None:
    controller = untimed(4)
    for i in range(30):  # the model's drafts mostly taken, the lookups mostly not
        state = batch("r")
        plan = controller.plan(state)
        learn(controller, plan, state, RowOutcome("r", plan.rows[0].drafts, plan.rows[0].drafts))
        _lookup_round(controller, 4, taken=int(i % 3 == 0), model=False)
    assert controller.acceptance.alpha("r") > 0.7 and 0.1 < controller.acceptance.lookup_alpha("r") < 0.4
    model_plan = controller.plan(batch("r")).rows[0].drafts
    state = batch(_offer("r", 4), offers_lookups=True)
    plan = controller.plan(state)
    assert drafts(plan) == [model_plan] and lookups(plan, state) == {} and plan.rows[0].source is DraftSource.MODEL
    lookup_only = batch(_offer("r", 4, model=False), offers_lookups=True)  # no model to draft with
    plan = controller.plan(lookup_only)
    assert plan.rows[0].drafts > 0 and lookups(plan, lookup_only) == {"r": plan.rows[0].drafts}


def test_without_a_model_a_row_with_no_offer_decodes_plain() -> None:
    controller = untimed(4)
    assert drafts(controller.plan(batch(_offer("r", 0, model=False), offers_lookups=True))) == [0]
    hybrid = controller.plan(batch(_offer("r", 0, model=True), offers_lookups=True))
    assert (
        hybrid.rows[0].drafts > 0 and hybrid.rows[0].source is DraftSource.MODEL
    )  # a hybrid row drafts with its model


def test_lookup_rounds_are_timed_apart_from_model_rounds(monkeypatch) -> None:
    monkeypatch.setattr(cost_model, "CALIBRATE_EVERY", 1000)
    controller = GammaController(4)
    for _ in range(cost_model.SETTLE):  # plain rounds: both cost tables' unit
        state = batch("r")
        learn(controller, controller.plan(state), state, seconds=(0.0, 0.010, 0.0))
    for _ in range(4):  # model rounds of two drafts: 1.6 plain rounds
        state = batch("r")
        plan = controller.plan(state)
        assert not plan.catching_up
        learn(controller, plan, state, RowOutcome("r", 2, 2), seconds=(0.004, 0.012, 0.0))
    for _ in range(4):  # lookup rounds of two tokens: 1.05 plain rounds
        state = batch(_offer("r", 2), offers_lookups=True)
        plan = controller.plan(state)
        assert lookups(plan, state) == {"r": 2}
        learn(controller, plan, state, RowOutcome("r", 2, 2), seconds=(0.0, 0.0105, 0.0))
    assert controller.costs.round_cost(1, 2) == pytest.approx(1.6, rel=0.02)
    assert controller.costs.lookup_cost(1, 2) == pytest.approx(1.05, rel=0.02)
    assert controller.costs.lookup_cost(1, 3) == pytest.approx(1.0 + 3 * cost_model.LOOKUP_COST)  # not timed yet
    # a round where a row drafted with its model beside a lookup prices neither
    state = batch(_offer("r", 2), _offer("s", 0), offers_lookups=True)
    plan = controller.plan(state)
    assert lookups(plan, state) == {"r": 2} and plan.rows[1].drafts > 0
    learn(
        controller,
        plan,
        state,
        RowOutcome("r", 2, 2),
        RowOutcome("s", plan.rows[1].drafts, 0),
        seconds=(0.004, 0.02, 0.0),
    )
    assert 2 not in controller.costs.lookups and 2 not in controller.costs.drafting


def test_lookup_lengths_match_what_propose_takes() -> None:
    hybrid = HybridDrafter.__new__(HybridDrafter)  # no model needed to look up
    hybrid.lookup, hybrid.min_match, hybrid.offer_match = NgramDrafter(min_n=2, max_n=3), 2, 2
    hybrid.lookup.add_rows([0, 1, 2], [[1, 2, 3, 4, 1, 2], [5, 6, 7], [1, 2, 3, 1, 2]])
    assert hybrid.lookup_lengths([0, 1, 2], [3, 3, 0]) == [3, 0, 0]
    ngram = NgramDrafter(min_n=2, max_n=3)
    ngram.add_rows([0, 1, 2], [[1, 2, 3, 4, 1, 2], [5, 6, 5, 6, 7, 5, 6], [5, 6, 5]])
    lengths = ngram.lookup_lengths([0, 1, 2], [2, 4, 4])
    assert lengths == [2, 3, 0]
    proposal = ngram.propose(
        draft_request(
            (0, 1, 2), tuple(lengths), tuple(lengths), (SamplingParams(),) * 3, (torch.Generator(),) * 3, width=4
        )
    )
    assert proposal.num_drafted.tolist() == lengths and proposal.tokens[1, :3].tolist() == [7, 5, 6]
    routed = RoutedDrafter(ngram)
    assert routed.abilities.looks_up and not ModelDrafter.abilities.looks_up
    assert routed.lookup_lengths([1, 0], [4, 2]) == [3, 2]


def test_hybrid_offers_gamma_auto_shorter_matches_than_it_takes_alone(tiny_draft) -> None:
    hybrid = HybridDrafter(ModelDrafter(tiny_draft))  # takes matches of 3 alone, offers 2 to gamma auto
    assert (hybrid.min_match, hybrid.offer_match) == (3, 2)
    history = [5, 6, 9, 1, 2, 3, 5, 6]  # its suffix [5, 6] occurred before (then 9, 1, 2); no 3-token match
    hybrid.allocate(2, 64)
    hybrid.add_rows([0], [history])
    assert hybrid.lookup_lengths([0], [3]) == [3]
    params, generators = (SamplingParams(),), (torch.Generator().manual_seed(0),)

    def proposal(n: int, source: tuple[DraftSource, ...]):
        return hybrid.propose(draft_request((0,), (n,), (n,), params, generators, source=source))

    chosen = proposal(3, (DraftSource.LOOKUP,))  # gamma auto took the offer
    assert chosen.probs is None and chosen.tokens[0].tolist() == [9, 1, 2]
    assert proposal(3, (DraftSource.EITHER,)).probs is not None  # fixed gamma: the model drafts
    hybrid.commit([0], [[9]])  # the suffix [5, 6, 9] now matches 3 tokens: taken alone too
    assert proposal(2, (DraftSource.EITHER,)).probs is None
    assert proposal(2, (DraftSource.MODEL,)).probs is not None  # sent to the model, it drafts with the model
    with pytest.raises(ValueError, match="offer_match"):
        HybridDrafter(ModelDrafter(tiny_draft), min_match=2, offer_match=3)


def test_engine_runs_lookups_and_model_drafts_and_reports_them(tiny_target, tiny_draft) -> None:
    prompt = [3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 3, 4, 5]  # repeats: the lookup has a continuation at once
    controller = GammaController(4)
    engine = Engine(
        tiny_target,
        HybridDrafter(ModelDrafter(tiny_draft), NgramDrafter(min_n=1), min_match=2),
        SpecConfig(),
        planner=controller,
    )
    engine.add_request(prompt, SamplingParams(temperature=0, max_new_tokens=40))
    stats = [r.stats for r in engine.stream()]
    lookups_run = sum(s.lookup_rows for s in stats)
    assert lookups_run > 0 and lookups_run == controller.lookup_rounds
    assert any(s.drafted > 0 and s.lookup_rows == 0 for s in stats)  # ...and rounds the model drafted
    assert controller.acceptance.lookup_pooled != [0.0, 0.0]  # lookups learnt as lookups


def test_engine_without_a_model_drafts_only_where_a_lookup_is_offered(tiny_target) -> None:
    engine = Engine(tiny_target, NgramDrafter(min_n=2), SpecConfig(), planner=GammaController(4))
    engine.add_request([1, 2, 3, 4, 5, 6], SamplingParams(temperature=0, max_new_tokens=20))
    stats = [r.stats for r in engine.stream()]
    # a round without a lookup was planned plain (the drafting path skipped), one with a lookup proposed it
    assert all(s.fallback_rows == int(s.lookup_rows == 0) for s in stats)
    assert any(s.lookup_rows == 0 for s in stats)


def test_engine_without_lookup_drafter_offers_none(tiny_target, tiny_draft) -> None:
    controller = GammaController(4)
    engine = Engine(tiny_target, ModelDrafter(tiny_draft), SpecConfig(), planner=controller)
    engine.add_request([1, 2, 1, 2, 1, 2], SamplingParams(temperature=0, max_new_tokens=12))
    assert sum(r.stats.lookup_rows for r in engine.stream()) == 0 and controller.lookup_rounds == 0


@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_hybrid_auto_equals_target_only(tiny_target, tiny_draft, seed: int) -> None:
    rng = random.Random(seed)
    prompt = [rng.randrange(1, 8) for _ in range(12)]
    params = SamplingParams(temperature=0, max_new_tokens=30)
    plain = Engine(tiny_target, None, SpecConfig(speculative=False))
    plain.add_request(prompt, params)
    expected = [t for r in plain.stream() for u in r.rows for t in u.new_tokens]
    engine = Engine(
        tiny_target,
        HybridDrafter(ModelDrafter(tiny_draft), NgramDrafter(min_n=1), min_match=1),
        SpecConfig(),
        planner=GammaController(6),
    )
    engine.add_request(prompt, params)
    assert [t for r in engine.stream() for u in r.rows for t in u.new_tokens] == expected
    assert engine.planner.lookup_rounds > 0


def test_the_summary_line_says_what_gamma_auto_did() -> None:
    from specsample.cli import summary_line

    stats = {
        "new_tokens": 10,
        "tokens_per_second": 50.0,
        "ttft_seconds": 0.1,
        "tpot_seconds": 0.02,
        "acceptance_rate": 0.5,
        "accepted_per_round": 1.0,
        "tokens_per_round": 2.0,
        "gamma": "auto (mean 2.0)",
        "draft": "hybrid",
        "step": "fused-amx",
    }
    assert "lookup rounds" not in summary_line(stats)
    assert summary_line(stats).endswith("| step fused-amx]")
    line = summary_line({**stats, "lookup_row_rounds": 4, "fallback_row_rounds": 2})
    assert "4 lookup rounds, 2 without drafting" in line
