"""Plain decoding speed of our runtime vs transformers `generate()` on the same weights.

Batch 1, a fixed chat prompt, 128 new tokens (EOS ignored so every run decodes the same length),
greedy. Systems run interleaved, repetition by repetition, so machine drift hits all alike; we
report medians. "ours compiled" is our runtime with `compile_decode` (torch.compile of the one-token
step); its one-time compile is timed separately and reported, not folded into ms/token. The memory
floor is (bytes of weights read per token) / (measured copy bandwidth: bytes copied per second by
`torch.Tensor.copy_` on 256 MiB, median of 10), on the device the models run on. A copy reads and
writes each byte while a decode step only reads its weights, so the table also gives the time at
read bandwidth (a `sum()` over 256 MiB): a reference, not a hard floor, since a well-tuned
matrix-vector kernel can read a little faster than a reduction.

    python benchmarks/runtime_speed.py --repeats 5 --out docs/results/runtime_speed.json
    python benchmarks/runtime_speed.py --device cuda --out docs/results/runtime_speed_cuda.json   # on a GPU
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

from specsample import SamplingParams, generate
from specsample.bench.systems import load_hf_peer
from specsample.models.loader import load_model

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def sync(device: torch.device) -> None:
    """Wait for queued GPU work, so wall-clock times include it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _bytes_per_second(device: torch.device, op, megabytes: int, repeats: int) -> float:
    """`op(src)` on 256 MiB of float32 timed `repeats` times: bytes of `src` per second, median."""
    src = torch.randn(megabytes * 2**20 // 4, device=device)
    op(src)
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        op(src)
        sync(device)
        times.append(time.perf_counter() - start)
    return src.numel() * 4 / statistics.median(times)


def copy_bandwidth(device: torch.device, megabytes: int = 256, repeats: int = 10) -> float:
    """Bytes copied per second on `device` (each byte read once and written once)."""
    dst = torch.empty(megabytes * 2**20 // 4, device=device)
    return _bytes_per_second(device, dst.copy_, megabytes, repeats)


def read_bandwidth(device: torch.device, megabytes: int = 256, repeats: int = 10) -> float:
    """Bytes read per second on `device` by a sum over 256 MiB: a copy moves each byte twice, a decode step once."""
    return _bytes_per_second(device, torch.sum, megabytes, repeats)


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of weights a decode step reads: every matrix once, one embedding row (tied head counted once)."""
    seen, total = set(), 0
    for name, param in model.named_parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        if name.endswith("embed.weight") or name.endswith("embed_tokens.weight"):
            total += param.shape[1] * param.element_size()  # one row looked up...
            total += param.numel() * param.element_size()  # ...and the whole table read by the tied head
            continue
        total += param.numel() * param.element_size()
    return total


def ours_ms_per_token(model, prompt_ids: list[int], new_tokens: int) -> float:
    sync(model.device)
    start = time.perf_counter()
    result = generate(model, [prompt_ids], SamplingParams(temperature=0, max_new_tokens=new_tokens))
    sync(model.device)
    elapsed = time.perf_counter() - start
    assert result.stats["new_tokens"] == new_tokens
    return 1000 * elapsed / new_tokens


def hf_ms_per_token(model, prompt_ids: list[int], new_tokens: int) -> float:
    ids = torch.tensor([prompt_ids], device=model.device)
    sync(model.device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    sync(model.device)
    elapsed = time.perf_counter() - start
    assert out.shape[1] - ids.shape[1] == new_tokens
    return 1000 * elapsed / new_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("docs/results/runtime_speed.json"))
    parser.add_argument("--compiled", action=argparse.BooleanOptionalAction, default=True,
                        help="also time our runtime with compile_decode (default on)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtypes = [getattr(torch, name) for name in args.dtypes.split(",") if name]

    systems = {}
    compile_s: dict[str, float] = {}
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        loaded = load_model(args.model, dtype=dtype, device=device)
        hf = load_hf_peer(loaded.folder, dtype, device)
        prompt_ids = loaded.tokenizer.encode(PROMPT, chat=True)
        systems[f"ours {name}"] = (ours_ms_per_token, loaded.model, weight_bytes_per_token(loaded.model))
        if args.compiled:
            start = time.perf_counter()
            compiled = load_model(args.model, dtype=dtype, device=device, compile_decode=True)
            compile_s[f"ours compiled {name}"] = time.perf_counter() - start  # load + one-time compile
            systems[f"ours compiled {name}"] = (ours_ms_per_token, compiled.model,
                                                weight_bytes_per_token(compiled.model))
        systems[f"transformers {name}"] = (hf_ms_per_token, hf, weight_bytes_per_token(hf))
    for fn, model, _ in systems.values():  # warm-up
        fn(model, prompt_ids, 8)
    times: dict[str, list[float]] = {name: [] for name in systems}
    bandwidths, read_bandwidths = [], []
    for rep in range(args.repeats):
        bandwidths.append(copy_bandwidth(device))
        read_bandwidths.append(read_bandwidth(device))
        for name, (fn, model, _) in systems.items():
            times[name].append(fn(model, prompt_ids, args.new_tokens))
            print(f"repeat {rep + 1}/{args.repeats} {name}: {times[name][-1]:.1f} ms/token", flush=True)
    bandwidth, read_bw = statistics.median(bandwidths), statistics.median(read_bandwidths)
    rows = []
    for name, (_, _, nbytes) in systems.items():
        ms = statistics.median(times[name])
        floor_ms, read_floor_ms = 1000 * nbytes / bandwidth, 1000 * nbytes / read_bw
        rows.append({"system": name, "ms_per_token": ms, "tokens_per_s": 1000 / ms, "weight_mb": nbytes / 1e6,
                     "floor_ms": floor_ms, "ratio_to_floor": ms / floor_ms, "read_bandwidth_ms": read_floor_ms,
                     "ratio_to_read_bandwidth": ms / read_floor_ms, "all_ms": times[name],
                     "load_and_compile_s": compile_s.get(name)})
    ratios = {}
    for dtype in (str(d).removeprefix("torch.") for d in dtypes):
        theirs = statistics.median(times[f"transformers {dtype}"])
        for ours in (f"ours {dtype}", f"ours compiled {dtype}"):
            if ours in times:
                ratios[ours] = theirs / statistics.median(times[ours])
    report = {
        "command": shlex.join(["python", *sys.argv]),
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "copy_bandwidth_gb_s": bandwidth / 1e9,
                    "read_bandwidth_gb_s": read_bw / 1e9},
        "prompt_tokens": len(prompt_ids), "new_tokens": args.new_tokens, "rows": rows,
        "speedup_vs_transformers": ratios,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    lines = [f"Command: `{report['command']}`", "",
             f"Machine: {report['machine']['device']} ({report['machine']['cpu']}, "
             f"{report['machine']['threads']} threads), torch "
             f"{report['machine']['torch']}; copy bandwidth {bandwidth / 1e9:.1f} GB/s, read bandwidth "
             f"{read_bw / 1e9:.1f} GB/s (medians of {args.repeats}); prompt {len(prompt_ids)} tokens, {args.new_tokens} new tokens, batch 1, greedy.", "",
             "| system | ms/token (median) | tokens/s | weights read/token MB | floor ms (copy) | ratio to floor "
             "| at read bandwidth ms | ratio to that | load + compile s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['system']} | {r['ms_per_token']:.1f} | {r['tokens_per_s']:.1f} | {r['weight_mb']:.0f} | "
                     f"{r['floor_ms']:.1f} | {r['ratio_to_floor']:.2f} | {r['read_bandwidth_ms']:.1f} | "
                     f"{r['ratio_to_read_bandwidth']:.2f} | "
                     f"{'' if r['load_and_compile_s'] is None else round(r['load_and_compile_s'])} |")
    lines.append("")
    for name, ratio in ratios.items():
        lines.append(f"{name}: **{ratio:.2f}x** transformers `generate()` on the same weights and dtype.  ")
    table = "\n".join(lines) + "\n"
    args.out.with_suffix(".md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
