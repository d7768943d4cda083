"""Plain decoding speed of our runtime vs transformers `generate()` on the same weights, and what quantized weights
cost and change.

Batch 1, a fixed chat prompt, 128 new tokens (EOS ignored so every run decodes the same length),
greedy. Systems run interleaved, repetition by repetition, so machine drift hits all alike; we
report medians. "ours compiled" is our runtime with `compile_decode` (torch.compile of the one-token
step); its one-time compile is timed separately and reported, not folded into ms/token. The memory
floor is (bytes of weights read per token) / (measured copy bandwidth: bytes copied per second by
`torch.Tensor.copy_` on 256 MiB, median of 10), on the device the models run on. A copy reads and
writes each byte while a decode step only reads its weights, so the table also gives the time at
read bandwidth (a `sum()` over 256 MiB): a reference, not a hard floor, since a well-tuned
matrix-vector kernel can read a little faster than a reduction.

Quantized weights (`--weights`, on a CPU): our runtime decoding with the alias's GGUF codes as stored (int4 layers,
int8 output layer: "int4 (GGUF)") and with every projection int8 ("int8"), beside the float systems, with the
effective bandwidth (weight bytes read per token / time per token). `--parts` adds, for the same models:
- `widths`: one row's cached forward over n = 1, 2, 4, 5, 8, 16 new tokens after 128 cached (verifying n - 1
  drafts), every model and width interleaved, medians and minimums;
- `accuracy`: logits of each quantized model against its dequantized float32 copy (same weights) over whole
  Spec-Bench prompts, and greedy continuations of both compared (identical, or the first divergence); the logits
  also against a dequantized bfloat16 copy (the kernels' activation dtype: what the kernels alone change);
- `self-draft`: a bfloat16 target (the float checkpoint) drafted by its own int4 weights (`--draft self:int4`),
  T 0, fixed gamma (`--gamma`), against plain decoding of the same target, interleaved per prompt;
- `memory`: resident memory each model adds to a process (after loading, and after decoding), each in a fresh
  process, against the GGUF file's size plus the KV cache the decoding allocated.

    python benchmarks/runtime_speed.py --repeats 5 --out docs/results/runtime_speed.json
    python benchmarks/runtime_speed.py --device cuda --out docs/results/runtime_speed_cuda.json   # on a GPU
    python benchmarks/runtime_speed.py --dtypes bfloat16 --no-compiled --weights int8,int4 \
        --parts widths,accuracy,self-draft,memory --out docs/results/quantized/runtime_speed.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing
import os
import platform
import shlex
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from specsample import SamplingParams, generate
from specsample.bench.systems import load_hf_peer
from specsample.config import SpecConfig
from specsample.datasets import spec_bench_prompts
from specsample.models.hub import ALIASES, alias_gguf
from specsample.models.loader import load_model
from specsample.models.quant import QuantLinear
from specsample.models.quant_model import dequantized_model
from specsample.options import EngineOptions
from specsample.pair import load_drafter
from specsample.planner import FixedGamma

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


WEIGHTS = {"int8": "int8", "int4": "auto"}  # --weights name -> load_model's quantize (int4: the GGUF's codes as stored)
WIDTHS = (1, 2, 4, 5, 8, 16)  # tokens scored in one forward (verifying n - 1 drafts)
PARTS = ("widths", "accuracy", "self-draft", "memory")


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of weights a decode step reads: every matrix once, one embedding row (tied head counted once); a
    quantized layer's codes, scales and zeros (models/quant.py)."""
    seen, total = set(), 0
    for module in model.modules():
        if isinstance(module, QuantLinear) and id(module) not in seen:
            seen.add(id(module))
            total += module.nbytes
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


