"""What gamma auto adds to a plain round: the engine's and the controller's own work.

A request in fallback decodes plain, but its round still runs the controller (plan, observe, timing),
keeps the target's probability of the committed token for backlog scoring, and commits to the draft.
Target-only and gamma auto held in fallback (it never resumes) decode the same prompts taking turns
round by round (`run_lockstep`, so the box's slow stretches hit both alike), and the script prints,
per temperature, the median over replies of gamma auto's median plain round over target-only's
(rounds that scored a backlog, and each reply's first 8 rounds, left out).

    python benchmarks/plain_round_overhead.py --models tiny --repeats 12
    python benchmarks/plain_round_overhead.py --models shipped --per-category 2 --out docs/plain_round_overhead.json

On tiny models (a forward of well under a millisecond) the overhead stands out in microseconds; on the
shipped pair it is what a request in fallback pays relative to target-only.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from specsample.bench.report import command_line
from specsample.bench.systems import Ours, run_lockstep
from specsample.config import SamplingParams, SpecConfig
from specsample.controller import ControllerConfig
from specsample.drafters.model import ModelDrafter
from specsample.models.tiny import tiny_lm

SKIP = 8  # first rounds of a reply left out: gamma auto drafts until its estimate sends it into fallback
# a predicted speedup under 100 falls back, none over 1e9 resumes: every round after the first few is plain
HELD_IN_FALLBACK = ControllerConfig(max_gamma=4, fallback_below=100.0, resume_above=1e9)


def systems(target, draft: ModelDrafter, eos: frozenset[int], max_len: int) -> list[Ours]:
    """Target-only, and gamma auto held in fallback with a fresh controller per reply."""
    return [Ours("target-only", target, None, SpecConfig(speculative=False, max_batch_size=1, max_seq_len=max_len), eos),
            Ours("gamma auto in fallback", target, draft,
                 SpecConfig(gamma=4, adaptive=True, max_batch_size=1, max_seq_len=max_len), eos,
                 keep_controller=False, controller_config=HELD_IN_FALLBACK)]


def plain_median(record) -> float | None:
    """Median seconds of a reply's plain rounds after the first SKIP (None if it has none)."""
    times = [r.seconds for r in record.timing.rounds[SKIP:] if r.drafted == 0 and not r.scored]
    return statistics.median(times) if times else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", choices=("tiny", "shipped"), default="tiny",
                        help="tiny random models (the overhead in microseconds) or the shipped target and draft")
    parser.add_argument("--repeats", type=int, default=12, help="tiny: replies per temperature")
    parser.add_argument("--per-category", type=int, default=2, help="shipped: Spec-Bench prompts per category")
    parser.add_argument("--tokens", type=int, default=200, help="tokens per reply")
    parser.add_argument("--temperatures", default="0,0.7")
    parser.add_argument("--out", type=Path, default=None, help="also write the result here (.json, and .md beside)")
    args = parser.parse_args()
    if min(args.repeats, args.per_category) < 1 or args.tokens <= SKIP + 1:
        parser.error(f"--repeats and --per-category must be >= 1 and --tokens > {SKIP + 1}")
    if args.models == "tiny":
        torch.set_num_threads(1)
        target = tiny_lm(32, seed=1, init_scale=0.2, dtype=torch.float32)
        draft = ModelDrafter(tiny_lm(32, seed=2, init_scale=0.2, num_layers=1, dtype=torch.float32))
        prompts, eos = [[1, 2, 3]] * args.repeats, frozenset()
    else:
        from specsample.bench.run import encode_fitting, load_model_draft_pair, load_prompts

        pair = load_model_draft_pair("smollm2-135m-instruct", None)
        target, draft, eos = pair.target.model, pair.drafter, frozenset()  # no EOS: every reply runs --tokens
        _, prompts = encode_fitting(load_prompts("spec-bench", args.per_category, 0), pair.target.tokenizer,
                                    target.max_seq_len, args.tokens)
    max_len = max(len(p) for p in prompts) + args.tokens + 16
    pair_of = systems(target, draft, eos, max_len)
    results = {}
    for temperature in (float(t) for t in args.temperatures.split(",")):
        ratios, differences, medians = [], [], {s.name: [] for s in pair_of}
        for i, prompt in enumerate(prompts):
            order = pair_of if i % 2 else pair_of[::-1]
            params = SamplingParams(temperature=temperature, max_new_tokens=args.tokens, seed=i)
            got = {s.name: plain_median(r[0]) for s, r in zip(order, run_lockstep(order, [prompt], params))}
            if None in got.values():
                continue
            for name, value in got.items():
                medians[name].append(value)
            ratios.append(got["gamma auto in fallback"] / got["target-only"])
            differences.append(got["gamma auto in fallback"] - got["target-only"])
        if not ratios:
            raise SystemExit("no reply had plain rounds after the first few: raise --tokens")
        results[str(temperature)] = {"replies": len(ratios),
                                     "target_only_us": statistics.median(medians["target-only"]) * 1e6,
                                     "auto_minus_target_us": statistics.median(differences) * 1e6,  # paired per reply
                                     "median_ratio": statistics.median(ratios),
                                     "ratio_quartiles": statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios,
                                     "ratios": ratios}
    lines = [f"`{command_line('benchmarks/plain_round_overhead.py', args)}`", "",
             "| temperature | replies | target-only plain round | gamma auto's minus target-only's (median per reply) | "
             "median ratio (gamma auto / target-only, per reply) | quartiles of the ratio |", "|---|---|---|---|---|---|"]
    for t, r in results.items():
        lines.append(f"| {t} | {r['replies']} | {r['target_only_us']:.1f} us | {r['auto_minus_target_us']:+.1f} us | "
                     f"{r['median_ratio']:.4f} | " + ", ".join(f"{q:.4f}" for q in r["ratio_quartiles"]) + " |")
    print("\n".join(lines))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"command": command_line("benchmarks/plain_round_overhead.py", args),
                                        "results": results}))
        args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
