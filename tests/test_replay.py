"""The paired replay (specsample.bench.replay): its premise, checked on the real verifier, and the
replay itself on hand-made traces."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats

from specsample.bench.goals import goal_tables
from specsample.bench.replay import DraftPrefill, RoundCostTable, Trace, compare, replay, trace_from_logits
from specsample.bench.round_costs import CostModel
from specsample.config import SamplingParams
from specsample.controller import ControllerConfig, GammaController
from specsample.theory import expected_tokens_per_round
from specsample.verify import verify
from stats_util import FALSE_ALARM, chi_square

ROOT = Path(__file__).resolve().parent.parent
ROWS = 60_000
# per position (2 draft positions, vocabulary 5): clearly different target and draft distributions
TARGET = torch.tensor([[0.40, 0.25, 0.20, 0.10, 0.05], [0.05, 0.15, 0.30, 0.30, 0.20]], dtype=torch.float64)
DRAFT = torch.tensor([[0.10, 0.30, 0.20, 0.25, 0.15], [0.30, 0.10, 0.20, 0.15, 0.25]], dtype=torch.float64)


def _verify_rounds() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ROWS rounds of 2 drafts through the real verifier: drafts, accepted prefix, output tokens."""
    generator = torch.Generator().manual_seed(0)
    drafts = torch.stack([torch.multinomial(DRAFT[j], ROWS, replacement=True, generator=generator)
                          for j in range(2)], dim=1)  # [rows, 2]
    draft_probs = DRAFT.unsqueeze(0).expand(ROWS, -1, -1)  # [rows, 2, vocab]
    target_probs = torch.cat([TARGET, TARGET[:1]]).unsqueeze(0).expand(ROWS, -1, -1)  # [rows, 3, vocab]
    verdict = verify(drafts, draft_probs, target_probs, generator)
    accepted = verdict.num_accepted
    # the text: accepted drafts, then the next token at the first unaccepted position
    output = drafts.clone()
    rows = torch.arange(ROWS)
    for j in range(2):
        here = accepted == j
        output[rows[here], j] = verdict.next_token[here]
    return drafts, accepted, output


def _acceptance_z(accepted_at: torch.Tensor, offered: torch.Tensor, output: torch.Tensor, bias: torch.Tensor) -> float:
    """Largest |z| over output tokens of the accepted count among offered drafts against `bias[x]`."""
    worst = 0.0
    for x in range(len(bias)):
        cell = offered & (output == x)
        n, k, a = int(cell.sum()), int((accepted_at & cell).sum()), float(bias[x])
        if n == 0:
            continue
        if a >= 1.0:
            worst = max(worst, 0.0 if k == n else math.inf)
            continue
        worst = max(worst, abs(k - n * a) / math.sqrt(n * a * (1 - a)))
    return worst


def test_given_the_text_each_draft_was_accepted_with_probability_min_one_q_over_p():
    """The replay's premise, on the real verifier: among rounds whose text has token x at a draft
    position, the draft there was accepted with probability min(1, q(x) / p(x)), at the second position
    as at the first. The unconditional acceptance, or q(x) alone, must fail the same test."""
    drafts, accepted, output = _verify_rounds()
    threshold = stats.norm.ppf(1 - FALSE_ALARM / 20)  # two-sided, 10 cells
    for j in range(2):
        offered = accepted >= j  # a second draft is only verified when the first was accepted
        accepted_at = accepted > j
        bias = torch.clamp(DRAFT[j] / TARGET[j], max=1.0)
        assert _acceptance_z(accepted_at, offered, output[:, j], bias) < threshold
        unconditional = torch.full_like(bias, float(torch.minimum(DRAFT[j], TARGET[j]).sum()))
        assert _acceptance_z(accepted_at, offered, output[:, j], unconditional) > 2 * threshold
        assert _acceptance_z(accepted_at, offered, output[:, j], DRAFT[j]) > 2 * threshold


