"""Benchmark statistics, dataset loaders on small fixtures, and a --quick run on tiny models."""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from model_factory import make_tokenizer, write_hf_model
from specsample.bench.stats import acceptance_summary, percentile, predicted_speedup, two_sample_test
from specsample.datasets import (iter_sharegpt, sharegpt_hard_prompts, sharegpt_prompts, spec_bench_prompts,
                                 text_file_prompts)
from specsample.theory import expected_speedup


def test_percentile() -> None:
    assert percentile([], 50) == 0.0
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile(list(map(float, range(101))), 99) == 99.0
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_two_sample_test_has_power_and_calibration() -> None:
    rng = random.Random(0)
    weights = [0.4, 0.3, 0.2, 0.1]
    same_a = [tuple(rng.choices(range(4), weights, k=2)) for _ in range(3000)]
    same_b = [tuple(rng.choices(range(4), weights, k=2)) for _ in range(3000)]
    other = [tuple(rng.choices(range(4), [0.3, 0.3, 0.25, 0.15], k=2)) for _ in range(3000)]
    assert two_sample_test(same_a, same_b)["p_value"] > 0.01
    assert two_sample_test(same_a, other)["p_value"] < 1e-6
    rare = [(9, 9)] + same_a[1:]  # a category too rare for the approximation is pooled, not dropped
    assert two_sample_test(rare, same_b)["categories"] <= 17


def test_acceptance_summary_and_prediction() -> None:
    stats = [{"drafted": 10, "accepted": 6, "drafts": 3, "rejections": 2, "accepted_per_position_counts": [3, 2, 1],
              "drafted_per_position_counts": [3, 3, 3]},
             {"drafted": 4, "accepted": 4, "drafts": 1, "rejections": 0, "accepted_per_position_counts": [1, 1, 1, 1],
              "drafted_per_position_counts": [1, 1, 1, 1]}]
    summary = acceptance_summary(stats)
    assert summary["acceptance_rate"] == pytest.approx(10 / 14)
    assert summary["alpha"] == pytest.approx(10 / 12)  # successes / (successes + rejections)
    assert summary["mean_accepted_length"] == pytest.approx(1 + 10 / 4)
    assert summary["acceptance_per_position"] == [1.0, 0.75, 0.5, 1.0]
    assert predicted_speedup(0.8, 4.4, 0.05) == pytest.approx(expected_speedup(0.8, 4, 0.05))


def test_cost_ratio_comes_from_whole_rounds() -> None:
    """c is what a drafted position adds to a round over a plain round, not a draft step over a target forward."""
    from specsample.bench.run import _cost_ratio

    plain = [{"rounds": 100, "draft_seconds": 0.0, "target_seconds": 9.0, "verify_seconds": 1.0}]  # 0.1 s/round
    spec = [{"rounds": 50, "gamma_mean": 4.0, "draft_seconds": 2.0, "target_seconds": 6.0, "verify_seconds": 1.0},
            {"rounds": 50, "gamma_mean": 4.0, "draft_seconds": 2.0, "target_seconds": 6.0, "verify_seconds": 1.0}]
    # 0.18 s per round with 4 drafts: (0.18 / 0.1 - 1) / 4; draft step / target forward would say 0.0083 / 0.12
    assert _cost_ratio(spec, plain) == pytest.approx(0.2)
    assert _cost_ratio(spec, []) is None  # no plain rounds timed: no estimate rather than c = 0


def test_sharegpt_parser_stops_at_a_truncated_tail(tmp_path) -> None:
    convs = [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"question {i}"},
                                               {"from": "gpt", "value": f"answer {i}"}]} for i in range(5)]
    text = json.dumps(convs, indent=2)
    cut = text[: text.index('"c4"') + 10]  # the file breaks inside the last conversation
    path = tmp_path / "sharegpt.json"
    path.write_text(cut)
    assert [c["id"] for c in iter_sharegpt(path, chunk_chars=64)] == ["c0", "c1", "c2", "c3"]
    prompts = list(sharegpt_prompts(path, limit=2, skip=1))
    assert [p.turns for p in prompts] == [("question 1",), ("question 2",)]
    assert prompts[0].replies == ("answer 1",)


def test_sharegpt_hard_prompts_pick_translations_and_long_prompts(tmp_path) -> None:
    convs = [{"id": f"c{i}", "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
             for i, (q, a) in enumerate([("short", "x" * 300), ("y" * 3000, "short"), ("skip", "z" * 900),
                                         ("short", "w" * 400), ("v" * 4000, "w" * 400)])]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(convs))
    prompts = sharegpt_hard_prompts(2, skip=0, path=path)
    assert [(p.id, p.category) for p in prompts] == [("c0-translate", "translate"), ("c3-translate", "translate"),
                                                     ("c1", "long"), ("c4", "long")]
    assert prompts[0].turns[0].startswith("Translate the following text into French:") and "x" * 300 in prompts[0].turns[0]
    assert "into German" in prompts[1].turns[0]


def test_prompt_file_loaders(tmp_path) -> None:
    bench = tmp_path / "questions.jsonl"
    bench.write_text('{"question_id": 1, "category": "qa", "turns": ["what?"]}\n'
                     '{"question_id": 3, "category": "math", "turns": ["1+1?", "and 2+2?"]}\n')
    prompts = spec_bench_prompts(bench)
    assert [(p.id, p.category, p.turns[0]) for p in prompts] == [("1", "qa", "what?"), ("3", "math", "1+1?")]
    plain = tmp_path / "plain.txt"
    plain.write_text("first prompt\n\n{\"prompt\": \"second\", \"category\": \"x\"}\n")
    assert [(p.category, p.turns) for p in text_file_prompts(plain)] == [("file", ("first prompt",)), ("x", ("second",))]
    with pytest.raises(ValueError, match="not found"):
        spec_bench_prompts(tmp_path / "missing.jsonl")


def test_quick_bench_on_tiny_models(tmp_path) -> None:
    tokenizer = make_tokenizer()
    target = write_hf_model(tmp_path / "target", "llama", tokenizer=tokenizer, max_position_embeddings=512)
    draft = write_hf_model(tmp_path / "draft", "llama", tokenizer=tokenizer, seed=3, num_hidden_layers=1)
    questions = tmp_path / "questions.jsonl"
    questions.write_text("\n".join(json.dumps({"question_id": i, "category": c, "turns": [f"the quick fox {i}"]})
                                   for i, c in enumerate(["qa", "qa", "math", "math"])))
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "specsample.cli", "bench", "--quick", "--target", str(target),
                           "--draft", str(draft), "--dataset", str(questions), "--max-new-tokens", "12",
                           "--compare", "hf,hf-assisted,hf-lookup", "--lossless-samples", "200",
                           "--gamma", "auto,2,3", "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    for name in ("results.json", "results.md", "speedup_vs_gamma.png", "acceptance_by_position.png",
                 "speedup_by_category.png", "speedup_vs_batch.png"):
        assert (out / name).exists(), name
    results = json.loads((out / "results.json").read_text())
    assert set(results["environment"]) >= {"cpu", "threads", "torch", "dtype"}
    table = results["compare"]["0.0"]
    assert set(table) == {"target-only (ours)", "specsample gamma=auto", "transformers generate",
                          "transformers assisted", "transformers prompt lookup"}
    spec = table["specsample gamma=auto"]["overall"]
    for field in ("tokens_per_s", "speedup", "ttft_p50_ms", "tpot_p50_ms", "tpot_p99_ms"):
        assert field in spec
    assert set(table["specsample gamma=auto"]) == {"qa", "math", "overall"}
    assert [p["gamma"] for p in results["gamma_sweep"]["points"]] == ["auto", 2, 3]
    assert [b["batch_size"] for b in results["batch_sweep"]] == [1, 4]
    assert all(0.0 <= t["p_value"] <= 1.0 for t in results["losslessness"])
    assert "## Losslessness" in (out / "results.md").read_text()


def _noisy_runs(rng: random.Random, drafts: int, noise: float) -> list[tuple[str, float, object]]:
    """Runs of one fixed-gamma system whose rounds cost 20 ms + 3 ms per draft + 5 ms per 1000 tokens of
    context, times lognormal noise of mean 1; per run: its category, its noise-free seconds and its RunTiming."""
    from specsample.bench.round_costs import RoundTiming, RunTiming

    runs = []
    for i in range(40):
        prompt = rng.choice([50, 400, 1200])
        rounds, true, context = [], 0.002 + 0.0001 * prompt, prompt
        for _ in range(30):
            d = drafts if rng.random() < 0.9 else 0
            cost = 0.020 + 0.003 * d + 0.005 * context / 1000
            rounds.append(RoundTiming(d, context, cost * rng.lognormvariate(-noise ** 2 / 2, noise)))
            true += cost
            context += 1 + d // 2
        runs.append((f"cat{i % 4}", true, RunTiming(prompt, (0.002 + 0.0001 * prompt) * rng.lognormvariate(-noise ** 2 / 2, noise),
                                                    tuple(rounds))))
    return runs


