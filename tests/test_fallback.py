"""Fallback: a request stops drafting where even a generous acceptance estimate predicts a loss, and learns whether
drafting pays again by probes (a drafting round now and then) or, where its draft model can score what plain
rounds committed, by backlog scorings; both spaced within PROBE_BUDGET of decode time."""

from __future__ import annotations

import random

import pytest
import torch
from planner_driver import batch, fall_back, learn, scorings, simulate, timed, untimed

from specsample import Engine, SamplingParams, SpecConfig, generate
from specsample.drafters.model import ModelDrafter
from specsample.planner import GammaController, fallback
from specsample.planner import costs as cost_model
from specsample.planner.base import RoundOutcome, RoundPlan, RowOutcome, RowPlan, RowState
from specsample.planner.costs import CostModel
from specsample.sampling import warp_probs
from specsample.theory import expected_speedup


def test_gamma_auto_falls_back_and_recovers(monkeypatch) -> None:
    monkeypatch.setattr(cost_model, "PRIOR_COST_RATIO", 0.2)
    monkeypatch.setattr(fallback, "PROBE_EVERY", 8)
    controller = untimed(8)
    rng = random.Random(1)
    simulate(controller, 0.9, 50, rng=rng)
    assert not controller.in_fallback("r")
    low = simulate(controller, 0.05, 160, rng=rng)  # alpha must look low even a standard error up
    assert controller.in_fallback("r")
    assert low[-40:].count(0) >= 30  # mostly plain decoding, with periodic probes
    assert any(g > 0 for g in low[-40:])  # ...which keep measuring alpha
    simulate(controller, 0.95, 120, rng=rng)
    assert not controller.in_fallback("r")
    assert [to for _, to in controller.switches] == ["off", "on"]


def test_probes_thin_out_when_they_cost_more(monkeypatch) -> None:
    """In fallback a probe's expected loss is capped at PROBE_BUDGET of decode time: a dear verification
    (e.g. a compiled plain step, c ~ 0.7) probes rarely, a near-break-even one as often as PROBE_EVERY."""
    assert 55 <= fallback.probe_interval(0.1, 1, 1.7) <= 65  # 1.1 tokens for 1.7 rounds' time
    assert fallback.probe_interval(0.3, 1, 1.25) == 4  # no predicted loss: the floor
    assert fallback.probe_interval(0.3, 1, 1.35) == 6  # 0.05 of a round lost per probe
    assert fallback.probe_interval(0.0, 1, 51.0) == 256  # the ceiling: recovery is still noticed
    # the pool kept (not aged per round): aged below 10 trials in this one 600-round request, it resets the
    # request's prior to 0.5 and adds probes of its own
    monkeypatch.setattr("specsample.planner.acceptance.POOL_ROUND_DECAY", 1.0)
    probes = []
    for cost in (0.7, 0.2):  # dear, cheap
        monkeypatch.setattr(cost_model, "PRIOR_COST_RATIO", cost)
        probes.append(sum(g > 0 for g in simulate(untimed(8), 0.05, 600, rng=random.Random(2))[100:]))
    assert probes[0] <= 12 < 25 <= probes[1]  # ~500/60 rounds against ~500/16


def test_no_probes_with_too_few_tokens_left(monkeypatch) -> None:
    """A probe pays only through the drafting it may bring back, which takes several probes to notice:
    with under PROBE_HORIZON tokens left in the budget a request in fallback stops probing."""
    monkeypatch.setattr(cost_model, "PRIOR_COST_RATIO", 0.2)

    def probes(remaining: int) -> int:
        controller = untimed(8)
        simulate(controller, 0.02, 100)
        assert controller.in_fallback("r")
        count = 0
        for _ in range(200):
            state = batch(RowState("r", remaining))
            plan = controller.plan(state)
            count += plan.rows[0].drafts > 0
            learn(controller, plan, state)  # a probe's drafts all rejected
        return count

    assert probes(32) >= 5 and probes(31) == 0
    monkeypatch.setattr(fallback, "PROBE_HORIZON", 0)
    assert probes(31) >= 5  # without a horizon it probes on


def _fallback_share(alpha: float, seeds: int = 6) -> float:
    shares = []
    for seed in range(seeds):
        chosen = timed(GammaController(8), alpha, 500, random.Random(seed))[100:]
        shares.append(chosen.count(0) / len(chosen))
    return sum(shares) / len(shares)