def test_a_rejected_draft_is_distributed_as_max_zero_q_minus_p():
    """What the trace's rejected_confidence is drawn from; the draft's own distribution must fail."""
    drafts, accepted, _ = _verify_rounds()
    rejected = drafts[accepted == 0, 0]
    counts = np.bincount(rejected.numpy(), minlength=5)
    residual = torch.clamp(DRAFT[0] - TARGET[0], min=0.0)
    statistic, threshold = chi_square(counts, (residual / residual.sum()).numpy())
    assert statistic < threshold
    assert chi_square(counts, DRAFT[0].numpy())[0] > threshold


def test_trace_from_logits_sampled_and_greedy():
    target_logits = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.3, 0.5]]))
    draft_logits = torch.log(torch.tensor([[0.25, 0.6, 0.15], [0.2, 0.3, 0.5]]))
    sampled = trace_from_logits("c", 7, [1, 2], target_logits, draft_logits, SamplingParams(temperature=1.0),
                                torch.Generator().manual_seed(0))
    assert sampled.accept == pytest.approx((1.0, 1.0))  # q(x) >= p(x) at both
    assert sampled.confidence == pytest.approx((0.6, 0.5))
    assert sampled.rejected_confidence[0] == pytest.approx(0.6)  # only token 1 has q > p there
    assert math.isnan(sampled.rejected_confidence[1])  # q == p: a draft there is never rejected
    other = trace_from_logits("c", 7, [0, 2], target_logits, draft_logits, SamplingParams(temperature=1.0),
                              torch.Generator().manual_seed(0))
    assert other.accept[0] == pytest.approx(0.5)  # min(1, 0.25 / 0.5)
    greedy = trace_from_logits("c", 7, [0, 2], target_logits, draft_logits, SamplingParams(temperature=0.0),
                               torch.Generator().manual_seed(0))
    assert greedy.accept == (0.0, 1.0)  # the draft's argmax is 1 at the first token, the text's 0
    assert greedy.rejected_confidence[0] == pytest.approx(0.6)  # the greedy draft it would have proposed


def _linear_costs(per_draft: float = 0.15) -> RoundCostTable:
    """A round of d drafts costs 1 + per_draft * d seconds whatever the context; prefills cost nothing."""
    models = {d: CostModel((d,), (1.0 + per_draft * d, 0.0, 0.0), (0.0, 0.0)) for d in range(9)}
    return RoundCostTable(models, per_draft)


def _constant_trace(alpha: float, length: int, category: str = "c") -> Trace:
    return Trace(category, 10, (alpha,) * length, (0.5,) * length, (0.1,) * length)


def test_fixed_gamma_replay_matches_theory_and_is_charged_its_rounds():
    """Tokens per round at a constant acceptance alpha is E(alpha, gamma), within 5 standard errors."""
    alpha, gamma, length = 0.6, 3, 4000
    trace, rng = _constant_trace(alpha, length), random.Random(0)
    tokens = rounds = 0
    for _ in range(10):
        result = replay(trace, gamma, [rng.random() for _ in range(length)], _linear_costs(), lambda: 1.0)
        tokens, rounds = tokens + result.tokens, rounds + result.rounds
        assert result.seconds == pytest.approx(result.rounds + 0.15 * result.drafted)
    expected = expected_tokens_per_round(alpha, gamma)
    # tokens per round is 1 + a truncated geometric count: its variance is below gamma^2 / 4 + 1
    assert abs(tokens / rounds - expected) < 5 * math.sqrt((gamma**2 / 4 + 1) / rounds)
    # a round that lost its bonus token reads about one token short and must fail that bound
    assert abs((tokens - rounds) / rounds - expected) > 5 * math.sqrt((gamma**2 / 4 + 1) / rounds)


def test_replay_uses_the_coins_given():
    trace = _constant_trace(0.5, 6)
    all_pass = replay(trace, 2, [0.0] * 6, _linear_costs(), lambda: 1.0)
    assert all_pass.rounds == 2  # 3 tokens a round
    none_pass = replay(trace, 2, [0.99] * 6, _linear_costs(), lambda: 1.0)
    assert none_pass.rounds == 6 and none_pass.drafted == 9  # 2 a round, then 1 and 0 as the reply runs out
    with pytest.raises(ValueError, match="uniform per reply token"):
        replay(trace, 2, [0.0] * 5, _linear_costs(), lambda: 1.0)
    with pytest.raises(ValueError, match="needs a controller"):
        replay(trace, "auto", [0.0] * 6, _linear_costs(), lambda: 1.0)


