"""Paired replay of the adaptive benchmark: every gamma policy on the same sampled texts (batch 1).

    python benchmarks/adaptive_replay.py --per-category 5 --samples 3 --costs docs/adaptive_results.json
    python benchmarks/adaptive_replay.py --replay-only docs/adaptive_replay.json   # again from the stored traces
    python benchmarks/adaptive_replay.py --replay-only A.json B.json   # traces of several runs as one stream

Samples replies from the target alone (temperature 0: one greedy reply per prompt; above 0: `--samples`
per prompt), scores each with the target and the draft teacher-forced, and replays fixed gamma 1..8,
gamma auto (the real controller) and target-only on them with the same acceptance coins; rounds are
charged the costs a benchmarks/adaptive.py run fitted (`--costs`). See specsample.bench.replay for
why given the text this is exact, and for its approximations.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from tqdm import tqdm

from specsample.api import generate
from specsample.bench.goals import goal_tables, passes
from specsample.bench.report import machine_info
from specsample.bench.replay import (ORDERS, DraftPrefill, RoundCostTable, Trace, compare, replay, reply_logits,
                                     trace_from_logits)
from specsample.bench.run import (add_pair_options, controller_config, encode_fitting, load_model_draft_pair,
                                  load_prompts)
from specsample.config import SamplingParams, SpecConfig
from specsample.controller import ControllerConfig, GammaController


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pair_options(parser)
    parser.add_argument("--dataset", default="spec-bench",
                        help="spec-bench (the benchmark), or sharegpt / sharegpt-hard (texts to tune on: never tune "
                             "on spec-bench; sharegpt-hard: translation requests and long prompts)")
    parser.add_argument("--per-category", type=int, default=5,
                        help="prompts per category (sharegpt: in all; sharegpt-hard: of each kind)")
    parser.add_argument("--samples", type=int, default=3, help="replies sampled per prompt at temperature > 0")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperatures", default="0,0.7")
    parser.add_argument("--costs", type=Path, default=Path("docs/adaptive_results.json"),
                        help="a benchmarks/adaptive.py result whose fitted round costs price the replayed rounds")
    parser.add_argument("--replicates", type=int, default=10, help="replays of every trace (fresh coins each)")
    parser.add_argument("--out", type=Path, default=Path("docs/adaptive_replay.json"))
    parser.add_argument("--replay-only", type=Path, nargs="+", metavar="RESULT",
                        help="replay the traces stored in these results instead (several: one stream, shuffled)")
    parser.add_argument("--controller", default="", metavar="KEY=VALUE,...",
                        help="ControllerConfig fields for gamma auto, e.g. fallback_margin=0,prior_weight=4")
    parser.add_argument("--draft-prefill", type=Path, default=None, metavar="RESULT",
                        help="a benchmarks/draft_window.py result: price a drafting policy's prefill as target-only's "
                             "plus the draft's own timed prefill of what its window feeds it (default: fixed gamma 1's "
                             "fit, a line in the prompt's length)")
    parser.add_argument("--order", choices=ORDERS, default="shuffled",
                        help="the order gamma auto's one controller sees the texts in: shuffled per replicate (as a "
                             "server sees requests), or given (as recorded: benchmarks/adaptive.py runs Spec-Bench "
                             "category by category)")
    parser.add_argument("--scoring-cost", type=float, default=None, metavar="PLAIN_ROUNDS",
                        help="what a backlog scoring adds to a plain round (default: gamma auto's fitted cost where "
                             "--costs has one, else a draft step; benchmarks/adaptive.py prints it as 'scoring a "
                             "backlog')")
    parser.add_argument("--controller-overhead", type=float, default=0.0, metavar="PLAIN_ROUNDS",
                        help="what gamma auto's own work (controller, backlog bookkeeping) adds to each of its rounds, "
                             "in plain rounds: benchmarks/plain_round_overhead.py measures it (median ratio - 1); "
                             "default 0, as replays before session 22")
    parser.add_argument("--by-acceptance", action="store_true",
                        help="group the texts by their mean acceptance instead of by category (e.g. for sharegpt)")
    args = parser.parse_args()
    try:
        config = controller_config(args.controller)
    except ValueError as error:
        parser.error(f"--controller: {error}")
    if args.scoring_cost is not None and args.scoring_cost < 0:
        parser.error(f"--scoring-cost must be >= 0, got {args.scoring_cost}")
    if args.controller_overhead < 0:
        parser.error(f"--controller-overhead must be >= 0, got {args.controller_overhead}")
    if min(args.per_category, args.samples, args.max_new_tokens, args.replicates) < 1:
        parser.error("--per-category, --samples, --max-new-tokens and --replicates must be >= 1")
    cost_run = json.loads(args.costs.read_text())
    fits = cost_run["model_fit"]
    wanted = [str(float(t)) for t in args.temperatures.split(",")] if not args.replay_only else []
    if any(t not in fits for t in wanted):  # before minutes of sampling, not after
        parser.error(f"{args.costs} has fitted costs at temperatures {sorted(fits)} only")
    if args.replay_only:
        traces, report = load_stored(args.replay_only)
    else:
        traces, report = record(args)
    replayed = traces if not args.by_acceptance else {
        t: [dataclasses.replace(x, category=acceptance_group(x)) for x in rows] for t, rows in traces.items()}
    report["command"] = "python benchmarks/adaptive_replay.py " + " ".join(sys.argv[1:])
    report["costs_from"] = str(args.costs)
    report["replicates"] = args.replicates
    report["controller"] = dataclasses.asdict(config)
    report["by_acceptance"] = args.by_acceptance
    report["order"] = args.order
    report["scoring_cost"] = args.scoring_cost
    report["controller_overhead"] = args.controller_overhead
    report["draft_prefill_from"] = str(args.draft_prefill) if args.draft_prefill else None
    draft_prefill = load_draft_prefill(args.draft_prefill, report.get("draft_window")) if args.draft_prefill else None
    report["results"] = {}
    bar = tqdm(total=args.replicates * sum(len(rows) for rows in replayed.values()), desc="replay")
    for temperature, rows in replayed.items():
        if temperature not in fits:
            raise SystemExit(f"{args.costs} has no fitted costs at temperature {temperature}")
        costs = RoundCostTable.from_fits(fits[temperature], draft_prefill=draft_prefill, scoring=args.scoring_cost,
                                         controller=args.controller_overhead)
        report.setdefault("scoring_costs", {})[temperature] = costs.scoring_seconds / costs.round_seconds(0, COST_CONTEXT)
        report.setdefault("round_costs", {})[temperature] = [  # what the verdicts hinge on, printed in the report
            costs.round_seconds(d, COST_CONTEXT) / costs.round_seconds(0, COST_CONTEXT) for d in range(1, 9)]
        probes = report.setdefault("probes", {}).setdefault(temperature, {})
        drafts = report.setdefault("drafts", {}).setdefault(temperature, {})
        breakdown = report.setdefault("breakdown", {}).setdefault(temperature, {})
        report["results"][temperature] = compare(rows, costs, args.replicates,
                                                 new_controller=lambda: GammaController(config), progress=bar.update,
                                                 probes=probes, order=args.order, breakdown=breakdown,
                                                 drafts=drafts)
    bar.close()
    report["check"] = round_check(traces, cost_run)
    report["traces"] = {t: [_dump_trace(x) for x in rows] for t, rows in traces.items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report))
    write_report(report, args.out.with_suffix(".md"))


COST_CONTEXT = 300  # context length at which the report prints round costs


def load_stored(paths: list[Path]) -> tuple[dict[str, list[Trace]], dict]:
    """Traces of one or more stored results, per temperature (those every result has), and their provenance."""
    stored = [json.loads(path.read_text()) for path in paths]
    drafts = {s["draft"] for s in stored}
    if len(drafts) > 1:
        raise SystemExit(f"the results were recorded with different drafts: {sorted(drafts)}")
    windows = {json.dumps(s.get("draft_window")) for s in stored}  # absent: recorded before windows (whole context)
    if len(windows) > 1:
        raise SystemExit(f"the results were recorded with different draft windows: {sorted(windows)}")
    temperatures = [t for t in stored[0]["traces"] if all(t in s["traces"] for s in stored)]
    if not temperatures:
        raise SystemExit("the results share no temperature")
    traces = {t: [_load_trace(x) for s in stored for x in s["traces"][t]] for t in temperatures}
    report = {"record_command": "; ".join(s["record_command"] for s in stored), "machine": stored[0]["machine"],
              "draft": stored[0]["draft"], "draft_window": stored[0].get("draft_window")}
    return traces, report


def acceptance_group(trace: Trace) -> str:
    """The text's mean acceptance of a draft: 0.0-0.2, 0.2-0.3, 0.3-0.4 or 0.4-1.0."""
    mean = sum(trace.accept) / len(trace.accept)
    bands = ((0.2, "alpha 0.0-0.2"), (0.3, "alpha 0.2-0.3"), (0.4, "alpha 0.3-0.4"))
    return next((label for top, label in bands if mean < top), "alpha 0.4-1.0")


