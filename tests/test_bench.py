"""`specsample bench`: its statistics, prompt loaders, systems run in lockstep, and whole runs on tiny models
(every suite, zero-sized sweeps, a suite that fails, progress lines)."""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from model_factory import make_tokenizer, write_hf_model
from virtual_clock import ClockedLM, VirtualClock

import specsample.bench.systems as systems_module
from specsample import Engine, ModelDrafter, SamplingParams, SpecConfig
from specsample.bench.report import _cost_ratio, write_report
from specsample.bench.stats import acceptance_summary, bootstrap, percentile, predicted_speedup, two_sample_test
from specsample.bench.suites import JSON_PROMPTS
from specsample.bench.systems import Ours, OursRun, run_lockstep
from specsample.datasets import iter_sharegpt, sharegpt_prompts, spec_bench_prompts, text_file_prompts
from specsample.planner import FixedGamma, GammaController
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
    stats = [
        {
            "drafted": 10,
            "accepted": 6,
            "drafts": 3,
            "rejections": 2,
            "accepted_per_position_counts": [3, 2, 1],
            "drafted_per_position_counts": [3, 3, 3],
        },
        {
            "drafted": 4,
            "accepted": 4,
            "drafts": 1,
            "rejections": 0,
            "accepted_per_position_counts": [1, 1, 1, 1],
            "drafted_per_position_counts": [1, 1, 1, 1],
        },
    ]
    summary = acceptance_summary(stats)
    assert summary["acceptance_rate"] == pytest.approx(10 / 14)
    assert summary["alpha"] == pytest.approx(10 / 12)  # successes / (successes + rejections)
    assert summary["mean_accepted_length"] == pytest.approx(1 + 10 / 4)
    assert summary["acceptance_per_position"] == [1.0, 0.75, 0.5, 1.0]
    assert predicted_speedup(0.8, 4.4, 0.05) == pytest.approx(expected_speedup(0.8, 4, 0.05))


def test_cost_ratio_comes_from_whole_rounds() -> None:
    """c is what a drafted position adds to a round over a target-only round, not a draft step over a forward."""

    def row(plain: dict, spec: dict) -> dict:
        return {"category": "qa", "prompt": "1", "systems": {"target-only": {"stats": plain}, "ours": {"stats": spec}}}

    plain = {"rounds": 50, "draft_seconds": 0.0, "target_seconds": 4.5, "verify_seconds": 0.5}  # 0.1 s a round
    spec = {"rounds": 50, "gamma_mean": 4.0, "draft_seconds": 2.0, "target_seconds": 6.0, "verify_seconds": 1.0}
    # 0.18 s per round with 4 drafts: (0.18 / 0.1 - 1) / 4; a draft step over a target forward would say 0.083
    assert _cost_ratio([row(plain, spec), row(plain, spec)], "ours") == pytest.approx(0.2)
    assert _cost_ratio([row({"rounds": 0}, spec)], "ours") is None  # no plain rounds timed: no estimate


def test_paired_bootstrap_is_tight_where_systems_share_each_prompts_cost() -> None:
    """Prompts differ tenfold in cost; a system 1.25x faster on every prompt up to 2% noise gets a tight interval
    around 1.25 because both systems are resampled on the same prompts (resampling them apart would not be)."""
    rng = random.Random(1)
    rows = []
    for i in range(40):
        seconds = rng.uniform(1.0, 10.0)
        rows.append(
            (
                "qa" if i % 2 else "math",
                {"base": (100, seconds), "fast": (100, seconds / 1.25 * rng.uniform(0.98, 1.02))},
            )
        )
    result = bootstrap(rows, lambda s: {"ratio": s["fast"] / s["base"]}, resamples=500)
    point, low, high = result["ratio"]["overall"]
    assert low <= 1.25 <= high and high - low < 0.03
    assert set(result["ratio"]) == {"qa", "math", "overall"}
    draw = random.Random(2)  # the broken twin: each system's prompts resampled apart

    def total(name: str) -> float:
        return sum(draw.choice(rows)[1][name][1] for _ in rows)

    unpaired = sorted(total("base") / total("fast") for _ in range(500))
    assert unpaired[475] - unpaired[25] > 10 * (high - low)  # what pairing takes out
    with pytest.raises(ValueError, match="level"):
        bootstrap(rows, lambda s: {}, level=1.5)