def test_gamma_auto_replayed_falls_back_on_a_poor_draft_and_drafts_on_a_good_one():
    rng = random.Random(1)
    controller = GammaController()
    low = replay(_constant_trace(0.02, 400), "auto", [rng.random() for _ in range(400)], _linear_costs(),
                 lambda: 1.0, controller, "low")
    assert low.drafted / low.rounds < 0.5  # mostly plain rounds, a probe now and then
    high = replay(_constant_trace(0.9, 400), "auto", [rng.random() for _ in range(400)], _linear_costs(),
                  lambda: 1.0, controller, "high")
    assert high.drafted / high.rounds > 3


def test_probes_are_counted_and_stop_near_the_end_of_the_budget():
    """A reply the draft is lost on: gamma auto falls back and probes now and then, but not with under
    probe_horizon tokens left in the budget (the budget, not the text: this text stops at 150 tokens of
    200); without the horizon (the broken variant) it probes there too. Replayed.probes counts them."""
    coins = [0.99] * 150  # every draft rejected
    trace = dataclasses.replace(_constant_trace(0.02, 150), max_new_tokens=200)

    def probes_left(horizon: int) -> tuple[list[int], int]:
        # drafting probes (a draft that scores its backlog instead is tested in test_adaptive.py)
        config = ControllerConfig(prior_cost_ratio=0.2, probe_horizon=horizon, score_backlog=False)
        controller = GammaController(config)
        plan, seen = controller.plan, []

        def spy(request_ids, batch_size, remaining=None, scorable=None):
            drafts = plan(request_ids, batch_size, remaining, scorable)
            if drafts[0] > 0 and controller.in_fallback(request_ids[0]):
                seen.append(remaining[0])
            return drafts

        controller.plan = spy
        return seen, replay(trace, "auto", coins, _linear_costs(), lambda: 1.0, controller).probes

    left, counted = probes_left(horizon=80)
    assert counted == len(left) >= 3 and min(left) >= 80 and max(left) > 150  # the budget left, not the text
    left, counted = probes_left(horizon=0)
    assert counted == len(left) and min(left) < 80


def test_compare_pairs_every_policy_on_the_same_texts():
    traces = [_constant_trace(0.9, 64, "easy"), _constant_trace(0.05, 64, "hard")]
    table = compare(traces, _linear_costs(), replicates=3)
    assert set(table) == {"target-only", *(f"gamma={g}" for g in range(1, 9)), "gamma=auto", "gamma=auto fresh"}
    assert table["target-only"]["easy"] == pytest.approx(1.0)  # one token per 1-second round
    assert table["gamma=4"]["easy"] > 2 * table["target-only"]["easy"]
    assert table["gamma=4"]["hard"] < table["target-only"]["hard"]
    assert table == compare(traces, _linear_costs(), replicates=3)  # seeded: the same coins again


def test_compare_breaks_gamma_autos_extra_time_down():
    """The breakdown's parts add up to gamma auto's time over target-only's, less 1, and its scoring part is
    the scorings' price: a text the draft cannot help, with prefills free (no prefill part)."""
    traces = [_constant_trace(0.02, 300, "hard"), _constant_trace(0.9, 64, "easy")]
    parts: dict = {}
    table = compare(traces, dataclasses.replace(_linear_costs(0.2), scoring=0.5), replicates=2, breakdown=parts)
    for cat in ("hard", "easy", "overall"):
        extra = table["target-only"][cat] / table["gamma=auto"][cat] - 1  # the same tokens: time over time
        assert sum(parts[cat].values()) == pytest.approx(extra)
        assert parts[cat]["prefill"] == 0.0
    # 0.005 (0.009 with the pool not aged per round: aged, the 300-token hard text's prior drifts back up and it
    # drafts a little more, scores a little less; 0.958 of target-only against 0.959)
    assert parts["hard"]["scoring"] > 2 * parts["easy"]["scoring"] and parts["hard"]["scoring"] > 0.003
    assert parts["easy"]["drafting"] < -0.3  # drafting there saves rounds


