"""Issue 7's goals with bootstrap intervals over the replies of one or more adaptive benchmark runs, pooled
(runs of the same prompts with the same code: each prompt's replies from every run resample together).

    python benchmarks/goal_intervals.py docs/adaptive_results_s25.json docs/adaptive_results_s26_t07.json \\
        --temperature 0.7 --out docs/goal_intervals_t07.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# the result files' format lives there
from adaptive import (DIFFICULTY_NOTE, UNFITTABLE_NOTE, _prompt_count, adjustment_table, difficulty_of, fixed_split_lines,
                      replies_of, rounds_of)

from specsample.bench.difficulty import adjust_for_difficulty, fittable
from specsample.bench.goals import DEFAULT, PLACEBO, fixed_gammas, goal_intervals, interval_table


def pooled_replies(reports: list[dict], temperature: str) -> tuple[dict[str, list], int, dict[str, dict[int, float]],
                                                                   dict[str, dict[int, tuple[int, float]]]]:
    """Every run's replies of `temperature` with keys made distinct across runs but still naming the same
    prompt modulo the prompt count, that count, the replies' text acceptances under the same keys where every
    run scored its texts (`--difficulty`; else {}), and their rounds. Systems missing from a run are left out."""
    counts = {_prompt_count(report, temperature) for report in reports}
    if len(counts) != 1:
        raise SystemExit(f"the runs decoded different prompt sets ({sorted(counts)} prompts): nothing to pool")
    prompts = counts.pop()
    shared = set.intersection(*(set(report["rounds"][temperature]) for report in reports))
    replies: dict[str, list] = {name: [] for name in sorted(shared)}
    scored = all(difficulty_of(report, temperature) for report in reports)
    difficulty: dict[str, dict[int, float]] = {name: {} for name in shared} if scored else {}
    rounds: dict[str, dict[int, tuple[int, float]]] = {name: {} for name in shared}
    for run, report in enumerate(reports):
        offset = run * prompts * 1_000_000  # a multiple of the prompt count: key % prompts still names the prompt
        own = difficulty_of(report, temperature) if scored else {}
        for name in shared:
            replies[name] += [(offset + key, *rest) for key, *rest in replies_of(report["rounds"][temperature][name])]
            difficulty.get(name, {}).update({offset + key: x for key, x in own.get(name, {}).items()})
            rounds[name].update({offset + key: r for key, r in rounds_of(report["rounds"][temperature][name]).items()})
    return replies, prompts, difficulty, rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, nargs="+", help="benchmarks/adaptive.py result files (.json)")
    parser.add_argument("--temperature", default="0.7")
    parser.add_argument("--level", type=float, default=0.9)
    parser.add_argument("--resamples", type=int, default=2000)
    parser.add_argument("--unit", choices=("prompt", "reply"), default="prompt",
                        help="what the bootstrap resamples: prompts with all their replies (default), or replies one "
                             "by one (as if every reply were a prompt of its own)")
    parser.add_argument("--systems", default=f"{DEFAULT},gamma=auto,ngram auto,{PLACEBO}",
                        help="comma-separated systems to test against the goals (those the runs have; a run's "
                             f"--variant names too; '{PLACEBO}' where the runs decoded each fixed gamma twice)")
    parser.add_argument("--out", type=Path, help="also write the tables here (markdown)")
    args = parser.parse_args()
    if not 0 < args.level < 1 or args.resamples < 1:
        parser.error(f"--level must be in (0, 1) and --resamples >= 1, got {args.level} and {args.resamples}")
    reports = []
    for path in args.results:
        report = json.loads(path.read_text())
        if args.temperature not in report.get("rounds", {}):
            raise SystemExit(f"{path} has no recorded replies at temperature {args.temperature}")
        reports.append(report)
    replies, prompts, difficulty, rounds = pooled_replies(reports, args.temperature)
    names = tuple(n for n in (n.strip() for n in args.systems.split(",")) if n in replies or n == PLACEBO)
    adjusted_lines = []
    original = prompts  # centred per prompt, before --unit reply makes every reply a prompt of its own
    if difficulty and not fittable(replies, prompts):
        difficulty = {}
        adjusted_lines = [UNFITTABLE_NOTE, ""]
    if difficulty:
        adjusted, betas = adjust_for_difficulty(replies, difficulty, prompts, rounds)
    if args.unit == "reply":  # every key its own cluster
        prompts = 1 + max(key for key, *_ in replies["target-only"])
    intervals = goal_intervals(replies, prompts, names=names, level=args.level, resamples=args.resamples)
    unit = "replies" if args.unit == "reply" else "prompts"
    if difficulty:
        adjusted_intervals = goal_intervals(adjusted, prompts, names=names, level=args.level, resamples=args.resamples)
        adjusted_lines = ["### Times adjusted for the text", "", DIFFICULTY_NOTE, "",
                          *adjustment_table(replies, adjusted, betas, original),
                          *interval_table(adjusted_intervals, args.level, unit)]
    sizes = ", ".join(f"{len(r['rounds'][args.temperature]['target-only'])}" for r in reports)
    lines = [f"Command: `python benchmarks/goal_intervals.py {' '.join(map(str, args.results))} --temperature "
             f"{args.temperature} --unit {args.unit}"
             + (f" --systems '{args.systems}'" if args.systems != parser.get_default("systems") else "")
             + "`", "", f"Temperature {args.temperature}: {prompts} "
             f"{'replies' if args.unit == 'reply' else 'prompts'} resampled, replies per run {sizes}; "
             f"fixed gammas in every run: {', '.join(fixed_gammas(replies))}.",
             "", *interval_table(intervals, args.level, unit), *adjusted_lines]
    split_lines = [line for name in names for line in fixed_split_lines(reports, args.temperature, name)]
    lines += ["### Where the time went", "", *split_lines] if split_lines else []
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