def record(args: argparse.Namespace) -> tuple[dict[str, list[Trace]], dict]:
    """Sample replies from the target alone and score them teacher-forced with both models."""
    pair = load_model_draft_pair(args.target, args.draft, args.draft_window, args.dtype, args.device)
    tokenizer, target, draft = pair.target.tokenizer, pair.target.model, pair.drafter.model
    prompts, ids = encode_fitting(load_prompts(args.dataset, args.per_category, 0), tokenizer, target.max_seq_len,
                                  args.max_new_tokens)
    temperatures = [float(t) for t in args.temperatures.split(",")]
    traces: dict[str, list[Trace]] = {}
    bar = tqdm(total=sum(len(prompts) * (1 if t == 0 else args.samples) for t in temperatures), desc="sampling texts")
    for temperature in temperatures:
        rows = traces.setdefault(str(temperature), [])
        for i, (prompt, prompt_ids) in enumerate(zip(prompts, ids)):
            for sample in range(1 if temperature == 0 else args.samples):
                params = SamplingParams(temperature=temperature, max_new_tokens=args.max_new_tokens,
                                        seed=10_000 + 100 * i + sample)
                result = generate(target, [prompt_ids], params, config=SpecConfig(speculative=False),
                                  eos_token_ids=tokenizer.eos_token_ids)
                reply = result.completions[0].token_ids
                with torch.inference_mode():
                    target_logits = reply_logits(target, prompt_ids, reply)
                    draft_logits = reply_logits(draft, prompt_ids, reply, pair.drafter.window)
                generator = torch.Generator().manual_seed(params.seed)
                rows.append(trace_from_logits(prompt.category, len(prompt_ids), reply, target_logits, draft_logits,
                                              params, generator))
                bar.update(1)
    bar.close()
    report = {"record_command": "python benchmarks/adaptive_replay.py " + " ".join(sys.argv[1:]),
              "machine": machine_info(target.device), "draft": pair.draft_spec,
              "draft_window": dataclasses.asdict(pair.drafter.window) if pair.drafter.window else None}
    return traces, report


