"""How often speculative greedy decoding leaves target-only greedy text on a real model, and why.

    python benchmarks/greedy_divergence.py --per-category 2 --gammas 1,8 --dtype bfloat16
    python benchmarks/greedy_divergence.py --per-category 2 --gammas 1,8 --dtype float32
    python benchmarks/greedy_divergence.py --per-category 2 --gammas 1,8 --dtype bfloat16 --pad-rows auto

In exact arithmetic speculative greedy output equals target-only greedy output. A real model scores a
round's gamma + 1 tokens in one forward, and a matrix product over more rows rounds differently, so
where the top two logits tie (bfloat16 logits are spaced 0.06-0.125 apart at the usual magnitudes,
so ties are common) the argmax can flip and the texts part. For every reply that diverges this prints
where, and the gap between the two tokens' logits in the target-only path's teacher-forced forward:
a gap of zero or about one rounding step is a tie, not a bug.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from specsample.api import generate
from specsample.bench.replay import reply_logits
from specsample.bench.run import add_pad_rows_option, add_pair_options, load_prompts, measured_widths
from specsample.config import SamplingParams, SpecConfig
from specsample.pair import load_pair


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pair_options(parser, dtype="bfloat16")
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--gammas", default="1,8")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    add_pad_rows_option(parser)
    args = parser.parse_args()
    gammas = [int(g) for g in args.gammas.split(",")]
    if min(gammas) < 1 or args.per_category < 1:
        parser.error("--gammas must be >= 1 and --per-category >= 1")
    pair = load_pair(args.target, args.draft, args.dtype, args.device, draft_window=args.draft_window)
    if pair.drafter is None:
        raise SystemExit(f"{args.target} has no draft to speculate with; pass --draft")
    tokenizer, target = pair.target.tokenizer, pair.target.model
    widths = measured_widths(target, max(gammas), args.pad_rows)  # other widths round differently again
    params = SamplingParams(temperature=0, max_new_tokens=args.max_new_tokens)
    prompts = load_prompts("spec-bench", args.per_category, 0)
    diverged: dict[int, list[tuple[int, float]]] = {g: [] for g in gammas}  # gamma -> (position, logit gap)
    for prompt in prompts:
        ids = tokenizer.encode(prompt.turns[0], chat=True)
        base = generate(target, [ids], params, config=SpecConfig(speculative=False),
                        eos_token_ids=tokenizer.eos_token_ids).completions[0].token_ids
        logits = None
        for gamma in gammas:
            out = generate(target, [ids], params, draft=pair.drafter, config=SpecConfig(gamma=gamma, adaptive=False, target_widths=widths[:gamma + 1]),
                           eos_token_ids=tokenizer.eos_token_ids).completions[0].token_ids
            if out == base:
                continue
            at = next((i for i, (a, b) in enumerate(zip(out, base)) if a != b), min(len(out), len(base)))
            gap = float("nan")
            if at < min(len(out), len(base)):
                if logits is None:
                    with torch.inference_mode():
                        logits = reply_logits(target, ids, base)  # [len(base), vocab]
                gap = abs(float(logits[at, base[at]] - logits[at, out[at]]))
            diverged[gamma].append((at, gap))
    print(f"{args.target} ({args.dtype}, --pad-rows {args.pad_rows}), {len(prompts)} Spec-Bench prompts, "
          f"{args.max_new_tokens} greedy tokens")
    print("| gamma | replies that leave target-only's text | first divergence (median position) | "
          "logit gap there (median, max) |")
    print("|---|---|---|---|")
    for gamma, rows in diverged.items():
        gaps = [g for _, g in rows if g == g]
        where = statistics.median(p for p, _ in rows) if rows else "-"
        gap = f"{statistics.median(gaps):.4f}, {max(gaps):.4f}" if gaps else "-"
        print(f"| {gamma} | {len(rows)} of {len(prompts)} | {where} | {gap} |")


if __name__ == "__main__":
    main()
