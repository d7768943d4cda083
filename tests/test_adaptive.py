"""n-gram lookup, the gamma controller on simulated acceptance streams, and graceful draft failures."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

import pytest
import torch

from specsample import Engine, ModelDrafter, SamplingParams, SpecConfig, generate
from specsample.controller import ControllerConfig, GammaController
from specsample.drafters.hybrid import HybridDrafter
from specsample.drafters.ngram import NgramDrafter, NgramIndex
from specsample.theory import expected_speedup, optimal_gamma
from ngram_reference import reference_continuation


def _indexed(history: list[int], max_tokens: int, min_n: int = 1, max_n: int = 4) -> tuple[list[int], int]:
    return NgramIndex(history, min_n, max_n).find(max_tokens)


FINDERS = pytest.mark.parametrize("find", [reference_continuation, _indexed], ids=["definition", "index"])


@FINDERS
def test_longest_match_wins(find) -> None:
    # suffix [7, 8, 9] occurs once (-> 1); suffix [8, 9] also occurs later (-> 5): the longer match wins
    history = [7, 8, 9, 1, 2, 3, 8, 9, 5, 6, 0, 7, 8, 9]
    assert find(history, 3, min_n=1, max_n=3) == ([1, 2, 3], 3)


@FINDERS
def test_most_recent_occurrence_wins_ties(find) -> None:
    history = [4, 5, 1, 1, 4, 5, 2, 2, 4, 5]
    assert find(history, 2, min_n=1, max_n=2) == ([2, 2], 2)


@FINDERS
def test_no_match_no_draft_and_limits(find) -> None:
    assert find([1, 2, 3, 4], 5, min_n=1, max_n=3) == ([], 0)
    assert find([1, 2, 3, 1, 2], 5, min_n=3, max_n=4) == ([], 0)  # only a 2-gram repeats
    assert find([1, 2, 3, 1, 2], 5, min_n=2, max_n=4) == ([3, 1, 2], 2)  # runs to the end
    assert find([1, 2, 3, 1, 2], 1, min_n=1, max_n=4) == ([3], 2)
    assert find([5], 3) == ([], 0)
    assert find([2, 2, 2, 2], 3, min_n=1, max_n=4) == ([2], 3)  # a match may overlap the suffix it matches
    with pytest.raises(ValueError, match="min_n"):
        NgramDrafter(min_n=3, max_n=2)


@pytest.mark.parametrize("min_n, max_n", [(1, 1), (1, 4), (2, 4), (3, 4), (3, 3)])
def test_ngram_index_answers_as_the_definition_while_tokens_arrive(min_n: int, max_n: int) -> None:
    # a small vocabulary repeats n-grams of every length; tokens arrive 0-3 at a time, as committed per round
    rng = random.Random(min_n * 10 + max_n)
    history = [rng.randrange(4) for _ in range(rng.randrange(1, 6))]
    index = NgramIndex(history, min_n, max_n)
    for _ in range(300):
        new = [rng.randrange(4) for _ in range(rng.randrange(4))]
        history += new
        index.extend(new)
        max_tokens = rng.randrange(1, 9)
        assert index.find(max_tokens) == reference_continuation(history, max_tokens, min_n, max_n)
        assert index.tokens == history


def test_ngram_drafter_rows_and_commit() -> None:
    drafter = NgramDrafter(min_n=1, max_n=3)
    drafter.add_rows([0, 3], [[1, 2, 3, 1, 2], [9, 8, 7]])
    gens = [torch.Generator(), torch.Generator()]
    proposal = drafter.propose([0, 3], 4, [4, 4], [SamplingParams()] * 2, gens)
    assert proposal.probs is None and proposal.num_drafted.tolist() == [3, 0]
    assert proposal.tokens[0, :3].tolist() == [3, 1, 2]
    drafter.commit([0, 3], [[3, 1], [9]])
    assert drafter.rows[3].tokens == [9, 8, 7, 9]
    assert drafter.propose([3], 4, [2], [SamplingParams()], gens[:1]).tokens[0].tolist() == [8, 7, 0, 0]


def _simulate(controller: GammaController, alpha: float, rounds: int, rid: str = "r",
              rng: random.Random | None = None) -> list[int]:
    """Feed a request rounds of i.i.d. Bernoulli(alpha) acceptance; return the gammas it was given."""
    rng = rng or random.Random(0)
    chosen = []
    for _ in range(rounds):
        gamma = controller.plan([rid], 1)[0]
        chosen.append(gamma)
        accepted = 0
        while accepted < gamma and rng.random() < alpha:
            accepted += 1
        controller.observe(rid, gamma, accepted)
    return chosen


@pytest.mark.parametrize("alpha, cost", [(0.9, 0.05), (0.7, 0.05), (0.5, 0.2), (0.8, 0.02)])
def test_controller_converges_to_the_formula(alpha: float, cost: float) -> None:
    controller = GammaController(ControllerConfig(max_gamma=12, prior_cost_ratio=cost))
    chosen = _simulate(controller, alpha, 400)
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


def test_controller_falls_back_and_recovers() -> None:
    controller = GammaController(ControllerConfig(max_gamma=8, prior_cost_ratio=0.2, probe_every=8))
    rng = random.Random(1)
    _simulate(controller, 0.9, 50, rng=rng)
    assert not controller.in_fallback("r")
    low = _simulate(controller, 0.05, 160, rng=rng)  # alpha must look low even a standard error up
    assert controller.in_fallback("r")
    assert low[-40:].count(0) >= 30  # mostly plain decoding, with periodic probes
    assert any(g > 0 for g in low[-40:])  # ...which keep measuring alpha
    _simulate(controller, 0.95, 120, rng=rng)
    assert not controller.in_fallback("r")
    assert [to for _, to in controller.switches] == ["off", "on"]


def test_probes_thin_out_when_they_cost_more() -> None:
    """In fallback a probe's expected loss is capped at probe_budget of decode time: a dear verification
    (e.g. a compiled plain step, c ~ 0.7) probes rarely, a near-break-even one as often as probe_every."""
    controller = GammaController(ControllerConfig())
    assert 55 <= controller.probe_interval(0.1, 1, 1.7) <= 65  # 1.1 tokens for 1.7 rounds' time
    assert controller.probe_interval(0.3, 1, 1.25) == 4  # no predicted loss: the floor
    assert controller.probe_interval(0.3, 1, 1.35) == 6  # 0.05 of a round lost per probe
    assert controller.probe_interval(0.0, 1, 51.0) == 256  # the ceiling: recovery is still noticed
    # the pool kept (not aged per round): aged below 10 trials in this one 600-round request, it resets the
    # request's prior to 0.5 and adds probes of its own (13 instead of 10 for the dear one)
    dear = GammaController(ControllerConfig(prior_cost_ratio=0.7, pool_round_decay=1.0))
    cheap = GammaController(ControllerConfig(prior_cost_ratio=0.2, pool_round_decay=1.0))
    probes = [sum(g > 0 for g in _simulate(ctl, 0.05, 600, rng=random.Random(2))[100:]) for ctl in (dear, cheap)]
    assert probes[0] <= 12 < 25 <= probes[1]  # ~500/60 rounds against ~500/16
    with pytest.raises(ValueError, match="probe_every"):
        ControllerConfig(probe_every=300)


def _probe_gaps(controller: GammaController, accept: Callable[[int], bool], rounds: int) -> list[int]:
    """Rounds between the probes of a request in fallback; `accept(i)`: whether probe i has its draft accepted."""
    gaps, since = [], 0
    for _ in range(rounds):
        gamma = controller.plan(["r"], 1)[0]
        since += 1
        if gamma:
            controller.observe("r", gamma, int(accept(len(gaps))) * min(gamma, 1))
            gaps.append(since)
            since = 0
    return gaps


def test_probes_that_keep_failing_back_off() -> None:
    """With probe_backoff 2 each probe in a row with nothing accepted doubles the next interval (up to
    max_probe_every); an accepted draft resets it. (Off by default: see ControllerConfig.)"""
    def fallen_back(config: ControllerConfig) -> GammaController:
        controller = GammaController(config)
        while not controller.in_fallback("r"):
            controller.observe("r", controller.plan(["r"], 1)[0], 0)
        return controller

    config = ControllerConfig(prior_cost_ratio=0.2, probe_budget=1.0, probe_backoff=2)  # the floor sets intervals
    gaps = _probe_gaps(fallen_back(config), lambda i: False, 1100)
    gaps[0] += 1  # the round that fell back counts towards the first
    assert gaps[:7] == [4, 8, 16, 32, 64, 128, 256] and set(gaps[7:]) == {256}
    flat = dataclasses.replace(config, probe_backoff=1)  # no backoff
    assert len(_probe_gaps(fallen_back(flat), lambda i: False, 1100)) > 3 * len(gaps)
    gaps = _probe_gaps(fallen_back(config), lambda i: i == 2, 200)  # the third probe's draft is accepted
    assert [gaps[0] + 1] + gaps[1:5] == [4, 8, 16, 4, 8]
    with pytest.raises(ValueError, match="probe_backoff"):
        ControllerConfig(probe_backoff=0.5)


def test_no_probes_with_too_few_tokens_left() -> None:
    """A probe pays only through the drafting it may bring back, which takes several probes to notice:
    with under probe_horizon tokens left in the budget a request in fallback stops probing."""
    def probes(config: ControllerConfig, remaining: int) -> int:
        controller = GammaController(config)
        _simulate(controller, 0.02, 100)
        assert controller.in_fallback("r")
        return sum(controller.plan(["r"], 1, [remaining])[0] > 0 for _ in range(200))

    config = ControllerConfig(prior_cost_ratio=0.2)
    assert probes(config, 32) >= 5 and probes(config, 31) == 0
    assert probes(dataclasses.replace(config, probe_horizon=0), 31) >= 5  # the broken variant probes on
    with pytest.raises(ValueError, match="probe_horizon"):
        ControllerConfig(probe_horizon=-1)


def test_the_engine_tells_the_controller_each_rows_budget_left(tiny_target, tiny_draft, monkeypatch) -> None:
    """Beside a fixed-gamma row and a plain one with other budgets, the adaptive rows' budgets left
    reach the controller, each beside its own request id."""
    controller = GammaController()
    seen: list[dict[str, int]] = []
    plan = controller.plan

    def spy(request_ids: list[str], batch_size: int, remaining: list[int] | None = None,
            scorable: list[int] | None = None, lookup: list[int] | None = None,
            otherwise: list[bool] | None = None) -> list[int]:
        seen.append(dict(zip(request_ids, remaining or [])))
        return plan(request_ids, batch_size, remaining, scorable, lookup, otherwise)

    monkeypatch.setattr(controller, "plan", spy)
    config = SpecConfig(gamma=4, adaptive=True, max_batch_size=4)
    engine = Engine(tiny_target, ModelDrafter(tiny_draft), config, controller=controller)
    budgets = {"auto-a": 12, "fixed": 20, "plain": 7, "auto-b": 9}
    for rid, budget in budgets.items():
        engine.add_request([1, 2, 3], SamplingParams(temperature=0, max_new_tokens=budget), request_id=rid,
                           speculative=rid != "plain", gamma=2 if rid == "fixed" else None)
    left, expected = dict(budgets), []
    for result in engine.stream():
        running = {rid: n for rid, n in left.items() if rid.startswith("auto") and n > 0}
        if running:
            expected.append(running)
        for update in result.rows:
            left[update.request_id] -= len(update.new_tokens)
    assert seen == expected and not any(left.values())


def test_the_engine_tells_the_controller_each_positions_acceptance_probability(tiny_target, tiny_draft,
                                                                                monkeypatch) -> None:
    """Sampled rows report, per position their round reached, the probability its draft was accepted with;
    greedy rows (whose accept-or-not is already certain) report none, nor does a controller told not to want them."""
    for wanted in (True, False):
        controller = GammaController(ControllerConfig(expected_acceptance=wanted))
        seen: list[tuple[str, int, int, list[float] | None]] = []
        observe = controller.observe

        def spy(request_id: str, num_drafted: int, num_accepted: int, confidences: list[float] | None = None,
                expected: list[float] | None = None) -> None:
            seen.append((request_id, num_drafted, num_accepted, expected))
            observe(request_id, num_drafted, num_accepted, confidences, expected)

        monkeypatch.setattr(controller, "observe", spy)
        engine = Engine(tiny_target, ModelDrafter(tiny_draft), SpecConfig(gamma=4, adaptive=True, max_batch_size=2),
                        controller=controller)
        engine.add_request([1, 2, 3], SamplingParams(temperature=1.0, max_new_tokens=40, seed=1), request_id="sampled")
        engine.add_request([4, 5, 6], SamplingParams(temperature=0, max_new_tokens=40), request_id="greedy")
        for _ in engine.stream():
            pass
        sampled = [e for rid, _, _, e in seen if rid == "sampled"]
        assert sampled and all(e is None for rid, _, _, e in seen if rid == "greedy")
        if not wanted:
            assert all(e is None for e in sampled)
            continue
        for rid, drafted, accepted, expected in seen:
            if rid == "sampled":
                assert len(expected) == min(accepted + 1, drafted) and all(0.0 <= b <= 1.0 for b in expected)
        assert 0.0 < sum(sum(e) for e in sampled) < sum(len(e) for e in sampled)  # probabilities, not coins


def test_cost_ratio_is_measured_per_batch_size() -> None:
    controller = GammaController()
    assert controller.cost_ratio(1) == controller.config.prior_cost_ratio
    for _ in range(30):
        controller.observe_timing(1, 4, draft_seconds=0.004, target_seconds=0.02)  # 1 ms / 20 ms
        controller.observe_timing(8, 4, draft_seconds=0.02, target_seconds=0.05)  # 5 ms / 50 ms
    assert controller.cost_ratio(1) == pytest.approx(0.05)
    assert controller.cost_ratio(8) == pytest.approx(0.1)
    assert controller.cost_ratio(6) == pytest.approx(0.1)  # nearest measured batch size


def test_cost_model_charges_whole_rounds_once_a_plain_round_is_timed() -> None:
    """Scoring gamma + 1 tokens and verifying them cost too: c is a drafted position's share of a round."""
    controller = GammaController(ControllerConfig(calibrate_every=50))
    assert controller.plan(["r"], 1) != [0]  # nothing timed yet: no calibration round
    controller.observe_timing(1, 4, draft_seconds=0.004, target_seconds=0.024, verify_seconds=0.004)
    assert controller.cost_ratio(1) == pytest.approx(1 / 24)  # draft step / target forward, until...
    assert controller.plan(["r"], 1) == [0]  # ...a plain round is planned to time plain decoding
    controller.observe_timing(1, 0, draft_seconds=0.0, target_seconds=0.018, verify_seconds=0.002)
    for _ in range(60):  # rounds of gamma 4 take 32 ms against a plain round's 20 ms, 4 of them drafting
        controller.observe_timing(1, 4, draft_seconds=0.004, target_seconds=0.024, verify_seconds=0.004)
    assert controller.cost_ratio(1) == pytest.approx(0.05, rel=0.01)  # a 1 ms draft step per 20 ms
    assert controller.overhead(1) == pytest.approx(0.4, rel=0.01)  # the other 8 ms, whatever gamma
    plain_rounds = []
    for i in range(120):
        if controller.plan(["r"], 1)[0] == 0:
            plain_rounds.append(i)
            controller.observe_timing(1, 0, draft_seconds=0.0, target_seconds=0.018, verify_seconds=0.002)
    # two more soon (settle_timings 3: one stalled timing must not price drafting), then every calibrate_every rounds
    steps = [b - a for a, b in zip(plain_rounds, plain_rounds[1:])]
    assert len(plain_rounds) == 4 and steps[0] == 4 and steps[1:] == [50, 50], plain_rounds