def test_a_category_of_one_prompt_has_no_interval_and_the_overall_one_still_varies() -> None:
    """One prompt per category: resampling within categories would repeat the point estimate as its own interval."""
    rows = [(f"cat{i}", {"base": (100, 1.0), "fast": (100, 1.0 / (1.0 + 0.1 * i))}) for i in range(8)]
    result = bootstrap(rows, lambda s: {"ratio": s["fast"] / s["base"]}, resamples=300)
    assert result["ratio"]["cat3"][1:] == [None, None]
    point, low, high = result["ratio"]["overall"]
    assert low < point < high


def test_sharegpt_parser_stops_at_a_truncated_tail(tmp_path) -> None:
    convs = [
        {
            "id": f"c{i}",
            "conversations": [{"from": "human", "value": f"question {i}"}, {"from": "gpt", "value": f"answer {i}"}],
        }
        for i in range(5)
    ]
    text = json.dumps(convs, indent=2)
    cut = text[: text.index('"c4"') + 10]  # the file breaks inside the last conversation
    path = tmp_path / "sharegpt.json"
    path.write_text(cut)
    assert [c["id"] for c in iter_sharegpt(path, chunk_chars=64)] == ["c0", "c1", "c2", "c3"]
    prompts = list(sharegpt_prompts(path, limit=2, skip=1))
    assert [p.turns for p in prompts] == [("question 1",), ("question 2",)]
    assert prompts[0].replies == ("answer 1",)


def test_prompt_file_loaders_and_the_bundled_spec_bench(tmp_path) -> None:
    bench = tmp_path / "questions.jsonl"
    bench.write_text(
        '{"question_id": 1, "category": "qa", "turns": ["what?"]}\n'
        '{"question_id": 3, "category": "math", "turns": ["1+1?", "and 2+2?"]}\n'
    )
    prompts = spec_bench_prompts(bench)
    assert [(p.id, p.category, p.turns[0]) for p in prompts] == [("1", "qa", "what?"), ("3", "math", "1+1?")]
    plain = tmp_path / "plain.txt"
    plain.write_text('first prompt\n\n{"prompt": "second", "category": "x"}\n')
    assert [(p.category, p.turns) for p in text_file_prompts(plain)] == [
        ("file", ("first prompt",)),
        ("x", ("second",)),
    ]
    with pytest.raises(ValueError, match="not found"):
        spec_bench_prompts(tmp_path / "missing.jsonl")
    bundled = spec_bench_prompts()  # shipped inside the package: no ../shared needed
    assert len(bundled) == 240 and len({p.category for p in bundled}) == 13


def _make_engine(target, config: SpecConfig, clock=time.perf_counter):
    def make(batch: int, drafter, planner):
        return Engine(target, drafter, dataclasses.replace(config, max_batch_size=batch), planner=planner, clock=clock)

    return make


def _report_renders_the_records(out: Path, elsewhere: Path) -> None:
    """`out/results.md` is what the report renders from `out/results.json` alone: what a run wrote is its records
    (asserted as records), and the report adds nothing they do not hold."""
    elsewhere.mkdir(parents=True)
    write_report(json.loads((out / "results.json").read_text()), elsewhere)
    assert (elsewhere / "results.md").read_text() == (out / "results.md").read_text()


