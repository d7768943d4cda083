"""Eager against `--compile` forwards of our runtime: scoring n tokens for one row, the one-token step as the context
grows, in caches of different allocations and for batches of rows (the compiled step must cost what the context
costs, not what the cache holds, and keep its lead from the first prompt on, however long).

One model, the alias's default weights (int4 on a CPU), compiled first as serving compiles it (`warm_up` with
blocks and batches: every graph a server runs, each timed); then every measurement times the eager and the compiled
forward alternately (the model's compiled step switched off and on between calls, so a busy machine's drift hits
both alike), `--repeats` times each after a warm-up call, medians in ms. Tables:

- widths: one row, `--context` tokens cached in a server-sized cache (12 rows of 8,192 positions, the row in
  slot 3), scoring n = 1, 2, 4, 5, 8, 16 tokens;
- contexts: the one-token step and a 5-token block of that row after `--contexts` tokens (long Spec-Bench
  prompts, summarisation and RAG, are 500-1,500 tokens);
- allocations: one-token steps with 60 tokens of context in caches of 1 x 64, 1 x 2,048 and 12 x 8,192 positions;
- batches: one-token steps of 2 rows with `--context` and the longest `--contexts` tokens each, in consecutive slots
  (read as views of the cache) and apart (gathered: a copy of every layer's keys and values, as the eager forward's).

Graphs compiled after the warm-up (recompiles) are counted over all measurements; there should be none.

    python benchmarks/compiled_widths.py --out docs/results/compiled/widths.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from specsample.bench.context import cpu_name
from specsample.models import compile_events
from specsample.models.loader import load_model

WIDTHS = (1, 2, 4, 5, 8, 16)
CONTEXTS = (100, 500, 1000, 1500)
ALLOCATIONS = ((1, 64), (1, 2048), (12, 8192))
BATCH_SLOTS = {"consecutive": (4, 5), "apart": (4, 9)}  # a batch of 2 rows read as views, and gathered


def medians_ms(model, compiled, tokens: torch.Tensor, cache, slots: torch.Tensor, repeats: int) -> tuple[float, float]:
    """Median eager and compiled times of appending `tokens [b, n]` to rows `slots` (rolled back after each call),
    the two alternating call by call."""
    lengths = cache.lengths[slots].clone()
    times: dict[bool, list[float]] = {False: [], True: []}
    for rep in range(repeats + 1):  # the first pair warms up
        for on in (rep % 2 == 0, rep % 2 == 1):  # who goes first alternates
            model.compiled = compiled if on else None
            start = time.perf_counter()
            model.forward_cached(tokens, cache, slots)
            if rep:
                times[on].append(time.perf_counter() - start)
            cache.lengths[slots] = lengths
    model.compiled = compiled
    return 1e3 * statistics.median(times[False]), 1e3 * statistics.median(times[True])


def measure(model, context: int, contexts: tuple[int, ...], repeats: int) -> dict:
    longest = max(max(contexts), context)
    ids = torch.randint(0, model.vocab_size, (1, longest + max(WIDTHS)), generator=torch.Generator().manual_seed(0))
    compiled = model.compiled
    # caches made as an engine makes them, outside inference mode (dynamo guards on a tensor's dispatch keys)
    server, slot = model.new_cache(12, 8192), torch.tensor([3])
    allocated = {(rows, size): model.new_cache(rows, size) for rows, size in ALLOCATIONS}
    small_context = 60
    with torch.inference_mode():
        model.prefill(ids[:, :context], server, slot)
        widths = {n: medians_ms(model, compiled, ids[:, context : context + n], server, slot, repeats) for n in WIDTHS}
        by_context = {}
        for length in contexts:
            server.lengths[slot] = 0
            model.prefill(ids[:, :length], server, slot)
            by_context[length] = {
                n: medians_ms(model, compiled, ids[:, length : length + n], server, slot, repeats) for n in (1, 5)
            }
        steps = {}
        for (rows, size), cache in allocated.items():
            row = torch.tensor([rows // 4])
            model.prefill(ids[:, :small_context], cache, row)
            steps[f"{rows}x{size}"] = medians_ms(
                model, compiled, ids[:, small_context : small_context + 1], cache, row, repeats
            )
        batches = {}
        for length in sorted({context, max(contexts)}):
            for name, slots in BATCH_SLOTS.items():
                rows = torch.tensor(slots)
                server.reset(torch.arange(12))
                model.prefill(ids[:, :length].expand(len(slots), length), server, rows)
                batches[f"c={length}, {name}"] = medians_ms(
                    model, compiled, ids[:, length : length + 1].expand(len(slots), 1), server, rows, repeats
                )
    return {"widths": widths, "contexts": by_context, "allocations": steps, "batches": batches}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument(
        "--runtime",
        default="auto",
        choices=("auto", "ours"),
        help="the eager side: auto (the fused step where it runs, as `load_model` picks) or ours (torch ops)",
    )
    parser.add_argument("--context", type=int, default=100)
    parser.add_argument(
        "--contexts", default=",".join(map(str, CONTEXTS)), help="comma-separated context lengths of the contexts table"
    )
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (at most the machine's)")
    parser.add_argument("--out", type=Path, default=Path("docs/results/compiled/widths.json"))
    args = parser.parse_args()
    contexts = tuple(int(c) for c in args.contexts.split(","))
    torch.set_num_threads(min(args.threads, torch.get_num_threads()))
    model = load_model(args.model, runtime=args.runtime).model
    eager_path = model.step_path  # what the eager side runs: the fused step or torch ops
    start, graphs = time.perf_counter(), compile_events.counts()[0]
    model.compile_decode(warm_up=True, blocks=True, batches=True)
    compile_s, warm_graphs = time.perf_counter() - start, compile_events.counts()[0] - graphs
    results = measure(model, args.context, contexts, args.repeats)
    recompiles = compile_events.counts()[0] - graphs - warm_graphs
    report = {
        "command": "python benchmarks/compiled_widths.py " + shlex.join(sys.argv[1:]),
        "machine": f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "eager": eager_path,
        "context": args.context,
        "repeats": args.repeats,
        "compile_s": compile_s,
        "warm_up_graphs": warm_graphs,
        "recompiles": recompiles,
        "ms_eager_compiled": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))

    def row(name: str, pairs: list[tuple[float, float]]) -> list[str]:
        return [
            f"| {name} | " + " | ".join(f"{e:.1f}" for e, _ in pairs) + " |",
            "| compiled | " + " | ".join(f"{c:.1f}" for _, c in pairs) + " |",
            "| eager / compiled | " + " | ".join(f"{e / c:.2f}x" for e, c in pairs) + " |",
        ]

    lines = [
        f"Command: `{report['command']}`",
        "",
        f"Machine: {report['machine']}; eager: {eager_path}; warm-up compiled {warm_graphs} graphs in "
        f"{compile_s:.0f} s; {recompiles} graphs compiled after it.",
        "",
        f"One row, {args.context} tokens cached in a cache of 12 x 8,192 positions, ms (median of "
        f"{args.repeats}, eager and compiled alternating):",
        "",
        "| | " + " | ".join(f"n={n}" for n in WIDTHS) + " |",
        "|---|" + "---|" * len(WIDTHS),
    ]
    lines += row("eager", [results["widths"][n] for n in WIDTHS])
    lines += [
        "",
        "One row after c tokens of context (same cache), one-token step and 5-token block, ms:",
        "",
        "| | " + " | ".join(f"c={c}, n={n}" for c in contexts for n in (1, 5)) + " |",
        "|---|" + "---|" * (2 * len(contexts)),
    ]
    lines += row("eager", [results["contexts"][c][n] for c in contexts for n in (1, 5)])
    keys = list(results["allocations"])
    lines += [
        "",
        "One-token step, 60 tokens of context, by cache allocation (rows x positions), ms:",
        "",
        "| | " + " | ".join(keys) + " |",
        "|---|" + "---|" * len(keys),
    ]
    lines += row("eager", [results["allocations"][k] for k in keys])
    names = list(results["batches"])
    lines += [
        "",
        "One-token step of 2 rows with c tokens of context each, in consecutive slots (4, 5: read as views) "
        "and apart (4, 9: gathered), ms:",
        "",
        "| | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    lines += row("eager", [results["batches"][k] for k in names])
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