def _timed(controller: GammaController, alpha: float, rounds: int, rng: random.Random, plain: float = 0.020,
           overhead: float = 0.1, cost: float = 0.15, extra: dict[int, float] | None = None,
           stalls: dict[int, float] | None = None, drafting_stalls: tuple[float, float] = (0.0, 0.0)) -> list[int]:
    """Rounds of one request on a simulated engine: a plain round takes `plain` seconds, a drafting one
    plain * (1 + overhead + gamma cost + extra[gamma]), plus one more draft step when it follows a plain
    round (the model draft catches up on the tokens it missed); acceptance i.i.d. Bernoulli(alpha).
    `stalls`: round index -> how many times its usual time that round takes (every phase alike);
    `drafting_stalls`: (share, plain rounds) a drafting round takes that much longer, in its target phase."""
    chosen, previous = [], None
    for i in range(rounds):
        gamma = controller.plan(["r"], 1)[0]
        chosen.append(gamma)
        stall = (stalls or {}).get(i, 1.0)
        if gamma == 0:
            controller.observe_timing(1, 0, 0.0, 0.9 * plain * stall, 0.1 * plain * stall)
        else:
            steps = gamma + (previous == 0)
            target = (0.9 + overhead + (extra or {}).get(gamma, 0.0)) * plain
            if drafting_stalls[0] and rng.random() < drafting_stalls[0]:
                target += drafting_stalls[1] * plain
            controller.observe_timing(1, gamma, steps * cost * plain * stall, target * stall, 0.1 * plain * stall)
            accepted = 0
            while accepted < gamma and rng.random() < alpha:
                accepted += 1
            controller.observe("r", gamma, accepted)
        previous = gamma
    return chosen