def test_modelled_time_removes_timing_noise_and_keeps_each_systems_total() -> None:
    from specsample.bench.round_costs import CostModel

    rng = random.Random(5)
    runs = _noisy_runs(rng, drafts=2, noise=0.3)
    model = CostModel.fit([timing for _, _, timing in runs])
    assert model.round_seconds(2, 1000) == pytest.approx(0.020 + 0.006 + 0.005, rel=0.05)
    # least squares with an intercept per draft count: the rounds' modelled total is their measured total
    # (this noise puts no round over 3x its prediction); prefills over 1.5x (lognormal 0.3: a few) are stalls
    rounds = [r for _, _, t in runs for r in t.rounds]
    assert sum(model.round_seconds(r.drafted, r.context) for r in rounds) == pytest.approx(
        sum(r.seconds for r in rounds), rel=1e-9)
    assert 0 < model.stalls < 0.2 * len(runs)
    # per category, measured time is off by the noise of ~10 runs; modelled time by far less
    for cat in ("cat0", "cat1"):
        chosen = [(true, timing) for c, true, timing in runs if c == cat]
        true = sum(x for x, _ in chosen)
        measured = sum(t.seconds for _, t in chosen) / true
        modelled = sum(model.seconds(t) for _, t in chosen) / true
        assert abs(modelled - 1) < 0.01 and abs(modelled - 1) < abs(measured - 1) + 1e-3
    with pytest.raises(ValueError, match="drafting 5 tokens"):
        model.round_seconds(5, 100)


def test_a_stall_of_the_box_does_not_spread_over_a_system(monkeypatch) -> None:
    """One run decoded at a quarter of the box's speed (another tenant): a plain mean charges that to
    every round of the system; the second fit leaves those rounds out."""
    import dataclasses

    import specsample.bench.round_costs as round_costs

    runs = [timing for _, _, timing in _noisy_runs(random.Random(6), drafts=2, noise=0.05)]
    runs[0] = dataclasses.replace(runs[0], rounds=tuple(dataclasses.replace(r, seconds=4 * r.seconds)
                                                        for r in runs[0].rounds))
    true = 0.020 + 0.006 + 0.005
    assert round_costs.CostModel.fit(runs).round_seconds(2, 1000) == pytest.approx(true, rel=0.02)
    monkeypatch.setattr(round_costs, "STALL", float("inf"))  # the plain mean: 1 run in 40 at 4x reads 16% dear here
    assert round_costs.CostModel.fit(runs).round_seconds(2, 1000) > 1.05 * true
    with pytest.raises(ValueError, match="without any rounds"):
        round_costs.CostModel.fit([])


def test_ours_records_every_round_of_a_batch_one_run(tiny_target, tiny_draft) -> None:
    from specsample.bench.systems import Ours
    from specsample.config import SamplingParams, SpecConfig
    from specsample.drafters.model import ModelDrafter

    system = Ours("g3", tiny_target, ModelDrafter(tiny_draft), SpecConfig(gamma=3, max_batch_size=1), frozenset())
    record = system.run([[1, 2, 3, 4, 5]], SamplingParams(temperature=1.0, max_new_tokens=20, seed=1))[0]
    timing = record.timing
    assert timing is not None and timing.prompt_tokens == 5 and len(timing.rounds) == record.stats["rounds"]
    assert timing.rounds[0].context == 5 and timing.rounds[-1].context < 5 + 20
    assert sum(r.drafted for r in timing.rounds) == record.stats["drafted"]
    assert timing.seconds == pytest.approx(record.seconds, rel=0.05) and timing.prefill_seconds > 0
    batch = system.run([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=4))
    assert batch[0].timing is None  # rounds of a batch are shared: no per-run cost


def test_a_placebo_copy_samples_other_texts_from_its_own_seeds(tiny_target, tiny_draft) -> None:
    """Ours(seed_offset=k) decodes a seeded request as seed + k (other texts, same distribution): the benchmark's
    copies of fixed gammas meet the luck of texts that gamma auto meets. Unseeded and greedy requests are as
    they were."""
    from specsample.bench.systems import Ours
    from specsample.config import SamplingParams, SpecConfig
    from specsample.drafters.model import ModelDrafter

    config = SpecConfig(gamma=2, max_batch_size=1)

    def tokens(offset: int, seed: int | None, temperature: float = 1.0) -> list[int]:
        system = Ours("g2", tiny_target, ModelDrafter(tiny_draft), config, frozenset(), seed_offset=offset)
        params = SamplingParams(temperature=temperature, max_new_tokens=24, seed=seed)
        return system.run([[1, 2, 3, 4, 5]], [params])[0].tokens

    assert tokens(7, 3) == tokens(0, 10) != tokens(0, 3)
    assert tokens(7, 3, temperature=0.0) == tokens(0, 3, temperature=0.0)
    assert len(tokens(7, None)) == 24


def test_lockstep_runs_decode_as_alone_and_time_only_their_own_rounds(tiny_target, tiny_draft) -> None:
    """Systems taking turns round by round (the adaptive benchmark's default) produce the texts they produce
    alone, and each system's time is its own rounds': a system whose every draft sleeps 10 ms does not slow
    the others' clocks."""
    from specsample.bench.systems import Ours, run_lockstep
    from specsample.config import SamplingParams, SpecConfig
    from specsample.drafters.model import ModelDrafter

    class SleepyDrafter(ModelDrafter):
        def propose(self, *args, **kwargs):
            time.sleep(0.01)
            return super().propose(*args, **kwargs)

    def systems(slow: bool = False) -> list[Ours]:
        config = SpecConfig(gamma=3, max_batch_size=1)
        return [Ours("plain", tiny_target, None, SpecConfig(speculative=False, max_batch_size=1), frozenset()),
                Ours("g3", tiny_target, (SleepyDrafter if slow else ModelDrafter)(tiny_draft), config, frozenset()),
                Ours("auto", tiny_target, ModelDrafter(tiny_draft), SpecConfig(gamma=4, adaptive=True, max_batch_size=1),
                     frozenset(), keep_controller=False)]

    prompt = [1, 2, 3, 4, 5]
    for params in (SamplingParams(temperature=0.0, max_new_tokens=24), SamplingParams(temperature=1.0, max_new_tokens=24,
                                                                                        seed=3)):
        alone = [s.run([prompt], params)[0] for s in systems()]
        together = [r[0] for r in run_lockstep(systems(), [prompt], params)]
        # gamma auto's choices follow its timings, which differ between any two runs: its sampled text may
        # differ too (from the same distribution); greedy, and with a fixed gamma, the texts are the same
        same = 3 if params.greedy else 2
        assert [r.tokens for r in together][:same] == [r.tokens for r in alone][:same]
        assert [r.stats["rounds"] for r in together][:2] == [r.stats["rounds"] for r in alone][:2]
    begin = time.perf_counter()
    plain, slow, auto = (r[0] for r in run_lockstep(systems(slow=True), [prompt], SamplingParams(max_new_tokens=24)))
    elapsed = time.perf_counter() - begin
    assert slow.seconds > 0.01 * len(slow.timing.rounds)  # it slept in every drafting round
    assert plain.seconds + slow.seconds + auto.seconds <= elapsed
    assert plain.seconds < 0.5 * slow.seconds and auto.seconds < 0.5 * slow.seconds
    for record in (plain, slow, auto):  # the own clock: rounds and prefill make up the system's time
        assert record.timing.seconds == pytest.approx(record.seconds, rel=0.2)
        assert 0 < record.ttft <= record.seconds
    # shuffled turns: a fresh order every round, the same texts, and each system follows more than one other
    import random

    from specsample.bench.systems import OursRun
    steps: list[str] = []
    real_step = OursRun.step

    def logged(run):
        steps.append(run.name)
        return real_step(run)

    greedy = SamplingParams(temperature=0.0, max_new_tokens=24)
    OursRun.step = logged
    try:
        shuffled = [r[0] for r in run_lockstep(systems(), [prompt], greedy, random.Random(0))]
    finally:
        OursRun.step = real_step
    assert [r.tokens for r in shuffled] == [s.run([prompt], greedy)[0].tokens for s in systems()]
    before_plain = {steps[k - 1] for k in range(1, len(steps)) if steps[k] == "plain"}
    assert before_plain >= {"g3", "auto"}
    shared = ModelDrafter(tiny_draft)
    with pytest.raises(ValueError, match="a drafter each"):
        run_lockstep([Ours(n, tiny_target, shared, SpecConfig(gamma=2, max_batch_size=1), frozenset()) for n in "ab"],
                     [prompt], SamplingParams(max_new_tokens=4))


def test_encode_fitting_keeps_prompts_that_leave_room_for_the_reply():
    from specsample.bench.run import encode_fitting
    from specsample.datasets import Prompt

    class Words:
        def encode(self, text, chat=True):
            return [1] * (len(text.split()) + (2 if chat else 0))

    prompts = [Prompt("a", "c", ("one two",)), Prompt("b", "c", ("one two three four five six",))]
    kept, ids = encode_fitting(prompts, Words(), max_seq_len=10, max_new_tokens=4)
    assert [p.id for p in kept] == ["a"] and ids == [[1] * 4]
    assert len(encode_fitting(prompts, Words(), 10, 4, chat=False)[0]) == 2  # 6 words + 4 fit without the template
    with pytest.raises(ValueError, match="no prompt fits"):
        encode_fitting(prompts, Words(), max_seq_len=5, max_new_tokens=4)