def round_check(traces: dict[str, list[Trace]], run: dict) -> dict[str, list[int]] | None:
    """At temperature 0 the cost run and the replay decode the same greedy texts: replayed rounds per fixed
    gamma on the run's prompts (its first --per-category of each category) against the run's, or None
    when the run has no greedy rounds or the traces do not cover its prompts."""
    match = re.search(r"--per-category (\d+)", run.get("command", ""))
    fits, greedy = run.get("model_fit", {}).get("0.0"), traces.get("0.0")
    if not (match and fits and greedy):
        return None
    seen: dict[str, int] = defaultdict(int)
    picked = []
    for trace in greedy:
        seen[trace.category] += 1
        if seen[trace.category] <= int(match.group(1)):
            picked.append(trace)
    if sum(len(t.accept) for t in picked) != fits["target-only"]["rounds"]:
        return None  # other prompts or reply lengths: not the run's texts (so target-only's rounds always agree)
    costs = RoundCostTable.from_fits(fits)
    return {name: [sum(replay(t, gamma, [0.5] * len(t.accept), costs, lambda: 1.0).rounds for t in picked),
                   fits[name]["rounds"]]
            for name, gamma in [("target-only", 0)] + [(f"gamma={g}", g) for g in range(1, 9)]}


def _dump_trace(trace: Trace) -> dict:
    def rounded(values: tuple[float, ...]) -> list[float | None]:
        return [None if math.isnan(v) else round(v, 5) for v in values]
    return {"category": trace.category, "prompt_tokens": trace.prompt_tokens, "max_new_tokens": trace.max_new_tokens,
            "accept": rounded(trace.accept), "confidence": rounded(trace.confidence),
            "rejected_confidence": rounded(trace.rejected_confidence)}