def test_rounds_affine_in_gamma_are_charged_a_fixed_overhead_and_a_per_draft_cost() -> None:
    """Rounds cost plain * (1 + k + gamma c): gamma is chosen on that, not on a per-draft c from whole
    rounds, which charges k to every draft (at gamma 1: c 0.25) and then prefers gamma 1 at alpha 0.5."""
    controller = GammaController(ControllerConfig(calibrate_every=20))
    chosen = _timed(controller, 0.5, 400, random.Random(4))
    assert controller.cost_ratio(1) == pytest.approx(0.15, rel=0.01)
    assert controller.overhead(1) == pytest.approx(0.1, rel=0.01)
    settled = [g for g in chosen[200:] if g > 0]
    assert optimal_gamma(0.5, 0.15, overhead=0.1) == 2 and optimal_gamma(0.5, 0.25) == 1
    assert max(set(settled), key=settled.count) == 2, settled[-20:]


def test_catch_up_after_plain_rounds_is_not_charged_to_drafting() -> None:
    """A probe in fallback (and the round after a calibration round) pays for the draft catching up;
    timed into c and k, that made drafting look twice as dear and kept requests in fallback."""
    controller = GammaController(ControllerConfig(calibrate_every=20))
    rng = random.Random(6)
    _timed(controller, 0.5, 100, rng)
    low = _timed(controller, 0.05, 300, rng)
    assert controller.in_fallback("r") and 0 < sum(g > 0 for g in low[-200:]) < 100
    assert controller.cost_ratio(1) == pytest.approx(0.15, rel=0.02)
    assert controller.overhead(1) == pytest.approx(0.1, rel=0.05)
    _timed(controller, 0.5, 200, rng)  # and alpha's recovery is noticed at the true costs
    assert not controller.in_fallback("r")
    # the mark covers one round: rounds the controller did not plan (only fixed-gamma rows) are timed
    controller.plan(["r"], 1)
    controller._catching_up = True
    controller.observe_timing(1, 2, 0.006, 0.020, 0.002)
    steps = controller._draft_step[1].value
    controller.observe_timing(1, 2, 0.1, 0.020, 0.002)
    assert controller._draft_step[1].value > steps


def test_a_stalled_first_plain_round_does_not_keep_a_dear_draft_drafting() -> None:
    """The GPU run of session 35: drafting rounds cost 1.7 plain rounds and acceptance is 0.3, so drafting
    loses; the first plain round timed was stalled 5x. Taken alone, that timing put drafting at a third of
    a plain round and, re-timed once in 64 rounds and averaged in, kept the request drafting for hundreds of
    rounds. The first settle_timings timings give their median and come every probe_every rounds."""
    def drafting_share(settle: int) -> float:
        controller = GammaController(ControllerConfig(settle_timings=settle))
        chosen = _timed(controller, 0.3, 300, random.Random(7), overhead=0.4, cost=0.3, stalls={1: 5.0})
        assert chosen[1] == 0  # the stalled round is the first plain round timed
        return sum(g > 0 for g in chosen[40:]) / len(chosen[40:])

    assert drafting_share(3) < 0.15  # fallback probes only
    assert drafting_share(1) > 0.8  # the first timing alone (before session 36): it kept drafting


