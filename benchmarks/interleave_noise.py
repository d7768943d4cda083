"""Timing noise of the two ways benchmarks/adaptive.py interleaves systems: an A/A test.

Two identical target-only systems decode each Spec-Bench prompt, once taking turns prompt by prompt
(each decodes the whole reply in turn) and once round by round (`run_lockstep`); the two modes
alternate per prompt. Identical systems should time alike, so the spread of their per-reply time
ratio is the noise a comparison between two policies carries per reply (gamma auto against
target-only is then compared on the same footing: its ratio is printed too).

    python benchmarks/interleave_noise.py --per-category 2 --out docs/interleave_noise.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from tqdm import tqdm

from specsample.bench.report import command_line, machine_info
from specsample.bench.run import add_pair_options
from specsample.bench.systems import run_lockstep
from specsample.config import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from adaptive import AGAIN, load_spec_bench, make_systems  # noqa: E402  (a sibling script: its systems and prompts)

MODES = ("prompt", "round")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pair_options(parser)
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("docs/interleave_noise.json"))
    args = parser.parse_args()
    if min(args.per_category, args.max_new_tokens) < 1:
        parser.error("--per-category and --max-new-tokens must be >= 1")
    pair, _, ids, max_len = load_spec_bench(args)
    systems = make_systems(["target-only", AGAIN, "gamma=auto"], pair.target.model, pair.drafter,
                           pair.target.tokenizer.eos_token_ids, max_len, ())
    ratios: dict[str, dict[str, list[float]]] = {m: {"A/A": [], "gamma=auto": []} for m in MODES}
    for i, prompt_ids in enumerate(tqdm(ids, desc="A/A")):
        params = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens, seed=i)
        order = systems if i % 2 else systems[::-1]
        for mode in (MODES if i % 2 else MODES[::-1]):
            if mode == "round":
                records = [r[0] for r in run_lockstep(order, [prompt_ids], params)]
            else:
                records = [s.run([prompt_ids], params)[0] for s in order]
            seconds = {s.name: r.seconds for s, r in zip(order, records)}
            ratios[mode]["A/A"].append(seconds[AGAIN] / seconds["target-only"])
            ratios[mode]["gamma=auto"].append(seconds["gamma=auto"] / seconds["target-only"])
    report = {"command": command_line("benchmarks/interleave_noise.py", args),
              "machine": machine_info(pair.target.model.device),
              "replies": len(ids), "ratios": ratios, "summary": {m: summary(r) for m, r in ratios.items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report))
    lines = [f"Command: `{report['command']}`", "",
             f"{len(ids)} Spec-Bench prompts, greedy, {args.max_new_tokens} new tokens, batch 1. Per reply, a "
             "system's time over target-only's; the standard deviation of log(ratio) is the noise of one reply's "
             "comparison.", "",
             "| interleave | A/A: sd of log ratio | A/A: median ratio | gamma auto: sd of log ratio | "
             "gamma auto: time over target-only's (mean per reply) |", "|---|---|---|---|---|"]
    for mode, s in report["summary"].items():
        lines.append(f"| {mode} | {s['A/A']['sd']:.4f} | {s['A/A']['median']:.4f} | {s['gamma=auto']['sd']:.4f} | "
                     f"{s['gamma=auto']['mean']:.4f} |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def summary(by_system: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Per system: the spread (sd of log ratio), median and mean of its per-reply time ratios."""
    return {name: {"sd": statistics.pstdev([math.log(r) for r in ratios]), "median": statistics.median(ratios),
                   "mean": statistics.fmean(ratios)} for name, ratios in by_system.items()}


if __name__ == "__main__":
    main()