def test_near_break_even_requests_that_gain_keep_drafting(monkeypatch) -> None:
    """At alpha 0.3 drafting gains 4% (rounds of 1.25 plain rounds for 1.3 tokens). An estimate from the
    request's ~25 remembered trials alone dips under break-even (0.25) often, and a request in fallback
    only learns from sparse probes: such a controller decodes most of these rounds plain. Behind a pooled prior,
    falling back only when alpha a standard error up still predicts a loss, it keeps drafting; where drafting
    loses (alpha 0.1: 1.1 tokens for 1.25 rounds) it still falls back."""
    assert expected_speedup(0.3, 1, 0.15, overhead=0.1) > 1.03
    monkeypatch.setattr(cost_model, "CALIBRATE_EVERY", 20)
    assert _fallback_share(0.3) < 0.4
    assert _fallback_share(0.1) > 0.8
    monkeypatch.setattr("specsample.planner.acceptance.PRIOR_WEIGHT", 2.0)  # a weak prior...
    monkeypatch.setattr(fallback, "MARGIN", 0.0)  # ...and no margin: the estimate alone
    assert _fallback_share(0.3) > 0.55


def test_a_scoring_draft_falls_back_on_the_same_evidence_as_a_probing_one(monkeypatch) -> None:
    """Whether a request learns in fallback by probes or by backlog scorings, it falls back where alpha MARGIN
    standard errors up still predicts a loss: after the same rejections; a narrower margin, sooner."""
    monkeypatch.setattr(cost_model, "PRIOR_COST_RATIO", 0.2)

    def rounds(can_score: bool) -> int:
        return fall_back(_pooled_at_0_4(), can_score=can_score)

    probing = rounds(False)
    assert rounds(True) == probing
    monkeypatch.setattr(fallback, "MARGIN", 0.5)
    assert rounds(True) == rounds(False) < probing


# ----- backlog scoring ---------------------------------------------------------------


def _pooled_at_0_4() -> GammaController:
    """An untimed controller after an earlier request pooled an acceptance of 0.4."""
    controller = untimed(8)
    for i in range(100):
        controller.acceptance.observe("w", 1, int(i % 5 < 2), False)
    controller.forget("w")
    return controller


def _fallen_back(timed_from_now: bool = False) -> GammaController:
    """A scoring controller whose request saw only rejections until it fell back (rounds not timed); with
    `timed_from_now`, the rounds it learns from then on are."""
    controller = _pooled_at_0_4()
    fall_back(controller, can_score=True)
    if timed_from_now:
        controller.costs = CostModel()
    return controller


def _fallback_rounds(controller: GammaController, rounds: int, acceptance: float) -> tuple[list[int], list[int]]:
    """Rounds in which the request's draft scored its backlog (each token at `acceptance`), and the drafts planned
    each round (a drafting round has every draft accepted)."""
    scored_at, backlog, planned = [], 0, []
    for i in range(rounds):
        backlog += 1
        state = batch(RowState("r", 1000, backlog=backlog), can_score=True)
        plan = controller.plan(state)
        gamma = plan.rows[0].drafts
        planned.append(gamma)
        wanted = scorings(plan, state).get("r", 0)
        scores = (acceptance,) * min(wanted, backlog) if wanted else None
        learn(controller, plan, state, RowOutcome("r", gamma, gamma, backlog_scores=scores))
        if wanted:
            scored_at.append(i)
        if wanted or gamma:
            backlog = 0
    return scored_at, planned


def test_in_fallback_gamma_auto_scores_instead_of_probing(monkeypatch) -> None:
    """The first scoring comes after 2 PROBE_EVERY rounds (the fallback rested on a few rounds), the next
    ones when a draft forward (c = 0.2 plain rounds) fits PROBE_BUDGET (1%): every 21 rounds."""
    monkeypatch.setattr(cost_model, "PRIOR_COST_RATIO", 0.2)
    controller = _fallen_back()
    scored_at, planned = _fallback_rounds(controller, 80, 0.0)
    assert scored_at[0] in (6, 7) and {b - a for a, b in zip(scored_at, scored_at[1:])} == {21}
    assert not any(planned) and controller.scored == len(scored_at)  # no drafting probe