def test_a_stalled_first_drafting_round_does_not_send_a_cheap_draft_into_fallback() -> None:
    """The other way round: drafting pays (rounds of 1.05 + 0.1 gamma plain rounds, acceptance 0.8) and the
    first drafting round was stalled 20x. Alone it priced drafting at 20 plain rounds: the request fell back
    at once, and a cost timed once is only re-timed by the rare probes it prices (or never, where the draft
    scores its backlog instead). No request falls back on costs timed fewer than settle_timings times."""
    def drafting_share(settle: int) -> float:
        controller = GammaController(ControllerConfig(settle_timings=settle))
        chosen = _timed(controller, 0.8, 300, random.Random(8), overhead=0.05, cost=0.1, stalls={0: 20.0})
        assert chosen[0] > 0
        return sum(g > 0 for g in chosen[20:]) / len(chosen[20:])

    assert drafting_share(3) > 0.9
    assert drafting_share(1) < 0.2  # the first timing alone (before session 36): fallback


def test_a_stalled_first_round_does_not_set_the_unit_round_costs_are_read_in() -> None:
    """The first round a batch size times sets the pace every round's relative cost is read against. Stalled 5x,
    it made rounds of one draft 1.67 plain rounds where they cost 1.3; from the first three timings' median
    (the first round counted once, not twice) the ratio is right."""
    from specsample.controller import _RoundCosts

    def ratio(settle: int) -> float | None:
        costs = _RoundCosts(settle=settle)
        costs.add(1, 0.130)
        for i in range(6):
            costs.add(1, 0.026)
            if i % 2 == 0:
                costs.add(0, 0.020)
        return costs.ratio(1, 2)

    assert ratio(3) == pytest.approx(1.3)
    assert ratio(1) > 1.5  # before session 36


def test_plain_rounds_that_rows_draft_through_are_not_re_planned_every_few_rounds() -> None:
    """Plain rounds come every probe_every rounds until settle_timings were timed, but a row with a fixed gamma
    drafts through every one of them (no plain round is timed): counted in attempts, the fast cadence ends."""
    controller = GammaController()
    controller.observe_timing(2, 4, 0.004, 0.020)
    controller.observe_timing(2, 0, 0.0, 0.020)  # one plain round timed at batch 2
    planned = 0
    for _ in range(200):
        planned += controller.plan(["r", "fixed"], 2) == [0, 0]
        controller.observe_timing(2, 4, 0.004, 0.020)  # the fixed row drafted: a drafting round was timed
    assert planned <= 3 + 200 // controller.config.calibrate_every + 1


def test_stall_costs_price_the_stalls_that_drafting_rounds_cause() -> None:
    """Session 36's GPU stalled a third to half of its drafting rounds by ~45 ms (several plain rounds) and few
    plain ones. Here 30% of drafting rounds take 3 plain rounds more: a round of 2 drafts costs 1.4 plain rounds
    typically and 2.3 on average, so at acceptance 0.6 drafting looks ~30% faster and is ~15% slower. The caps
    hold near the typical cost; with `stall_costs` each measured length is priced at its mean and the request falls
    back. Rare stalls (3% of drafting rounds, as OS stalls on a shared box) change neither."""
    def drafting_share(stall_costs: bool, stalls: tuple[float, float]) -> float:
        controller = GammaController(ControllerConfig(stall_costs=stall_costs))
        chosen = _timed(controller, 0.6, 600, random.Random(9), drafting_stalls=stalls)
        return sum(g > 0 for g in chosen[200:]) / len(chosen[200:])

    assert drafting_share(True, (0.3, 3.0)) < 0.25
    assert drafting_share(False, (0.3, 3.0)) > 0.8  # the default: near the typical cost
    assert drafting_share(True, (0.03, 2.0)) > 0.8 and drafting_share(False, (0.03, 2.0)) > 0.8


def test_timed_means_start_from_the_median_of_their_first_timings() -> None:
    controller = GammaController()
    for seconds in (0.100, 0.020, 0.022):  # a stalled first plain round
        controller.observe_timing(1, 0, 0.0, seconds)
    assert controller._plain_round[1].value == pytest.approx(0.022)
    controller.observe_timing(1, 0, 0.0, 0.020)
    assert controller._plain_round[1].value == pytest.approx(0.75 * 0.022 + 0.25 * 0.020)  # then a mean
    with pytest.raises(ValueError, match="settle_timings"):
        ControllerConfig(settle_timings=0)