def _load_trace(row: dict) -> Trace:
    def floats(values: list) -> tuple[float, ...]:
        return tuple(math.nan if v is None else float(v) for v in values)
    return Trace(row["category"], row["prompt_tokens"], floats(row["accept"]), floats(row["confidence"]),
                 floats(row["rejected_confidence"]), row.get("max_new_tokens"))


def _group(row: dict, report: dict) -> str:
    return acceptance_group(_load_trace(row)) if report.get("by_acceptance") else row["category"]


def _acceptance_lines(rows: list[dict], report: dict) -> list[str]:
    """Per category: the mean acceptance over its texts, how many accept under 5% of drafts, and the draft's
    mean confidence in its own drafts (what gamma auto's confidence prior reads)."""
    by_cat: dict[str, list[float]] = defaultdict(list)
    confidence: dict[str, list[float]] = defaultdict(list)
    for row in rows:
        trace, group = _load_trace(row), _group(row, report)
        by_cat[group].append(sum(trace.accept) / len(trace.accept))
        confidence[group].append(draft_confidence(trace))
    return ["Mean acceptance of a draft per category (texts under 0.05; the draft's mean confidence in its drafts): "
            + ", ".join(f"{cat} {sum(v) / len(v):.3f} ({sum(a < 0.05 for a in v)}; {sum(confidence[cat]) / len(confidence[cat]):.2f})"
                        for cat, v in sorted(by_cat.items())) + ".", ""]


def _by_category(per_category: dict) -> list[tuple]:
    """(category, value) pairs by category name, "overall" last."""
    return sorted(per_category.items(), key=lambda kv: (kv[0] == "overall", kv[0]))


def _probe_lines(report: dict, temperature: str) -> list[str]:
    probes = report.get("probes", {}).get(temperature)
    if not probes:
        return []
    lines = ["Fallback probes per reply (gamma auto): " + ", ".join(
        f"{cat} {n:.1f}" for cat, n in _by_category(probes)) + "."]
    drafts = report.get("drafts", {}).get(temperature)  # results from before session 27 lack it
    if drafts:
        lines.append("Drafts per reply (gamma auto): " + ", ".join(f"{cat} {n:.1f}" for cat, n in _by_category(drafts)) + ".")
    return lines + [""]


def _breakdown_lines(report: dict, temperature: str) -> list[str]:
    """Where gamma auto's time beyond target-only's went, per category (results from before session 21 lack it)."""
    parts = report.get("breakdown", {}).get(temperature)
    if not parts:
        return []
    own = any(p.get("controller") for p in parts.values())  # charged since session 22 (--controller-overhead)
    return ["gamma auto's time beyond target-only's, in % of target-only's (the draft's prefill + backlog "
            "scorings" + (" + its own work per round" if own else "") + " + drafting rounds' cost less the rounds "
            "they saved): " + ", ".join(
                f"{cat} {100 * p['prefill']:+.1f} {100 * p['scoring']:+.1f}"
                + (f" {100 * p.get('controller', 0.0):+.1f}" if own else "") + f" {100 * p['drafting']:+.1f}"
                for cat, p in _by_category(parts)) + ".", ""]


