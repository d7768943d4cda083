"""Prompt lookup under gamma auto: lookup rows are sized by their own acceptance and cost, run even where
the draft model is in fallback, and never feed the draft model's estimates."""

from __future__ import annotations

import random

import pytest
import torch

from specsample import Engine, ModelDrafter, SamplingParams, SpecConfig
from specsample.controller import ControllerConfig, GammaController
from specsample.drafters.base import PromptLookup
from specsample.drafters.hybrid import HybridDrafter
from specsample.drafters.ngram import NgramDrafter, NgramIndex
from specsample.drafters.routed import RoutedDrafter
from ngram_reference import reference_continuation


def _lookup_rounds(controller: GammaController, accept: float, rounds: int, available: int = 8,
                   rng: random.Random | None = None, model: bool = True) -> list[int]:
    """Plan `rounds` rounds where a lookup of `available` tokens is on offer, each token accepted with
    probability `accept` (a rejection ends the round); return the lookup lengths planned. `model`: whether the
    drafter could draft with a model instead (if so, its probes in fallback are among the lengths)."""
    rng = rng or random.Random(0)
    planned = []
    for _ in range(rounds):
        n = controller.plan(["r"], 1, lookup=[available], otherwise=[model])[0]
        planned.append(n)
        accepted = 0
        while accepted < n and rng.random() < accept:
            accepted += 1
        controller.observe("r", n, accepted)
    return planned


def test_lookup_length_follows_the_lookups_own_acceptance() -> None:
    copying = GammaController(ControllerConfig(max_gamma=8))
    assert _lookup_rounds(copying, 1.0, 40)[-1] == 8  # every token taken: the whole lookup
    assert copying.lookup_alpha("r") > 0.9
    assert copying.alpha("r") == pytest.approx(0.5)  # the draft model's estimate never moved
    failing = GammaController(ControllerConfig(max_gamma=8))
    planned = _lookup_rounds(failing, 0.0, 120, model=False)
    # nothing taken: a plain round beats even one looked-up token (but for a retry now and then, as the pooled
    # lookup acceptance ages under 10 trials and gives way to the prior)
    assert planned[0] > 1 and planned[40:].count(0) >= 72
    middling = _lookup_rounds(GammaController(ControllerConfig(max_gamma=8)), 0.5, 200)
    assert 2 <= sorted(middling[100:])[50] <= 5  # at 0.04 per token E(0.5, n) / cost peaks at 3-4: not all 8


def test_lookup_offer_limits_and_no_offer_keeps_the_models_plan() -> None:
    controller = GammaController(ControllerConfig(max_gamma=4))
    assert controller.plan(["a", "b"], 2, lookup=[3, 0]) == [3, controller.plan(["b"], 1)[0]]
    assert controller.lookups_planned() == {}  # the last plan offered none
    for _ in range(10):  # a's lookups all taken
        planned = controller.plan(["a"], 1, lookup=[4])[0]
        controller.observe("a", planned, planned)
    assert controller.plan(["a"], 1, lookup=[9]) == [4]  # never past max_gamma
    assert controller.lookups_planned() == {"a": 4}
    assert controller.plan(["a"], 1, lookup=[2]) == [2]  # nor past what the lookup offers


def test_lookups_run_while_the_model_is_in_fallback() -> None:
    controller = GammaController(ControllerConfig(max_gamma=4))
    for _ in range(40):  # the draft model's drafts all rejected
        controller.observe("r", controller.plan(["r"], 1)[0], 0)
    assert controller.in_fallback("r")
    assert controller.plan(["r"], 1, lookup=[3])[0] == 3
    controller.observe("r", 3, 3)
    assert controller.in_fallback("r")  # a lookup accepted says nothing about the model
    assert controller.plan(["r"], 1, lookup=[0])[0] == 0


def test_a_request_takes_whichever_of_lookup_and_model_predicts_more() -> None:
    controller = GammaController(ControllerConfig(max_gamma=4))
    for i in range(30):  # the model's drafts mostly taken, the lookups mostly not
        planned = controller.plan(["r"], 1)[0]
        controller.observe("r", planned, planned)
        controller.observe("r", controller.plan(["r"], 1, lookup=[4], otherwise=[False])[0], int(i % 3 == 0))
    assert controller.alpha("r") > 0.7 and 0.1 < controller.lookup_alpha("r") < 0.4
    model_plan = controller.plan(["r"], 1)[0]
    assert controller.plan(["r"], 1, lookup=[4]) == [model_plan] and controller.lookups_planned() == {}
    lookup_only = controller.plan(["r"], 1, lookup=[4], otherwise=[False])  # no model to draft with
    assert lookup_only[0] > 0 and controller.lookups_planned() == {"r": lookup_only[0]}