def test_round_lengths_timed_at_different_moments_are_compared_at_one_pace() -> None:
    """The box runs 30% slower in alternate stretches of 32 rounds; the plain rounds happened to be timed
    in slow stretches, the rounds of 2 drafts in fast ones. Raw mean times would put a round of 2
    drafts at 1.04 plain rounds; as pace x relative cost each length keeps its own cost."""
    controller = GammaController()
    for i in range(1280):
        pace = 1.3 if (i // 32) % 2 else 1.0
        if i % 64 == 52:
            controller.observe_timing(1, 0, 0.0, 0.020 * pace)
        drafts = 2 if i % 64 == 20 else 1
        seconds = 0.020 * (1.30 if drafts == 1 else 1.35) * pace
        controller.observe_timing(1, drafts, 0.003 * drafts * pace, seconds - 0.003 * drafts * pace)
    assert controller.round_cost(1, 1) == pytest.approx(1.30, rel=0.03)
    assert controller.round_cost(1, 2) == pytest.approx(1.35, rel=0.03)


def test_exploration_keeps_both_neighbours_fresh_and_a_frozen_clock_is_ignored() -> None:
    controller = GammaController()
    controller.observe_timing(1, 1, 0.0, 0.0)  # a round the clock did not see: no division by zero
    for _ in range(20):
        controller.observe_timing(1, 3, 0.009, 0.020)
    for _ in range(500):  # a long stretch at gamma 1, then gamma 2 is chosen
        controller.observe_timing(1, 1, 0.003, 0.020)
    assert controller._neighbour(2, 1) == 3  # timed least recently, though far less often
    controller.observe_timing(1, 3, 0.009, 0.020)
    assert controller._neighbour(2, 1) == 1  # now gamma 1's cost is the staler one


def test_a_stalled_round_barely_moves_the_cost_of_its_length() -> None:
    """Rounds of a length tried only now and then keep a slow mean: one round the OS stalled 5x (common
    on a shared box) would move it by 40%. It counts as at most 1.2x the mean, at a weight of at most
    0.1: a move under 2% (at 1.5x it was 5%)."""
    controller = GammaController()
    controller.observe_timing(1, 0, 0.0, 0.020)
    for _ in range(10):
        controller.observe_timing(1, 2, 0.006, 0.020)
    before = controller.round_cost(1, 2)
    controller.observe_timing(1, 2, 0.006, 0.124)  # 130 ms against 26 ms
    assert before < controller.round_cost(1, 2) < 1.02 * before


def test_a_stalled_calibration_round_leaves_the_drafting_costs_alone() -> None:
    """Plain rounds are timed once in 64 rounds while a request drafts, so each weighed 1 - 0.995^64 =
    0.27 in the plain round's cost: one stalled 2x (counted as 1.5x) put every drafting round 12% cheaper
    (gamma 1 at 1.11 plain rounds for 1.26), enough to keep requests drafting at acceptance 0.1."""
    controller = GammaController()
    for i in range(2000):
        if i % 64 == 0:
            stall = 2.0 if i == 1920 else 1.0
            controller.observe_timing(1, 0, 0.0, 0.020 * stall)
        else:
            controller.observe_timing(1, 1, 0.003, 0.020 * 1.26 - 0.003)
    assert controller.round_cost(1, 1) == pytest.approx(1.26, rel=0.02)


def test_a_new_request_re_seeds_the_pace_of_round_costs() -> None:
    """At batch 1 each request has its own context: after a long prompt's request (every round 1.6x
    dearer) fell back to plain rounds, the next, short one drafts. Its first rounds, timed against the
    long request's pace, would look cheap and, being rarely timed, weigh heavily: the request's first
    round timed only re-seeds the pace."""
    def run(tell_requests: bool) -> float:
        controller = GammaController()
        for request in range(40):
            scale = 1.6 if request % 2 else 1.0
            rounds = [1] * 30 + [0] * 30 if request % 2 else [1] * 60
            for drafts in rounds:
                if tell_requests:
                    controller._planned_rows = (f"r{request}",)  # what plan() notes for the engine's round
                seconds = 0.020 * scale * (1.26 if drafts else 1.0)
                controller.observe_timing(1, drafts, 0.003 * drafts, seconds - 0.003 * drafts)
        return controller.round_cost(1, 1)

    assert run(tell_requests=True) == pytest.approx(1.26, rel=0.02)
    assert not run(tell_requests=False) == pytest.approx(1.26, rel=0.05)  # the stale pace: a biased cost


def _fallback_share(config: ControllerConfig, alpha: float, seeds: int = 6) -> float:
    shares = []
    for seed in range(seeds):
        chosen = _timed(GammaController(config), alpha, 500, random.Random(seed))[100:]
        shares.append(chosen.count(0) / len(chosen))
    return sum(shares) / len(shares)


def test_near_break_even_requests_that_gain_keep_drafting() -> None:
    """At alpha 0.3 drafting gains 4% (rounds of 1.25 plain rounds for 1.3 tokens). An estimate from the
    request's ~25 remembered trials alone dips under break-even (0.25) often, and a request in fallback
    only learns from sparse probes: such a controller decoded ~67% of these rounds plain (~30% now). Behind a
    pooled prior, falling back only when alpha a standard error up still predicts a loss, it keeps
    drafting; where drafting loses (alpha 0.1: 1.1 tokens for 1.25 rounds) it still falls back."""
    assert expected_speedup(0.3, 1, 0.15, overhead=0.1) > 1.03
    config = ControllerConfig(calibrate_every=20)
    assert _fallback_share(config, 0.3) < 0.4
    assert _fallback_share(ControllerConfig(calibrate_every=20, prior_weight=2, fallback_margin=0), 0.3) > 0.55
    assert _fallback_share(config, 0.1) > 0.8


def _falls_back_within(alpha: float, expected: bool, seed: int, rounds: int = 40) -> int | None:
    """Drafting rounds before a request whose every draft is accepted with probability `alpha` falls back
    (None: it drafted all `rounds`), told each position's acceptance probability or only its coin."""
    controller = GammaController(ControllerConfig(prior_cost_ratio=0.3))  # a round of one draft: 1.3 plain rounds
    rng = random.Random(seed)
    for r in range(rounds):
        gamma = controller.plan(["r"], 1)[0]
        if controller.in_fallback("r"):
            return r
        accepted = 0
        while accepted < gamma and rng.random() < alpha:
            accepted += 1
        reached = min(accepted + 1, gamma)
        controller.observe("r", gamma, accepted, None, [alpha] * reached if expected else None)
    return None


def test_acceptance_probabilities_keep_requests_that_gain_from_falling_back_on_bad_luck() -> None:
    """At alpha 0.45 against a break-even of 0.3 drafting gains; learnt from coins, runs of rejections send
    some such requests into fallback in their first rounds (35 of 300 here), learnt from each position's
    acceptance probability none. Where drafting loses (alpha 0.1) both fall back, the probabilities no later."""
    coins = [_falls_back_within(0.45, False, seed) for seed in range(300)]
    told = [_falls_back_within(0.45, True, seed) for seed in range(300)]
    assert sum(r is not None for r in coins) >= 15 and all(r is None for r in told)
    lost_coins = [_falls_back_within(0.1, False, seed) for seed in range(100)]
    lost_told = [_falls_back_within(0.1, True, seed) for seed in range(100)]
    assert None not in lost_coins and None not in lost_told
    assert max(lost_told) <= sorted(lost_coins)[len(lost_coins) // 2]
    controller = GammaController()
    with pytest.raises(ValueError, match="one probability per position reached"):
        controller.observe("r", 3, 1, None, [0.5, 0.5, 0.5])  # reached: the accepted draft and the rejected one
    controller.observe("r", 3, 1, None, [0.9, 0.2])
    assert controller.alpha("r") == pytest.approx((1.1 + 8 * 0.5) / (2 + 8))  # 1.1 successes in 2 trials


def test_new_requests_start_from_the_pooled_acceptance() -> None:
    controller = GammaController()
    assert controller.alpha("first") == pytest.approx(0.5)  # the constant prior before any data
    rng = random.Random(3)
    _simulate(controller, 0.2, 100, rid="first", rng=rng)
    controller.release("first")
    assert controller.alpha("second") == pytest.approx(0.2, abs=0.08)


def _rounds_before_fallback(config: ControllerConfig, confidence: float, alpha: float = 0.02,
                            seed: int = 0) -> int:
    """Drafting rounds a request takes to fall back when its drafts are accepted with `alpha` and the
    draft's confidence in each is `confidence`, after a calibration where acceptance grows with it."""
    controller = GammaController(config)
    _calibrate_gate(controller)
    rng = random.Random(seed)
    for rounds in range(1, 200):
        gamma = controller.plan(["r"], 1)[0]
        if gamma == 0:
            return rounds - 1
        accepted = 0
        while accepted < gamma and rng.random() < alpha:
            accepted += 1
        controller.observe("r", gamma, accepted, [confidence] * gamma)
    return 200


def test_a_draft_unsure_of_its_tokens_falls_back_sooner() -> None:
    """Drafts accepted 2% of the time: when the draft is unsure of them (confidence 0.05, a bin accepted
    ~5% of the time in calibration) the request's prior moves to that and it falls back within a few
    rounds; a draft confidently wrong (0.6) is caught only by its rejections, as without the prior."""
    config = ControllerConfig(prior_cost_ratio=0.2, gate_min_samples=100)
    unsure = [_rounds_before_fallback(config, 0.05, seed=s) for s in range(5)]
    confident = [_rounds_before_fallback(config, 0.6, seed=s) for s in range(5)]
    blind = [_rounds_before_fallback(dataclasses.replace(config, confidence_prior=False), 0.05, seed=s)
             for s in range(5)]
    assert max(unsure) <= 8 < 20 <= min(confident)
    assert blind == confident  # without the prior, confidence does not enter
    with pytest.raises(ValueError, match="confidence_weight"):
        ControllerConfig(confidence_weight=0)


def test_a_good_request_with_unsure_drafts_keeps_drafting() -> None:
    """Acceptance 0.5 with the draft's confidence spread as in calibration: the confidence prior agrees
    with the acceptance and the request drafts on (a prior from confidence alone is not a verdict)."""
    controller = GammaController(ControllerConfig(prior_cost_ratio=0.2, gate_min_samples=100))
    _calibrate_gate(controller)
    rng = random.Random(4)
    chosen = []
    for _ in range(300):
        gamma = controller.plan(["r"], 1)[0]
        chosen.append(gamma)
        confidences = [rng.random() for _ in range(gamma)]
        accepted = 0
        while accepted < gamma and rng.random() < confidences[accepted]:
            accepted += 1
        controller.observe("r", gamma, accepted, confidences)
    assert chosen.count(0) < 0.05 * len(chosen)


def _calibrate_gate(controller: GammaController) -> None:
    rng = random.Random(0)
    for _ in range(2000):  # acceptance grows with the draft's confidence
        q = rng.random()
        first = rng.random() < q
        controller.observe("x", 2, int(first) + int(first and rng.random() < q), [q, q])


def test_gate_thresholds_from_calibration() -> None:
    controller = GammaController(ControllerConfig(max_gamma=4, gate_min_samples=100, prior_cost_ratio=0.2))
    assert controller.gate_thresholds(1) == []  # not calibrated yet
    _calibrate_gate(controller)
    thresholds = controller.gate_thresholds(1)
    assert len(thresholds) == 3 and len(set(thresholds)) == 1  # affine costs: one more draft costs c anywhere
    assert 0.0 < thresholds[0] < 0.6
    assert GammaController(ControllerConfig(gate=False)).gate_thresholds(1) == []


def test_gate_follows_the_measured_cost_of_one_more_draft() -> None:
    """Where a second draft costs almost nothing (rounds of 1 and 2 drafts take the same time), a round
    never stops after its first draft; after the second, one more draft costs a full step and it may."""
    controller = GammaController(ControllerConfig(max_gamma=4, gate_min_samples=100))
    for _ in range(controller.config.settle_timings):  # plain rounds timed often enough to be re-timed rarely
        controller.observe_timing(1, 0, 0.0, 0.020)
    for _ in range(10):
        for drafts, seconds in ((1, 0.026), (2, 0.0262), (3, 0.030), (4, 0.034)):
            controller.observe_timing(1, drafts, 0.003 * drafts, seconds - 0.003 * drafts)
    assert [round(controller.round_cost(1, d), 2) for d in (1, 2, 3, 4)] == [1.3, 1.31, 1.5, 1.7]
    _calibrate_gate(controller)
    thresholds = controller.gate_thresholds(1)
    assert thresholds[0] == 0.0 and thresholds[1] > 0.0 and thresholds[1] == thresholds[2]
    controller._round = controller.config.explore_every - 1
    assert controller.plan(["r"], 1) in ([1], [3])  # a round that tries a neighbouring gamma...
    assert controller.gate(1) == ([], None)  # ...drafts it in full, or its cost would never be timed


def test_the_extension_prices_one_more_draft_as_the_gate_does() -> None:
    """Past the planned gamma one more draft pays where all drafts so far were accepted with at least
    S (R(j + 1) - R(j)) / a_mean: the gate's bar, against the product of the drafts' bins' acceptance."""
    controller = GammaController(ControllerConfig(max_gamma=4, gate_min_samples=100, prior_cost_ratio=0.2))
    assert controller.gate(1) == ([], None)  # not calibrated: neither
    _calibrate_gate(controller)
    thresholds, (acceptance, bars) = controller.gate(1)
    assert len(acceptance) == 10 and len(bars) == 3
    assert acceptance[0] < 0.15 and acceptance[9] > 0.85  # the calibration's acceptance grows with confidence
    mean = sum(controller._gate_accepts) / sum(controller._gate_trials)
    rate = max(controller.best_gamma(controller._pooled_alpha(), 1)[1], 1.0)
    assert bars[0] == pytest.approx(rate * 0.2 / mean)  # one more draft at c = 0.2 plain rounds (no timings)
    # the gate stops below the first bin that reaches the same bar
    assert thresholds[0] == pytest.approx(next(b for b, a in enumerate(acceptance) if a >= bars[0]) / 10)
    assert GammaController(ControllerConfig(extend=False)).gate(1) == ([], None)
    no_extension = GammaController(ControllerConfig(max_gamma=4, gate_min_samples=100, prior_cost_ratio=0.2,
                                                    extend=False))
    _calibrate_gate(no_extension)
    assert no_extension.gate(1) == (thresholds, None)
    no_gate = GammaController(ControllerConfig(max_gamma=4, gate_min_samples=100, prior_cost_ratio=0.2, gate=False))
    _calibrate_gate(no_gate)
    assert no_gate.gate(1) == ([], (acceptance, bars))


def test_round_costs_are_measured_per_gamma_not_extrapolated() -> None:
    """On the shipped pair at batch 1 a round of one draft costs about what one of two does (the target's
    matrix kernels run 2 rows slower than 3). Rounds modelled as 1 + k + gamma c, fitted where the
    controller drafts (gamma 1), charge that to k and make gamma 2 look dear: at alpha 0.35 that model
    falls back to plain decoding, though gamma 2 runs 5% faster. The controller times each round length
    (exploring neighbours now and then) and settles on gamma 2."""
    extra = {1: 0.12}
    assert optimal_gamma(0.35, 0.15, overhead=0.1 + extra[1]) == 1
    assert expected_speedup(0.35, 1, 0.15, overhead=0.22) < 1 < expected_speedup(0.35, 2, 0.15, overhead=0.1)
    controller = GammaController(ControllerConfig(calibrate_every=20))
    chosen = _timed(controller, 0.35, 600, random.Random(5), extra=extra)
    assert controller.round_cost(1, 1) == pytest.approx(1.37, rel=0.02)
    assert controller.round_cost(1, 2) == pytest.approx(1.40, rel=0.02)
    settled = chosen[200:]
    assert settled.count(2) > 0.6 * len(settled), settled[-40:]


def test_greedy_equality_for_every_drafter_and_auto_gamma(tiny_target, tiny_draft) -> None:
    prompts = [[1, 2, 3, 1, 2], [4, 5, 6, 7, 4, 5, 6], [3], [10, 11, 10, 11, 10]]
    params = SamplingParams(temperature=0, max_new_tokens=30)
    plain = [c.token_ids for c in generate(tiny_target, prompts, params).completions]
    drafters = {
        "ngram": lambda: NgramDrafter(min_n=1),
        "hybrid": lambda: HybridDrafter(ModelDrafter(tiny_draft), NgramDrafter(min_n=1), min_match=2),
        "model": lambda: ModelDrafter(tiny_draft),
    }
    for name, make in drafters.items():
        for config in (SpecConfig(gamma=4), SpecConfig(gamma=8, adaptive=True)):
            out = generate(tiny_target, prompts, params, draft=make(), config=config)
            assert [c.token_ids for c in out.completions] == plain, (name, config)


class _AlwaysExtends(GammaController):
    """Plans one draft a row and extends every round to its reach (every bin accepted, no bar)."""

    def best_gamma(self, alpha: float, batch_size: int) -> tuple[int, float]:
        return 1, 2.0

    def gate(self, batch_size: int):
        return [], ((1.0,) * 10, (0.0,) * (self.config.max_gamma - 1))


def test_greedy_equality_when_rounds_draft_past_their_plan(tiny_target, tiny_draft) -> None:
    prompts = [[1, 2, 3, 1, 2], [4, 5, 6, 7, 4, 5, 6], [3], [10, 11, 10, 11, 10]]
    params = SamplingParams(temperature=0, max_new_tokens=30)
    plain = [c.token_ids for c in generate(tiny_target, prompts, params).completions]
    controller = _AlwaysExtends(ControllerConfig(max_gamma=5, explore_every=10**6, calibrate_every=10**6))
    out = generate(tiny_target, prompts, params, draft=ModelDrafter(tiny_draft),
                   config=SpecConfig(gamma=4, adaptive=True), controller=controller)
    assert [c.token_ids for c in out.completions] == plain
    assert out.stats["drafted"] > 1.5 * out.stats["drafts"]  # planned one a round, drafted up to 4 (config.gamma)
    assert out.stats["extended_row_rounds"] >= out.stats["drafts"] // 2  # ...and the statistics say so


def test_a_model_drafter_extends_past_its_plan_only_as_the_rule_allows(tiny_draft) -> None:
    from specsample.drafters.base import Extension

    params = [SamplingParams(temperature=1.0, seed=s) for s in range(2)]

    def drafted(extension: Extension | None, max_drafts: list[int], thresholds=()) -> list[int]:
        drafter = ModelDrafter(tiny_draft)
        drafter.allocate(2, 64)
        drafter.add_rows([0, 1], [[1, 2, 3, 4], [5, 6, 7]])
        generators = [torch.Generator().manual_seed(s) for s in range(2)]
        proposal = drafter.propose([0, 1], max(max_drafts), max_drafts, params, generators, thresholds, extension)
        return proposal.num_drafted.tolist()

    always = ((1.0,) * 10, (0.0,) * 7)
    never = ((0.0,) * 10, (0.5,) * 7)
    assert drafted(Extension((1, 2), *always), [4, 3]) == [4, 3]  # each row to its reach
    assert drafted(Extension((1, 2), *never), [4, 3]) == [1, 2]  # each row to its plan
    assert drafted(None, [4, 3]) == [4, 3]  # no extension: max_drafts is the plan
    # within the plan the gate stops (every confidence is under 1.0), past it only the extension judges
    assert drafted(Extension((2, 0), *always), [4, 3], thresholds=[1.0] * 7) == [1, 3]
    with pytest.raises(ValueError, match="plans 1 rows for a batch of 2"):
        drafted(Extension((1,), *always), [4, 3])


def test_drafters_without_confidences_refuse_an_extension_past_the_plan(tiny_draft) -> None:
    from specsample.drafters.base import Extension

    rule = ((1.0,) * 10, (0.0,) * 7)
    ngram = NgramDrafter(min_n=1)
    ngram.allocate(1, 64)
    ngram.add_rows([0], [[1, 2, 3, 1, 2]])
    generator = [torch.Generator().manual_seed(0)]
    params = [SamplingParams(temperature=1.0)]
    with pytest.raises(ValueError, match="n-gram draft has no confidence"):
        ngram.propose([0], 3, [3], params, generator, (), Extension((1,), *rule))
    assert ngram.propose([0], 3, [3], params, generator, (), Extension((3,), *rule)).num_drafted.tolist() == [3]
    hybrid = HybridDrafter(ModelDrafter(tiny_draft), NgramDrafter(min_n=1), min_match=1)
    hybrid.allocate(1, 64)
    hybrid.add_rows([0], [[1, 2, 3, 1, 2]])
    with pytest.raises(ValueError, match="only rows sent to the draft model"):
        hybrid.propose_chosen([0], 3, [3], params, generator, (), [None], Extension((1,), *rule))
    model_row = hybrid.propose_chosen([0], 3, [3], params, generator, (), [False], Extension((1,), *rule))
    assert model_row.num_drafted.tolist() == [3]
    with pytest.raises(ValueError, match="one probability per bin"):
        Extension((1,), (1.5,), (0.0,))
    with pytest.raises(ValueError, match="planned drafts must be >= 0"):
        Extension((-1,), (1.0,), (0.0,))


class _FailingDrafter(NgramDrafter):
    def allocate(self, num_slots: int, max_len: int) -> None:
        raise RuntimeError("CUDA out of memory (simulated)")


def test_draft_cache_allocation_failure_decodes_without_drafting(tiny_target, caplog) -> None:
    engine = Engine(tiny_target, _FailingDrafter(), SpecConfig(gamma=4, max_batch_size=2))
    assert engine.drafter is None
    assert "WITHOUT speculation" in caplog.text
    engine.add_request([1, 2, 3], SamplingParams(temperature=0, max_new_tokens=5))
    tokens = [t for r in engine.stream() for u in r.rows for t in u.new_tokens]
    assert len(tokens) == 5


def test_unloadable_draft_falls_back_loudly(tmp_path, caplog) -> None:
    from model_factory import write_hf_model
    from specsample.models.loader import load_model
    from specsample.pair import load_drafter

    target = load_model(str(write_hf_model(tmp_path / "t", "llama")), dtype="float32")
    broken = write_hf_model(tmp_path / "d", "llama")
    (broken / "model.safetensors").write_bytes(b"\x00" * 64)  # unreadable weights
    assert load_drafter(str(broken), target) is None
    assert "WITHOUT speculation" in caplog.text
    with pytest.raises(ValueError, match="unknown model spec"):  # a typo is still an error
        load_drafter("no-such-draft", target)


def test_long_draft_backlog_never_overflows_another_rows_cache(tiny_draft) -> None:
    drafter = ModelDrafter(tiny_draft)
    drafter.allocate(2, 40 + 6)  # context 40 plus the engine's slack for gamma 4
    drafter.add_rows([0, 1], [[t % 32 for t in range(1, 39)], [1, 2, 3]])
    drafter.commit([1], [[t % 32 for t in range(4, 32)]])  # row 1 fell 28 tokens behind (an n-gram streak)
    gens = [torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)]
    proposal = drafter.propose([0, 1], 2, [1, 2], [SamplingParams(temperature=0)] * 2, gens)
    assert proposal.num_drafted.tolist() == [1, 2]
    assert int(drafter.cache.lengths[1]) == len(drafter.history[1]) + 1  # caught up, plus one fed draft


def test_swap_from_ngram_to_a_model_draft_mid_run(tiny_target, tiny_draft) -> None:
    from specsample.drafters.routed import RoutedDrafter

    routed = RoutedDrafter(NgramDrafter(min_n=1))
    engine = Engine(tiny_target, routed, SpecConfig(gamma=3, max_batch_size=3))
    params = SamplingParams(temperature=0.8, max_new_tokens=12, seed=0)
    engine.add_request([1, 2, 1, 2, 1], params)
    engine.step()
    routed.replace(ModelDrafter(tiny_draft))  # the old row keeps the n-gram drafter, new rows get the model
    engine.add_request([3, 4, 5], params)
    assert routed.vocab_size == tiny_draft.vocab_size
    results = list(engine.stream())
    assert sum(len(u.new_tokens) for r in results for u in r.rows) > 0 and not engine.has_work()


@pytest.mark.parametrize("behind", [3, 8, 9, 10, 30])  # backlogs 2, 7, 8 (the last merged), 9, 29
def test_a_lone_rows_backlog_drafts_as_from_a_fresh_prefill(tiny_draft, behind: int) -> None:
    """At batch 1 a short backlog rides in the first draft forward (one forward fewer per probe), a long
    one is prefilled first; either way the drafts and their probabilities are those of a fresh draft."""
    prompt = [t % 32 for t in range(1, 12)]
    missed = [(7 * t) % 32 for t in range(behind)]  # tokens committed by plain rounds
    forwards = []

    class Counting:
        def __getattr__(self, name):
            return getattr(tiny_draft, name)

        def forward_cached(self, tokens, cache, slots):
            forwards.append(tokens.shape[1])
            return tiny_draft.forward_cached(tokens, cache, slots)

        def forward_cached_last(self, tokens, cache, slots, last):
            forwards.append(tokens.shape[1])
            return tiny_draft.forward_cached_last(tokens, cache, slots, last)

    behind_drafter, fresh = ModelDrafter(Counting()), ModelDrafter(tiny_draft)
    for drafter, rows in ((behind_drafter, prompt), (fresh, prompt + missed)):
        drafter.allocate(1, 64)
        drafter.add_rows([0], [rows])
    behind_drafter.commit([0], [missed])
    params = [SamplingParams(temperature=1.0)]
    late = behind_drafter.propose([0], 3, [3], params, [torch.Generator().manual_seed(5)])
    ref = fresh.propose([0], 3, [3], params, [torch.Generator().manual_seed(5)])
    assert late.tokens.tolist() == ref.tokens.tolist()
    assert torch.allclose(late.probs, ref.probs, atol=1e-10)
    assert int(behind_drafter.cache.lengths[0]) == int(fresh.cache.lengths[0])
    # the first forward carries the backlog when it is short, else only the last 2 tokens
    assert forwards[0] == (behind + 1 if behind + 1 - 2 <= 8 else 2)


def test_a_short_backlog_in_a_batch_is_still_fed_on_its_own(tiny_draft) -> None:
    """Merged into the first forward, one row's backlog would pad the other rows past their slack."""
    drafter = ModelDrafter(tiny_draft)
    drafter.allocate(2, 24 + 6)  # context 24 plus the engine's slack for gamma 4
    drafter.add_rows([0, 1], [[t % 32 for t in range(1, 29)], [1, 2, 3]])  # row 0 near its end
    drafter.commit([1], [[4, 5, 6, 7, 8, 9]])  # row 1 is 5 tokens behind
    gens = [torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)]
    proposal = drafter.propose([0, 1], 2, [2, 2], [SamplingParams(temperature=0)] * 2, gens)
    assert proposal.num_drafted.tolist() == [2, 2]
    assert [int(drafter.cache.lengths[s]) for s in (0, 1)] == [len(drafter.history[s]) + 1 for s in (0, 1)]


