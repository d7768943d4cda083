"""What verification costs at the sizes users serve: our runtime's cached forward scoring n tokens for one row, with
random weights in the shapes of Llama-3-8B and Llama-3.2-1B (time does not depend on the values), against scoring
one token.

One row, `--context` tokens cached, each n in --tokens timed --repeats times after a warm-up (medians, ms; on CUDA
synchronised). `--shape tiny` runs the same on a small shape (a dry run on a CPU).

    python benchmarks/scoring_cost.py --device cuda --shape llama-8b --out docs/results/scoring_cost/llama-8b.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from specsample.models.llama import LlamaConfig, LlamaModel

SHAPES = {
    "llama-8b": LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        max_position_embeddings=8192,
        rope_theta=500000.0,
    ),
    "llama-1b": LlamaConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        max_position_embeddings=8192,
        rope_theta=500000.0,
    ),
    "tiny": LlamaConfig(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=512,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
    ),
}


def build(shape: str, device: torch.device, dtype: torch.dtype) -> LlamaModel:
    """A model of `shape` with random weights (small, so activations stay finite), made on `device` directly."""
    with torch.device(device):
        model = LlamaModel(SHAPES[shape]).to(dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.endswith("norm.weight"):
                param.normal_(0.0, 0.02)
    return model.eval()


def median_ms(model: LlamaModel, n: int, context: int, repeats: int, device: torch.device) -> float:
    cache = model.new_cache(1, context + 64)
    slot = torch.tensor([0])
    model.prefill(torch.randint(0, 1000, (1, context), device=device), cache, slot)
    tokens = torch.randint(0, 1000, (1, n), device=device)
    times = []
    for rep in range(repeats + 1):  # the first call warms up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        model.forward_cached(tokens, cache, slot)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if rep:
            times.append(time.perf_counter() - start)
        cache.lengths[slot] = context
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--tokens", default="1,2,4,8,16,32")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    model = build(args.shape, device, getattr(torch, args.dtype))
    counts = [int(t) for t in args.tokens.split(",")]
    ms = {n: median_ms(model, n, args.context, args.repeats, device) for n in counts}
    for n, value in ms.items():
        print(f"{args.shape} scoring {n:2d} tokens: {value:8.2f} ms  ({value / ms[counts[0]]:.2f}x one)", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
        args.out.write_text(
            json.dumps(
                {
                    "shape": args.shape,
                    "device": device_name,
                    "dtype": args.dtype,
                    "torch": torch.__version__,
                    "context": args.context,
                    "command": " ".join(["python", *sys.argv]),
                    "ms": {str(n): v for n, v in ms.items()},
                    "over_one": {str(n): v / ms[counts[0]] for n, v in ms.items()},
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