def test_gamma_autos_own_work_is_charged_to_its_rounds_only():
    """--controller-overhead: every round of gamma auto (and only gamma auto's) costs that many plain rounds
    more, the breakdown reports it as its own part, and a negative price is refused."""
    traces = [_constant_trace(0.02, 200, "hard"), _constant_trace(0.9, 64, "easy")]
    plain, parts = compare(traces, _linear_costs(0.2), replicates=2), {}
    own = compare(traces, dataclasses.replace(_linear_costs(0.2), controller=0.01), replicates=2, breakdown=parts)
    assert all(own[name] == plain[name] for name in plain if not name.startswith("gamma=auto"))
    assert own["gamma=auto"] != plain["gamma=auto"]
    trace, rng = traces[0], random.Random(2)
    result = replay(trace, "auto", [rng.random() for _ in trace.accept],
                    dataclasses.replace(_linear_costs(0.2), controller=0.01), lambda: 1.0,
                    GammaController(ControllerConfig(prior_cost_ratio=0.2)))
    # every round 1 s + 0.2 per draft (and per scoring), and 0.01 s of gamma auto's own work
    assert result.seconds == pytest.approx(1.01 * result.rounds + 0.2 * result.drafted + 0.2 * result.scorings)
    assert parts["hard"]["controller"] == pytest.approx(0.01, rel=0.05)  # nearly all its rounds are plain
    for cat in ("hard", "easy", "overall"):
        assert sum(parts[cat].values()) == pytest.approx(own["target-only"][cat] / own["gamma=auto"][cat] - 1)
    fits = {n: {"cost_model": dataclasses.asdict(m)} for n, m in zip(
        ["target-only", *(f"gamma={d}" for d in range(1, 9))], _linear_costs(0.2).models.values())}
    assert RoundCostTable.from_fits(fits, controller=0.01).controller == pytest.approx(0.01)  # plain rounds of 1 s
    with pytest.raises(ValueError, match="controller overhead"):
        RoundCostTable.from_fits(fits, controller=-0.1)


def test_replay_scores_the_backlog_in_fallback_instead_of_probing():
    """A text the draft cannot help: in fallback the replay has the draft score what it missed (the trace's
    acceptance at each position, one draft step charged per scoring) rather than draft probes."""
    trace, rng = _constant_trace(0.02, 600), random.Random(1)
    coins = [rng.random() for _ in range(600)]
    runs = {}
    for scoring in (True, False):
        controller = GammaController(ControllerConfig(prior_cost_ratio=0.2, score_backlog=scoring))
        runs[scoring] = replay(trace, "auto", coins, _linear_costs(0.2), lambda: 1.0, controller)
    scored, probed = runs[True], runs[False]
    assert scored.scorings >= 10 and scored.probes == 0
    assert probed.scorings == 0 and probed.probes >= 10
    assert scored.drafted < probed.drafted
    # every round is charged 1 + 0.2 per draft, a scoring one draft step (0.2) more
    assert scored.seconds == pytest.approx(scored.rounds + 0.2 * scored.drafted + 0.2 * scored.scorings)
    # a scoring priced apart (as benchmarks/adaptive.py fits it) is charged so, and the controller, timing
    # the whole round as the engine does, spaces its scorings by that price: fewer of them
    dear = dataclasses.replace(_linear_costs(0.2), scoring=0.5)
    controller = GammaController(ControllerConfig(prior_cost_ratio=0.2))
    spaced = replay(trace, "auto", coins, dear, lambda: 1.0, controller)
    assert controller.scoring_cost(1) == pytest.approx(0.5, rel=0.01)
    assert spaced.seconds == pytest.approx(spaced.rounds + 0.2 * spaced.drafted + 0.5 * spaced.scorings)
    assert 3 <= spaced.scorings < 0.6 * scored.scorings