def test_lookup_rounds_are_timed_apart_from_model_rounds() -> None:
    controller = GammaController(ControllerConfig(max_gamma=4, calibrate_every=1000))
    for _ in range(controller.config.settle_timings):  # plain rounds: both cost tables' unit
        controller.plan(["r"], 1)
        controller.observe_timing(1, 0, 0.0, 0.010)
    for _ in range(4):
        controller.plan(["r"], 1)
        controller.observe_timing(1, 2, 0.004, 0.012)  # model rounds of two drafts: 1.6 plain rounds
    for _ in range(4):
        controller.plan(["r"], 1, lookup=[2])
        controller.observe_timing(1, 2, 0.0, 0.0105)  # lookup rounds of two tokens: 1.05 plain rounds
    assert controller.round_cost(1, 2) == pytest.approx(1.6, rel=0.02)
    assert controller.lookup_cost(1, 2) == pytest.approx(1.05, rel=0.02)
    assert controller.lookup_cost(1, 3) == pytest.approx(1.0 + 3 * controller.config.lookup_cost)  # not timed yet


def test_lookup_lengths_match_what_propose_takes() -> None:
    hybrid = HybridDrafter.__new__(HybridDrafter)  # no model needed to look up
    hybrid.ngram, hybrid.min_match, hybrid.offer_match = NgramDrafter(min_n=2, max_n=3), 2, 2
    hybrid.ngram.add_rows([0, 1, 2], [[1, 2, 3, 4, 1, 2], [5, 6, 7], [1, 2, 3, 1, 2]])
    assert hybrid.lookup_lengths([0, 1, 2], [3, 3, 0]) == [3, 0, 0]
    ngram = NgramDrafter(min_n=2, max_n=3)
    ngram.add_rows([0, 1, 2], [[1, 2, 3, 4, 1, 2], [5, 6, 5, 6, 7, 5, 6], [5, 6, 5]])
    lengths = ngram.lookup_lengths([0, 1, 2], [2, 4, 4])
    assert lengths == [2, 3, 0]
    proposal = ngram.propose([0, 1, 2], 4, lengths, [SamplingParams()] * 3, [torch.Generator()] * 3)
    assert proposal.num_drafted.tolist() == lengths and proposal.tokens[1, :3].tolist() == [7, 5, 6]
    routed = RoutedDrafter(ngram)
    assert isinstance(routed, PromptLookup) and not isinstance(ModelDrafter.__new__(ModelDrafter), PromptLookup)
    assert routed.lookup_lengths([1, 0], [4, 2]) == [3, 2]


def test_hybrid_offers_the_controller_shorter_matches_than_it_takes_alone(tiny_draft) -> None:
    hybrid = HybridDrafter(ModelDrafter(tiny_draft))  # takes matches of 3 alone, offers 2 to gamma auto
    assert (hybrid.min_match, hybrid.offer_match) == (3, 2)
    history = [5, 6, 9, 1, 2, 3, 5, 6]  # its suffix [5, 6] occurred before (then 9, 1, 2); no 3-token match
    hybrid.allocate(2, 64)
    hybrid.add_rows([0], [history])
    assert hybrid.lookup_lengths([0], [3]) == [3]
    params, generators = [SamplingParams()], [torch.Generator().manual_seed(0)]
    chosen = hybrid.propose_chosen([0], 3, [3], params, generators, (), [True])  # the controller took the offer
    assert chosen.probs is None and chosen.tokens[0].tolist() == [9, 1, 2]
    alone = hybrid.propose_chosen([0], 3, [3], params, generators, (), [None])  # fixed gamma: the model drafts
    assert alone.probs is not None
    hybrid.commit([0], [[9]])  # the suffix [5, 6, 9] now matches 3 tokens: taken alone too
    assert hybrid.propose_chosen([0], 2, [2], params, generators, (), [None]).probs is None
    with pytest.raises(ValueError, match="offer_match"):
        HybridDrafter(ModelDrafter(tiny_draft), min_match=2, offer_match=3)


def test_engine_runs_lookups_and_model_drafts_and_reports_them(tiny_target, tiny_draft) -> None:
    prompt = [3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 3, 4, 5]  # repeats: the lookup has a continuation at once
    controller = GammaController(ControllerConfig(max_gamma=4))
    engine = Engine(tiny_target, HybridDrafter(ModelDrafter(tiny_draft), NgramDrafter(min_n=1), min_match=2),
                    SpecConfig(gamma=4, adaptive=True), controller=controller)
    engine.add_request(prompt, SamplingParams(temperature=0, max_new_tokens=40))
    stats = [r.stats for r in engine.stream()]
    lookups = sum(s.lookup_rows for s in stats)
    assert lookups > 0 and lookups == controller.lookup_rounds
    assert any(s.drafted > 0 and s.lookup_rows == 0 for s in stats)  # ...and rounds the model drafted
    assert controller._lookup_pooled != [0.0, 0.0]  # lookups observed as lookups


