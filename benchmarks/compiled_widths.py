"""Eager against `--compile` forwards of our runtime: scoring n tokens for one row, and the one-token step in caches
of different allocations (the compiled step must cost what the context costs, not what the cache holds).

One row, `--context` tokens cached, the alias's default weights (int4 on a CPU); each width timed `--repeats`
times after a warm-up, medians in ms. The widths table uses a server-sized cache (12 rows of 8,192 positions, the
row in slot 3); the allocation table times one-token steps with 60 tokens of context in caches of 1 x 64,
1 x 2,048 and 12 x 8,192 positions.

    python benchmarks/compiled_widths.py --out docs/results/compiled/widths.json
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from specsample.models.loader import load_model

WIDTHS = (1, 2, 4, 5, 8, 16)
ALLOCATIONS = ((1, 64), (1, 2048), (12, 8192))


def median_ms(model, tokens: torch.Tensor, cache, slots: torch.Tensor, length: int, repeats: int) -> float:
    """Median time of appending `tokens [1, n]` after `length` cached tokens (rolled back after each call)."""
    times = []
    for rep in range(repeats + 1):  # the first call warms up
        start = time.perf_counter()
        model.forward_cached(tokens, cache, slots)
        if rep:
            times.append(time.perf_counter() - start)
        cache.lengths[slots] = length
    return 1e3 * statistics.median(times)


def measure(model, context: int, repeats: int) -> dict:
    ids = torch.randint(0, model.vocab_size, (1, context + max(WIDTHS)), generator=torch.Generator().manual_seed(0))
    server, slot = model.new_cache(12, 8192), torch.tensor([3])
    small_context = 60
    allocations = {(rows, size): (model.new_cache(rows, size), torch.tensor([rows // 4])) for rows, size in ALLOCATIONS}
    with torch.inference_mode():
        model.prefill(ids[:, :context], server, slot)
        for cache, row in allocations.values():
            model.prefill(ids[:, :small_context], cache, row)
        widths = {n: median_ms(model, ids[:, context:context + n], server, slot, context, repeats) for n in WIDTHS}
        steps = {f"{rows}x{size}": median_ms(model, ids[:, small_context:small_context + 1], cache, row,
                                              small_context, repeats)
                 for (rows, size), (cache, row) in allocations.items()}
    return {"widths": widths, "allocations": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--context", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--out", type=Path, default=Path("docs/results/compiled/widths.json"))
    args = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    model = load_model(args.model).model
    eager = measure(model, args.context, args.repeats)
    start = time.perf_counter()
    model.compile_decode(warm_up=True, blocks=True)
    compile_s = time.perf_counter() - start
    compiled = measure(model, args.context, args.repeats)
    report = {"command": "python benchmarks/compiled_widths.py " + shlex.join(sys.argv[1:]),
              "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
                         f"torch {torch.__version__}",
              "context": args.context, "repeats": args.repeats, "compile_s": compile_s,
              "eager": eager, "compiled": compiled}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    lines = [f"Command: `{report['command']}`", "", f"Machine: {report['machine']}; compile {compile_s:.0f} s.", "",
             f"One row, {args.context} tokens cached in a cache of 12 x 8,192 positions, ms (median of "
             f"{args.repeats}):", "", "| | " + " | ".join(f"n={n}" for n in WIDTHS) + " |",
             "|---|" + "---|" * len(WIDTHS)]
    for name, result in (("eager", eager), ("compiled", compiled)):
        lines.append(f"| {name} | " + " | ".join(f"{result['widths'][n]:.1f}" for n in WIDTHS) + " |")
    keys = list(eager["allocations"])
    lines += ["", "One-token step, 60 tokens of context, by cache allocation (rows x positions), ms:", "",
              "| | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
    for name, result in (("eager", eager), ("compiled", compiled)):
        lines.append(f"| {name} | " + " | ".join(f"{result['allocations'][k]:.1f}" for k in keys) + " |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
