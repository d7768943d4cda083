"""Adaptive speculation benchmark: fixed gamma 1..8, gamma auto, n-gram, hybrid and target-only, per
Spec-Bench category, at temperatures 0 and 0.7, in one interleaved run (batch 1).

    python benchmarks/adaptive.py --per-category 3 --max-new-tokens 96 --out docs/adaptive_results.json

The goal checked in the output: gamma auto within 3% of the best fixed gamma per category (without
being told the category), and never more than 3% slower than target-only. "gamma=auto" keeps one
controller across the prompts, as a server does (costs and a pooled acceptance rate carry over);
"gamma=auto fresh" starts every prompt from the controller's priors, as a one-off `generate` does.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import random
import re
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm import tqdm

from specsample.bench.difficulty import adjust_for_difficulty, fittable, text_acceptance, within_prompt_spread
from specsample.bench.goals import again, fixed_gammas, goal_intervals, goal_tables, interval_table
from specsample.bench.report import command_line, machine_info
from specsample.bench.round_costs import CostModel, RoundTiming, RunTiming, fit_shared_speed
from specsample.bench.run import (add_attention_option, add_pair_options, attention_backends, controller_config,
                                  encode_fitting, load_model_draft_pair, load_prompts)
from specsample.bench.systems import Ours, run_lockstep
from specsample.datasets import Prompt
from specsample.config import SamplingParams, SpecConfig
from specsample.controller import ControllerConfig
from specsample.drafters.hybrid import HybridDrafter
from specsample.drafters.model import ModelDrafter
from specsample.drafters.ngram import NgramDrafter
from specsample.models.row_padding import PAD_MODES, with_target_widths
from specsample.pair import Pair


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pair_options(parser)
    add_attention_option(parser)
    parser.add_argument("--per-category", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--temperatures", default="0,0.7")
    parser.add_argument("--samples", type=int, default=1,
                        help="replies sampled per prompt at temperature > 0 (each system samples its own texts, so a "
                             "category's figure there varies with them; MT-bench categories have 5 prompts)")
    parser.add_argument("--first-sample", type=int, default=0,
                        help="at temperature > 0, sample replies first-sample .. first-sample + samples - 1 of each "
                             "prompt (seeds i + k * prompts): a run with other texts than an earlier one, to pool with "
                             "it (benchmarks/goal_intervals.py)")
    parser.add_argument("--draft-delay-ms", type=float, default=0.0, metavar="MS",
                        help="what-if: every drafting step of the draft model waits MS more (its prefills and backlog "
                             "scorings do not), to put the controller in a regime this machine does not have, e.g. a "
                             "GPU's, where a drafted round costs ~1.7 plain rounds (docs/cuda.md); prompt lookups are "
                             "unaffected")
    parser.add_argument("--pad-rows", choices=PAD_MODES, default="auto",
                        help="score rounds at the target's fastest width (measured once, used by every system)")
    parser.add_argument("--systems", default="all",
                        help="comma-separated systems to run (default all: " + ", ".join(SYSTEMS) + "); the goal check "
                             "needs target-only, gamma=auto and a fixed gamma, and compares with the fixed gammas run")
    parser.add_argument("--controller", default="", metavar="KEY=VALUE,...",
                        help="ControllerConfig fields for the gamma auto systems, e.g. scored_fallback_margin=0.5")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME[:KEY=VALUE,...]",
                        help="also run the draft model's gamma auto under these ControllerConfig knobs, as a system "
                             "of this name, interleaved with the others (repeat), e.g. 'gamma=auto noext:extend=false'; "
                             "a name starting with 'hybrid' drafts with the hybrid drafter instead")
    parser.add_argument("--box-speed", choices=BOX_SPEED, default="shared",
                        help="modelled time: factor out the box's slowdown per prompt, shared by every system "
                             "(default), or fit each system alone (none)")
    parser.add_argument("--turns", choices=TURNS, default="shuffled",
                        help="with --interleave round: the systems' order drawn afresh every round (default), or one "
                             "fixed cyclic order per prompt, rotated prompt by prompt (before session 23), in which "
                             "each system always follows the same other one (benchmarks/lockstep_order.py)")
    parser.add_argument("--interleave", choices=INTERLEAVE, default="round",
                        help="round: the systems take turns round by round on each prompt, so the box's slow stretches "
                             "hit them alike (default); prompt: each decodes the whole prompt in turn (runs before "
                             "session 22)")
    parser.add_argument("--difficulty", action=argparse.BooleanOptionalAction, default=None,
                        help="after each prompt (untimed), score every reply's text teacher-forced: how hard it was for "
                             "the draft (specsample.bench.difficulty); the report then also prints intervals with "
                             "that noise taken out (default on when --samples >= 2: the fit is within a prompt)")
    parser.add_argument("--remodel", type=Path, metavar="RESULT",
                        help="recompute a stored result's modelled tables from its recorded rounds (with --box-speed) "
                             "into --out, decoding nothing")
    parser.add_argument("--out", type=Path, default=Path("docs/adaptive_results.json"))
    args = parser.parse_args()
    if args.samples < 1:
        parser.error(f"--samples must be >= 1, got {args.samples}")
    if args.difficulty and args.samples < 2:  # honoured (the scores are stored for pooling), but say what it buys
        print("--difficulty with --samples 1: the texts are scored and stored, but this run's report cannot adjust "
              "for them (the fit is among a prompt's replies)", file=sys.stderr)
    if args.difficulty is None:
        args.difficulty = args.samples >= 2
    if args.first_sample < 0:
        parser.error(f"--first-sample must be >= 0, got {args.first_sample}")
    if args.draft_delay_ms < 0:
        parser.error(f"--draft-delay-ms must be >= 0, got {args.draft_delay_ms}")
    if args.remodel:
        remodel(args.remodel, args.box_speed, args.out,
                f"python benchmarks/adaptive.py --remodel {args.remodel} --box-speed {args.box_speed} --out {args.out}")
        return
    try:
        controller = controller_config(args.controller)
    except ValueError as error:
        parser.error(f"--controller: {error}")
    chosen = list(SYSTEMS) if args.systems == "all" else [n.strip() for n in args.systems.split(",")]
    unknown = [n for n in chosen if n not in SYSTEMS]
    if unknown:
        parser.error(f"--systems: unknown {unknown}; choose from {', '.join(SYSTEMS)}")
    if not {"target-only", "gamma=auto"} <= set(chosen) or not any(n.startswith("gamma=") and n[6:].isdigit() for n in chosen):
        parser.error("--systems must include target-only, gamma=auto and at least one fixed gamma (the goal check)")

    try:
        variants = [parse_variant(v) for v in args.variant]
    except ValueError as error:
        parser.error(f"--variant: {error}")
    clash = [n for n, _ in variants if n in SYSTEMS or [m for m, _ in variants].count(n) > 1]
    if clash:
        parser.error(f"--variant: names must differ from each other and from the systems, got {sorted(set(clash))}")

    pair, prompts, ids, max_len = load_spec_bench(args)
    if args.draft_delay_ms:
        delay_draft_forwards(args.draft_delay_ms / 1000)
    tokenizer, target = pair.target.tokenizer, pair.target.model
    attention = contextlib.ExitStack()  # for the whole run: every system decodes under the same kernels
    attention.enter_context(attention_backends(args.attention, [target, pair.drafter.model]))
    eos = tokenizer.eos_token_ids
    widths = with_target_widths(SpecConfig(gamma=8), target, args.pad_rows).target_widths

    systems = make_systems(chosen, target, pair.drafter, eos, max_len, widths, controller, variants)
    temperatures = [float(t) for t in args.temperatures.split(",")]
    totals = {t: defaultdict(lambda: defaultdict(lambda: [0, 0.0])) for t in temperatures}
    timings = {t: defaultdict(list) for t in temperatures}  # system -> [(prompt, category, tokens, RunTiming)]
    difficulty = {t: defaultdict(list) for t in temperatures}  # system -> [text_acceptance per reply, as timings]

    def snapshot() -> dict:
        """The result so far: tokens/s per category and every round recorded (no modelled time yet)."""
        report = {"command": command_line("benchmarks/adaptive.py", args),
                  "machine": machine_info(target.device), "draft": pair.draft_spec,
                  "draft_window": dataclasses.asdict(pair.drafter.window) if pair.drafter.window else None,
                  "target_widths": list(widths), "interleave": args.interleave, "turns": args.turns,
                  "prompts": len(prompts), "samples": args.samples, "first_sample": args.first_sample,
                  **({"placebo_seeds": PLACEBO_SEEDS} if any(s.seed_offset for s in systems) else {}),
                  **({"draft_delay_ms": args.draft_delay_ms} if args.draft_delay_ms else {}),
                  "controller": {k: v for k, v in dataclasses.asdict(controller).items()
                                 if getattr(ControllerConfig(), k) != v},  # gamma auto's knobs off their defaults
                  "results": {}}
        for temperature in temperatures:
            if totals[temperature]:
                report["results"][str(temperature)] = {name: {cat: tok / sec for cat, (tok, sec) in cats.items()}
                                                       for name, cats in totals[temperature].items()}
        report["rounds"] = {str(t): {name: [_dump_run(*run) for run in runs] for name, runs in timings[t].items()}
                            for t in temperatures if timings[t]}
        if args.difficulty:
            report["difficulty"] = {str(t): dict(by_system) for t, by_system in difficulty.items() if by_system}
        return report

    total = sum(len(prompts) * (args.samples if t > 0 else 1) for t in temperatures)
    bar, done = tqdm(total=total, desc="adaptive benchmark"), 0
    for temperature in temperatures:
        # at temperature > 0 each prompt is sampled --samples times (seeds i + k n from k = --first-sample), prompt by prompt
        replies = [(i + k * len(prompts), prompt, prompt_ids) for i, (prompt, prompt_ids) in enumerate(zip(prompts, ids))
                   for k in (range(args.first_sample, args.first_sample + args.samples) if temperature > 0 else [0])]
        for i, prompt, prompt_ids in replies:
            order = systems[i % len(systems):] + systems[: i % len(systems)]
            params = SamplingParams(temperature=temperature, max_new_tokens=args.max_new_tokens, seed=i)
            if args.interleave == "round":
                shuffle = random.Random(i) if args.turns == "shuffled" else None
                records = [r[0] for r in run_lockstep(order, [prompt_ids], params, shuffle)]
            else:
                records = [s.run([prompt_ids], params)[0] for s in order]
            scored: dict[tuple[int, ...], float] = {}  # systems that wrote the same text share its score
            for s, record in zip(order, records):
                timings[temperature][s.name].append((i, prompt.category, len(record.tokens), record.timing))
                if args.difficulty:
                    text = tuple(record.tokens)
                    if text not in scored:
                        scored[text] = text_acceptance(target, pair.drafter.model, prompt_ids, text, params)
                    difficulty[temperature][s.name].append(scored[text])
                for cat in (prompt.category, "overall"):
                    totals[temperature][s.name][cat][0] += len(record.tokens)
                    totals[temperature][s.name][cat][1] += record.seconds
            bar.update(1)
            done += 1
            if done < total:  # a run stopped early (a time limit) still leaves what it measured
                save_partial(snapshot(), partial_path(args.out), done, total)
    bar.close()
    report = snapshot()
    add_modelled(report, args.box_speed)
    save(report, args.out)
    partial_path(args.out).unlink(missing_ok=True)


def partial_path(out: Path) -> Path:
    """Where a run writes its result so far: beside `out` (X.json -> X.partial.json), which only a finished run
    writes, so a stopped run never overwrites an earlier full result there."""
    return out.with_name(out.stem + ".partial" + out.suffix)


def save_partial(report: dict, out: Path, done: int, total: int) -> None:
    """Write the result so far to `out` (`partial_path` of the run's; .json only, replaced atomically), marked
    partial: `--report-only out` renders it if the run is stopped before it ends."""
    out.parent.mkdir(parents=True, exist_ok=True)
    report["partial"] = {"replies": done, "of": total}
    staging = out.with_name(out.name + ".partial")
    staging.write_text(json.dumps(report))
    staging.replace(out)


def _draft_delay_ms(report: dict) -> float:
    """The run's `--draft-delay-ms` (the field, or the recorded command of a run that wrote none)."""
    if "draft_delay_ms" in report:
        return float(report["draft_delay_ms"])
    found = re.search(r"--draft-delay-ms ([0-9.]+)", report.get("command", ""))
    return float(found.group(1)) if found else 0.0


def delay_draft_forwards(seconds: float) -> None:
    """Make every drafting step of a draft model in this process wait `seconds` more (`--draft-delay-ms`): a dearer
    draft, as on a GPU, where the draft's kernel launches cost as much per layer as the target's."""
    forward = ModelDrafter._logits

    def delayed(self: ModelDrafter, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        time.sleep(seconds)
        return out

    ModelDrafter._logits = delayed


def load_spec_bench(args: argparse.Namespace) -> tuple[Pair, list[Prompt], list[list[int]], int]:
    """The pair (`--target`, `--draft`, `--draft-window`), the first `--per-category` Spec-Bench prompts of each
    category that leave room for `--max-new-tokens`, their token ids, and the engine's max length for them."""
    pair = load_model_draft_pair(args.target, args.draft, args.draft_window, args.dtype, args.device)
    prompts, ids = encode_fitting(load_prompts("spec-bench", args.per_category, 0), pair.target.tokenizer,
                                  pair.target.model.max_seq_len, args.max_new_tokens)
    return pair, prompts, ids, max(len(x) for x in ids) + args.max_new_tokens + 16


def save(report: dict, out: Path) -> None:
    """Write a result (.json) and its report (.md beside it)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report))
    write_report(report, out.with_suffix(".md"))


def remodel(source: Path, box_speed: str, out: Path, command: str) -> None:
    """Rewrite a stored result's modelled tables from its rounds (recorded since session 21)."""
    report = json.loads(source.read_text())
    if "rounds" not in report:
        raise SystemExit(f"{source} has no recorded rounds (runs before session 21 did not store them)")
    report["remodel_command"] = command
    add_modelled(report, box_speed)
    save(report, out)


BOX_SPEED = ("shared", "none")  # modelled time: one box slowdown per prompt shared by the systems, or none


def add_modelled(report: dict, box_speed: str) -> None:
    """Fill the report's modelled tables and fits from its stored rounds."""
    report["box_speed"] = box_speed
    report["modelled"], report["model_fit"], report["box_slowdown"] = {}, {}, {}
    for temperature, by_system in report["rounds"].items():
        runs = {name: [_load_run(row) for row in rows] for name, rows in by_system.items()}
        (report["modelled"][temperature], report["model_fit"][temperature],
         report["box_slowdown"][temperature]) = modelled(runs, box_speed)


def _dump_run(prompt: int, category: str, tokens: int, timing: RunTiming) -> list:
    """One generation's rounds, compactly: [prompt, category, tokens, prompt tokens, prefill ms,
    [[drafted, context, ms, scored (0 or 1), lookup (0 or 1: gamma auto had it propose a prompt lookup; since
    session 35), [draft ms, target ms, verify ms] (the engine's phases of the round; since session 36)], ...]]
    (times rounded to a microsecond)."""
    def row(r: RoundTiming) -> list:
        phases = [[round(s * 1000, 3) for s in r.phases]] if r.phases is not None else []
        return [r.drafted, r.context, round(r.seconds * 1000, 3), int(r.scored), int(r.lookup), *phases]

    return [prompt, category, tokens, timing.prompt_tokens, round(timing.prefill_seconds * 1000, 3),
            [row(r) for r in timing.rounds]]


def _load_run(row: list) -> tuple[int, str, int, RunTiming]:
    prompt, category, tokens, prompt_tokens, prefill_ms, rounds = row
    return prompt, category, tokens, RunTiming(prompt_tokens, prefill_ms / 1000,
                                               tuple(RoundTiming(d, c, ms / 1000, bool(rest and rest[0]),
                                                                 bool(rest[1:] and rest[1]),
                                                                 tuple(p / 1000 for p in rest[2]) if rest[2:] else None)
                                                     for d, c, ms, *rest in rounds))


INTERLEAVE = ("round", "prompt")  # systems take turns per round of a prompt, or decode whole prompts in turn
TURNS = ("shuffled", "rotated")  # round by round: a fresh order every round, or a fixed cyclic order per prompt

PLACEBO_SEEDS = 1_000_000_007  # the copies' seed shift: far past any reply's seed (i + k * prompts)
AGAIN = again("target-only")  # target-only run a second time: the run's own timing noise
SYSTEMS = ("target-only", AGAIN, *(f"gamma={g}" for g in range(1, 9)), *(again(f"gamma={g}") for g in range(1, 9)),
           "gamma=auto", "gamma=auto fresh", "ngram",
           "ngram auto", "hybrid", "hybrid auto", "hybrid auto offer3")


def parse_variant(spec: str) -> tuple[str, ControllerConfig]:
    """'name' or 'name:key=value,...' -> (name, its ControllerConfig)."""
    name, _, knobs = spec.partition(":")
    if not name or name == "target-only" or re.fullmatch(r"gamma=\d+", name):
        raise ValueError(f"a variant needs a name of its own (not target-only or gamma=N), got {spec!r}")
    return name, controller_config(knobs)


def make_systems(chosen: list[str], target, draft: ModelDrafter, eos: frozenset[int], max_len: int,
                 widths: tuple[int, ...], controller: ControllerConfig | None = None,
                 variants: Sequence[tuple[str, ControllerConfig]] = ()) -> list[Ours]:
    """The systems named in `chosen`, in SYSTEMS order, then the draft model's gamma auto once per named
    `variants` entry under its own knobs (benchmarks/controller_variants.py); a variant named hybrid... drafts with
    the hybrid drafter (prompt lookup, the draft model elsewhere), as "hybrid auto" does. Each model-drafting system gets
    its own drafter (its own cache and history) with the loaded draft's model and window: built from the model
    alone, the drafters of session 19's first full run drafted from the whole context. `controller`: the knobs
    of the gamma auto systems in `chosen` (default ControllerConfig's)."""

    def system(name, drafter, gamma, adaptive=False, speculative=True, keep_controller=True, knobs=controller,
               seed_offset=0):
        config = SpecConfig(gamma=gamma, adaptive=adaptive, speculative=speculative, max_batch_size=1,
                            max_seq_len=max_len, target_widths=widths)
        return Ours(name, target, drafter, config, eos, keep_controller=keep_controller, controller_config=knobs,
                    seed_offset=seed_offset)

    def model() -> ModelDrafter:
        return ModelDrafter(draft.model, draft.folder, draft.window)

    builders = {
        "target-only": lambda: system("target-only", None, 1, speculative=False),
        # the same system twice: how far its ratio to target-only strays from 1 is the run's timing noise
        AGAIN: lambda: system(AGAIN, None, 1, speculative=False),
        **{f"gamma={g}": (lambda g=g: system(f"gamma={g}", model(), g)) for g in range(1, 9)},
        # a fixed gamma twice (a placebo gamma auto): how often a copy of the best fixed gamma "misses" the goal;
        # the copy samples its own texts (other seeds), as gamma auto does, so it meets the texts' luck too
        **{again(f"gamma={g}"): (lambda g=g: system(again(f"gamma={g}"), model(), g, seed_offset=PLACEBO_SEEDS))
           for g in range(1, 9)},
        "gamma=auto": lambda: system("gamma=auto", model(), 8, adaptive=True),
        "gamma=auto fresh": lambda: system("gamma=auto fresh", model(), 8, adaptive=True, keep_controller=False),
        "ngram": lambda: system("ngram", NgramDrafter(), 5),
        "ngram auto": lambda: system("ngram auto", NgramDrafter(), 8, adaptive=True),
        "hybrid": lambda: system("hybrid", HybridDrafter(model()), 5),
        "hybrid auto": lambda: system("hybrid auto", HybridDrafter(model()), 8, adaptive=True),
        # the default before session 40: gamma auto was offered only prompt-lookup matches of 3 tokens or more
        "hybrid auto offer3": lambda: system("hybrid auto offer3", HybridDrafter(model(), offer_match=3), 8,
                                             adaptive=True),
    }
    return ([builders[name]() for name in SYSTEMS if name in chosen]
            + [system(name, HybridDrafter(model()) if name.startswith("hybrid") else model(), 8, adaptive=True,
                      knobs=knobs) for name, knobs in variants])


def modelled(runs_by_system: dict[str, list], box_speed: str = "shared") -> tuple[dict, dict, dict | None]:
    """Tokens/s per category in modelled time (each round at its system's mean cost, with the box's
    slowdown per prompt shared by all systems unless `box_speed` is "none"; see
    specsample.bench.round_costs), per system how far measured and modelled categories differ, and the
    spread of the prompts' slowdowns (None without)."""
    if box_speed not in BOX_SPEED:
        raise ValueError(f"box_speed must be one of {BOX_SPEED}, got {box_speed!r}")
    table, fit, spread = {}, {}, None
    if box_speed == "shared":
        shared = fit_shared_speed({name: [(prompt, timing) for prompt, _, _, timing in runs]
                                   for name, runs in runs_by_system.items()})
        models, slowdown = shared.models, sorted(shared.slowdown.values())
        spread = {"p05": slowdown[len(slowdown) // 20], "median": slowdown[len(slowdown) // 2],
                  "p95": slowdown[-1 - len(slowdown) // 20]}
    else:
        models = {name: CostModel.fit([timing for _, _, _, timing in runs]) for name, runs in runs_by_system.items()}
    for name, runs in runs_by_system.items():
        model = models[name]
        tokens, seconds, measured = defaultdict(int), defaultdict(float), defaultdict(float)
        for _, category, count, timing in runs:
            for cat in (category, "overall"):
                tokens[cat] += count
                seconds[cat] += model.seconds(timing)
                measured[cat] += timing.seconds
        table[name] = {cat: tokens[cat] / seconds[cat] for cat in tokens}
        ratios = [math.log(measured[c] / seconds[c]) for c in tokens if c != "overall"]
        fit[name] = {"rounds": sum(len(t.rounds) for *_, t in runs), "overall_measured_over_modelled":
                     measured["overall"] / seconds["overall"], "category_log_ratio_sd": statistics.pstdev(ratios),
                     "cost_model": dataclasses.asdict(model)}
    return table, fit, spread


def _speed_note(spread: dict | None) -> str:
    """How the fit treated the box's speed (results from before the shared fit have no spread)."""
    if spread is None:
        return ", with no correction for the box's speed"
    return (", with the box's slowdown while each prompt ran shared by every system (they decode it back to back) "
            f"and factored out: prompts' slowdowns {spread['p05']:.3f} (5th percentile), {spread['median']:.3f} "
            f"(median), {spread['p95']:.3f} (95th) of the run's mean")


def _stall_note(fit: dict) -> str:
    """Rounds each system's fit left out as stalls of the box (runs from before that rule have no count)."""
    if not all("stalls" in f["cost_model"] for f in fit.values()):
        return " (Fitted with the plain mean: no rounds were left out as stalls.)"
    return (" Rounds left out of the fit as stalls of the box (over 3x their prediction): "
            + ", ".join(f"{n} {f['cost_model']['stalls']}" for n, f in fit.items()) + ".")


FIT_CONTEXT = 300  # context length at which the report prints each system's fitted round costs


def _fitted_costs(fit: dict) -> list[str]:
    """Each system's fitted round costs at FIT_CONTEXT, in target-only's plain rounds: what the modelled
    tables charge. A plain round is the same computation in every system, so where a system's plain
    round reads dearer than target-only's, that is the fit's noise (or work the system adds, such as a
    draft forward that scores a backlog) and it weighs most in categories decoded mostly plain."""
    models = {name: CostModel.from_dict(f["cost_model"]) for name, f in fit.items()}
    if "target-only" not in models:
        return []
    plain = models["target-only"].round_seconds(0, FIT_CONTEXT)
    rows = []
    for name, model in models.items():
        costs = [f"{d} drafts {model.round_seconds(d, FIT_CONTEXT) / plain:.3f}" for d in model.draft_counts]
        if model.scored_coef:  # gamma auto's rounds that scored a backlog, fitted apart from its plain rounds
            costs.append(f"scoring a backlog +{model.scored_coef / plain:.3f}")
        rows.append(f"{name}: " + ", ".join(costs))
    return [f"Fitted round costs at context {FIT_CONTEXT}, in target-only plain rounds ({plain * 1000:.1f} ms): "
            + "; ".join(rows) + ".", ""]


def _interleave_note(report: dict) -> str:
    """How the systems shared the box (results from before session 22 took turns prompt by prompt)."""
    if report.get("interleave", "prompt") == "round":
        turns = (" in an order drawn afresh every round (`--turns shuffled`)" if report.get("turns") == "shuffled" else
                 " in one cyclic order per prompt, so each system always followed the same other one")
        return ("Interleaved round by round: on each prompt the systems took turns, one round each" + turns + ", and "
                "a system's time counts its own rounds only (`--interleave round`).")
    return "Interleaved prompt by prompt: each system decoded the whole prompt in turn (`--interleave prompt`)."


def _by_prompt(rows: list) -> dict[int, RunTiming]:
    """A system's stored runs of one temperature by prompt key (the key pairs replies across systems)."""
    return {row[0]: _load_run(row)[3] for row in rows}


def rounds_of(rows: list) -> dict[int, tuple[int, float]]:
    """A system's stored runs as reply key -> (its rounds, the seconds spent in them), for the adjustment."""
    return {key: (len(timing.rounds), sum(r.seconds for r in timing.rounds))
            for key, _, _, timing in map(_load_run, rows)}


def replies_of(rows: list) -> list[tuple[int, str, int, float]]:
    """A system's stored runs as the goal bootstrap's replies: (key, category, tokens, measured seconds)."""
    return [(key, category, tokens, timing.seconds) for key, category, tokens, timing in map(_load_run, rows)]


def _noise_note(report: dict, temperature: str) -> list[str]:
    """With target-only run twice: the spread of the two's per-reply time ratio, the run's own timing noise."""
    rounds = report.get("rounds", {}).get(temperature, {})
    if AGAIN not in rounds or "target-only" not in rounds:
        return []
    base = _by_prompt(rounds["target-only"])
    logs = [math.log(run.seconds / base[key].seconds) for key, run in _by_prompt(rounds[AGAIN]).items() if key in base]
    return [f"Timing noise: `{AGAIN}` is target-only decoding every reply a second time; the standard deviation of "
            f"log(its time / target-only's) per reply is {statistics.pstdev(logs):.3f} over {len(logs)} replies "
            "(a category's figure averages that over its replies).", ""]


def _placebo_note(report: dict, temperature: str) -> list[str]:
    """With fixed gammas decoded twice: whether the copies sampled texts of their own."""
    rounds = report.get("rounds", {}).get(temperature, {})
    copies = [again(g) for g in fixed_gammas(rounds) if again(g) in rounds]
    if not copies:
        return []
    if float(temperature) == 0:
        texts = "at temperature 0 every system writes the target's greedy text, the copies too"
    elif report.get("placebo_seeds"):
        texts = (f"the copies sample texts of their own (seeds shifted by {report['placebo_seeds']}), as gamma auto "
                 "does, so the placebo meets the texts' luck, the timing noise and the pick of the best fixed gamma")
    else:
        texts = ("the copies sampled the same texts as the fixed gammas they copy (same seeds; before session 34's "
                 "seed shift), so the placebo shows the timing noise and the pick of the best, not the texts' luck")
    return [f"Placebo: {', '.join(f'`{n}`' for n in copies)} decode a fixed gamma a second time as systems of their "
            f"own; {texts}.", ""]


def measured_split(report: dict, temperature: str) -> dict[str, dict[str, float]]:
    """Per category, where gamma auto's measured time beyond target-only's went, as shares of target-only's
    time, reply by reply (each prompt's rounds paired with target-only's on it): its prefill beyond
    target-only's; its plain rounds and its scoring rounds beyond as many of target-only's plain rounds (at
    that reply's mean); and the rest, its drafting rounds less the rounds they saved (at T > 0 also the
    texts' different lengths). The parts add up to gamma auto's time over target-only's, less 1."""
    rounds = report.get("rounds", {}).get(temperature, {})
    if "gamma=auto" not in rounds or "target-only" not in rounds:
        return {}
    base = _by_prompt(rounds["target-only"])
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0] * 5)  # target-only, extra, prefill, plain, scoring
    for row in rounds["gamma=auto"]:
        _, category, _, timing = _load_run(row)
        paired = base.get(row[0])
        if paired is None or not paired.rounds:
            continue
        plain = statistics.fmean(r.seconds for r in paired.rounds)  # target-only decodes plain throughout
        parts = [paired.seconds, timing.seconds - paired.seconds, timing.prefill_seconds - paired.prefill_seconds,
                 sum(r.seconds - plain for r in timing.rounds if r.drafted == 0 and not r.scored),
                 sum(r.seconds - plain for r in timing.rounds if r.scored)]
        for cat in (category, "overall"):
            sums[cat] = [a + b for a, b in zip(sums[cat], parts)]
    return {cat: {"prefill": pre / t, "plain": plain / t, "scoring": scored / t,
                  "drafting": (extra - pre - plain - scored) / t}
            for cat, (t, extra, pre, plain, scored) in sums.items()}


def _prompt_count(report: dict, temperature: str) -> int:
    """How many prompts a temperature's replies came from (runs before session 26 did not store it: their
    --samples is read from the command, and at temperature > 0 each prompt has that many replies)."""
    if "prompts" in report:
        return report["prompts"]
    found = re.search(r"--samples (\d+)", report["command"])
    samples = int(found.group(1)) if found and float(temperature) > 0 else 1
    return len(report["rounds"][temperature]["target-only"]) // samples


def _interval_lines(report: dict, temperature: str) -> list[str]:
    """Bootstrap intervals of the measured goal ratios, where the run recorded its replies."""
    rounds = report.get("rounds", {}).get(temperature, {})
    if "target-only" not in rounds:
        return []
    replies = {name: replies_of(rows) for name, rows in rounds.items()}
    prompts = _prompt_count(report, temperature)
    lines = interval_table(goal_intervals(replies, prompts))
    difficulty = difficulty_of(report, temperature)
    if difficulty and not fittable(replies, prompts):
        return lines + [UNFITTABLE_NOTE, ""]
    if difficulty:
        rounds_by = {name: rounds_of(rows) for name, rows in rounds.items()}
        adjusted, betas = adjust_for_difficulty(replies, difficulty, prompts, rounds_by)
        lines += ["#### The same, times adjusted for the text", "", DIFFICULTY_NOTE, "",
                  *adjustment_table(replies, adjusted, betas, prompts),
                  *interval_table(goal_intervals(adjusted, prompts))]
    return lines


UNFITTABLE_NOTE = ("Not adjusted for the text: its texts were scored, but with one reply per prompt there is nothing "
                   "to fit within a prompt (`--samples` >= 2).")
DIFFICULTY_NOTE = ("Adjusted for the text (`specsample.bench.difficulty`): each reply's text was scored teacher-forced "
                   "after its prompt (untimed): the mean over its tokens of the probability that a draft there is "
                   "accepted. Per system, rounds per token are fitted against that acceptance within prompts, and "
                   "each reply is charged, at its own price per round, the rounds its text's distance from the "
                   "prompt's mean over every system's texts predicts it saved or cost. All systems sample from one "
                   "distribution, so this leaves each system's expected time where it was and takes out the luck of "
                   "drawing an easy or a hard text; the box's timing noise stays.")


def adjustment_table(replies: dict[str, list], adjusted: dict[str, list], betas: dict[str, float],
                     prompts: int) -> list[str]:
    """Markdown: each system's rounds per token against its texts' acceptance, and how far one reply's speed
    strays on a prompt before and after the adjustment."""
    before, after = within_prompt_spread(replies, prompts), within_prompt_spread(adjusted, prompts)
    return (["| system | slope (rounds per token per unit of acceptance) | spread of a reply's time per token on its "
             "prompt (sd of log) | adjusted |", "|---|---|---|---|"]
            + [f"| {name} | {betas[name]:.3f} | {before[name]:.3f} | {after[name]:.3f} |" for name in replies]
            + [""])


def difficulty_of(report: dict, temperature: str) -> dict[str, dict[int, float]]:
    """Per system, reply key -> its text's acceptance (`--difficulty`; {} for runs without it)."""
    scores = report.get("difficulty", {}).get(temperature, {})
    rounds = report.get("rounds", {}).get(temperature, {})
    return {name: {row[0]: x for row, x in zip(rounds[name], values, strict=True)}
            for name, values in scores.items() if name in rounds}


def _split_lines(report: dict, temperature: str) -> list[str]:
    split = measured_split(report, temperature)
    if not split:
        return []
    cats = sorted(c for c in split if c != "overall") + ["overall"]
    return ["Where gamma auto's measured time beyond target-only's went, in % of target-only's (reply by reply; "
            "`measured_split`): its prefill, its plain rounds and scoring rounds beyond target-only's plain rounds, "
            "and the rest (drafting rounds less the rounds they saved):", "",
            "| category | prefill | plain rounds | scorings | drafting | total |", "|---|---|---|---|---|---|"] + [
            f"| {c} | " + " | ".join(f"{100 * split[c][k]:+.1f}" for k in ("prefill", "plain", "scoring", "drafting"))
            + f" | {100 * sum(split[c].values()):+.1f} |" for c in cats] + [""]


ROUND_CLASSES = ("prefill", "plain", "scoring", "1 draft", "2 drafts", "3+ drafts")


def _round_class(r: RoundTiming) -> str:
    if r.scored:
        return "scoring"
    return "plain" if r.drafted == 0 else "1 draft" if r.drafted == 1 else "2 drafts" if r.drafted == 2 else "3+ drafts"


def fixed_split(reports: list[dict], temperature: str,
                name: str = "gamma=auto") -> tuple[dict[str, dict[str, tuple[float, float]]], dict[str, str]]:
    """Per category, where `name`'s time went against the category's best fixed gamma (by measured tokens/s over
    every run given, runs of the same prompts), by class of round (`ROUND_CLASSES`): each round's time less the
    time the fixed gamma's rounds took for as many tokens on the same prompt (pooled over its replies there), and
    its prefill less the fixed gamma's mean prefill there. Per class: (share of `name`'s time, share of its
    rounds); the shares of time add up to 1 - (its tokens at the fixed gamma's pace) / its time, about 1 - its
    speed over the fixed gamma's. Also the best fixed gamma per category. A round's tokens are the context it
    added (the last round's: the rest of the reply)."""
    pooled: dict[str, list[tuple[int, str, int, RunTiming]]] = defaultdict(list)
    for report in reports:
        prompts = _prompt_count(report, temperature)
        stored = report.get("rounds", {}).get(temperature, {})
        for system in (*fixed_gammas(stored), name) if name in stored else ():  # only what the split reads
            pooled[system] += [(key % prompts, category, tokens, timing)
                               for key, category, tokens, timing in map(_load_run, stored[system])]
    fixed = fixed_gammas(pooled)
    if name not in pooled or not fixed:
        return {}, {}
    speed: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])  # (system, category) -> tokens, s
    for system in fixed:
        for _, category, tokens, timing in pooled[system]:
            speed[system, category][0] += tokens
            speed[system, category][1] += timing.seconds
    categories = {category for _, category, _, _ in pooled[name]}
    best = {c: max(fixed, key=lambda n: speed[n, c][0] / max(speed[n, c][1], 1e-12)) for c in categories}
    pace: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])  # prompt -> tokens, round s, prefill s, n
    for category in categories:
        for prompt, cat, tokens, timing in pooled[best[category]]:
            if cat == category:
                for i, x in enumerate((tokens, timing.seconds - timing.prefill_seconds, timing.prefill_seconds, 1)):
                    pace[prompt][i] += x
    sums: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for prompt, category, tokens, timing in pooled[name]:
        fixed_tokens, fixed_seconds, fixed_prefill, fixed_replies = pace.get(prompt, (0, 0, 0, 0))
        if fixed_tokens <= 0 or not timing.rounds:
            continue
        per_token = fixed_seconds / fixed_tokens
        start = timing.rounds[0].context
        for cat in (category, "overall"):
            total = sums[cat]
            total["seconds"] += timing.seconds
            total["prefill"] += timing.prefill_seconds - fixed_prefill / fixed_replies
            for k, r in enumerate(timing.rounds):
                made = (timing.rounds[k + 1].context - r.context if k + 1 < len(timing.rounds)
                        else tokens - (r.context - start))
                kind = _round_class(r)
                total[kind] += r.seconds - made * per_token
                total["rounds " + kind] += 1
                total["rounds"] += 1
    split = {cat: {c: (total[c] / total["seconds"], total["rounds " + c] / total["rounds"]) for c in ROUND_CLASSES}
             for cat, total in sums.items()}
    return split, best