def test_without_a_model_a_row_with_no_offer_decodes_plain(tiny_target) -> None:
    controller = GammaController(ControllerConfig(max_gamma=4))
    assert controller.plan(["r"], 1, lookup=[0], otherwise=[False]) == [0]
    assert controller.plan(["r"], 1, lookup=[0], otherwise=[True])[0] > 0  # a hybrid row drafts with its model
    engine = Engine(tiny_target, NgramDrafter(min_n=2), SpecConfig(gamma=4, adaptive=True), controller=controller)
    engine.add_request([1, 2, 3, 4, 5, 6], SamplingParams(temperature=0, max_new_tokens=20))
    stats = [r.stats for r in engine.stream()]
    # a round without a lookup was planned plain (the drafting path skipped), one with a lookup proposed it
    assert all(s.fallback_rows == int(s.lookup_rows == 0) for s in stats)
    assert any(s.lookup_rows == 0 for s in stats)


def test_engine_without_lookup_drafter_offers_none(tiny_target, tiny_draft) -> None:
    controller = GammaController(ControllerConfig(max_gamma=4))
    engine = Engine(tiny_target, ModelDrafter(tiny_draft), SpecConfig(gamma=4, adaptive=True), controller=controller)
    engine.add_request([1, 2, 1, 2, 1, 2], SamplingParams(temperature=0, max_new_tokens=12))
    assert sum(r.stats.lookup_rows for r in engine.stream()) == 0 and controller.lookup_rounds == 0


def test_lookup_cost_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="lookup_cost"):
        ControllerConfig(lookup_cost=-0.1)


@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_hybrid_auto_equals_target_only(tiny_target, tiny_draft, seed: int) -> None:
    rng = random.Random(seed)
    prompt = [rng.randrange(1, 8) for _ in range(12)]
    params = SamplingParams(temperature=0, max_new_tokens=30)
    plain = Engine(tiny_target, None, SpecConfig(speculative=False))
    plain.add_request(prompt, params)
    expected = [t for r in plain.stream() for u in r.rows for t in u.new_tokens]
    engine = Engine(tiny_target, HybridDrafter(ModelDrafter(tiny_draft), NgramDrafter(min_n=1), min_match=1),
                    SpecConfig(gamma=6, adaptive=True))
    engine.add_request(prompt, params)
    assert [t for r in engine.stream() for u in r.rows for t in u.new_tokens] == expected
    assert engine.controller.lookup_rounds > 0
    torch.manual_seed(0)


def test_ngram_index_matches_its_definition() -> None:
    rng = random.Random(7)
    for _ in range(3000):
        history = [rng.randrange(rng.randrange(1, 5)) for _ in range(rng.randrange(0, 25))]
        min_n = rng.randrange(1, 4)
        max_n, max_tokens = rng.randrange(min_n, 6), rng.randrange(0, 6)
        assert (NgramIndex(history, min_n, max_n).find(max_tokens)
                == reference_continuation(history, max_tokens, min_n, max_n)), (history, max_tokens, min_n, max_n)


def test_a_rows_lookup_follows_its_commits() -> None:
    ngram = NgramDrafter(min_n=1, max_n=2)
    ngram.add_rows([0], [[1, 2, 3, 1]])
    assert ngram.continuation(0, 3) == ([2, 3, 1], 1)
    assert ngram.continuation(0, 1) == ([2], 1)  # the same lookup, fewer tokens
    ngram.commit([0], [[2]])
    assert ngram.continuation(0, 3) == ([3, 1, 2], 2)
    ngram.add_rows([0], [[5, 6, 7, 8, 9]])  # a new row in the slot, history as long as the last one
    assert ngram.continuation(0, 3) == ([], 0)


def test_the_summary_line_says_what_gamma_auto_did() -> None:
    from specsample.cli import summary_line

    stats = {"new_tokens": 10, "tokens_per_second": 50.0, "ttft_seconds": 0.1, "tpot_seconds": 0.02,
             "acceptance_rate": 0.5, "accepted_per_round": 1.0, "tokens_per_round": 2.0, "gamma": "auto (mean 2.0)",
             "draft": "hybrid"}
    assert "lookup rounds" not in summary_line(stats)
    line = summary_line({**stats, "lookup_row_rounds": 4, "fallback_row_rounds": 2})
    assert "4 lookup rounds, 2 without drafting" in line


def test_the_goal_report_shows_the_default_system_per_category() -> None:
    from specsample.bench.goals import DEFAULT, goal_tables

    table = {"target-only": {"qa": 50.0, "overall": 50.0}, "gamma=1": {"qa": 60.0, "overall": 60.0},
             "gamma=auto": {"qa": 55.0, "overall": 55.0}, DEFAULT: {"qa": 57.0, "overall": 48.0}}
    lines = goal_tables(table)
    start = next(i for i, line in enumerate(lines) if line.startswith(f"`{DEFAULT}`"))
    assert lines[start + 4] == "| qa | 0.950 | 1.140 | no | yes |"
    assert lines[start + 5] == "| overall | 0.800 | 0.960 | no | no |"
    assert not any(line.startswith(f"`{DEFAULT}`") for line in goal_tables({k: table[k] for k in list(table)[:3]}))