def test_compare_replays_in_the_order_given_or_shuffled():
    """benchmarks/adaptive.py runs Spec-Bench category by category, so a category's requests start from the
    acceptance pooled over the categories before it; order="given" replays that, "shuffled" a server's mix."""
    seen: list[list[str]] = []

    class Recording(GammaController):
        def __post_init__(self) -> None:
            super().__post_init__()
            self.ids: list[str] = []  # requests in the order first planned
            seen.append(self.ids)

        def plan(self, request_ids, batch_size, remaining=None, scorable=None, lookup=None, otherwise=None):
            if request_ids[0] not in self.ids:
                self.ids.append(request_ids[0])
            return super().plan(request_ids, batch_size, remaining, scorable, lookup, otherwise)

    traces = [_constant_trace(0.9 if i < 4 else 0.05, 16, "easy" if i < 4 else "hard") for i in range(8)]
    for order, expect_sorted in (("given", True), ("shuffled", False)):
        seen.clear()
        compare(traces, _linear_costs(), replicates=2, new_controller=Recording, order=order)
        shared = [ids for ids in seen if len(ids) == len(traces)]  # gamma auto's; "fresh" ones see one request
        assert len(shared) == 2
        for ids in shared:
            assert ([int(i.split("-")[1]) for i in ids] == list(range(8))) == expect_sorted
    with pytest.raises(ValueError, match="order"):
        compare(traces, _linear_costs(), replicates=1, order="sorted")


def test_costs_from_a_benchmark_run():
    fits = json.loads((ROOT / "docs" / "adaptive_results.json").read_text())["model_fit"]["0.0"]
    costs = RoundCostTable.from_fits(fits)
    assert 0 < costs.round_seconds(0, 300) < costs.round_seconds(8, 300)
    # a prefill with drafting is priced by fixed gamma 1's fit, one without by target-only's (their order is
    # one run's noise: the draft's prefill is ~1 ms of ~100)
    for drafting, name in ((True, "gamma=1"), (False, "target-only")):
        a, b = fits[name]["cost_model"]["prefill_coef"]
        assert costs.prefill_seconds(100, drafting) == pytest.approx(a + 100 * b)
        assert costs.prefill_seconds(100, drafting) > 0
    assert 0 < costs.draft_step < costs.round_seconds(0, 300)
    with pytest.raises(ValueError, match="lack systems"):
        RoundCostTable.from_fits({k: v for k, v in fits.items() if k != "gamma=3"})


def test_trace_validation():
    with pytest.raises(ValueError, match="one value per reply token"):
        Trace("c", 1, (0.5, 0.5), (0.5,), (0.5,))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        Trace("c", 1, (1.5,), (0.5,), (0.5,))


def test_replay_only_script(tmp_path):
    """The script's --replay-only path: traces from a stored result, the goal tables out."""
    traces = [{"category": cat, "prompt_tokens": 20, "accept": [a] * 32, "confidence": [0.5] * 32,
               "rejected_confidence": [None] * 31 + [0.2]} for cat, a in (("easy", 0.8), ("hard", 0.1))]
    stored = {"record_command": "test", "machine": {}, "draft": "test", "traces": {"0.0": traces}}
    (tmp_path / "in.json").write_text(json.dumps(stored))
    out = tmp_path / "out.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "adaptive_replay.py"), "--replay-only", str(tmp_path / "in.json"),
               "--replicates", "2", "--out", str(out), "--costs", str(ROOT / "docs" / "adaptive_results.json")]
    subprocess.run(command, check=True, capture_output=True)
    result = json.loads(out.read_text())
    assert set(result["results"]["0.0"]["gamma=auto"]) == {"easy", "hard", "overall"}
    assert "| category | auto / best fixed gamma |" in out.with_suffix(".md").read_text()
    assert set(result["probes"]["0.0"]) == {"easy", "hard", "overall"}
    assert "Fallback probes per reply (gamma auto): easy " in out.with_suffix(".md").read_text()
    drafts = result["drafts"]["0.0"]
    assert drafts["easy"] > drafts["hard"] > 0  # drafts per reply: the hard text falls back
    assert "Drafts per reply (gamma auto): easy " in out.with_suffix(".md").read_text()
    # grouped by acceptance, with a controller setting named in the report
    subprocess.run(command + ["--by-acceptance", "--controller", "fallback_margin=0,gate=false"], check=True,
                   capture_output=True)
    result = json.loads(out.read_text())
    assert set(result["results"]["0.0"]["gamma=auto"]) == {"alpha 0.0-0.2", "alpha 0.4-1.0", "overall"}
    assert result["controller"]["fallback_margin"] == 0.0 and result["controller"]["gate"] is False
    assert "fallback_margin" in out.with_suffix(".md").read_text()
    for bad in ("no_such_knob=1", "decay=2"):  # an unknown field, and a value ControllerConfig refuses
        failed = subprocess.run(command + ["--controller", bad], capture_output=True, text=True)
        assert failed.returncode == 2 and "--controller" in failed.stderr
    # two stored results replayed as one stream; the report reads the draft's confidence per category
    (tmp_path / "more.json").write_text(json.dumps({**stored, "record_command": "other", "traces": {
        "0.0": [dict(traces[0], category="extra")], "0.7": traces}}))
    subprocess.run(command[:3] + [str(tmp_path / "in.json"), str(tmp_path / "more.json")] + command[4:], check=True,
                   capture_output=True)
    result = json.loads(out.read_text())
    assert set(result["results"]) == {"0.0"}  # only the temperature both have
    assert set(result["results"]["0.0"]["gamma=auto"]) == {"easy", "hard", "extra", "overall"}
    assert result["record_command"] == "test; other"
    assert "easy 0.800 (0; 0.50)" in out.with_suffix(".md").read_text()


