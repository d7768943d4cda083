"""Does a system's measured time depend on which system ran the round before its own? An A/A test.

Target-only, target-only again and fixed gamma 2 decode each Spec-Bench prompt in lockstep (`run_lockstep`),
twice: once in a fixed order of turns, target-only after gamma 2 and target-only again after target-only,
and once in an order drawn afresh every round. The two target-only systems are identical, so their per-reply
time ratio should be 1 but for noise; in the fixed order it also carries what following a drafting round
costs. The modes alternate per prompt (which runs first).

    python benchmarks/lockstep_order.py --per-category 1 --out docs/lockstep_order.json
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from pathlib import Path

from tqdm import tqdm

from specsample.bench.report import command_line, publish
from specsample.bench.run import add_pair_options
from specsample.bench.systems import run_lockstep
from specsample.config import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from adaptive import AGAIN, load_spec_bench, make_systems  # noqa: E402  (a sibling script: its systems and prompts)

MODES = ("fixed", "shuffled")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pair_options(parser)
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("docs/lockstep_order.json"))
    args = parser.parse_args()
    if min(args.per_category, args.max_new_tokens) < 1:
        parser.error("--per-category and --max-new-tokens must be >= 1")
    pair, _, ids, max_len = load_spec_bench(args)
    target_only, again, drafting = make_systems(["target-only", AGAIN, "gamma=2"], pair.target.model, pair.drafter,
                                                pair.target.tokenizer.eos_token_ids, max_len, ())
    fixed = [target_only, again, drafting]  # cyclic: target-only follows gamma 2, target-only again follows target-only
    log_ratios: dict[str, list[float]] = {m: [] for m in MODES}
    for i, prompt_ids in enumerate(tqdm(ids, desc="lockstep order")):
        params = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens, seed=i)
        for mode in (MODES if i % 2 else MODES[::-1]):
            shuffle = random.Random(i) if mode == "shuffled" else None
            records = run_lockstep(fixed, [prompt_ids], params, shuffle)
            log_ratios[mode].append(math.log(records[1][0].seconds / records[0][0].seconds))
    report = {"command": command_line("benchmarks/lockstep_order.py", args), "replies": len(ids),
              "modes": {m: summary(v) for m, v in log_ratios.items()}, "log_ratios": log_ratios}
    publish(report, render(report), args.out)


def summary(log_ratios: list[float]) -> dict[str, float]:
    """Geometric mean ratio, its standard error, and the per-reply standard deviation of the log ratio."""
    sd = statistics.stdev(log_ratios) if len(log_ratios) > 1 else 0.0
    return {"ratio": math.exp(statistics.fmean(log_ratios)), "se": sd / math.sqrt(len(log_ratios)), "sd": sd}


def render(report: dict) -> str:
    lines = [f"Command: `{report['command']}`", "",
             f"Time of target-only again over target-only's, per reply ({report['replies']} replies, T 0): in the "
             "fixed order target-only's rounds follow gamma 2's, target-only again's follow target-only's.", "",
             "| order of turns | geometric mean ratio | standard error (log) | per-reply sd (log) |", "|---|---|---|---|"]
    for mode, row in report["modes"].items():
        lines.append(f"| {mode} | {row['ratio']:.4f} | {row['se']:.4f} | {row['sd']:.4f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