def test_lockstep_runs_decode_as_alone_and_time_only_their_own_rounds(tiny_target, tiny_draft, monkeypatch) -> None:
    """Systems taking turns round by round produce the texts they produce alone, and each system's time is its own
    rounds': on a virtual clock (1 ms per target forward), a system whose every draft takes 30 ms more does not move
    the others' clocks, and each system's time in turns is its time alone."""
    clock = VirtualClock()

    class SlowDrafter(ModelDrafter):
        def propose(self, request):
            clock.now += 0.03
            return super().propose(request)

    config = SpecConfig(max_seq_len=64)
    make = _make_engine(tiny_target, config)

    def systems(slow: bool = False, engine=make) -> list[Ours]:
        return [
            Ours("plain", engine, None, lambda: FixedGamma(1)),
            Ours("g3", engine, (SlowDrafter if slow else ModelDrafter)(tiny_draft), lambda: FixedGamma(3)),
            Ours("auto", engine, ModelDrafter(tiny_draft), lambda: GammaController(4), keep_planner=False),
        ]

    prompt = [1, 2, 3, 4, 5]
    for params in (
        SamplingParams(temperature=0.0, max_new_tokens=24),
        SamplingParams(temperature=1.0, max_new_tokens=24, seed=3),
    ):
        alone = [s.run([prompt], [params])[0] for s in systems()]
        together = [r[0] for r in run_lockstep(systems(), [prompt], [params])]
        # gamma auto's choices follow its timings, which differ between any two runs: its sampled text may differ
        # too (from the same distribution); greedy, and with a fixed gamma, the texts are the same
        same = 3 if params.greedy else 2
        assert [r.tokens for r in together][:same] == [r.tokens for r in alone][:same]
        assert [r.stats["rounds"] for r in together][:2] == [r.stats["rounds"] for r in alone][:2]
    monkeypatch.setattr(systems_module, "time", SimpleNamespace(perf_counter=clock))  # what the runs time with
    clocked = _make_engine(ClockedLM(tiny_target, clock, base=1e-3, per_token=0.0), config, clock)

    params = [SamplingParams(temperature=0.0, max_new_tokens=24)]
    alone = [s.run([prompt], params)[0] for s in systems(slow=True, engine=clocked)]
    begin = clock.now
    plain, slow, auto = (r[0] for r in run_lockstep(systems(slow=True, engine=clocked), [prompt], params))
    elapsed = clock.now - begin
    assert [r.seconds for r in (plain, slow, auto)] == pytest.approx([r.seconds for r in alone])
    assert slow.seconds >= 0.03 * (slow.stats["rounds"] - 1)  # 30 ms more in every round but the last (no draft)...
    assert plain.seconds < 0.03  # ...and none of it in another system's time
    assert plain.seconds + slow.seconds + auto.seconds == pytest.approx(elapsed)
    for record in (plain, slow, auto):
        assert 0 < record.ttft <= record.seconds
    # shuffled turns: a fresh order every round, the same texts, and each system follows more than one other
    steps: list[str] = []
    real_step = OursRun.step

    def logged(run):
        steps.append(run.name)
        return real_step(run)

    greedy = [SamplingParams(temperature=0.0, max_new_tokens=24)]
    OursRun.step = logged
    try:
        shuffled = [r[0] for r in run_lockstep(systems(), [prompt], greedy, random.Random(0))]
    finally:
        OursRun.step = real_step
    assert [r.tokens for r in shuffled] == [s.run([prompt], greedy)[0].tokens for s in systems()]
    assert {steps[k - 1] for k in range(1, len(steps)) if steps[k] == "plain"} >= {"g3", "auto"}
    shared = ModelDrafter(tiny_draft)
    with pytest.raises(ValueError, match="a drafter each"):
        run_lockstep(
            [Ours(n, make, shared, lambda: FixedGamma(2)) for n in "ab"], [prompt], [SamplingParams(max_new_tokens=4)]
        )


@pytest.fixture(scope="module")
def tiny_pair_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bench")
    tokenizer = make_tokenizer()
    target = write_hf_model(folder / "target", "llama", tokenizer=tokenizer, max_position_embeddings=512)
    draft = write_hf_model(folder / "draft", "llama", tokenizer=tokenizer, seed=3, num_hidden_layers=1)
    questions = folder / "questions.jsonl"
    questions.write_text(
        "\n".join(
            json.dumps({"question_id": i, "category": c, "turns": [f"the quick fox {i}"]})
            for i, c in enumerate(["qa", "qa", "math", "math"])
        )
    )
    return target, draft, questions


def _bench(args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "specsample.cli", "bench", *args], capture_output=True, text=True, timeout=timeout
    )