def test_draft_confidence_weighs_accepted_and_rejected_drafts():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from adaptive_replay import draft_confidence
    trace = Trace("c", 5, (1.0, 0.25, 0.0, 1.0), (0.9, 0.4, 0.3, 0.6), (math.nan, 0.8, 0.2, math.nan))
    assert draft_confidence(trace) == pytest.approx((0.9 + (0.25 * 0.4 + 0.75 * 0.8) + 0.2 + 0.6) / 4)


class _Scripted:
    """A stand-in controller: plans the given drafts round by round, with fixed gate thresholds."""

    def __init__(self, plans: list[int], thresholds: list[float] = (), rule=None) -> None:
        self.plans, self.thresholds, self.observed, self.remaining = list(plans), list(thresholds), [], []
        self.expected: list[list[float] | None] = []
        self.rule = rule  # (per-bin acceptance, bars): the extension's, as GammaController.gate returns it

    def plan(self, request_ids, batch_size, remaining=None, scorable=None, lookup=None, otherwise=None):
        self.remaining.append(remaining)
        return [self.plans.pop(0) if self.plans else 0]

    def scores_planned(self):
        return {}

    def gate(self, batch_size):
        return self.thresholds, self.rule

    def in_fallback(self, request_id):
        return False

    def observe(self, request_id, drafted, accepted, confidences=None, expected=None):
        self.observed.append((drafted, accepted, list(confidences or [])))
        self.expected.append(expected)

    def observe_timing(self, *args):
        pass

    def release(self, request_id):
        pass


@pytest.mark.parametrize("plain_rounds, charged", [(9, False), (10, True)])
def test_a_long_draft_backlog_costs_a_forward(plain_rounds: int, charged: bool):
    """After a rejected draft the model draft lacks 1 token, then one more per plain round; beyond the
    2 tokens its first forward takes anyway, a backlog over MERGED_BACKLOG (8) costs a draft step, as
    in test_adaptive.py's test of the real drafter (9 plain rounds: a backlog of 8, merged)."""
    trace = _constant_trace(0.5, 40)
    coins = [0.99] * 40  # every draft rejected
    controller = _Scripted([1] + [0] * plain_rounds + [1])
    result = replay(trace, "auto", coins, _linear_costs(), lambda: 1.0, controller)
    plain_cost = result.rounds + 0.15 * result.drafted  # rounds at 1 + 0.15 d seconds, no prefill cost
    assert result.seconds == pytest.approx(plain_cost + (0.15 if charged else 0.0))
    # the controller hears the budget left each round (one token a round, all drafts rejected), as the engine says
    assert controller.remaining == [[40 - r] for r in range(result.rounds)]


