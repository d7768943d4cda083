"""One forward of the target and of the draft by tokens scored: one width at a time, widths in turn, a growing context.

On the GPU of session 36 (docs/cuda.md) rounds that scored 4 or more tokens with the target (prompt lookups) or
ran the draft model over a backlog took ~5 plain rounds, while fixed gamma's rounds of as many tokens in session
35 took ~2. The engine's adaptive rounds meet a new context length every round and switch widths from round to
round; a fixed gamma keeps one width; `--pad-rows auto` times each width at one context, repeated. This times each
model's forward over W new tokens `--calls` times in three modes: `runs` (the context held, the cache rolled back
after each call, all calls of one width before the next), `turns` (the context held, the widths taking turns
call by call) and `growing` (widths taking turns, the context one token longer every call, as decoding), under
each attention kernel set in `--backends` (`engine`: the runtimes' own choice, no cuDNN in cached forwards;
`torch`: torch's pick, cuDNN's on Hopper; `no-cudnn`: every SDPA kernel but cuDNN's, everywhere; `math`: the
reference kernel), and prints median and mean milliseconds. A cost per attention shape (a kernel chosen or a
graph built per shape and cached) shows as growing >> turns; one that a switch of width brings (a small cache) as
turns >> runs. Each model's forward is also profiled once per width and backend, to name the SDPA implementation
torch dispatched (since session 38: cuDNN's shows as `_scaled_dot_product_cudnn_attention`).

    python benchmarks/forward_shapes.py --device cuda --out out/forward_shapes.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import Tensor

from specsample.bench.report import command_line, machine_info, publish
from specsample.bench.run import ATTENTION_BACKENDS, add_pair_options, attention_backends, load_model_draft_pair
from specsample.models.base import CausalLM, ModelCache

MODES = ("runs", "turns", "growing")


def time_shapes(model: CausalLM, widths: list[int], context: int, calls: int, mode: str) -> dict[int, list[float]]:
    """Seconds of `calls` forwards over each width (after one warm-up pass) after `context` cached tokens, in `mode`
    (see MODES): one width's calls in a row or the widths in turn, the context held or one token longer every call."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    cache, slot, tokens = _one_row(model, context + calls + max(widths) + 1,
                                   f"context {context} + calls {calls} + width {max(widths)}")
    times: dict[int, list[float]] = {w: [] for w in widths}
    # (call, width) in the order they run; call 0 of each width warms kernels and allocators up
    order = ([(call, width) for width in widths for call in range(calls + 1)] if mode == "runs"
             else [(call, width) for call in range(calls + 1) for width in widths])
    with torch.inference_mode():
        model.prefill(tokens[:, : context + calls], cache, slot)
        for call, width in order:
            start_at = context + (call if mode == "growing" else 0)
            cache.truncate(slot, torch.tensor([start_at]))
            _sync(model.device)
            begin = time.perf_counter()
            model.forward_cached(tokens[:, start_at:start_at + width], cache, slot)
            _sync(model.device)
            if call:
                times[width].append(time.perf_counter() - begin)
    return times


def attention_kernels(model: CausalLM, widths: list[int], context: int) -> dict[int, dict[str, int]]:
    """Per width, which SDPA implementations one cached forward over that many tokens after `context` cached ones
    dispatched, and how often (aten op names such as `_scaled_dot_product_cudnn_attention`, read off torch's
    profiler): which kernel torch picked, measured rather than inferred from its rules."""
    cache, slot, tokens = _one_row(model, context + max(widths) + 1, f"context {context} + width {max(widths)}")
    kernels: dict[int, dict[str, int]] = {}
    with torch.inference_mode():
        model.prefill(tokens[:, :context], cache, slot)
        for width in widths:
            cache.truncate(slot, torch.tensor([context]))
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
                model.forward_cached(tokens[:, context:context + width], cache, slot)
                _sync(model.device)
            counts: dict[str, int] = {}
            for event in profiler.events():
                name = event.name.removeprefix("aten::")
                if name.startswith("_") and "attention" in name:  # the implementation, not the public entry point
                    counts[name] = counts.get(name, 0) + 1
            kernels[width] = counts
    return kernels