def _cost_lines(report: dict, temperature: str) -> list[str]:
    costs = report.get("round_costs", {}).get(temperature)
    if not costs:
        return []
    scoring = report.get("scoring_costs", {}).get(temperature)
    return [f"Round costs charged, in plain rounds at context {COST_CONTEXT}, for 1-8 drafts: "
            + ", ".join(f"{c:.3f}" for c in costs) + "." + ("" if scoring is None else
                                                             f" A backlog scoring adds {scoring:.3f}."), ""]


def draft_confidence(trace: Trace) -> float:
    """The draft's mean temperature-1 probability of the token it drafts at a reply position: an accepted
    draft's (the reply token's) weighted by acceptance, a rejected one's by the rest."""
    values = [a * c + (1 - a) * (r if r == r else c)  # NaN: no draft there is ever rejected
              for a, c, r in zip(trace.accept, trace.confidence, trace.rejected_confidence)]
    return sum(values) / len(values)


def load_draft_prefill(path: Path, window: dict | None) -> DraftPrefill:
    """The draft's timed prefill from a benchmarks/draft_window.py result, fed what the traces' window keeps."""
    timed = json.loads(path.read_text()).get("prefill_seconds", {}).get("draft")
    if not timed:
        raise SystemExit(f"{path} has no draft prefill times (prefill_seconds.draft): run benchmarks/draft_window.py")
    keeps = window["sink"] + window["recent"] if window else None
    return DraftPrefill(tuple(sorted((int(n), float(s)) for n, s in timed.items())), keeps)


def write_report(report: dict, out: Path) -> None:
    """Per temperature: the texts replayed, the acceptance on them, and the goal tables."""
    lines = [f"Traces recorded by: `{report['record_command']}`", f"Replayed by: `{report['command']}`", "",
             f"Draft: `{report['draft']}`. Round costs: the fits of `{report['costs_from']}`"
             + (f"; a drafting prefill: target-only's plus the draft's prefill timed in `{report['draft_prefill_from']}`"
                if report.get("draft_prefill_from") else "") + f". {report['replicates']} replays of every text; "
             "tokens per modelled second." + (" gamma auto's controller sees the texts in the order recorded (as "
                                              "benchmarks/adaptive.py runs them)." if report.get("order") == "given" else ""),
             ""]
    changed = {k: v for k, v in report.get("controller", {}).items() if getattr(ControllerConfig(), k) != v}
    if changed:
        lines += [f"gamma auto with ControllerConfig changes: {changed}.", ""]
    for temperature, table in report["results"].items():
        rows = report["traces"][temperature]
        accept = [a for row in rows for a in row["accept"]]
        cats = sorted(c for c in table["target-only"] if c != "overall")  # categories, or acceptance groups
        sizes = [sum(1 for c in counts if c == cat) for cat in cats
                 for counts in [[_group(row, report) for row in rows]]]
        per = str(sizes[0]) if min(sizes) == max(sizes) else f"{min(sizes)}-{max(sizes)}"
        within, not_slower = passes(table, "gamma=auto", cats)
        lines += [f"### Temperature {temperature}", "",
                  f"{len(rows)} texts ({per} per {'acceptance group' if report.get('by_acceptance') else 'category'}), {len(accept)} tokens; mean acceptance "
                  f"of a draft at a reply token {sum(accept) / len(accept):.3f}. gamma auto: within 3% of the best fixed "
                  f"gamma in {within} of {len(cats)} categories, not over 3% slower than target-only in {not_slower}.",
                  ""] + _acceptance_lines(rows, report) + _probe_lines(report, temperature)
        lines += _breakdown_lines(report, temperature) + _cost_lines(report, temperature) + goal_tables(table)
    check = report.get("check")
    if check:
        lines += ["### Check against the cost run", "",
                  "At temperature 0 the replay decodes target-only's greedy texts; on the run's prompts a fixed "
                  "gamma's replayed rounds should come close to the run's (not equal: in bfloat16 the run's texts "
                  "part from target-only's at logit ties, see benchmarks/greedy_divergence.py):", "",
                  "| system | replayed rounds | the run's rounds |", "|---|---|---|"]
        lines += [f"| {name} | {replayed} | {real} |" for name, (replayed, real) in check.items()] + [""]
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    started = time.time()
    main()
    print(f"{(time.time() - started) / 60:.1f} min")