def test_scorings_wait_for_a_backlog(monkeypatch) -> None:
    """A scoring waits until plain rounds committed SCORE_MIN_TOKENS tokens it can score."""
    monkeypatch.setattr(cost_model, "PRIOR_COST_RATIO", 0.2)
    controller = _fallen_back()
    first = []
    for i in range(40):
        state = batch(RowState("r", 1000, backlog=min(i, 2)), can_score=True)  # never more than 2 tokens
        plan = controller.plan(state)
        first += [i] if scorings(plan, state) else []
        learn(controller, plan, state)
    assert first == []
    state = batch(RowState("r", 1000, backlog=fallback.SCORE_MIN_TOKENS), can_score=True)
    assert scorings(controller.plan(state), state) == {"r": fallback.SCORE_MIN_TOKENS}


def test_scorings_are_spaced_by_what_they_were_timed_to_cost(monkeypatch) -> None:
    """A scoring forward feeds many tokens and costs more than a draft step: timed at 0.4 plain rounds over
    plain rounds of 20 ms (c is 0.2), the next scorings come every 40-41 rounds instead of 21. A scoring round
    in which drafting rows ran says nothing about it."""
    monkeypatch.setattr(cost_model, "PRIOR_COST_RATIO", 0.2)
    controller = _fallen_back(timed_from_now=True)
    plain = RoundPlan(rows=(RowPlan(),))
    for _ in range(10):
        controller.learn(plain, RoundOutcome((RowOutcome("fixed", 0, 0),), 0, 0.0, 0.02, 0.0))
    assert controller.costs.scoring_cost(1) == pytest.approx(0.2)  # c until a scoring was timed
    scored_at, backlog = [], 0
    for i in range(150):
        backlog += 1
        state = batch(RowState("r", 1000, backlog=backlog), can_score=True)
        plan = controller.plan(state)
        assert plan.rows[0].drafts == 0
        wanted = scorings(plan, state).get("r", 0)
        learn(
            controller,
            plan,
            state,
            RowOutcome("r", 0, 0, backlog_scores=(0.0,) * min(wanted, backlog) if wanted else None),
            seconds=(0.0, 0.028 if wanted else 0.02, 0.0),
        )
        if wanted:
            scored_at.append(i)
            backlog = 0
    assert controller.costs.scoring_cost(1) == pytest.approx(0.4, rel=0.01)
    assert {b - a for a, b in zip(scored_at[1:], scored_at[2:])} <= {40, 41}  # 0.4 / 1% + 1, as it rounds
    # a scoring planned in a round where another row drafted, at a batch size whose plain rounds were timed
    controller.learn(
        RoundPlan(rows=(RowPlan(),) * 2),
        RoundOutcome((RowOutcome("x", 0, 0), RowOutcome("y", 0, 0)), 0, 0.0, 0.025, 0.0),
    )
    drafting = RoundPlan(rows=(RowPlan(score_backlog=4), RowPlan(1, 1)), chosen_ids=("r", "s"), model_drafting=True)
    controller.learn(
        drafting,
        RoundOutcome((RowOutcome("r", 0, 0, backlog_scores=(0.0,) * 4), RowOutcome("s", 1, 1)), 1, 0.005, 0.03, 0.0),
    )
    assert 2 not in controller.costs.scoring  # nor is it a drafting round's time
    assert 2 not in controller.costs.draft_step and controller.costs.drafting[2].count(1) == 0