def test_merge_proposals_returns_a_whole_proposal_and_copies_parts() -> None:
    from specsample.drafters.base import Proposal, merge_proposals

    tokens = torch.tensor([[3, 4], [5, 0]])
    probs = torch.softmax(torch.randn(2, 2, 9), dim=-1)  # vocab 9
    whole = Proposal(tokens, probs, torch.tensor([2, 1]), torch.rand(2, 2))
    assert merge_proposals([([0, 1], whole)], 2, 2) is whole  # every row, full width: nothing to copy
    # rows out of order, a narrower part, or a dtype the merge widens: copied into a fresh proposal
    for rows, batch, gamma, part in (([1, 0], 2, 2, whole), ([0, 1], 2, 3, whole),
                                     ([0, 1], 2, 2, Proposal(tokens, probs.bfloat16(), whole.num_drafted))):
        merged = merge_proposals([(rows, part)], batch, gamma)
        assert merged is not part and merged.probs.dtype == torch.float32 and merged.tokens.shape == (batch, gamma)
        assert merged.tokens[rows[0], :2].tolist() == part.tokens[0].tolist()
        assert torch.equal(merged.probs[rows[0], :2], part.probs[0].float())
    lookup = Proposal(torch.tensor([[7, 8]]), None, torch.tensor([2]))
    model = Proposal(torch.tensor([[1, 0]]), probs[:1], torch.tensor([1]), torch.tensor([[0.5, 0.0]]))
    merged = merge_proposals([([1], lookup), ([0], model)], 2, 2)
    assert merged.tokens.tolist() == [[1, 0], [7, 8]] and merged.num_drafted.tolist() == [1, 2]
    assert merged.probs[1, 0, 7] == 1 and merged.probs[1, 1, 8] == 1  # the lookup's row one-hot
    assert torch.isnan(merged.confidence[1]).all() and merged.confidence[0, 0] == 0.5
