"""Matrix-vector products on SmolLM2-135M's weight shapes, batch 1: oneDNN called from Python (what
eager decoding does), oneDNN called from inductor's compiled C++ wrapper (kernel against kernel:
no Python per call), and inductor's autotuned C++ kernels (what `--compile` uses on CPUs).

Each shape is timed over enough distinct random weights (~100 MB) that every call reads its weight
from memory, as in a decode step; median of 7 passes. Reports microseconds per call and GB/s of
weights read.

    python benchmarks/matvec_kernels.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from specsample.models.compiled import CPU_INDUCTOR_CONFIG
from specsample.models.llama import linear, prepack

SHAPES = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "output layer": (49152, 576)}  # (out, in) of SmolLM2-135M's projections


class Stack(nn.Module):
    """Many weights of one shape, each applied to the same input vector."""

    def __init__(self, weights: list[torch.Tensor]) -> None:
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(w, requires_grad=False) for w in weights)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [F.linear(x, w) for w in self.weights]


def per_call_seconds(fn, x: torch.Tensor, calls: int) -> float:
    fn(x)
    times = []
    for _ in range(7):
        start = time.perf_counter()
        fn(x)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--megabytes", type=int, default=100, help="weights per shape, to defeat the caches")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}")
    print("| weight | shape | oneDNN from Python µs (GB/s) | oneDNN compiled µs (GB/s) | inductor autotuned µs (GB/s) |")
    print("|---|---|---|---|---|")
    onednn_compiled = {**CPU_INDUCTOR_CONFIG, "max_autotune": False}  # frozen, prepacked, C++ wrapper
    for name, (out_features, in_features) in SHAPES.items():
        nbytes = out_features * in_features * dtype.itemsize
        count = max(1, args.megabytes * 10**6 // nbytes)
        weights = [torch.randn(out_features, in_features).to(dtype) for _ in range(count)]
        x = torch.randn(1, in_features).to(dtype)
        packed = [prepack(w) for w in weights]
        with torch.inference_mode():
            timings = [per_call_seconds(lambda v: [linear(v, w, None, p) for w, p in zip(weights, packed)], x, count)]
            for config in (onednn_compiled, CPU_INDUCTOR_CONFIG):
                torch._dynamo.reset()  # each configuration compiles afresh
                with torch._inductor.config.patch(config):
                    timings.append(per_call_seconds(torch.compile(Stack(weights).eval()), x, count))
        cells = " | ".join(f"{t * 1e6:.1f} ({nbytes / t / 1e9:.1f})" for t in timings)
        print(f"| {name} | {out_features} × {in_features} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