def time_widths(
    models: dict[str, torch.nn.Module], repeats: int, context: int = 128
) -> dict[str, dict[str, dict[int, float]]]:
    """Milliseconds of one row's cached forward over n new tokens after `context` cached: model -> statistic
    ('median', and 'min': the least disturbed repeat, on a machine shared with other work) -> n."""
    tokens = torch.randint(0, 49152, (1, context + max(WIDTHS)), generator=torch.Generator().manual_seed(0))
    slot = torch.tensor([0])
    caches = {}
    for name, model in models.items():
        caches[name] = model.new_cache(1, context + max(WIDTHS))
        model.prefill(tokens[:, :context], caches[name], slot)
    times: dict[tuple[str, int], list[float]] = {(name, n): [] for name in models for n in WIDTHS}
    for rep in range(repeats + 1):  # the first pass warms up
        for n in WIDTHS:
            for name, model in models.items():
                sync(model.device)
                start = time.perf_counter()
                model.forward_cached(tokens[:, context : context + n], caches[name], slot)
                sync(model.device)
                if rep:
                    times[(name, n)].append(time.perf_counter() - start)
                caches[name].truncate(slot, torch.tensor([context]))
    return {
        name: {
            stat: {n: 1e3 * fn(times[(name, n)]) for n in WIDTHS}
            for stat, fn in (("median", statistics.median), ("min", min))
        }
        for name in models
    }


def bench_prompts(tokenizer, count: int) -> list[list[int]]:
    """The first turn of `count` bundled Spec-Bench prompts, one per category in turn, as chat token ids."""
    by_category: dict[str, list] = {}
    for prompt in spec_bench_prompts():
        by_category.setdefault(prompt.category, []).append(prompt)
    chosen, rank = [], 0
    while len(chosen) < count:
        chosen += [group[rank] for group in by_category.values() if rank < len(group)][: count - len(chosen)]
        rank += 1
    return [tokenizer.encode(p.turns[0], chat=True) for p in chosen]


def greedy_tokens(model, prompt: list[int], new_tokens: int) -> list[int]:
    result = generate(model, [prompt], SamplingParams(temperature=0, max_new_tokens=new_tokens))
    return result.completions[0].token_ids


def accuracy(model, prompts: list[list[int]], new_tokens: int) -> dict:
    """A quantized model against its dequantized float32 copy (the same weights): logits over whole prompts, and
    greedy continuations."""
    reference = dequantized_model(model, torch.float32)
    same_dtype = dequantized_model(model, torch.bfloat16)
    worst, worst_bf16, scale, argmax_agree, positions = 0.0, 0.0, 0.0, 0, 0
    continuations = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            ours, theirs = model(ids).float()[0], reference(ids).float()[0]  # [n, vocab]
            worst = max(worst, (ours - theirs).abs().max().item())
            worst_bf16 = max(worst_bf16, (ours - same_dtype(ids).float()[0]).abs().max().item())
            scale = max(scale, theirs.abs().max().item())
            argmax_agree += int((ours.argmax(-1) == theirs.argmax(-1)).sum())
            positions += len(prompt)
            a, b = greedy_tokens(model, prompt, new_tokens), greedy_tokens(reference, prompt, new_tokens)
            diverged = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
            continuations.append(diverged)
    return {
        "prompts": len(prompts),
        "positions": positions,
        "max_abs_logit_diff": worst,
        "max_abs_logit": scale,
        "max_abs_logit_diff_bf16": worst_bf16,
        "argmax_agreement": argmax_agree / positions,
        "new_tokens": new_tokens,
        "identical_continuations": sum(d is None for d in continuations),
        "first_divergence": continuations,
    }