def test_a_dear_first_scoring_waits_for_a_request_long_enough_to_pay_for_it(monkeypatch) -> None:
    """The early first scoring is paid from PROBE_BUDGET over the tokens the request has left: where a scoring
    costs 4 plain rounds, one per 64-token reply would cost it 6%. A request with 64 tokens left is then not scored
    early (the budget's cadence, capped at MAX_PROBE_EVERY, is past its end); one with 1000 left is, as is every
    request where a scoring costs 0.4 plain rounds."""
    monkeypatch.setattr(cost_model, "PRIOR_COST_RATIO", 0.2)

    def first_scoring(scoring_seconds: float, remaining: int) -> int | None:
        controller = _fallen_back(timed_from_now=True)
        plain = RoundPlan(rows=(RowPlan(),))
        for _ in range(3):
            controller.learn(plain, RoundOutcome((RowOutcome("fixed", 0, 0),), 0, 0.0, 0.02, 0.0))
        scoring = RoundPlan(rows=(RowPlan(score_backlog=8),), chosen_ids=("r",))  # one scoring timed
        controller.learn(scoring, RoundOutcome((RowOutcome("r", 0, 0),), 0, 0.0, scoring_seconds, 0.0))
        for i in range(remaining):
            state = batch(RowState("r", remaining - i, backlog=i + 1), can_score=True)
            plan = controller.plan(state)
            if scorings(plan, state):
                return i
            learn(controller, plan, state, seconds=(0.0, 0.02, 0.0))
        return None

    assert first_scoring(0.028, 64) in (6, 7)  # 0.4 plain rounds: within 1% of 64 tokens
    assert first_scoring(0.100, 64) is None  # 4 plain rounds: not within 1% of 64 tokens
    assert first_scoring(0.100, 1000) in (6, 7)  # ...but within 1% of 1000


def test_score_interval_stays_within_the_budget_and_its_bounds() -> None:
    assert fallback.score_interval(0.2, 1, None) == 21  # 0.2 plain rounds within 1% of decode time
    assert fallback.score_interval(0.2, 0, None) == 2 * fallback.PROBE_EVERY  # the first comes early...
    assert fallback.score_interval(4.0, 0, 64) == fallback.MAX_PROBE_EVERY  # ...where the tokens left pay for it
    assert fallback.score_interval(4.0, 0, 1000) == 2 * fallback.PROBE_EVERY
    assert fallback.score_interval(0.0, 3, None) == fallback.PROBE_EVERY  # free: the floor


def test_scores_that_recover_bring_drafting_back(monkeypatch) -> None:
    monkeypatch.setattr(cost_model, "PRIOR_COST_RATIO", 0.2)
    controller = _fallen_back()
    _, planned = _fallback_rounds(controller, 40, 0.9)
    assert not controller.in_fallback("r") and sum(planned) > 0
    assert [to for _, to in controller.switches] == ["off", "on"]


def test_scorings_come_sooner_while_drafting_may_pay(monkeypatch) -> None:
    """A request that fell back on a slow start is scored every 2 PROBE_EVERY rounds, not every 21, while alpha
    a margin above its estimate would resume drafting; it resumes sooner. Where the scores show a draft that
    cannot pay, the cadence stays the budget's."""
    monkeypatch.setattr(cost_model, "PRIOR_COST_RATIO", 0.2)

    def scorings_until_resumed(acceptance: float) -> tuple[list[int], int | None]:
        controller = _fallen_back()
        scored_at, backlog = [], 0
        for i in range(120):
            backlog += 1
            state = batch(RowState("r", 1000, backlog=backlog), can_score=True)
            plan = controller.plan(state)
            if plan.rows[0].drafts:
                return scored_at, i  # drafting again
            wanted = scorings(plan, state).get("r", 0)
            if wanted:
                learn(controller, plan, state, RowOutcome("r", 0, 0, backlog_scores=(acceptance,) * backlog))
                scored_at.append(i)
                backlog = 0
            else:
                learn(controller, plan, state)
        return scored_at, None

    hopeful, resumed = scorings_until_resumed(0.21)
    assert {b - a for a, b in zip(hopeful[1:], hopeful[2:])} == {8}
    for acceptance in (0.0, 0.1):  # a generous alpha still loses: a scoring every 21 rounds, as the budget says
        lost, never = scorings_until_resumed(acceptance)
        assert never is None and {b - a for a, b in zip(lost, lost[1:])} == {21}
    # with the early cadence only before a request's first scoring (score_interval answering as for the scorings
    # done, whatever it is asked), later scorings keep the budget's cadence and drafting returns later
    budget_only = fallback.score_interval
    scorings_done: list[int] = [0]

    def as_budgeted(cost: float, done: int, remaining: int | None) -> int:
        return budget_only(cost, max(done, scorings_done[0]), remaining)

    monkeypatch.setattr(fallback, "score_interval", as_budgeted)
    spy = GammaController.learn

    def counting(self, plan, outcome) -> None:
        scorings_done[0] += sum(r.score_backlog > 0 for r in plan.rows)
        spy(self, plan, outcome)

    monkeypatch.setattr(GammaController, "learn", counting)
    plain, plain_resumed = scorings_until_resumed(0.21)
    assert {b - a for a, b in zip(plain, plain[1:])} == {21}
    assert resumed is not None and plain_resumed is not None and resumed + 10 < plain_resumed