def fixed_split_lines(reports: list[dict], temperature: str, name: str = "gamma=auto") -> list[str]:
    """Markdown of `fixed_split`: per category, the loss against the best fixed gamma by class of round."""
    split, best = fixed_split(reports, temperature, name)
    if not split:
        return []
    cats = sorted(c for c in split if c != "overall") + ["overall"]
    return [f"Where `{name}`'s time went against the category's best fixed gamma, in % of its own time (`fixed_split`: "
            "each round's time less the fixed gamma's time for as many tokens on the same prompt; its prefill less "
            "the fixed gamma's; in brackets the class's share of its rounds). A positive total is about how much "
            "slower it was; the classes say where, not what another choice would have saved: the confidence gate "
            "ends a round after its first draft where that draft is least likely accepted, so one-draft rounds lose "
            "by selection and the longer ones gain by it:", "",
            "| category | best fixed | " + " | ".join(ROUND_CLASSES) + " | total |", "|---|---|" + "---|" * 7] + [
            f"| {c} | {best[c].split('=')[1] if c in best else 'per category'} | "
            + " | ".join(f"{100 * split[c][k][0]:+.1f}" + ("" if k == "prefill" else f" ({split[c][k][1]:.2f})")
                         for k in ROUND_CLASSES)
            + f" | {100 * sum(v[0] for v in split[c].values()):+.1f} |" for c in cats] + [""]