def test_every_suite_runs_on_tiny_models_and_reports_as_it_goes(tiny_pair_files, tmp_path) -> None:
    target, draft, questions = tiny_pair_files
    out = tmp_path / "out"
    done = _bench(
        [
            "--quick",
            "--suite",
            "compare,gamma,batch,lossless,adaptive",
            "--target",
            str(target),
            "--draft",
            str(draft),
            "--dataset",
            str(questions),
            "--max-new-tokens",
            "8",
            "--compare",
            "hf,hf-assisted,hf-lookup",
            "--lossless-samples",
            "100",
            "--gamma",
            "auto,2,3",
            "--temperature",
            "0",
            "--out",
            str(out),
        ]
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # stderr is not a terminal here: a line per prompt, not a bar
    assert "specsample bench: compare T=0.0 1/2: qa 0:" in done.stderr
    assert "specsample bench: adaptive T=0.0 2/2: math 2:" in done.stderr
    for name in (
        "results.json",
        "results.md",
        "speedup_vs_gamma.png",
        "speedup_by_category.png",
        "speedup_vs_batch.png",
    ):
        assert (out / name).exists(), name
    results = json.loads((out / "results.json").read_text())
    assert results["status"] == "complete" and results["command"].startswith("specsample bench --quick")
    assert {"cpu", "cores", "threads", "torch", "dtype"} <= set(results["environment"])
    suites = results["suites"]
    assert suites["compare"]["systems"] == [
        "target-only",
        "specsample gamma=auto",
        "transformers generate",
        "transformers assisted",
        "transformers prompt lookup",
    ]
    assert [r["category"] for r in suites["compare"]["runs"]["0.0"]] == ["qa", "math"]
    assert suites["gamma"]["gammas"] == ["auto", 2, 3] and len(suites["gamma"]["rows"]) == 2
    assert [b["batch_size"] for b in suites["batch"]["rows"]] == [1, 4]
    assert all(0.0 <= t["p_value"] <= 1.0 for t in suites["lossless"]["tests"])
    assert suites["adaptive"]["systems"] == [
        "target-only",
        "gamma=2",
        "gamma=3",
        "gamma=auto",
        "ngram auto",
        "hybrid auto",
    ]
    assert results["environment"]["cpu"] and results["environment"]["cores"] > 0  # the machine is named
    _report_renders_the_records(out, tmp_path / "rendered")


def test_structured_and_prefix_suites(tiny_pair_files, tmp_path) -> None:
    """The grammar suite decodes every JSON prompt under the schema and free; the prefix suite's requests share
    their prefixes with the cache on, and only then."""
    target, draft, questions = tiny_pair_files
    out = tmp_path / "out"
    done = _bench(
        [
            "--suite",
            "structured,prefix",
            "--target",
            str(target),
            "--draft",
            str(draft),
            "--dataset",
            str(questions),
            "--max-new-tokens",
            "8",
            "--gamma",
            "3",
            "--temperature",
            "0.7",
            "--history-tokens",
            "150",
            "--long-prompt-tokens",
            "60",
            "--prefix-reps",
            "1",
            "--pad-rows",
            "off",
            "--out",
            str(out),
        ]
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["status"] == "complete", {k: v.get("error") for k, v in results["suites"].items()}
    structured, prefix = results["suites"]["structured"], results["suites"]["prefix"]
    assert structured["systems"] == [
        "specsample gamma=3",
        "specsample gamma=3 json_schema",
        "target-only",
        "target-only json_schema",
    ]
    for rows in structured["runs"].values():
        assert len(rows) == len(JSON_PROMPTS)
        assert all(r["tokens"] > 0 for row in rows for r in row["systems"].values())
    shared = prefix["shared_system"]
    assert shared["prompt_tokens"] >= 150 and len(shared["runs"]["cache on"]) == 1
    assert all(r["prefix_hits"] == prefix["clients"] - 1 for r in shared["runs"]["cache on"])
    assert all(r["prefix_hits"] == 0 for r in shared["runs"]["cache off"])
    on, off = shared["runs"]["cache on"][0], shared["runs"]["cache off"][0]
    assert on["prefilled_tokens"] < off["prefilled_tokens"] - (prefix["clients"] - 2) * 150
    chat = prefix["chat"]["runs"]
    assert chat["cache on"]["prefilled_tokens"] <= 1.1 * chat["cache on"]["final_tokens"]
    assert chat["cache off"]["prefilled_tokens"] > 2 * chat["cache on"]["prefilled_tokens"]
    assert prefix["samples"]["runs"]["cache on"]["prefix_hits"] == prefix["samples"]["n"] - 1
    for run in prefix["long_prompt"]["runs"].values():
        assert run["tpot_seconds"]["idle"] and run["tpot_seconds"]["long prompt"] and run["long_prompt_ttft_seconds"]
    _report_renders_the_records(out, tmp_path / "rendered")


def test_repeat_suite_streams_through_one_engine_per_system(tiny_pair_files, tmp_path) -> None:
    """One of each kind (a two-turn chat, an extraction, a question asked three ways) through every system; a second
    turn's prompt holds its first turn and target-only's reply; the global suffix cache holds every request."""
    from specsample.bench.config import BenchConfig
    from specsample.bench.run import run
    from specsample.options import EngineOptions

    target, draft, questions = tiny_pair_files
    config = BenchConfig(
        engine=EngineOptions(target=str(target), draft=str(draft), pad_rows="off"),
        dataset=str(questions),
        suites=("repeat",),
        num_prompts=1,
        max_new_tokens=2,
        temperatures=(0.7,),
        out=tmp_path / "out",
    )
    results = run(config, say=lambda m: None)
    assert results["status"] == "complete", results["suites"]["repeat"].get("error")
    repeat = results["suites"]["repeat"]
    assert repeat["systems"] == [
        "target-only",
        "hybrid, n-gram lookup",
        "hybrid, suffix (request)",
        "hybrid, suffix (global)",
    ]
    rows = repeat["runs"]["0.7"]
    assert [r["category"] for r in rows] == [
        "first turn",
        "extraction",
        "question",
        "second turn",
        "reworded question",
        "reworded question",
    ]
    assert rows[3]["prompt_tokens"] > rows[0]["prompt_tokens"] + 2  # the first turn and its reply, then the second
    assert all(r["tokens"] > 0 for row in rows for r in row["systems"].values())
    # one engine throughout: every request and the untimed warm-up
    assert repeat["suffix_cache"]["0.7"]["hybrid, suffix (global)"]["sequences"] == len(rows) + 1
    _report_renders_the_records(tmp_path / "out", tmp_path / "rendered")


def test_zero_sized_sweeps_and_a_single_gamma_run_to_the_end(tiny_pair_files, tmp_path) -> None:
    """The flag combination that once ran for an hour and crashed in the gamma sweep: one gamma, two temperatures,
    one batch size, a peer, no sweep prompts and no lossless prompts."""
    target, draft, questions = tiny_pair_files
    out = tmp_path / "out"
    done = _bench(
        [
            "--target",
            str(target),
            "--draft",
            str(draft),
            "--dataset",
            str(questions),
            "--num-prompts",
            "1",
            "--max-new-tokens",
            "6",
            "--gamma",
            "auto",
            "--temperature",
            "0,0.7",
            "--batch-size",
            "1",
            "--compare",
            "hf-lookup,hybrid-ngram,draft:ngram",
            "--sweep-prompts",
            "0",
            "--lossless-prompts",
            "0",
            "--out",
            str(out),
        ]
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["status"] == "complete"
    assert set(results["suites"]["compare"]["runs"]) == {"0.0", "0.7"}
    assert "hybrid, n-gram lookup gamma=auto" in results["suites"]["compare"]["systems"]  # the n-gram lookup beside
    assert "ngram gamma=auto" in results["suites"]["compare"]["systems"]  # another draft, named by its spec
    for suite in ("gamma", "batch", "lossless"):
        assert "skipped" in results["suites"][suite]
    _report_renders_the_records(out, tmp_path / "rendered")


def test_a_failing_suite_keeps_what_was_measured_and_the_run_goes_on(tiny_pair_files, tmp_path, monkeypatch) -> None:
    """Results are written as they are measured: a suite that fails mid-way keeps its rows, records its error, and
    the next suite still runs; an interrupted run keeps everything too."""
    from specsample.bench import suites
    from specsample.bench.config import BenchConfig
    from specsample.bench.run import run
    from specsample.options import EngineOptions

    target, draft, questions = tiny_pair_files
    calls = {"n": 0}
    real = suites.record

    def failing(run_record):
        calls["n"] += 1
        if calls["n"] == 5:  # the compare suite's third prompt... after two prompts were saved
            raise RuntimeError("the machine fell over")
        return real(run_record)

    monkeypatch.setattr(suites, "record", failing)
    config = BenchConfig(
        engine=EngineOptions(target=str(target), draft=str(draft)),
        dataset=str(questions),
        suites=("compare", "gamma"),
        max_new_tokens=4,
        gammas=("auto", 2),
        temperatures=(0.0,),
        sweep_prompts=1,
        out=tmp_path / "out",
    )
    results = run(config, say=lambda m: None)
    stored = json.loads((tmp_path / "out" / "results.json").read_text())
    assert stored["status"] == results["status"] == "complete, failed: compare"
    assert len(stored["suites"]["compare"]["runs"]["0.0"]) == 2
    assert "the machine fell over" in stored["suites"]["compare"]["error"]
    assert len(stored["suites"]["gamma"]["rows"]) == 1
    _report_renders_the_records(tmp_path / "out", tmp_path / "rendered")

    def interrupted(run_record):
        raise KeyboardInterrupt

    monkeypatch.setattr(suites, "record", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run(dataclasses.replace(config, out=tmp_path / "cut"), say=lambda m: None)
    assert json.loads((tmp_path / "cut" / "results.json").read_text())["status"] == "interrupted in compare"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--suite", "nope"], "unknown or no suite"),
        (["--gamma", "0"], "--gamma values must be integers >= 1"),
        (["--compare", "vllm"], "unknown --compare"),
        (["--compare", "draft:"], "needs a draft spec"),
        (["--sweep-prompts", "-1"], "sweep-prompts must be >= 0"),
        (["--temperature", "-1"], "--temperature values must be >= 0"),
    ],
)
def test_bad_bench_flags_fail_before_any_model_loads(flags, message, tmp_path, capsys) -> None:
    from specsample.cli import main

    assert main(["bench", "--target", str(tmp_path / "no-such-model"), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_load_suite_sweeps_concurrency_through_a_real_server(tiny_pair_files, tmp_path) -> None:
    """Both modes at every concurrency through `specsample serve`, every request exactly --max-new-tokens long
    (ignore_eos), a summary with intervals after every phase, the table and the plot."""
    target, draft, questions = tiny_pair_files
    out = tmp_path / "out"
    done = _bench(
        [
            "--suite",
            "load",
            "--target",
            str(target),
            "--draft",
            str(draft),
            "--dtype",
            "float32",
            "--dataset",
            str(questions),
            "--num-prompts",
            "1",
            "--concurrency",
            "1,2",
            "--max-new-tokens",
            "8",
            "--temperature",
            "0.7",
            "--out",
            str(out),
        ]
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["status"] == "complete", results["suites"]["load"].get("error")
    load = results["suites"]["load"]
    assert "--enforce-eager" in load["server"] and "--max-batch-size 2" in load["server"]
    rows = load["runs"]["0.7"]
    assert [r["concurrency"] for r in rows] == [1, 2]
    for row in rows:
        assert sorted(p["mode"] for p in row["phases"]) == ["default", "default", "plain", "plain"]
        assert all(r["tokens"] == 8 for p in row["phases"] for r in p["requests"])
        assert all(len(p["requests"]) == 2 * row["concurrency"] for p in row["phases"])
        summary = row["summary"]
        point, low, high = summary["ratio"]
        assert low <= point <= high
        for mode in ("default", "plain"):
            for key in ("tokens_per_s", "tpot_p50_ms", "tpot_p99_ms", "ttft_p50_ms", "ttft_p99_ms"):
                assert summary[mode][key][0] > 0, (mode, key)
    assert "## load" in (out / "results.md").read_text() and (out / "load.png").exists()


def test_load_phases_send_prompts_no_earlier_phase_sent() -> None:
    from specsample.bench.load import _Prompts

    prompts = _Prompts(["a", "b", "c", "d", "e"])
    assert prompts.take(2) == ["a", "b"] and prompts.take(2) == ["c", "d"] and prompts.reused == 0
    assert prompts.take(3) == ["e", "a", "b"] and prompts.reused == 2  # the dataset ran out: counted