def test_command_line_reproduces_the_options_given() -> None:
    import argparse

    from specsample.bench.report import command_line
    args = argparse.Namespace(target="smollm2", draft=None, compiled=False, fast=True, per_category=2, controller="")
    line = command_line("benchmarks/x.py", args)
    assert line == "python benchmarks/x.py --target smollm2 --no-compiled --fast --per-category 2"
    assert "None" not in line  # a default resolved later is left out, so the line runs (and an empty one)
    spaced = argparse.Namespace(systems="target-only,target-only again", variant=["default", "nogate:gate=false"])
    line = command_line("benchmarks/y.py", spaced)
    assert line == ("python benchmarks/y.py --systems 'target-only,target-only again' "
                    "--variant default --variant nogate:gate=false")
    import shlex
    assert shlex.split(line)[3] == "target-only,target-only again"  # the shell reads it back as one value


def _drifting_box_runs(rng: random.Random) -> tuple[dict[str, list], set[int]]:
    """Two systems decode 60 prompts back to back while the box runs 8% slow on prompts 20-39. Plain rounds
    cost 15 ms in both; "policy" decodes plain only on those slow prompts (as gamma auto does where its
    draft fails: Spec-Bench runs category by category) and drafts 1 (20 ms) elsewhere."""
    from specsample.bench.round_costs import RoundTiming, RunTiming

    slow = set(range(20, 40))
    runs: dict[str, list] = {"target-only": [], "policy": []}
    for prompt in range(60):
        factor = 1.08 if prompt in slow else 1.0
        for name in runs:
            drafted = 1 if name == "policy" and prompt not in slow else 0
            rounds = tuple(RoundTiming(drafted, 100 + k, factor * (0.015 + 0.005 * drafted) * rng.lognormvariate(0, 0.05))
                           for k in range(40))
            runs[name].append((prompt, RunTiming(100, 0.01 * factor, rounds)))
    return runs, slow


def test_a_shared_box_speed_prices_the_same_plain_round_alike() -> None:
    """Fitted per system, "policy"'s plain round takes the slow stretch's price (8% dear), so on the slow
    prompts it reads ~8% slower than target-only though both decoded the same plain rounds at the same
    time; with the slowdown per prompt shared by both systems, both plain rounds cost the same and the
    slow prompts compare equal. Modelled totals stay the measured totals over all systems."""
    from specsample.bench.round_costs import CostModel, fit_shared_speed

    runs, slow = _drifting_box_runs(random.Random(3))

    def slow_ratio(models: dict) -> float:  # policy's modelled time over target-only's on the slow prompts
        time = {name: sum(models[name].seconds(r) for p, r in rows if p in slow) for name, rows in runs.items()}
        return time["policy"] / time["target-only"]

    alone = {name: CostModel.fit([r for _, r in rows]) for name, rows in runs.items()}
    assert slow_ratio(alone) > 1.04  # 1.08 / 1.027 (the mean speed): the bias the shared fit removes: this test can fail
    shared = fit_shared_speed(runs)
    assert slow_ratio(shared.models) == pytest.approx(1.0, abs=0.01)
    plain = {name: model.round_seconds(0, 120) for name, model in shared.models.items()}
    assert plain["policy"] == pytest.approx(plain["target-only"], rel=0.01)
    assert shared.models["policy"].round_seconds(1, 120) / plain["target-only"] == pytest.approx(20 / 15, rel=0.01)
    by_stretch = [statistics.mean(v for p, v in shared.slowdown.items() if (p in slow) == s) for s in (True, False)]
    assert by_stretch[0] / by_stretch[1] == pytest.approx(1.08, rel=0.01)
    measured = sum(r.seconds for rows in runs.values() for _, r in rows)
    modelled = sum(shared.models[name].seconds(r) for name, rows in runs.items() for _, r in rows)
    assert modelled == pytest.approx(measured, rel=1e-9)
    with pytest.raises(ValueError, match="every system"):
        fit_shared_speed({"a": []})