def write_report(report: dict, out: Path) -> None:
    """Tables per temperature, the goal check for gamma auto, and the same check for every policy; in
    measured time and, where the run recorded rounds, in modelled time (timing noise removed).

    The fixed gammas are checked too: each is itself one of the "fixed gammas", so how often they fail
    the 3% criteria shows how much of a miss is measurement noise rather than a worse policy.
    """
    widths = report.get("target_widths") or []
    padding = (f" Target rounds scored at widths {widths} for 1..{len(widths)} tokens (measured, `--pad-rows auto`)."
               if widths else " No row padding.")
    lines = [f"Command: `{report['command']}`", ""]
    about = report.get("machine", {})
    if about:  # runs before session 35 recorded no device: they ran on the CPU
        lines += [f"Machine: {about.get('gpu') or about.get('cpu')} ({about.get('device', 'cpu')}), "
                  f"{about.get('threads')} CPU threads, torch {about.get('torch')}.", ""]
    if report.get("remodel_command"):
        lines += [f"Modelled tables recomputed by: `{report['remodel_command']}`", ""]
    if report.get("partial"):
        done = report["partial"]
        lines += [f"**Partial run:** stopped after {done['replies']} of its {done['of']} replies; the tables hold "
                  "the categories reached" + ("." if "modelled" in report else " (no modelled time).") , ""]
    delay = _draft_delay_ms(report)
    if delay:
        lines += [f"**What-if, not this machine's speeds:** every drafting step of the draft model waited {delay:g} ms "
                  "more (`--draft-delay-ms`), to emulate a dearer draft such as a GPU's.", ""]
    lines += [f"Draft: `{report['draft']}`; tokens/s per category, batch 1.{padding}", "", _interleave_note(report), ""]
    if report.get("controller"):
        lines += [f"gamma auto with ControllerConfig changes: {report['controller']}.", ""]
    for temperature, table in report["results"].items():
        lines += ([f"### Temperature {temperature}, measured", "", *_noise_note(report, temperature),
                   *_placebo_note(report, temperature)] + goal_tables(table)
                  + _interval_lines(report, temperature) + _split_lines(report, temperature)
                  + fixed_split_lines([report], temperature))
        if temperature in report.get("modelled", {}):
            fit = report["model_fit"][temperature]
            lines += [f"### Temperature {temperature}, modelled time", "",
                      "Each round charged its system's mean cost for its draft count and context length, fitted over "
                      "all of that system's rounds in this run (specsample.bench.round_costs)"
                      + _speed_note(report.get("box_slowdown", {}).get(temperature)) + ". Per system, the "
                      "standard deviation over categories of log(measured / modelled time), i.e. the timing noise "
                      "the model removes: " + ", ".join(f"{n} {f['category_log_ratio_sd']:.3f}" for n, f in fit.items())
                      + "." + _stall_note(fit), ""] + _fitted_costs(fit) + goal_tables(report["modelled"][temperature])
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--report-only":  # rewrite the .md from a results .json
        write_report(json.loads(Path(sys.argv[2]).read_text()), Path(sys.argv[2]).with_suffix(".md"))
        sys.exit(0)
    started = time.time()
    main()
    print(f"{(time.time() - started) / 60:.1f} min")