def test_the_gate_stops_on_the_text_and_never_off_it():
    trace = Trace("c", 5, (1.0, 1.0, 0.0, 1.0), (0.9, 0.05, 0.5, 0.9), (0.3, 0.3, 0.02, 0.3))
    stops = _Scripted([3], thresholds=[0.1, 0.1, 0.1])
    replay(trace, "auto", [0.5] * 4, _linear_costs(), lambda: 1.0, stops)
    assert stops.observed[0][:2] == (2, 2)  # the second draft (confidence 0.05) ended the round
    rejected = _Scripted([3], thresholds=[0.1, 0.01, 0.01])
    replay(trace, "auto", [0.5] * 4, _linear_costs(), lambda: 1.0, rejected)
    assert rejected.observed[0][:2] == (3, 2)  # rejected at the third: its drawn confidence 0.02 passes
    assert rejected.expected[0] == [1.0, 1.0, 0.0]  # each reached position's acceptance probability, as the engine's
    beyond = _Scripted([3], thresholds=[0.1, 0.01, 0.99])
    trace_short = Trace("c", 5, (1.0, 0.0), (0.9, 0.5), (0.3, 0.3), max_new_tokens=8)
    replay(trace_short, "auto", [0.5] * 2, _linear_costs(), lambda: 1.0, beyond)
    drafted, accepted, confidences = beyond.observed[0]
    assert (drafted, accepted) == (3, 1) and math.isnan(confidences[2])  # off the text: never stops there
    assert beyond.expected[0] == [1.0, 0.0]


def test_a_round_drafts_past_its_plan_while_its_drafts_were_likely_all_accepted():
    """The extension as the engine's drafter applies it: past the plan, one more draft while the product of the
    drafts' bins' acceptance reaches the position's bar; never from a draft off the text (no confidence)."""
    trace = Trace("c", 5, (0.5,) + (1.0,) * 5, (0.95, 0.95, 0.55, 0.95, 0.95, 0.95), (0.3,) * 6, max_new_tokens=12)
    acceptance = (0.0,) * 5 + (0.5,) * 4 + (0.9,)  # bins of 0.1: 0.5-0.9 accepted half the time, 0.9-1 at 0.9
    rule = (acceptance, (0.5,) * 7)
    extended = _Scripted([1], rule=rule)
    replay(trace, "auto", [0.0] * 6, _linear_costs(), lambda: 1.0, extended)
    # 0.9 after one draft, 0.81 after two, 0.405 after the third (confidence 0.55): the round ends there
    assert extended.observed[0][:2] == (3, 3)
    planned = _Scripted([4], rule=rule)  # within the plan the gate alone judges (none here): all 4 drafted
    replay(trace, "auto", [0.0] * 6, _linear_costs(), lambda: 1.0, planned)
    assert planned.observed[0][:2] == (4, 4)
    none = _Scripted([1])
    replay(trace, "auto", [0.0] * 6, _linear_costs(), lambda: 1.0, none)
    assert none.observed[0][:2] == (1, 1)
    rejected = _Scripted([1], rule=rule)
    replay(trace, "auto", [0.99] + [0.0] * 5, _linear_costs(), lambda: 1.0, rejected)
    assert rejected.observed[0][:2] == (1, 0)  # the rejected draft's own confidence (0.3) is too low to go on
    off = _Scripted([1], rule=((0.9,) * 10, (0.0,) * 7))  # every bin 0.9, no bar: only the text's end stops it
    replay(trace, "auto", [0.0] * 6, _linear_costs(), lambda: 1.0, off)
    assert off.observed[0][:2] == (7, 6)  # the seventh draft, past the reply, has no confidence to go on from