def _one_row(model: CausalLM, total: int, what: str) -> tuple[ModelCache, Tensor, Tensor]:
    """A one-row cache of `total` positions, its slot and `total` random tokens (`what` names the sum in the error
    when the model's context is shorter)."""
    if total > model.max_seq_len:
        raise ValueError(f"{what} passes the model's {model.max_seq_len} tokens")
    generator = torch.Generator().manual_seed(0)  # any tokens will do; leave the global random state alone
    tokens = torch.randint(0, model.vocab_size, (1, total), generator=generator).to(model.device)
    return model.new_cache(1, total), torch.tensor([0]), tokens


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _parse_ints(text: str, name: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values or min(values) < 1:
        raise SystemExit(f"--{name} needs positive integers, got {text!r}")
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pair_options(parser)
    parser.add_argument("--widths", default="1,2,3,4,5,9", help="tokens per target forward")
    parser.add_argument("--draft-widths", default="1,2,8,16", help="tokens per draft forward (a backlog scoring: 8-20)")
    parser.add_argument("--context", type=int, default=300, help="cached tokens before the first call")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--backends", default="engine,torch,math", help=f"of {', '.join(ATTENTION_BACKENDS)}")
    parser.add_argument("--out", type=Path, default=None, help="also write the result here (.json, and .md beside)")
    args = parser.parse_args()
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [b for b in backends if b not in ATTENTION_BACKENDS]
    if unknown or not backends:
        raise SystemExit(f"--backends: unknown {unknown}; choose from {', '.join(ATTENTION_BACKENDS)}")
    if args.calls < 1 or args.context < 1:
        raise SystemExit("--calls and --context must be >= 1")
    pair = load_model_draft_pair(args.target, args.draft, args.draft_window, args.dtype, args.device)
    models = {"target": (pair.target.model, _parse_ints(args.widths, "widths")),
              "draft": (pair.drafter.model, _parse_ints(args.draft_widths, "draft-widths"))}
    results: dict[str, dict] = {}
    for backend in backends:
        for name, (model, widths) in models.items():
            for mode in MODES:
                with attention_backends(backend, [model]):
                    try:
                        times = time_shapes(model, widths, args.context, args.calls, mode)
                    except ValueError as error:
                        raise SystemExit(f"forward_shapes.py: {name}: {error}") from None
                results.setdefault(backend, {}).setdefault(name, {})[mode] = {
                    str(w): {"median_ms": 1000 * statistics.median(t), "mean_ms": 1000 * statistics.fmean(t)}
                    for w, t in times.items()}
            try:
                with attention_backends(backend, [model]):
                    ops = attention_kernels(model, widths, args.context)
            except RuntimeError as error:  # a profiler that cannot start must not cost the timings above
                print(f"forward_shapes.py: {name}, {backend}: no kernel names ({error})", file=sys.stderr)
                continue
            results[backend][name]["kernels"] = {str(w): counts for w, counts in ops.items()}
    report = {"command": command_line("benchmarks/forward_shapes.py", args),
              "machine": machine_info(pair.target.model.device), "context": args.context, "calls": args.calls,
              "results": results}
    publish(report, render(report), args.out)


def render(report: dict) -> str:
    """Per backend and model, a row per width: median (mean) ms in each mode."""
    lines = [f"Command: `{report['command']}`", "",
             "Machine: " + ", ".join(f"{k} {v}" for k, v in report["machine"].items()), "",
             f"One forward of one row over W new tokens after {report['context']} cached ones, {report['calls']} calls "
             "each: runs (context held, one width's calls in a row), turns (context held, widths in turn), growing "
             "(widths in turn, the context one token longer every call). Median (mean) ms.", ""]
    for backend, by_model in report["results"].items():
        for name, by_mode in by_model.items():
            lines += [f"{name}, attention kernels `{backend}`:", "", "| tokens | " + " | ".join(MODES) + " |",
                      "|---|" + "---|" * len(MODES)]
            for width in by_mode[MODES[0]]:
                cells = [f"{by_mode[m][width]['median_ms']:.2f} ({by_mode[m][width]['mean_ms']:.2f})" for m in MODES]
                lines.append(f"| {width} | " + " | ".join(cells) + " |")
            lines.append("")
            if "kernels" in by_mode:  # runs before session 38 did not record them
                lines += ["SDPA implementations one forward dispatched, by tokens: " + "; ".join(
                    f"{width}: " + (", ".join(f"`{op}` ×{n}" for op, n in sorted(ops.items())) or "none")
                    for width, ops in by_mode["kernels"].items()), ""]
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    main()
