"""Where a round's time goes on the shipped pair: drafting, the target's scoring, verification and commit.

Target-only and fixed gamma 1 and 2 decode the same Spec-Bench prompts taking turns round by round
(`run_lockstep`); every engine round's own statistics (`RoundStats.draft_seconds`, `target_seconds`,
`verify_seconds`, the last including the commit) are collected and the script prints their medians by
drafts per round, and each round length's total over the plain round's. With `--auto`, gamma auto decodes the
same prompts in the same lockstep and its rounds are tabled apart, each system's with the rest of the engine
round's wall time (planning, the controller's bookkeeping, statistics) as a fourth phase.

    python benchmarks/round_phases.py --out docs/round_phases.json

Run against an older tree (`git archive COMMIT src/specsample | tar -x -C /tmp/old`, then
`PYTHONPATH=/tmp/old/src`) for a before/after of an engine or drafter change.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from specsample.bench.report import command_line, publish
from specsample.bench.run import add_pair_options, encode_fitting, load_model_draft_pair, load_prompts
from specsample.bench.systems import Ours, run_lockstep
from specsample.config import SamplingParams, SpecConfig
from specsample.drafters.hybrid import HybridDrafter
from specsample.engine import Engine
from specsample.pair import Pair

PHASES = ("draft", "target", "verify")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pair_options(parser)
    parser.add_argument("--per-category", type=int, default=1, help="Spec-Bench prompts per category")
    parser.add_argument("--prompts", type=int, default=6, help="of those, how many to decode")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--temperatures", default="0,0.7")
    parser.add_argument("--auto", action="store_true",
                        help="also gamma auto, its rounds apart; every round's rest of the step as a phase")
    parser.add_argument("--out", type=Path, default=None, help="also write the result here (.json, and .md beside)")
    args = parser.parse_args()
    pair = load_model_draft_pair(args.target, args.draft, args.draft_window, args.dtype, args.device)
    target = pair.target.model
    prompts, systems = lockstep_setup(pair, args.per_category, args.prompts, args.tokens, (1, 2), args.auto)
    # drafts per round (fixed systems), or "auto N" for gamma auto's rounds of N drafts
    collected: dict[str, list[tuple[float, ...]]] = defaultdict(list)
    step = Engine.step

    def recording_step(engine: Engine):
        begin = time.perf_counter()
        result = step(engine)
        wall = time.perf_counter() - begin
        stats = result.stats
        if stats.batch_size:
            phases = (stats.draft_seconds, stats.target_seconds, stats.verify_seconds)
            key = f"auto {stats.drafted}" if engine.config.adaptive else str(stats.gamma)
            collected[key].append(phases + ((wall - stats.prefill_seconds - sum(phases),) if args.auto else ()))
        return result

    Engine.step = recording_step
    results = {}
    try:
        for temperature in (float(t) for t in args.temperatures.split(",")):
            collected.clear()
            for i, prompt in enumerate(prompts):
                order = systems if i % 2 else systems[::-1]
                run_lockstep(order, [prompt], SamplingParams(temperature=temperature, max_new_tokens=args.tokens, seed=i))
            phases = PHASES + (("rest",) if args.auto else ())
            results[str(temperature)] = {
                key: {"rounds": len(rows), **{f"{name}_ms": 1000 * statistics.median(r[j] for r in rows)
                                              for j, name in enumerate(phases)}}
                for key, rows in sorted(collected.items(), key=lambda kv: (kv[0].startswith("auto"), len(kv[0]), kv[0]))}
    finally:
        Engine.step = step
    report = {"command": command_line("benchmarks/round_phases.py", args), "prompts": len(prompts),
              "device": str(target.device), "results": results}
    publish(report, render(report), args.out)


def lockstep_setup(pair: Pair, per_category: int, count: int, tokens: int, gammas: Sequence[int],
                   auto: bool, hybrid: bool = False) -> tuple[list[list[int]], list[Ours]]:
    """The first `count` of `per_category` Spec-Bench prompts per category (token ids, leaving room for `tokens`),
    and the systems that decode them in lockstep: target-only, each fixed gamma and, with `auto`, gamma auto, with
    `hybrid` the hybrid drafter under gamma auto (prompt lookups and the draft model), every reply running its full
    budget."""
    target = pair.target.model
    _, prompts = encode_fitting(load_prompts("spec-bench", per_category, 0), pair.target.tokenizer,
                                target.max_seq_len, tokens)
    prompts = prompts[:count]
    max_len = max(len(p) for p in prompts) + tokens + 16
    eos = frozenset()  # every reply runs its full budget
    systems = [Ours("target-only", target, None, SpecConfig(speculative=False, max_batch_size=1, max_seq_len=max_len), eos)]
    for k, gamma in enumerate(gammas):  # one drafter each: a drafter keeps one cache
        drafter = pair.drafter if k == 0 else pair.load_draft(pair.draft_spec)
        systems.append(Ours(f"gamma={gamma}", target, drafter,
                            SpecConfig(gamma=gamma, adaptive=False, max_batch_size=1, max_seq_len=max_len), eos))
    if auto:
        systems.append(Ours("gamma=auto", target, pair.load_draft(pair.draft_spec),
                            SpecConfig(gamma=8, adaptive=True, max_batch_size=1, max_seq_len=max_len), eos))
    if hybrid:
        systems.append(Ours("hybrid auto", target, HybridDrafter(pair.load_draft(pair.draft_spec)),
                            SpecConfig(gamma=8, adaptive=True, max_batch_size=1, max_seq_len=max_len), eos))
    return prompts, systems


def render(report: dict) -> str:
    lines = [f"Command: `{report['command']}`", "",
             f"Median ms per engine round over {report['prompts']} prompts (systems in lockstep) on "
             f"{report.get('device', 'cpu')}; total: the three medians summed, over the plain round's.", ""]
    for temperature, by_gamma in report["results"].items():
        rest = "rest_ms" in by_gamma["0"]  # --auto: the step's wall time beyond the three phases
        phases = PHASES + (("rest",) if rest else ())
        plain = sum(by_gamma["0"][f"{name}_ms"] for name in phases)
        lines += [f"Temperature {temperature}:", "",
                  "| drafts | rounds | draft | target | verify + commit |" + (" rest |" if rest else "") + " total / plain |",
                  "|---|---|---|---|---|---|" + ("---|" if rest else "")]
        for gamma, row in by_gamma.items():
            total = sum(row[f"{name}_ms"] for name in phases)
            lines.append(f"| {gamma} | {row['rounds']} | {row['draft_ms']:.2f} | {row['target_ms']:.2f} "
                         f"| {row['verify_ms']:.2f} |" + (f" {row['rest_ms']:.2f} |" if rest else "")
                         + f" {total / plain:.3f} |")
        lines.append("")
    return "\n".join(lines).rstrip()


if __name__ == "__main__":
    main()