def test_drafts_are_clipped_to_the_budget_not_the_text():
    """A reply that stopped at EOS: the engine drafts up to its token budget, past the EOS."""
    ended = Trace("c", 5, (1.0, 1.0), (0.5, 0.5), (0.3, 0.3), max_new_tokens=10)
    result = replay(ended, 4, [0.0, 0.0], _linear_costs(), lambda: 1.0)
    assert (result.rounds, result.drafted, result.tokens) == (1, 4, 2)  # both text tokens were accepted drafts
    cut = replay(dataclasses.replace(ended, max_new_tokens=None), 4, [0.0, 0.0], _linear_costs(), lambda: 1.0)
    assert (cut.rounds, cut.drafted) == (1, 1)  # without a budget the text's end is the limit
    with pytest.raises(ValueError, match="shorter than the reply"):
        dataclasses.replace(ended, max_new_tokens=1)


def test_bad_policies_and_tables_are_refused():
    with pytest.raises(ValueError, match="policy must be"):
        replay(_constant_trace(0.5, 4), "fast", [0.0] * 4, _linear_costs(), lambda: 1.0)
    with pytest.raises(ValueError, match="policy must be"):
        replay(_constant_trace(0.5, 4), -1, [0.0] * 4, _linear_costs(), lambda: 1.0)
    fits = json.loads((ROOT / "docs" / "adaptive_results.json").read_text())["model_fit"]["0.0"]
    with pytest.raises(ValueError, match="max_gamma must be >= 3"):
        RoundCostTable.from_fits(fits, max_gamma=2)
    table = compare([_constant_trace(0.5, 8)], _linear_costs(), replicates=1, fixed=(1, 2))
    assert "Fixed gammas in this run: 1, 2 (the best fixed gamma below is the best of these)." in goal_tables(table)
    for dropped in (["gamma=1", "gamma=2"], ["gamma=auto"], ["target-only"]):
        with pytest.raises(ValueError, match="missing"):
            goal_tables({k: v for k, v in table.items() if k not in dropped})


def test_round_check_compares_the_runs_greedy_prompts_only():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from adaptive_replay import round_check

    fits = json.loads((ROOT / "docs" / "adaptive_results.json").read_text())["model_fit"]["0.0"]
    traces = [Trace(cat, 10, (1.0, 0.0) * 5, (0.5,) * 10, (0.3,) * 10) for cat in "abc" for _ in range(3)]
    run_fits = {name: dict(fit, rounds=1000) for name, fit in fits.items()}
    run_fits["target-only"]["rounds"] = 60  # 2 prompts x 3 categories x 10 tokens: the run's texts
    check = round_check({"0.0": traces}, {"command": "x --per-category 2", "model_fit": {"0.0": run_fits}})
    assert check["target-only"] == [60, 60]
    assert check["gamma=1"] == [6 * 5, 1000]  # drafts alternate accepted, rejected: 2 tokens a round
    run_fits["target-only"]["rounds"] = 90  # the run decoded other texts: nothing to compare
    assert round_check({"0.0": traces}, {"command": "x --per-category 2", "model_fit": {"0.0": run_fits}}) is None


def test_a_drafting_prefill_priced_by_the_drafts_own_timing():
    """With the draft's prefill timed apart, a drafting policy pays target-only's prefill plus the draft's
    prefill of what its window feeds it (interpolated), not fixed gamma 1's line in the whole prompt."""
    fits = json.loads((ROOT / "docs" / "adaptive_results.json").read_text())["model_fit"]["0.0"]
    timed = DraftPrefill(((64, 0.002), (288, 0.006), (512, 0.012)), keeps=288)
    costs = RoundCostTable.from_fits(fits, draft_prefill=timed)
    a, b = fits["target-only"]["cost_model"]["prefill_coef"]
    assert costs.prefill_seconds(700, False) == pytest.approx(a + 700 * b)
    assert costs.prefill_seconds(700, True) == pytest.approx(a + 700 * b + 0.006)  # the window feeds 288
    assert costs.prefill_seconds(177, True) == pytest.approx(a + 177 * b + 0.004)  # 176 fed: halfway
    whole = DraftPrefill(timed.seconds, keeps=None)
    assert whole(1025) == pytest.approx(0.012 + 0.006 * (1024 - 512) / 224)  # past the last point: the last slope
    assert whole(1) == 0.0  # a one-token prompt feeds the draft nothing
    with pytest.raises(ValueError, match="two or more"):
        DraftPrefill(((64, 0.002),))
