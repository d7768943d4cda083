"""What a forward of the default target costs on each code path: torch ops, and the fused step with its products on
AMX tiles and on AVX-512 (models/fused.py), scoring n tokens for one row, as the context grows, and for batches of
rows.

One model, the alias's default weights (int4 on a CPU). Every measurement times the paths alternately, call by call
(the model's fused step switched off and on, the tiles switched on and off between calls, who goes first rotating),
so a busy machine's drift hits all alike; `--repeats` calls each after a warm-up call, medians in ms; each call runs
as the engine runs a round (`fused.torch_ops_alone`). Tables:

- widths: one row, `--context` tokens cached, scoring n = 1 .. 16 tokens, and each cost over one token's;
- contexts: the one-token step and a 5-token block after `--contexts` tokens;
- batches: one-token steps of b rows with `--context` tokens each.

    python benchmarks/step_widths.py --out docs/results/fused
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

from specsample.bench.context import cpu_name
from specsample.models import row_kernels
from specsample.models.fused import torch_ops_alone
from specsample.models.loader import load_model

WIDTHS = (1, 2, 3, 4, 5, 6, 8, 12, 16)
CONTEXTS = (100, 500, 1000, 1500)
BATCHES = (1, 2, 4, 8)
PATHS = ("torch", "fused-amx", "fused-avx512")


def set_path(model, fused, path: str) -> None:
    model.fused = None if path == "torch" else fused
    if path != "torch":
        row_kernels.set_amx(path == "fused-amx")


def medians_ms(model, fused, paths, tokens: torch.Tensor, cache, slots: torch.Tensor, repeats: int) -> dict:
    """Median time per path of appending `tokens [b, n]` to rows `slots` (rolled back after each call), the paths
    alternating call by call."""
    lengths = cache.lengths[slots].clone()
    times: dict[str, list[float]] = {path: [] for path in paths}
    for rep in range(repeats + 1):  # the first round warms up
        for k in range(len(paths)):
            path = paths[(rep + k) % len(paths)]
            set_path(model, fused, path)
            start = time.perf_counter()
            with torch_ops_alone(model):  # as the engine runs a round
                model.forward_cached(tokens, cache, slots)
            if rep:
                times[path].append(time.perf_counter() - start)
            cache.lengths[slots] = lengths
    return {path: 1e3 * statistics.median(values) for path, values in times.items()}


def measure(model, paths: tuple[str, ...], context: int, repeats: int) -> dict:
    fused = model.fused
    ids = torch.randint(
        0, model.vocab_size, (8, max(CONTEXTS) + max(WIDTHS)), generator=torch.Generator().manual_seed(0)
    )
    cache, slot = model.new_cache(8, max(CONTEXTS) + max(WIDTHS) + 8), torch.tensor([0])
    with torch.inference_mode():
        set_path(model, fused, paths[-1])
        model.prefill(ids[:1, :context], cache, slot)
        widths = {
            n: medians_ms(model, fused, paths, ids[:1, context : context + n], cache, slot, repeats) for n in WIDTHS
        }
        by_context = {}
        for length in CONTEXTS:
            cache.lengths[slot] = 0
            model.prefill(ids[:1, :length], cache, slot)
            by_context[length] = {
                n: medians_ms(model, fused, paths, ids[:1, length : length + n], cache, slot, repeats) for n in (1, 5)
            }
        batches = {}
        for rows in BATCHES:
            slots = torch.arange(rows)
            cache.lengths[slots] = 0
            model.prefill(ids[:rows, :context], cache, slots)
            batches[rows] = medians_ms(model, fused, paths, ids[:rows, context : context + 1], cache, slots, repeats)
    set_path(model, fused, "fused-amx" if "fused-amx" in paths else paths[-1])
    return {"widths": widths, "contexts": by_context, "batches": batches}


def markdown(result: dict) -> str:
    paths = result["paths"]
    lines = [
        f"# Forward cost by code path ({result['machine']})",
        "",
        f"`{result['command']}`: {result['target']}, medians of {result['repeats']} calls, ms; the paths alternate "
        "call by call.",
        "",
        f"## Scoring n tokens for one row ({result['context']} tokens cached)",
        "",
        "| n | " + " | ".join(paths) + " | " + " | ".join(f"{p} ÷ its n = 1" for p in paths) + " |",
        "|---|" + "---|" * (2 * len(paths)),
    ]
    widths = result["widths"]
    for n, row in widths.items():
        ratios = [row[p] / widths["1"][p] for p in paths]
        lines.append(
            f"| {n} | "
            + " | ".join(f"{row[p]:.2f}" for p in paths)
            + " | "
            + " | ".join(f"{r:.2f}" for r in ratios)
            + " |"
        )
    lines += [
        "",
        "## As the context grows (one row)",
        "",
        "| context | n | " + " | ".join(paths) + " |",
        "|---|---|" + "---|" * len(paths),
    ]
    for length, by_n in result["contexts"].items():
        for n, row in by_n.items():
            lines.append(f"| {length} | {n} | " + " | ".join(f"{row[p]:.2f}" for p in paths) + " |")
    lines += [
        "",
        f"## One-token steps of b rows ({result['context']} tokens cached each)",
        "",
        "| rows | " + " | ".join(paths) + " |",
        "|---|" + "---|" * len(paths),
    ]
    for rows, row in result["batches"].items():
        lines.append(f"| {rows} | " + " | ".join(f"{row[p]:.2f}" for p in paths) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--context", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", type=Path, default=None, help="folder for widths.json and widths.md")
    args = parser.parse_args()
    model = load_model(args.target, progress=False).model
    if getattr(model, "fused", None) is None:
        sys.exit(f"{args.target} does not run the fused step on this machine: nothing to compare")
    paths = PATHS if row_kernels.set_amx(True) else ("torch", "fused-avx512")
    result = {
        "command": "python " + shlex.join(sys.argv),
        "machine": f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"{platform.python_version()}",
        "target": args.target,
        "context": args.context,
        "repeats": args.repeats,
        "paths": list(paths),
        **json.loads(json.dumps(measure(model, paths, args.context, args.repeats))),
    }
    text = markdown(result)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "widths.json").write_text(json.dumps(result, indent=1) + "\n")
        (args.out / "widths.md").write_text(text)


if __name__ == "__main__":
    main()