def test_the_adaptive_benchmark_remodels_a_stored_run(tmp_path) -> None:
    """benchmarks/adaptive.py stores every round, and --remodel rewrites the modelled tables from them:
    with --box-speed none as each system's fit alone, by default with the shared box speed."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import adaptive

    runs, _ = _drifting_box_runs(random.Random(4))
    rows = {name: [adaptive._dump_run(p, "slow" if 20 <= p < 40 else "fast", 40, r) for p, r in rs]
            for name, rs in runs.items()}
    rows["gamma=1"] = rows.pop("policy")  # the goal tables need a fixed gamma...
    rows["gamma=auto"] = rows["gamma=1"]  # ...and gamma auto
    rows[adaptive.AGAIN] = rows["target-only"]  # target-only twice: its report prints the run's timing noise
    stored = {"command": "python benchmarks/adaptive.py --test", "draft": "d", "results": {"0.0": {}},
              "rounds": {"0.0": rows}}
    adaptive.add_modelled(stored, "none")
    stored["results"]["0.0"] = stored["modelled"]["0.0"]
    source = tmp_path / "run.json"
    source.write_text(json.dumps(stored))
    for box_speed, expected in (("none", 1.04), ("shared", 0.99)):
        out = tmp_path / f"{box_speed}.json"
        subprocess.run([sys.executable, str(Path(__file__).resolve().parents[1] / "benchmarks" / "adaptive.py"),
                        "--remodel", str(source), "--box-speed", box_speed, "--out", str(out)], check=True,
                       capture_output=True)
        table = json.loads(out.read_text())["modelled"]["0.0"]
        ratio = table["target-only"]["slow"] / table["gamma=auto"]["slow"]  # time of gamma auto over target-only's
        assert (ratio > expected) if box_speed == "none" else (ratio == pytest.approx(1.0, abs=0.01))
        text = out.with_suffix(".md").read_text()
        assert f"--remodel {source} --box-speed {box_speed}" in text
        assert ("prompts' slowdowns" in text) == (box_speed == "shared")
        assert "log(its time / target-only's) per reply is 0.000 over 60 replies" in text
        assert "Interleaved prompt by prompt" in text  # a result without the interleave mode predates round turns
    assert "drawn afresh every round" in adaptive._interleave_note({"interleave": "round", "turns": "shuffled"})
    assert "always followed the same other one" in adaptive._interleave_note({"interleave": "round"})  # session 22
    old = tmp_path / "old.json"  # a result from before rounds were stored
    old.write_text(json.dumps({k: v for k, v in stored.items() if k != "rounds"}))
    with pytest.raises(SystemExit, match="no recorded rounds"):
        adaptive.remodel(old, "shared", tmp_path / "x.json", "cmd")


def test_rounds_that_scored_a_backlog_are_priced_apart() -> None:
    """One plain round in 10 also runs a draft forward over the backlog (+4 ms on 15): with the flag it
    has its own term and the plain round keeps its 15 ms; without it, every plain round reads 0.4 ms dear."""
    import dataclasses

    from specsample.bench.round_costs import CostModel, RoundTiming, RunTiming

    rng = random.Random(8)
    rounds = tuple(RoundTiming(0, 100 + k, (0.015 + (0.004 if k % 10 == 0 else 0.0)) * rng.lognormvariate(0, 0.02),
                               scored=k % 10 == 0) for k in range(400))
    run = RunTiming(100, 0.01, rounds)
    model = CostModel.fit([run])
    assert model.round_seconds(0, 300) == pytest.approx(0.015, rel=0.01)
    assert model.scored_coef == pytest.approx(0.004, rel=0.05)
    assert model.round_seconds(0, 300, scored=True) == pytest.approx(0.019, rel=0.01)
    unmarked = CostModel.fit([RunTiming(100, 0.01, tuple(dataclasses.replace(r, scored=False) for r in rounds))])
    assert unmarked.round_seconds(0, 300) > 1.02 * model.round_seconds(0, 300) and unmarked.scored_coef == 0.0
    # stored models from before the term read back with none
    stored = dataclasses.asdict(model)
    del stored["scored_coef"]
    assert CostModel.from_dict(stored).scored_coef == 0.0


def test_a_stalled_prefill_does_not_bend_the_prefill_line() -> None:
    """A one-second stall during the longest prompt's prefill (4.2 s where 1.5 s is usual) pulled the
    least-squares prefill line so far that short prompts' predictions went negative and long ones read
    30% dear; stalls judged against a robust line are left out."""
    from specsample.bench.round_costs import CostModel, RoundTiming, RunTiming

    rng = random.Random(9)
    runs = []
    for i in range(60):
        prompt = 1376 if i == 0 else rng.choice([40, 60, 90, 300, 500, 700, 800])
        seconds = (0.002 + 0.001 * prompt) * rng.lognormvariate(0, 0.08) * (2.8 if i == 0 else 1.0)
        runs.append(RunTiming(prompt, seconds, (RoundTiming(0, prompt, 0.015),)))
    model = CostModel.fit(runs)
    assert model.prefill_coef[1] == pytest.approx(0.001, rel=0.05) and model.stalls >= 1
    line = np.polyfit([r.prompt_tokens for r in runs], [r.prefill_seconds for r in runs], 1)
    assert line[0] > 1.1 * 0.001  # plain least squares: the stall steepens the line (the test can fail)


def test_plain_round_overhead_script_on_tiny_models(tmp_path) -> None:
    """benchmarks/plain_round_overhead.py runs target-only and gamma auto held in fallback in lockstep and
    writes per-reply ratios (gamma auto's plain round does more work: the ratio is not below 1 by much)."""
    out = tmp_path / "overhead.json"
    done = subprocess.run([sys.executable, str(Path(__file__).resolve().parents[1] / "benchmarks" / "plain_round_overhead.py"),
                           "--models", "tiny", "--repeats", "2", "--tokens", "40", "--temperatures", "0", "--out",
                           str(out)], capture_output=True, text=True, check=True)
    result = json.loads(out.read_text())["results"]["0.0"]
    assert result["replies"] == 2 and len(result["ratios"]) == 2 and result["median_ratio"] > 0.8
    assert "gamma auto's minus target-only's" in done.stdout and out.with_suffix(".md").exists()


def test_the_measured_split_pairs_replies_and_adds_up() -> None:
    """benchmarks/adaptive.py's measured split: gamma auto's prefill, plain and scoring rounds beyond as many of
    target-only's plain rounds (at that reply's mean), the rest to drafting; the parts add up to its extra time."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import adaptive
    from specsample.bench.round_costs import RoundTiming, RunTiming

    plain = RunTiming(50, 0.1, tuple(RoundTiming(0, 50 + k, 0.02) for k in range(10)))  # 0.3 s
    auto = RunTiming(50, 0.11, (RoundTiming(1, 50, 0.026), RoundTiming(1, 52, 0.026), RoundTiming(0, 54, 0.025, True),
                                *(RoundTiming(0, 55 + k, 0.021) for k in range(6))))  # 0.313 s
    report = {"rounds": {"0.0": {"target-only": [adaptive._dump_run(7, "c", 10, plain)],
                                 "gamma=auto": [adaptive._dump_run(7, "c", 10, auto)]}}}
    split = adaptive.measured_split(report, "0.0")
    assert split["c"] == split["overall"]
    assert split["c"]["prefill"] == pytest.approx(0.01 / 0.3)
    assert split["c"]["plain"] == pytest.approx(6 * 0.001 / 0.3)
    assert split["c"]["scoring"] == pytest.approx(0.005 / 0.3)
    assert split["c"]["drafting"] == pytest.approx((0.013 - 0.01 - 0.006 - 0.005) / 0.3)
    assert sum(split["c"].values()) == pytest.approx(0.313 / 0.3 - 1)
    assert adaptive.measured_split({"rounds": {"0.0": {"target-only": []}}}, "0.0") == {}


def test_goal_intervals_pair_systems_on_resampled_prompts() -> None:
    """The bootstrap of the goal ratios: exact where every reply agrees, the best fixed gamma picked afresh in
    each resample, a prompt's replies resampled together, and a clear miss called a miss."""
    from specsample.bench.goals import goal_intervals, interval_table

    def replies(speeds: dict[str, list[float]], category: str = "c") -> dict[str, list]:
        return {name: [(key, category, 10, 10 / speed) for key, speed in enumerate(by_key)]
                for name, by_key in speeds.items()}

    flat = replies({"target-only": [50.0] * 4, "gamma=1": [60.0] * 4, "gamma=2": [55.0] * 4,
                    "gamma=auto": [72.0] * 4})
    assert goal_intervals(flat, prompts=4, resamples=200)["gamma=auto"]["c"] == pytest.approx([1.2] * 3 + [1.44] * 3)
    # gamma 1 is fast on prompts 0-1, gamma 2 on 2-3, auto on all: 1.5 times either over the whole category, but
    # 1.0 in a resample holding one kind of prompt, whose best fixed gamma is then as fast as auto
    split = replies({"target-only": [50.0] * 4, "gamma=1": [100.0, 100.0, 50.0, 50.0],
                     "gamma=2": [50.0, 50.0, 100.0, 100.0], "gamma=auto": [100.0] * 4})
    point, low, high, *_ = goal_intervals(split, prompts=4, resamples=400)["gamma=auto"]["c"]
    assert (point, low, high) == (1.5, pytest.approx(1.0), 1.5)  # the max is taken in each resample
    # four replies of one prompt (key % prompts) resample as one: no spread; as four prompts they spread
    noisy = replies({"target-only": [50.0] * 4, "gamma=1": [50.0] * 4, "gamma=auto": [40.0, 60.0, 45.0, 55.0]})
    one_prompt = goal_intervals(noisy, prompts=1, resamples=400)["gamma=auto"]["c"]
    assert one_prompt[1] == one_prompt[2]
    four = goal_intervals(noisy, prompts=4, resamples=400)["gamma=auto"]["c"]
    assert four[2] - four[1] > 0.1 and four[1] < four[0] < four[2]
    slow = replies({"target-only": [50.0] * 6, "gamma=1": [50.0] * 6,
                    "gamma=auto": [45.0, 46.0, 44.0, 45.5, 46.0, 44.5]})
    table = interval_table(goal_intervals(slow, prompts=6, resamples=400))
    assert table[4].startswith("| c |") and table[4].count("| missed |") == 2
    assert "| within noise |" in interval_table(goal_intervals(noisy, prompts=4, resamples=400))[4]
    with pytest.raises(ValueError, match="gamma=auto did not decode the same replies"):
        goal_intervals({**flat, "gamma=auto": flat["gamma=auto"][:3]}, prompts=4)
    with pytest.raises(ValueError, match="missing"):
        goal_intervals({"target-only": flat["target-only"], "gamma=auto": flat["gamma=auto"]}, prompts=4)
    with pytest.raises(ValueError, match="level"):
        goal_intervals(flat, prompts=4, level=1.0)
    with pytest.raises(ValueError, match="resamples"):
        goal_intervals(flat, prompts=4, resamples=0)


def test_the_placebo_is_the_copy_of_whichever_fixed_gamma_measured_best() -> None:
    """'best fixed gamma again': per category (and per resample) the second decoding of the fixed gamma that
    measured best; absent unless every fixed gamma was decoded twice."""
    from specsample.bench.goals import PLACEBO, goal_intervals, goal_tables, placebo_speeds

    # gamma 1 measured best in "a" (its copy 57), gamma 2 in "b" (its copy 70): the copies fall short of the max
    table = {"target-only": {"a": 50.0, "b": 50.0, "overall": 50.0},
             "gamma=1": {"a": 60.0, "b": 55.0, "overall": 57.0}, "gamma=2": {"a": 58.0, "b": 72.0, "overall": 64.0},
             "gamma=1 again": {"a": 57.0, "b": 61.0, "overall": 59.0},
             "gamma=2 again": {"a": 62.0, "b": 70.0, "overall": 66.0},
             "gamma=auto": {"a": 59.0, "b": 71.0, "overall": 65.0}}
    assert placebo_speeds(table, ["a", "b", "overall"]) == {"a": 57.0, "b": 70.0, "overall": 66.0}
    lines = goal_tables(table)
    assert "| a | 0.950 | 1.140 | no | yes |" in lines and "| b | 0.972 | 1.400 | yes | yes |" in lines
    assert f"| {PLACEBO} | 1 | 2 | 1.320 |" in lines
    assert placebo_speeds({k: v for k, v in table.items() if k != "gamma=2 again"}, ["a"]) is None
    assert not any(PLACEBO in line for line in goal_tables({k: v for k, v in table.items() if k != "gamma=2 again"}))

    def replies(speeds: dict[str, list[float]]) -> dict[str, list]:
        return {name: [(key, "c", 10, 10 / speed) for key, speed in enumerate(by_key)] for name, by_key in speeds.items()}

    # gamma 1 is best on prompts 0-1 and overall, its copy as fast; gamma 2 is best on 2-3, where its copy is
    # 10% slower: the placebo is 1 on all replies and 0.9 in resamples that hold only prompts 2-3
    pair = replies({"target-only": [50.0] * 4, "gamma=1": [100.0, 100.0, 50.0, 50.0],
                    "gamma=2": [45.0, 45.0, 100.0, 100.0], "gamma=1 again": [100.0, 100.0, 50.0, 50.0],
                    "gamma=2 again": [45.0, 45.0, 90.0, 90.0], "gamma=auto": [100.0] * 4})
    point, low, high = goal_intervals(pair, prompts=4, resamples=400)[PLACEBO]["c"][:3]
    assert point == pytest.approx(1.0) and high == pytest.approx(1.0) and low < 0.95
    assert PLACEBO not in goal_intervals({k: v for k, v in pair.items() if k != "gamma=2 again"}, prompts=4,
                                         resamples=50)


def test_goal_intervals_pool_runs_of_the_same_prompts(tmp_path) -> None:
    """benchmarks/goal_intervals.py pools runs: a prompt's replies from every run stay one prompt, runs of
    different prompt sets are refused, and the tables say which runs they pooled."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import adaptive
    from goal_intervals import pooled_replies
    from specsample.bench.round_costs import RoundTiming, RunTiming

    def run(samples: int, speed: dict[str, float]) -> dict:
        timing = {name: RunTiming(5, 0.0, (RoundTiming(0, 5, 10 / s),)) for name, s in speed.items()}
        return {"command": f"x --samples {samples}", "rounds": {"0.7": {
            name: [adaptive._dump_run(i + k * 3, "c", 10, timing[name]) for k in range(samples) for i in range(3)]
            for name in speed}}}

    first, second = run(2, {"target-only": 50, "gamma=1": 60, "gamma=auto": 55}), run(4, {"target-only": 50,
                                                                                         "gamma=1": 60, "gamma=auto": 66})
    replies, prompts, difficulty, rounds = pooled_replies([first, second], "0.7")
    assert difficulty == {} and sorted(rounds["gamma=auto"]) == sorted(k for k, *_ in replies["gamma=auto"])
    assert prompts == 3 and len(replies["gamma=auto"]) == 18
    assert sorted({key % 3 for key, *_ in replies["gamma=auto"]}) == [0, 1, 2]
    assert len({key for key, *_ in replies["gamma=auto"]}) == 18  # distinct across runs
    with pytest.raises(SystemExit, match="different prompt sets"):
        pooled_replies([first, {**run(1, {"target-only": 1, "gamma=1": 1, "gamma=auto": 1}), "prompts": 4}], "0.7")
    paths = []
    for n, report in enumerate((first, second)):
        paths.append(tmp_path / f"r{n}.json")
        paths[-1].write_text(json.dumps(report))
    out = tmp_path / "pooled.md"
    subprocess.run([sys.executable, str(Path(__file__).resolve().parents[1] / "benchmarks" / "goal_intervals.py"),
                    *map(str, paths), "--out", str(out)], check=True, capture_output=True)
    text = out.read_text()
    assert "3 prompts resampled, replies per run 6, 12" in text
    overall = 18 * 10 / (6 * 10 / 55 + 12 * 10 / 66)  # gamma auto's pooled tokens/s
    assert f"| overall | {overall / 60:.3f} ({overall / 60:.3f} to {overall / 60:.3f}) | met |" in text


def test_draft_step_and_round_phases_reports() -> None:
    """benchmarks/draft_step.py and round_phases.py render what they measured: a round's total over the plain
    round's is the sum of its phases over the plain round's sum."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import draft_step
    import round_phases

    phases = {"command": "python benchmarks/round_phases.py", "prompts": 2, "results": {"0.0": {
        "0": {"rounds": 10, "draft_ms": 0.0, "target_ms": 9.0, "verify_ms": 1.0},
        "1": {"rounds": 8, "draft_ms": 2.0, "target_ms": 10.0, "verify_ms": 1.0}}}}
    text = round_phases.render(phases)
    assert "| 1 | 8 | 2.00 | 10.00 | 1.00 | 1.300 |" in text and "| 0 | 10 | 0.00 | 9.00 | 1.00 | 1.000 |" in text
    # --auto: gamma auto's rounds apart, and the rest of each step (planning, bookkeeping) as a fourth phase
    rest = {"0": {"rounds": 10, "draft_ms": 0.0, "target_ms": 9.0, "verify_ms": 0.5, "rest_ms": 0.5},
            "1": {"rounds": 8, "draft_ms": 2.0, "target_ms": 10.0, "verify_ms": 0.5, "rest_ms": 0.5},
            "auto 1": {"rounds": 6, "draft_ms": 2.0, "target_ms": 10.0, "verify_ms": 0.5, "rest_ms": 1.5}}
    text = round_phases.render({**phases, "results": {"0.7": rest}})
    assert "| verify + commit | rest | total / plain |" in text and "| auto 1 | 6 | 2.00 | 10.00 | 0.50 | 1.50 | 1.400 |" in text
    step = {"command": "python benchmarks/draft_step.py", "threads": 2, "temperature": 0.7, "rounds": 3, "prompts": 1,
            "matrices_us": [{"shape": [128, 128], "float32_linear_us": 3.0, "float32_packed_us": 16.0,
                             "bfloat16_linear_us": 20.0, "bfloat16_packed_us": 15.0}],
            "propose_ms": {"1": {"a": 1.5, "b": 1.25}, "3": {"a": 4.0, "b": 3.0}}}
    text = draft_step.render(step)
    assert "| 128 × 128 | 3.0 | 16.0 | 20.0 | 15.0 |" in text and "| b | 1.250 | 3.000 |" in text


def test_controller_variants_script_on_tiny_models(tmp_path) -> None:
    """benchmarks/controller_variants.py runs target-only, fixed gammas and gamma auto per variant in lockstep on
    the same replies: every system decodes every token, and each variant is compared with the best fixed gamma."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "controller_variants.py"
    out = tmp_path / "variants.json"
    done = subprocess.run([sys.executable, str(script), "--models", "tiny", "--replies", "2", "--max-new-tokens", "20",
                           "--fixed", "1,2", "--variant", "default", "--variant", "nogate:gate=false", "--out", str(out)],
                          capture_output=True, text=True, check=True)
    result = json.loads(out.read_text())
    assert result["variants"]["nogate"]["gate"] is False and result["variants"]["default"]["gate"] is True
    tokens = {key: value[0] for key, value in result["totals"].items() if key.endswith("|all")}
    assert set(tokens) == {f"{s}|all" for s in ("target-only", "gamma=1", "gamma=2", "default", "nogate")}
    assert set(tokens.values()) == {4 * 20}  # 2 replies per group, no EOS: every system decodes all of them
    assert "| nogate |" in done.stdout and out.with_suffix(".md").exists()
    bad = subprocess.run([sys.executable, str(script), "--models", "tiny", "--variant", "x:no_such_knob=1"],
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "no_such_knob" in bad.stderr


def _scored_run(rng: random.Random, prompts: int = 20, samples: int = 2) -> dict:
    """A stored adaptive-benchmark result whose replies' texts were scored (`--difficulty`): 40 tokens each;
    target-only 40 plain rounds of 15 ms, gamma=1 and gamma=auto (alike) rounds of one draft at 20 ms, as
    many as 40 / (1 + the text's acceptance) (an easy text takes fewer rounds)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import adaptive
    from specsample.bench.round_costs import RoundTiming, RunTiming

    rows: dict[str, list] = {"target-only": [], "gamma=1": [], "gamma=auto": []}
    scores: dict[str, list] = {name: [] for name in rows}
    for key in range(prompts * samples):
        ease = 0.2 + 0.2 * (key % prompts) / prompts
        for name in rows:
            x = min(max(rng.gauss(ease, 0.1), 0.0), 1.0)
            drafted, ms = (0, 0.015) if name == "target-only" else (1, 0.020)
            count = 40 if name == "target-only" else round(40 / (1 + x))
            timing = RunTiming(50, 0.01, tuple(RoundTiming(drafted, 50 + k, ms * rng.lognormvariate(0, 0.02))
                                               for k in range(count)))
            rows[name].append(adaptive._dump_run(key, "c" if key % 2 else "d", 40, timing))
            scores[name].append(x)
    return {"command": "python benchmarks/adaptive.py --test", "draft": "d", "prompts": prompts, "samples": samples,
            "results": {"0.7": {}}, "rounds": {"0.7": rows}, "difficulty": {"0.7": scores}}


def test_scored_texts_narrow_the_goal_intervals_in_reports_and_pools(tmp_path) -> None:
    """With every reply's text scored, the report and benchmarks/goal_intervals.py also print the intervals with
    the text's luck taken out (specsample.bench.difficulty): narrower, about the same ratio. A pool with a run
    that did not score its texts prints the raw intervals only."""
    from specsample.bench.difficulty import adjust_for_difficulty
    from specsample.bench.goals import goal_intervals

    stored = _scored_run(random.Random(5))
    import adaptive  # on the path once _scored_run has run
    replies = {name: adaptive.replies_of(rows) for name, rows in stored["rounds"]["0.7"].items()}
    difficulty = adaptive.difficulty_of(stored, "0.7")
    assert difficulty["gamma=auto"][3] == stored["difficulty"]["0.7"]["gamma=auto"][3]  # keyed by the reply
    raw = goal_intervals(replies, 20, resamples=400)["gamma=auto"]["overall"]
    rounds = {name: adaptive.rounds_of(rows) for name, rows in stored["rounds"]["0.7"].items()}
    fixed = goal_intervals(adjust_for_difficulty(replies, difficulty, 20, rounds)[0], 20,
                           resamples=400)["gamma=auto"]["overall"]
    assert fixed[2] - fixed[1] < 0.6 * (raw[2] - raw[1])  # / best fixed gamma: its interval
    assert fixed[0] == pytest.approx(1.0, abs=0.02) and raw[0] == pytest.approx(1.0, abs=0.06)
    adaptive.add_modelled(stored, "none")
    stored["results"]["0.7"] = stored["modelled"]["0.7"]
    first, second, unscored = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    adaptive.save(stored, first)
    assert "#### The same, times adjusted for the text" in first.with_suffix(".md").read_text()
    second.write_text(json.dumps(_scored_run(random.Random(6))))
    unscored.write_text(json.dumps({k: v for k, v in _scored_run(random.Random(7)).items() if k != "difficulty"}))
    script = str(Path(__file__).resolve().parents[1] / "benchmarks" / "goal_intervals.py")
    pooled = subprocess.run([sys.executable, script, str(first), str(second), "--resamples", "200"], check=True,
                            capture_output=True, text=True).stdout
    assert "### Times adjusted for the text" in pooled and "slope (rounds per token" in pooled
    plain = subprocess.run([sys.executable, script, str(first), str(unscored), "--resamples", "200"], check=True,
                           capture_output=True, text=True).stdout
    assert "adjusted for the text" not in plain and "`gamma=auto` with 90% bootstrap intervals" in plain


def test_texts_scored_with_one_reply_per_prompt_are_not_adjusted(tmp_path) -> None:
    """With one reply per prompt the within-prompt fit has nothing to fit (a session-32 report printed slopes of 0
    and spreads of nan, then the raw intervals again as 'adjusted'): the report and the pooled intervals say why
    they skip it (the benchmark scores texts by default only with --samples >= 2)."""
    stored = _scored_run(random.Random(8), samples=1)
    import adaptive  # on the path once _scored_run has run
    adaptive.add_modelled(stored, "none")
    stored["results"]["0.7"] = stored["modelled"]["0.7"]
    path = tmp_path / "one.json"
    adaptive.save(stored, path)
    report = path.with_suffix(".md").read_text()
    assert "times adjusted for the text" not in report and "nan" not in report
    assert "Not adjusted for the text" in report
    script = Path(__file__).resolve().parents[1] / "benchmarks"
    pooled = subprocess.run([sys.executable, str(script / "goal_intervals.py"), str(path), "--resamples", "50"],
                            check=True, capture_output=True, text=True).stdout
    assert "Not adjusted for the text" in pooled and "slope (rounds per token" not in pooled


def test_a_benchmark_system_keeps_the_max_gamma_its_knobs_ask_for(tiny_target, tiny_draft) -> None:
    """Ours caps gamma auto's max_gamma at the config's gamma (the draft cache's slack) but keeps a smaller one:
    a variant asking for max_gamma=2 once ran with the config's 8, silently."""
    from specsample.bench.systems import Ours
    from specsample.config import SamplingParams, SpecConfig
    from specsample.controller import ControllerConfig
    from specsample.drafters.model import ModelDrafter

    config = SpecConfig(gamma=6, adaptive=True, max_batch_size=1)
    assert Ours("a", tiny_target, ModelDrafter(tiny_draft), config, frozenset()).controller_config.max_gamma == 6
    pinned = Ours("b", tiny_target, ModelDrafter(tiny_draft), config, frozenset(),
                  controller_config=ControllerConfig(min_gamma=2, max_gamma=2, explore_every=10_000))
    assert pinned.controller_config.max_gamma == 2
    record = pinned.run([[1, 2, 3, 4, 5]], SamplingParams(temperature=1.0, max_new_tokens=40, seed=2))[0]
    assert max(r.drafted for r in record.timing.rounds) == 2


def test_the_split_against_the_best_fixed_gamma_prices_each_class_of_round() -> None:
    """benchmarks/adaptive.py's fixed_split: gamma auto's rounds and prefill against the best fixed gamma's pace
    on the same prompt, by class of round; the classes add up to 1 - its time at that pace / its time, and a
    gamma auto that decodes like the best fixed gamma loses nothing anywhere."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import adaptive
    from specsample.bench.round_costs import RoundTiming, RunTiming

    def run(classes: list[tuple[int, int, float]], prefill: float = 0.1, scored_at: int = -1) -> RunTiming:
        """Rounds of (drafted, tokens made, seconds), from context 50."""
        rounds, context = [], 50
        for k, (drafted, made, seconds) in enumerate(classes):
            rounds.append(RoundTiming(drafted, context, seconds, k == scored_at))
            context += made
        return RunTiming(50, prefill, tuple(rounds))

    two = run([(2, 2, 0.03)] * 5)  # 10 tokens in 0.15 s of rounds: 0.015 s per token
    one = run([(1, 1, 0.025)] * 10)  # slower: gamma 2 is the best fixed gamma
    auto = run([(0, 1, 0.02), (0, 1, 0.02), (1, 1, 0.025), (2, 3, 0.03), (2, 2, 0.03), (3, 2, 0.04)],
               prefill=0.11, scored_at=1)
    tokens = 10

    def report(auto_run: RunTiming) -> dict:
        rows = {"target-only": [adaptive._dump_run(3, "c", tokens, run([(0, 1, 0.02)] * 10))],
                "gamma=1": [adaptive._dump_run(3, "c", tokens, one)], "gamma=2": [adaptive._dump_run(3, "c", tokens, two)],
                "gamma=auto": [adaptive._dump_run(3, "c", tokens, auto_run)]}
        return {"prompts": 10, "rounds": {"0.7": rows}}

    split, best = adaptive.fixed_split([report(auto)], "0.7")
    assert best == {"c": "gamma=2"} and split["c"] == split["overall"]
    seconds = auto.seconds  # 0.275
    assert split["c"]["prefill"][0] == pytest.approx(0.01 / seconds)
    assert split["c"]["plain"] == (pytest.approx((0.02 - 0.015) / seconds), pytest.approx(1 / 6))
    assert split["c"]["scoring"][0] == pytest.approx((0.02 - 0.015) / seconds)
    assert split["c"]["1 draft"][0] == pytest.approx((0.025 - 0.015) / seconds)
    assert split["c"]["2 drafts"] == (pytest.approx((0.06 - 5 * 0.015) / seconds), pytest.approx(2 / 6))
    assert split["c"]["3+ drafts"][0] == pytest.approx((0.04 - 2 * 0.015) / seconds)  # the last round: the rest
    total = sum(v[0] for v in split["c"].values())
    assert total == pytest.approx(1 - (tokens * 0.015 + 0.1) / seconds)
    same, _ = adaptive.fixed_split([report(two)], "0.7")
    assert all(v[0] == pytest.approx(0.0, abs=1e-12) for v in same["c"].values())
    lines = adaptive.fixed_split_lines([report(auto), report(auto)], "0.7")  # two runs pool: the same shares
    assert f"| c | 2 | {100 * split['c']['prefill'][0]:+.1f} |" in "\n".join(lines)
    assert adaptive.fixed_split([{"prompts": 1, "rounds": {"0.7": {"gamma=auto": []}}}], "0.7") == ({}, {})


def test_round_kinds_are_ratios_to_target_only_within_each_prompt() -> None:
    """A kind's cost is its median round over target-only's median round on the same prompt, then the median over
    prompts: a prompt where every round is twice as slow (long context, a slow box) changes nothing."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from round_kinds import pooled_kinds, round_kinds

    def reply(prompt: int, rounds: list[tuple[int, float, int]]) -> list:
        return [prompt, "qa", len(rounds), 10, 1.0, [[d, 100, ms, s] for d, ms, s in rounds]]

    rounds = {"target-only": [reply(0, [(0, 10.0, 0)] * 3), reply(1, [(0, 20.0, 0)] * 3)],
              "gamma=1": [reply(0, [(1, 15.0, 0), (1, 15.0, 0), (0, 30.0, 1)]),
                          reply(1, [(1, 30.0, 0), (5, 60.0, 0), (6, 80.0, 0)])],
              "hybrid auto": [reply(0, [(2, 20.0, 0)]), [1, "qa", 1, 10, 1.0, [[2, 100, 30.0, 0, 1]]]]}
    kinds = round_kinds(rounds)
    assert kinds["target-only"]["0"] == {"rounds": 6, "median": 1.0, "min": 1.0}
    assert kinds["gamma=1"]["1"]["median"] == pytest.approx(1.5) and kinds["gamma=1"]["1"]["rounds"] == 3
    assert kinds["gamma=1"]["S0"]["median"] == pytest.approx(3.0)  # a plain round that scored a backlog, apart
    assert kinds["gamma=1"]["4+"]["median"] == pytest.approx(3.5) and kinds["gamma=1"]["4+"]["min"] == pytest.approx(3.0)
    assert kinds["hybrid auto"]["2"]["median"] == pytest.approx(2.0)  # a model's drafts and a lookup's, apart
    assert kinds["hybrid auto"]["L2"]["median"] == pytest.approx(1.5)
    with pytest.raises(ValueError, match="target-only"):
        round_kinds({"gamma=1": rounds["gamma=1"]})
    pooled = pooled_kinds(rounds)  # over target-only's median of all its rounds (15 ms), every prompt pooled
    assert pooled["target-only"]["0"] == {"rounds": 6, "mean": pytest.approx(1.0), "median": pytest.approx(1.0)}
    assert pooled["gamma=1"]["1"]["mean"] == pytest.approx(20.0 / 15) and pooled["gamma=1"]["1"]["median"] == 1.0
    with pytest.raises(ValueError, match="target-only"):
        pooled_kinds({"gamma=1": rounds["gamma=1"]})


def test_rounds_keep_their_phases_and_round_kinds_tables_them() -> None:
    """Since session 36 a stored round keeps the engine's draft, target and verify times; round_phases tables each
    kind's mean and median per phase, and the rest of the round: a stall in a third of the rounds moves the mean
    of the phase it hit and leaves the median alone. Rounds stored before keep loading (no phases)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import adaptive
    from round_kinds import round_phases
    from specsample.bench.round_costs import RoundTiming, RunTiming

    rounds = tuple(RoundTiming(1, 100 + i, 0.020 + (0.045 if i % 3 == 0 else 0.0), lookup=i == 4,
                               phases=(0.004, 0.012 + (0.045 if i % 3 == 0 else 0.0), 0.002)) for i in range(6))
    dumped = adaptive._dump_run(3, "qa", 6, RunTiming(10, 0.001, rounds))
    assert dumped[5][0] == [1, 100, 65.0, 0, 0, [4.0, 57.0, 2.0]]
    loaded = adaptive._load_run(dumped)[3].rounds
    assert [r.phases for r in loaded] == [pytest.approx(r.phases) for r in rounds]
    assert [r.lookup for r in loaded] == [r.lookup for r in rounds]
    old = [3, "qa", 1, 10, 1.0, [[1, 100, 20.0, 0, 1]]]  # session 35: no phases
    assert adaptive._load_run(old)[3].rounds[0].phases is None
    table = round_phases({"gamma=auto": [dumped, old]})["gamma=auto"]
    assert set(table) == {"1", "L1"} and table["1"]["rounds"] == 5  # the old round recorded no phases
    assert table["1"]["median"]["target"] == pytest.approx(12.0)
    assert table["1"]["mean"]["target"] == pytest.approx(12.0 + 45.0 * 2 / 5)  # rounds 0 and 3 stalled
    assert table["1"]["mean"]["rest"] == pytest.approx(2.0) and table["1"]["mean"]["draft"] == pytest.approx(4.0)
    assert round_phases({"target-only": [old]}) == {}


def test_shape_stalls_split_rounds_by_whether_their_shape_was_met_before() -> None:
    """round_kinds.shape_stalls: a round counts as "met" when an earlier turn (any system's, this reply's or an
    earlier one's, a prompt without a target-only round included) scored as many tokens at the same context length,
    "tied" when another system's round met it first in the same turn, else "new", one-token rounds apart ("plain");
    stalled = over the prompt's median target-only round + 30 ms. A per-shape cost shows as new >> met; a cost by round kind alone
    (every drafting round dear) would not split."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from round_kinds import shape_stalls

    def reply(prompt: int, rows: list[list]) -> list:
        return [prompt, "qa", len(rows), 10, 1.0, rows]

    # gamma=1 meets (2, 102) first on prompt 0's turn 0 and stalls; hybrid meets it again at turn 1 and gamma=1 on
    # prompt 1, both cheap; both meet (3, 104) at turn 2; prompt 2 has no target-only round, yet its (3, 203)
    # makes prompt 3's the shape's second meeting
    rounds = {"target-only": [reply(0, [[0, 100, 10.0, 0], [0, 101, 10.0, 0], [0, 102, 55.0, 0]]),
                              reply(1, [[0, 100, 20.0, 0]]), reply(2, []), reply(3, [[0, 200, 10.0, 0]])],
              "gamma=1": [reply(0, [[1, 100, 60.0, 0], [1, 102, 12.0, 0], [2, 101, 20.0, 0]]),
                          reply(1, [[1, 100, 30.0, 0]]), reply(2, [[2, 200, 90.0, 0]]), reply(3, [[2, 200, 22.0, 0]])],
              "hybrid auto": [reply(0, [[0, 100, 10.0, 1], [1, 100, 15.0, 0], [2, 101, 58.0, 0, 1]])]}
    table = shape_stalls(rounds)  # stalled: over the prompt's median target-only round (10, 20, 10 ms) + 30 ms
    assert table["target-only"] == {  # one-token rounds by shape too: its first round ties with hybrid's scoring
        "plain met": {"rounds": 1, "stalled": 0.0, "mean": 1.0, "ms": 20.0},
        "plain new": {"rounds": 3, "stalled": pytest.approx(1 / 3), "mean": pytest.approx(2.5), "ms": 25.0},
        "plain tied": {"rounds": 1, "stalled": 0.0, "mean": 1.0, "ms": 10.0}}
    assert table["gamma=1"] == {"met": {"rounds": 2, "stalled": 0.0, "mean": pytest.approx(1.85), "ms": 26.0},
                                "new": {"rounds": 2, "stalled": 0.5, "mean": pytest.approx(3.6), "ms": 36.0},
                                "tied": {"rounds": 1, "stalled": 0.0, "mean": 2.0, "ms": 20.0}}
    assert table["hybrid auto"] == {"met": {"rounds": 1, "stalled": 0.0, "mean": 1.5, "ms": 15.0},  # no scoring
                                    "tied": {"rounds": 1, "stalled": 1.0, "mean": 5.8, "ms": 58.0}}
    with pytest.raises(ValueError, match="target-only"):
        shape_stalls({"gamma=1": rounds["gamma=1"]})


def test_forward_shapes_times_each_width_in_runs_in_turns_and_at_a_growing_context(tiny_target, monkeypatch) -> None:
    """benchmarks/forward_shapes.py: `calls` timings per width after a warm-up call, one width's calls in a row or
    the widths in turn, the context held (the cache rolled back each time) or one token longer every call; too
    long a run and an unknown mode are refused."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import forward_shapes

    seen = []
    forward = type(tiny_target).forward_cached
    monkeypatch.setattr(type(tiny_target), "forward_cached",
                        lambda self, tokens, cache, slots: seen.append((tokens.shape[1], int(cache.lengths[0])))
                        or forward(self, tokens, cache, slots))
    expected = {"runs": [(1, 8)] * 3 + [(3, 8)] * 3, "turns": [(1, 8), (3, 8)] * 3,
                "growing": [(1, 8), (3, 8), (1, 9), (3, 9), (1, 10), (3, 10)]}
    for mode, order in expected.items():
        seen.clear()
        times = forward_shapes.time_shapes(tiny_target, [1, 3], context=8, calls=2, mode=mode)
        assert seen == order and set(times) == {1, 3} and all(len(t) == 2 and min(t) > 0 for t in times.values())
    with pytest.raises(ValueError, match="passes the model's"):
        forward_shapes.time_shapes(tiny_target, [4], context=tiny_target.max_seq_len - 4, calls=2, mode="growing")
    with pytest.raises(ValueError, match="mode must be one of"):
        forward_shapes.time_shapes(tiny_target, [1], context=8, calls=2, mode="fixed")
    row = {"1": {"median_ms": 1.0, "mean_ms": 1.5}}
    report = {"command": "x", "machine": {"cpu": "c"}, "context": 8, "calls": 3,
              "results": {"math": {"target": {mode: row for mode in forward_shapes.MODES}}}}
    assert "| 1 | 1.00 (1.50) | 1.00 (1.50) | 1.00 (1.50) |" in forward_shapes.render(report)



def test_controller_calls_times_gamma_autos_own_work_in_place_and_restores_the_methods(tiny_target, tiny_draft) -> None:
    """benchmarks/controller_calls.py: every per-round call of the controller is timed while gamma auto decodes (the
    first prompt untimed), per round figures add up, and the wrapped methods are the originals again afterwards,
    also when the block raises."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import controller_calls

    from specsample.config import SamplingParams
    from specsample.controller import ControllerConfig, GammaController
    from specsample.drafters.model import ModelDrafter

    plan = GammaController.__dict__["plan"]
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    params = [SamplingParams(temperature=0.7, max_new_tokens=24, seed=i) for i in range(3)]
    # a controller that never falls back: tiny models' drafts cost about a target step, so it would decode plain
    never_plain = ControllerConfig(max_gamma=4, fallback_below=0.0)
    result = controller_calls.call_costs(tiny_target, ModelDrafter(tiny_draft), prompts, params, frozenset(),
                                         max_gamma=4, controller_config=never_plain)
    calls = result["calls"]
    assert result["rounds"] >= 2 * 24 // 9 and calls["GammaController.plan"]["calls"] == result["rounds"]
    assert calls["GammaController.observe_timing"]["calls"] == result["rounds"]
    assert "GammaController.gate" in calls and "Engine._acceptance" in calls
    # the engine's planning holds the controller's plan: shown, but counted once in the total
    assert calls["Engine._plan"]["calls"] == result["rounds"]
    assert calls["Engine._plan"]["per_round_us"] >= calls["GammaController.plan"]["per_round_us"]
    assert result["per_round_us"] == pytest.approx(sum(c["per_round_us"] for label, c in calls.items()
                                                       if label != "Engine._plan"))
    assert "(holds others: not in the total)" in controller_calls.render(
        {"command": "c", "machine": {}, "results": {"0.7": result}})
    assert GammaController.__dict__["plan"] is plan
    with pytest.raises(RuntimeError, match="inside"), controller_calls.timed_calls():
        assert GammaController.__dict__["plan"] is not plan
        raise RuntimeError("inside")
    assert GammaController.__dict__["plan"] is plan
    with pytest.raises(ValueError, match="warm_up"):
        controller_calls.call_costs(tiny_target, ModelDrafter(tiny_draft), prompts[:1], params[:1], frozenset())


def test_controller_calls_times_the_hybrids_lookups_and_merge_and_restores_a_modules_function(tiny_target,
                                                                                               tiny_draft) -> None:
    """With the hybrid drafter the lookups and the merge (a module's function, wrapped where the hybrid looks it up)
    are timed too, and the module's function is the original again afterwards, also when the block raises."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import controller_calls

    from specsample.config import SamplingParams
    from specsample.controller import ControllerConfig
    from specsample.drafters import hybrid
    from specsample.drafters.hybrid import HybridDrafter
    from specsample.drafters.model import ModelDrafter
    from specsample.drafters.ngram import NgramDrafter

    merge = hybrid.__dict__["merge_proposals"]
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 6, 4, 5, 6, 4, 5], [7, 8, 9, 7, 8, 9, 7, 8]]
    params = [SamplingParams(temperature=0.7, max_new_tokens=24, seed=i) for i in range(3)]
    drafter = HybridDrafter(ModelDrafter(tiny_draft), NgramDrafter(min_n=1), min_match=2)
    result = controller_calls.call_costs(tiny_target, drafter, prompts, params, frozenset(), max_gamma=4,
                                         controller_config=ControllerConfig(max_gamma=4, fallback_below=0.0))
    calls = result["calls"]
    assert calls["HybridDrafter.lookup_lengths"]["calls"] == result["rounds"]  # every adaptive row, every round
    assert 0 < calls["hybrid.merge_proposals"]["calls"] <= result["rounds"]  # every round that drafted
    assert hybrid.__dict__["merge_proposals"] is merge
    with pytest.raises(RuntimeError, match="inside"), controller_calls.timed_calls():
        assert hybrid.__dict__["merge_proposals"] is not merge
        raise RuntimeError("inside")
    assert hybrid.__dict__["merge_proposals"] is merge


def test_forward_shapes_names_the_attention_implementation_each_backend_dispatched(tiny_target) -> None:
    """benchmarks/forward_shapes.py's kernel names come from the forward run under the backend's context: the math
    backend dispatches the math implementation once per layer at every width, the engine's choice never does."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import forward_shapes

    from specsample.bench.run import attention_backends

    layers = len(tiny_target.layers)
    with attention_backends("math", [tiny_target]):
        assert forward_shapes.attention_kernels(tiny_target, [1, 3], context=8) == {
            w: {"_scaled_dot_product_attention_math": layers} for w in (1, 3)}
    with attention_backends("engine", [tiny_target]):
        engine = forward_shapes.attention_kernels(tiny_target, [1, 3], context=8)
    assert all(sum(ops.values()) == layers and "_scaled_dot_product_attention_math" not in ops
               for ops in engine.values())
    with pytest.raises(ValueError, match="passes"):
        forward_shapes.attention_kernels(tiny_target, [4], context=tiny_target.max_seq_len - 4)
    row = {"median_ms": 1.0, "mean_ms": 1.5}
    report = {"command": "c", "machine": {"device": "cpu"}, "context": 8, "calls": 2,
              "results": {"math": {"target": {**{mode: {"1": row} for mode in forward_shapes.MODES},
                                              "kernels": {"1": {"_scaled_dot_product_attention_math": 2}}}}}}
    assert "1: `_scaled_dot_product_attention_math` ×2" in forward_shapes.render(report)

def test_attention_option_limits_the_sdpa_kernels_for_its_context(tiny_target) -> None:
    """`--attention` (adaptive.py, forward_shapes.py): engine leaves the runtimes' own choice, torch lets them run
    cuDNN's kernels too, no-cudnn leaves every SDPA kernel but cuDNN's, math only the reference one; flags and the
    models' switches come back when the context ends; a wrong name, or a runtime without the switch, is refused."""
    import torch
    from specsample.bench.run import attention_backends

    flags = torch.backends.cuda
    before = (flags.cudnn_sdp_enabled(), flags.flash_sdp_enabled(), flags.mem_efficient_sdp_enabled())
    assert tiny_target.cudnn_attention is False
    with attention_backends("no-cudnn", [tiny_target]):
        assert not flags.cudnn_sdp_enabled() and flags.flash_sdp_enabled() and flags.math_sdp_enabled()
    with attention_backends("math", [tiny_target]):
        assert not (flags.flash_sdp_enabled() or flags.mem_efficient_sdp_enabled()) and flags.math_sdp_enabled()
    for choice, allowed in (("engine", False), ("torch", True)):
        with attention_backends(choice, [tiny_target]):
            assert (flags.cudnn_sdp_enabled(), flags.flash_sdp_enabled(), flags.mem_efficient_sdp_enabled()) == before
            assert tiny_target.cudnn_attention is allowed
    assert (flags.cudnn_sdp_enabled(), flags.flash_sdp_enabled(), flags.mem_efficient_sdp_enabled()) == before
    assert tiny_target.cudnn_attention is False
    with pytest.raises(RuntimeError, match="inside"), attention_backends("torch", [tiny_target]):
        raise RuntimeError("inside")  # an error inside: the switch still comes back
    assert tiny_target.cudnn_attention is False
    with pytest.raises(ValueError, match="must be one of"):
        attention_backends("cudnn-only", [tiny_target]).__enter__()
    with pytest.raises(ValueError, match="these have none: object"):
        attention_backends("torch", [object()]).__enter__()


def test_draft_delay_slows_each_drafting_step_and_the_report_says_so(monkeypatch) -> None:
    """`adaptive.py --draft-delay-ms`: each drafting step of a draft model waits the delay (a what-if for a dearer
    draft), and the run's report says its speeds are not the machine's."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import adaptive
    from specsample.drafters.model import ModelDrafter

    calls = []
    monkeypatch.setattr(ModelDrafter, "_logits", lambda self, *args: calls.append(args) or "logits")
    adaptive.delay_draft_forwards(0.05)  # undone by monkeypatch at the end of the test
    begin = time.perf_counter()
    assert ModelDrafter._logits(None, 1, 2) == "logits" and calls == [(1, 2)]
    assert time.perf_counter() - begin >= 0.05
    assert adaptive._draft_delay_ms({"draft_delay_ms": 6.0}) == 6.0
    assert adaptive._draft_delay_ms({"command": "python benchmarks/adaptive.py --draft-delay-ms 4.5 --out x"}) == 4.5
    assert adaptive._draft_delay_ms({"command": "python benchmarks/adaptive.py --out x"}) == 0.0


def test_a_variant_named_hybrid_drafts_with_the_hybrid_drafter(monkeypatch) -> None:
    """`adaptive.py --variant NAME:KNOBS` runs gamma auto under other knobs; one named hybrid... runs the hybrid
    drafter (as "hybrid auto"), so a controller change can be compared with the default draft, interleaved."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import adaptive
    from types import SimpleNamespace

    monkeypatch.setattr(adaptive, "ModelDrafter", lambda model, folder, window: ("model", model))
    monkeypatch.setattr(adaptive, "HybridDrafter", lambda inner: ("hybrid", inner))
    monkeypatch.setattr(adaptive, "Ours", lambda name, target, drafter, config, eos, **kw:
                        (name, drafter, config.adaptive, kw["controller_config"]))
    variants = [adaptive.parse_variant(v) for v in ("hybrid s1:settle_timings=1", "auto s1:settle_timings=1")]
    systems = adaptive.make_systems(["hybrid auto"], None, SimpleNamespace(model="m", folder=None, window=None),
                                    frozenset(), 64, (), variants=variants)
    assert [(name, drafter, adaptive_) for name, drafter, adaptive_, _ in systems] == [
        ("hybrid auto", ("hybrid", ("model", "m")), True), ("hybrid s1", ("hybrid", ("model", "m")), True),
        ("auto s1", ("model", "m"), True)]
    assert systems[0][3] is None and systems[1][3].settle_timings == 1 and systems[2][3].settle_timings == 1


def test_round_ops_counts_kernel_operations_apart_from_views() -> None:
    """benchmarks/round_ops.py: views launch no kernel and are left out of "not views"; host reads are counted
    apart; the report divides by the plain round's and lists gamma auto's extra operations by name."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import round_ops
    import torch

    from devices import DEVICE

    x = torch.arange(6.0, device=DEVICE)
    with round_ops.OpCounter() as counter:
        y = (x.view(2, 3) * 2).sum()
        bool(y > 0)
        y.cpu()
    counter.ops["_to_copy"] = 0  # the copy back is counted as a wait on a GPU, and left out of the rest here
    total, kernels, reads, waits = round_ops.summarise(counter.ops, counter.waits)
    assert waits == 0 if DEVICE == "cpu" else waits >= 2  # a host read and a copy back wait for a GPU; CPU tensors never
    assert counter.ops["view"] == 1 and counter.ops["mul"] == 1 and counter.ops["sum"] == 1
    assert kernels == total - 1 and reads == 1  # bool() reads the value (item, is_nonzero or _local_scalar_dense)
    report = {"command": "python benchmarks/round_ops.py", "device": "cpu", "temperature": 0.7, "results": {
        "0": {"rounds": 5, "ops": 100, "kernel_ops": 60, "host_reads": 4, "by_name": {"mul": 10}},
        "1": {"rounds": 5, "ops": 150, "kernel_ops": 90, "host_reads": 9, "by_name": {"mul": 20}},
        "auto 1": {"rounds": 3, "ops": 160, "kernel_ops": 93, "host_reads": 9, "by_name": {"mul": 20, "to": 3}}}}
    text = round_ops.render(report)
    assert "| 1 | 5 | 150 | 90 | 1.50 | 9 | n/a (CPU) |" in text and "| auto 1 | 3 | 160 | 93 | 1.55 | 9 |" in text
    assert "- 1 drafts: to +3.0" in text


def test_a_stopped_adaptive_run_leaves_its_replies_so_far(tmp_path) -> None:
    """After every reply but the last the benchmark writes the result so far beside its .json (X.partial.json,
    which a finished run removes), marked partial: a device run cut off by its time limit kept nothing before, and
    an earlier full result at X.json stays. `--report-only` renders it and says so."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import adaptive

    runs, _ = _drifting_box_runs(random.Random(4))
    rows = {name: [adaptive._dump_run(p, "c", 40, r) for p, r in rs[:5]] for name, rs in runs.items()}
    rows["gamma=1"] = rows["gamma=auto"] = rows.pop("policy")
    report = {"command": "python benchmarks/adaptive.py --test", "draft": "d", "rounds": {"0.0": rows},
              "results": {"0.0": {name: {"c": 50.0, "overall": 50.0} for name in rows}}}
    assert adaptive.partial_path(tmp_path / "run.json") == tmp_path / "run.partial.json"
    out = tmp_path / "run.partial.json"
    out.write_text("an earlier partial write")
    adaptive.save_partial(report, out, 5, 60)
    stored = json.loads(out.read_text())
    assert stored["partial"] == {"replies": 5, "of": 60} and stored["rounds"]["0.0"]["gamma=1"] == rows["gamma=1"]
    assert [p.name for p in tmp_path.iterdir()] == ["run.partial.json"]  # staged, then moved over: never half a file
    subprocess.run([sys.executable, str(Path(__file__).resolve().parents[1] / "benchmarks" / "adaptive.py"),
                    "--report-only", str(out)], check=True, capture_output=True)
    assert "**Partial run:** stopped after 5 of its 60 replies" in out.with_suffix(".md").read_text()