# ----- backlog scoring in the engine -----------------------------------------------------


class _UnhelpfulCosts(CostModel):
    """Drafting priced as a loss at any alpha below 0.9, so requests fall back; a scoring pinned at 0.2 plain
    rounds (timed on a loaded machine, one stalled scoring could space the next ones past the reply)."""

    def round_cost(self, batch_size: int, drafts: int) -> float:
        return 1.0 if drafts == 0 else 1.9 + 0.1 * drafts

    def scoring_cost(self, batch_size: int) -> float:
        return 0.2


class _Watching(GammaController):
    """Gamma auto on `_UnhelpfulCosts`, noting each round whether its request was in fallback and every score."""

    def __init__(self, max_gamma: int) -> None:
        super().__init__(max_gamma)
        self.costs = _UnhelpfulCosts()
        self.seen: list[float] = []
        self.in_fallback_at: list[bool] = []

    def plan(self, batch):
        plan = super().plan(batch)
        self.in_fallback_at.append(self.in_fallback(batch.rows[0].request_id))
        return plan

    def read_outcome(self, plan, outcome: RoundOutcome):
        rows = super().read_outcome(plan, outcome)
        for row in rows:
            self.seen += list(row.backlog_scores or ())
        return rows


class _Recording(ModelDrafter):
    """Notes which reply positions each scoring covered."""

    def score_backlog(self, slots, counts, params):
        out = super().score_backlog(slots, counts, params)
        for slot, scores in zip(slots, out):
            end = len(self.history[slot])  # scored: history[end - len(scores):end]
            self.scored = getattr(self, "scored", []) + list(range(end - len(scores), end))
        return out


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_request_in_fallback_learns_from_scores_not_probes(
    tiny_target, tiny_draft, monkeypatch, temperature: float
) -> None:
    """The acceptances gamma auto is told are, per token plain rounds committed, min(1, q / p) of the
    draft's and the target's probabilities of it (greedy: their agreement); no drafting probe runs; greedy,
    the reply is the target's."""
    monkeypatch.setattr(fallback, "PROBE_HORIZON", 0)
    monkeypatch.setattr(fallback, "PROBE_BUDGET", 1.0)  # score often
    prompt, budget = [3, 1, 4, 1, 5], 80
    params = SamplingParams(temperature=temperature, max_new_tokens=budget, seed=3)
    controller = _Watching(4)
    drafter = _Recording(tiny_draft)
    engine = Engine(tiny_target, drafter, SpecConfig(max_batch_size=1), planner=controller)
    engine.add_request(prompt, params, request_id="r")
    drafted, reply, scored_rows = [], [], 0
    for result in engine.stream():
        drafted += [u.num_drafted for u in result.rows]
        reply += [t for u in result.rows for t in u.new_tokens]
        scored_rows += result.stats.scored_rows
    assert scored_rows == controller.scored  # the statistics report them (backlog_scorings)
    fallen = controller.in_fallback_at
    assert sum(fallen) >= 30 and all(d == 0 for d, f in zip(drafted, fallen) if f)  # no drafting probes
    assert controller.scored >= 3 and len(controller.seen) == len(drafter.scored) >= 20
    text = prompt + reply
    with torch.no_grad():
        inputs = torch.tensor([text], device=tiny_draft.device)
        draft_probs = warp_probs(tiny_draft(inputs)[0], params)  # [len, vocab]: row i predicts text[i + 1]
        target_probs = warp_probs(tiny_target(inputs)[0], params)
    expected = [
        min(1.0, float(draft_probs[i - 1, text[i]]) / float(target_probs[i - 1, text[i]])) for i in drafter.scored
    ]
    assert controller.seen == pytest.approx(expected, abs=1e-6)
    if temperature == 0:
        assert set(controller.seen) == {0.0, 1.0}
        reference = generate(tiny_target, [prompt], params, config=SpecConfig(speculative=False))
        assert reply == list(reference.completions[0].token_ids)