def self_draft(spec: str, prompts: list[list[int]], new_tokens: int, gamma: int) -> dict:
    """A bfloat16 target drafted by its own int4 weights, T 0, against plain decoding, interleaved per prompt."""
    target = load_model(spec, dtype=torch.bfloat16)
    drafter = load_drafter("self:int4", target, EngineOptions(target=spec, dtype="bfloat16"))
    params = SamplingParams(temperature=0, max_new_tokens=new_tokens)
    config = SpecConfig()
    generate(
        target.model,
        [prompts[0]],
        SamplingParams(temperature=0, max_new_tokens=8),
        drafter,
        config,
        planner=FixedGamma(gamma),
    )  # warm-up
    plain_s, spec_s, drafted, accepted, same = 0.0, 0.0, 0, 0, 0
    for prompt in prompts:
        start = time.perf_counter()
        plain = generate(target.model, [prompt], params)
        plain_s += time.perf_counter() - start
        start = time.perf_counter()
        spec = generate(target.model, [prompt], params, drafter, config, planner=FixedGamma(gamma))
        spec_s += time.perf_counter() - start
        drafted, accepted = drafted + spec.stats["drafted"], accepted + spec.stats["accepted"]
        same += int(plain.completions[0].token_ids == spec.completions[0].token_ids)
    return {
        "gamma": gamma,
        "prompts": len(prompts),
        "new_tokens": new_tokens,
        "acceptance_rate": accepted / drafted,
        "plain_ms_per_token": 1e3 * plain_s / (new_tokens * len(prompts)),
        "speculative_ms_per_token": 1e3 * spec_s / (new_tokens * len(prompts)),
        "speedup": plain_s / spec_s,
        "identical_outputs": same,
    }


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _release_freed_heap() -> None:
    """Hand memory freed while loading back to the OS (glibc keeps freed heap pages resident until trimmed)."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _resident(spec: str, quantize: str, dtype: str, prompt: list[int], new_tokens: int) -> dict:
    """In a fresh process: resident bytes the model adds after loading (freed heap handed back) and after decoding,
    the bytes its tensors hold, and its KV cache's. The baseline is taken after loading the model once and freeing
    it, so the libraries the loading imports are not counted."""
    torch.set_num_threads(1)
    load_model(spec, dtype=dtype, quantize=quantize, progress=False)  # imports and file caches, then freed
    _release_freed_heap()
    base = _rss_bytes()
    model = load_model(spec, dtype=dtype, quantize=quantize, progress=False).model
    _release_freed_heap()
    loaded = _rss_bytes()
    generate(model, [prompt], SamplingParams(temperature=0, max_new_tokens=new_tokens))
    _release_freed_heap()
    decoded = _rss_bytes()
    tensors = {id(t): t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]}
    c = model.config
    kv = 2 * c.num_layers * c.num_kv_heads * c.head_dim * (len(prompt) + new_tokens) * model.dtype.itemsize
    return {
        "after_load": loaded - base,
        "after_decode": decoded - base,
        "tensors": sum(tensors.values()),
        "kv_cache": kv,
    }


def resident_memory(spec: str, systems: dict[str, tuple[str, str]], prompt: list[int], new_tokens: int) -> dict:
    """`_resident` per system (name -> (quantize, dtype)), one fresh process each, beside the GGUF file's size."""
    context = multiprocessing.get_context("spawn")
    out: dict = {"gguf_bytes": alias_gguf(spec).stat().st_size if spec in ALIASES else None}
    for name, (quantize, dtype) in systems.items():
        with ProcessPoolExecutor(1, mp_context=context) as pool:
            out[name] = pool.submit(_resident, spec, quantize, dtype, prompt, new_tokens).result()
    return out


