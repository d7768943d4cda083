"""What a decoding round costs at each fixed gamma, over a plain round, on the real pair (batch 1).

The gamma controller models a drafting round as 1 + k + gamma c plain rounds (k: a fixed overhead,
c: a draft step). This measures the rounds themselves: the first N Spec-Bench prompts (one per
category), temperature 0, 64 new tokens, every gamma interleaved prompt by prompt, twice. Prefill
rounds are left out. It prints, per gamma, the mean and median round time, the mean over plain
rounds, and the draft / target / verify split the engine reports, then the least-squares line
through the means (k + 1 and c), and the draft model's forward by tokens fed at once (batch 1: what a
lone row's backlog costs when it rides in the first draft forward, specsample.drafters.model).

    python benchmarks/round_costs.py --prompts 8
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

import numpy as np

from specsample.api import generate_stream
from specsample.bench.run import (add_pad_rows_option, add_pair_options, load_model_draft_pair, load_prompts,
                                  measured_widths)
from specsample.config import SamplingParams, SpecConfig
from specsample.drafters.model import MERGED_BACKLOG
from specsample.models.row_padding import time_forward_widths

GAMMAS = (0, 1, 2, 3, 4, 6, 8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pair_options(parser)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--gammas", default=",".join(map(str, GAMMAS)), help="gammas to time (plain rounds, gamma 0, are always timed: the unit)")
    add_pad_rows_option(parser)
    args = parser.parse_args()
    gammas = sorted({int(g) for g in args.gammas.split(",")} | {0})

    pair = load_model_draft_pair(args.target, args.draft, args.draft_window, args.dtype, args.device)
    tokenizer, target = pair.target.tokenizer, pair.target.model
    prompts = [tokenizer.encode(p.turns[0], chat=True) for p in load_prompts("spec-bench", 1, 0)[: args.prompts]]
    widths = measured_widths(target, max(max(gammas), 1), args.pad_rows)  # gamma 0 alone: plain rounds only
    rounds: dict[int, list[float]] = defaultdict(list)
    parts: dict[int, list[tuple[float, float, float]]] = defaultdict(list)
    for _ in range(args.repeats):
        for i, prompt in enumerate(prompts):
            for gamma in gammas:
                config = SpecConfig(gamma=max(gamma, 1), adaptive=False, speculative=gamma > 0, max_batch_size=1,
                                    max_seq_len=len(prompt) + args.max_new_tokens + 16, target_widths=widths)
                params = SamplingParams(temperature=0, max_new_tokens=args.max_new_tokens, seed=i)
                previous = None
                for _, result in generate_stream(target, [prompt], params, pair.drafter if gamma else None, config,
                                                 tokenizer.eos_token_ids):
                    s = result.stats
                    # full rounds only: not the prefill's, nor a last one cut short by the length limit
                    if previous is not None and s.prefill_seconds < 1e-3 and s.drafted == gamma:
                        rounds[gamma].append(result.finished_at - previous)
                        parts[gamma].append((s.draft_seconds, s.target_seconds, s.verify_seconds))
                    previous = result.finished_at
    plain = statistics.fmean(rounds[0])
    means = []
    for gamma in gammas:
        mean = statistics.fmean(rounds[gamma])
        means.append(mean / plain)
        draft, target_s, verify = (1000 * statistics.fmean(x) for x in zip(*parts[gamma]))
        print(f"gamma {gamma}: {len(rounds[gamma])} rounds, mean {1000 * mean:.2f} ms, median "
              f"{1000 * statistics.median(rounds[gamma]):.2f} ms, {mean / plain:.3f} plain rounds "
              f"(draft {draft:.2f}, target {target_s:.2f}, verify {verify:.2f} ms)")
    slope, intercept = np.polyfit(gammas[1:], means[1:], 1) if len(gammas) > 2 else (float("nan"), float("nan"))
    print(f"drafting rounds ~ {intercept:.3f} + {slope:.3f} gamma plain rounds: k {intercept - 1:.3f}, c {slope:.3f}")
    fed = time_forward_widths(pair.drafter.model, MERGED_BACKLOG + 2, context=128, repeats=24)
    print("draft forward by tokens fed at once, batch 1, median (ms): "
          + ", ".join(f"{w}: {1000 * statistics.median(t):.2f}" for w, t in fed.items()))


if __name__ == "__main__":
    main()