def quantized_report(report: dict) -> list[str]:
    """Markdown for the quantized parts of `report`."""
    lines = []
    if "widths" in report:
        lines += [
            "",
            "One row's cached forward over n new tokens (128 cached), ms (median, and the least disturbed "
            "repeat); in brackets over n = 1:",
            "",
            "| weights | statistic | " + " | ".join(f"n={n}" for n in WIDTHS) + " |",
            "|---|---|" + "---|" * len(WIDTHS),
        ]
        for name, by_stat in report["widths"].items():
            for stat, by_n in by_stat.items():
                lines.append(
                    f"| {name} | {stat} | "
                    + " | ".join(f"{by_n[n]:.1f} ({by_n[n] / by_n[1]:.2f}x)" for n in WIDTHS)
                    + " |"
                )
    for name, acc in report.get("accuracy", {}).items():
        lines += [
            "",
            f"Accuracy of {name} against its dequantized float32 copy: {acc['prompts']} prompts, "
            f"{acc['positions']} positions; max |logit difference| {acc['max_abs_logit_diff']:.3f} "
            f"(largest |logit| {acc['max_abs_logit']:.1f}; against a dequantized bfloat16 copy "
            f"{acc['max_abs_logit_diff_bf16']:.3f}); argmax agrees at "
            f"{100 * acc['argmax_agreement']:.1f}% of positions; greedy {acc['new_tokens']} tokens: "
            f"{acc['identical_continuations']}/{acc['prompts']} identical, first divergences at "
            f"{[d for d in acc['first_divergence'] if d is not None]}.",
        ]
    if "self_draft" in report:
        sd = report["self_draft"]
        lines += [
            "",
            f"Self-draft (`--draft self:int4`) on the bfloat16 target, T 0, gamma {sd['gamma']}, "
            f"{sd['prompts']} prompts x {sd['new_tokens']} tokens: acceptance {sd['acceptance_rate']:.3f}, "
            f"{sd['speculative_ms_per_token']:.1f} vs plain {sd['plain_ms_per_token']:.1f} ms/token: "
            f"**{sd['speedup']:.2f}x**; outputs identical to plain decoding on {sd['identical_outputs']}/"
            f"{sd['prompts']}.",
        ]
    if "memory" in report:
        memory = report["memory"]
        gguf = memory["gguf_bytes"]
        lines += [
            "",
            f"Resident memory a model adds to a fresh process, MB (GGUF file {gguf / 1e6:.0f} MB):",
            "",
            "| weights | tensors held | after load | after decoding | KV cache | after decoding / (GGUF + KV) |",
            "|---|---|---|---|---|---|",
        ]
        for name, m in memory.items():
            if name != "gguf_bytes":
                lines.append(
                    f"| {name} | {m['tensors'] / 1e6:.0f} | {m['after_load'] / 1e6:.0f} | {m['after_decode'] / 1e6:.0f} | "
                    f"{m['kv_cache'] / 1e6:.1f} | {m['after_decode'] / (gguf + m['kv_cache']):.2f} |"
                )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("docs/results/runtime_speed.json"))
    parser.add_argument(
        "--compiled",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time our runtime with compile_decode (default on)",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16")
    parser.add_argument(
        "--weights",
        default=None,
        help="comma-separated quantized systems of ours (CPU only): int8, int4 (the GGUF's codes); "
        "default int8,int4 on a CPU, none elsewhere",
    )
    parser.add_argument("--parts", default="", help=f"comma-separated extra measurements: {', '.join(PARTS)}")
    parser.add_argument("--prompts", type=int, default=8, help="Spec-Bench prompts of accuracy and self-draft")
    parser.add_argument("--accuracy-tokens", type=int, default=32, help="greedy tokens compared per prompt")
    parser.add_argument("--gamma", type=int, default=3, help="drafts per round of the self-draft")
    parser.add_argument("--widths-repeats", type=int, default=15, help="repeats of each forward of the widths part")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtypes = [getattr(torch, name) for name in args.dtypes.split(",") if name]
    weights_arg = args.weights if args.weights is not None else ("int8,int4" if device.type == "cpu" else "")
    weights = [w for w in weights_arg.split(",") if w]
    parts = [p for p in args.parts.split(",") if p]
    if not dtypes:
        parser.error("--dtypes: name at least one of float32, bfloat16")
    for w in weights:
        if w not in WEIGHTS:
            parser.error(f"--weights: {w!r} is not one of {', '.join(WEIGHTS)}")
    if weights and device.type != "cpu":
        parser.error("--weights: the int4/int8 kernels run on CPUs; pass --weights '' on another device")
    for part in parts:
        if part not in PARTS:
            parser.error(f"--parts: {part!r} is not one of {', '.join(PARTS)}")

    load_before = os.getloadavg()[0]  # other work on the machine: timings under load are not comparable
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
            compiled = load_model(args.model, dtype=dtype, device=device, compile=True)
            compile_s[f"ours compiled {name}"] = time.perf_counter() - start  # load + one-time compile
            systems[f"ours compiled {name}"] = (
                ours_ms_per_token,
                compiled.model,
                weight_bytes_per_token(compiled.model),
            )
        systems[f"transformers {name}"] = (hf_ms_per_token, hf, weight_bytes_per_token(hf))
    quantized = {}
    for w in weights:
        loaded = load_model(args.model, quantize=WEIGHTS[w], device=device)
        quantized[f"ours {w}" + (" (GGUF)" if WEIGHTS[w] == "auto" else "")] = loaded.model
    tokenizer = loaded.tokenizer
    for name, model in quantized.items():
        systems[name] = (ours_ms_per_token, model, weight_bytes_per_token(model))
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
        rows.append(
            {
                "system": name,
                "ms_per_token": ms,
                "tokens_per_s": 1000 / ms,
                "weight_mb": nbytes / 1e6,
                "effective_gb_s": nbytes / ms / 1e6,
                "floor_ms": floor_ms,
                "ratio_to_floor": ms / floor_ms,
                "read_bandwidth_ms": read_floor_ms,
                "ratio_to_read_bandwidth": ms / read_floor_ms,
                "all_ms": times[name],
                "load_and_compile_s": compile_s.get(name),
            }
        )
    extra: dict = {}
    float_models = {
        name: model
        for name, (_, model, _) in systems.items()
        if name.startswith("ours ") and "compiled" not in name and name not in quantized
    }
    if "widths" in parts:
        extra["widths"] = time_widths({**float_models, **quantized}, args.widths_repeats)
    prompts = bench_prompts(tokenizer, args.prompts) if set(parts) - {"widths"} else []
    if "accuracy" in parts:
        extra["accuracy"] = {name: accuracy(model, prompts, args.accuracy_tokens) for name, model in quantized.items()}
    if "self-draft" in parts:
        extra["self_draft"] = self_draft(args.model, prompts, args.new_tokens, args.gamma)
    if "memory" in parts:
        extra["memory"] = resident_memory(
            args.model,
            {"int4 (GGUF)": ("auto", "auto"), "int8": ("int8", "auto"), "bfloat16": ("none", "bfloat16")},
            prompts[0],
            args.new_tokens,
        )
    ratios = {}
    for dtype in (str(d).removeprefix("torch.") for d in dtypes):
        theirs = statistics.median(times[f"transformers {dtype}"])
        for ours in (f"ours {dtype}", f"ours compiled {dtype}"):
            if ours in times:
                ratios[ours] = theirs / statistics.median(times[ours])
    report = {
        "command": shlex.join(["python", *sys.argv]),
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "copy_bandwidth_gb_s": bandwidth / 1e9,
            "read_bandwidth_gb_s": read_bw / 1e9,
            "load_average_before": load_before,
            "load_average_after": os.getloadavg()[0],
        },
        "prompt_tokens": len(prompt_ids),
        "new_tokens": args.new_tokens,
        "rows": rows,
        "speedup_vs_transformers": ratios,
        **extra,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    lines = [
        f"Command: `{report['command']}`",
        "",
        f"Machine: {report['machine']['device']} ({report['machine']['cpu']}, "
        f"{report['machine']['threads']} threads), torch "
        f"{report['machine']['torch']}; copy bandwidth {bandwidth / 1e9:.1f} GB/s, read bandwidth "
        f"{read_bw / 1e9:.1f} GB/s (medians of {args.repeats}); load average {load_before:.1f} before, "
        f"{report['machine']['load_average_after']:.1f} after; prompt {len(prompt_ids)} tokens, {args.new_tokens} new tokens, batch 1, greedy.",
        "",
        "| system | ms/token (median) | tokens/s | weights read/token MB | effective GB/s | floor ms (copy) "
        "| ratio to floor | at read bandwidth ms | ratio to that | load + compile s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['system']} | {r['ms_per_token']:.1f} | {r['tokens_per_s']:.1f} | {r['weight_mb']:.0f} | "
            f"{r['effective_gb_s']:.1f} | "
            f"{r['floor_ms']:.1f} | {r['ratio_to_floor']:.2f} | {r['read_bandwidth_ms']:.1f} | "
            f"{r['ratio_to_read_bandwidth']:.2f} | "
            f"{'' if r['load_and_compile_s'] is None else round(r['load_and_compile_s'])} |"
        )
    lines.append("")
    for name, ratio in ratios.items():
        lines.append(f"{name}: **{ratio:.2f}x** transformers `generate()` on the same weights and dtype.  ")
    lines += quantized_report(report)
    table = "\n".join(lines) + "\n"
    args.out.with_suffix(".md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
