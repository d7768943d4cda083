"""What a draft step costs on this CPU, and what the cheaper paths save.

Two measurements, both on the shipped draft (`smollm2-135m-instruct-draft`, 6 layers, 128 wide, an 8,192-token
output subset):

1. Its matrix products alone, one token: `F.linear` against oneDNN's prepacked call, in float32 and bfloat16
   (why `prepack` leaves small float32 matrices unpacked).
2. `ModelDrafter.propose` at batch 1 on a Spec-Bench prompt, four ways taking turns round by round: bfloat16 or
   float32 weights, and sampling over the whole vocabulary from every fed position's logits (the path for models
   without `forward_cached_last`, and the only path before session 23) or over the output subset from the last
   position only. Every round keeps the first draft and adds a token, as an accepted round would.

    python benchmarks/draft_step.py --out docs/draft_step.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from specsample.bench.report import command_line, publish
from specsample.bench.run import encode_fitting, load_prompts
from specsample.config import SamplingParams
from specsample.drafters.model import ModelDrafter
from specsample.models.llama import Linear, LlamaModel, linear
from specsample.models.loader import load_model

DRAFT = "smollm2-135m-instruct-draft"


def per_call_us(fn, calls: int, repeats: int = 7) -> float:
    """Median over `repeats` of the mean microseconds per call over `calls` calls."""
    for _ in range(20):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def matrix_table(model: LlamaModel) -> list[dict]:
    """Each distinct weight shape of the draft (and its output subset), F.linear vs a forced prepack."""
    shapes = sorted({tuple(m.weight.shape) for m in model.modules() if isinstance(m, Linear) and m is not model.lm_head})
    shapes.append((len(model.output_subset), model.config.hidden_size))
    rows = []
    for out_features, in_features in shapes:
        row = {"shape": [out_features, in_features]}
        for dtype in (torch.float32, torch.bfloat16):
            weight = torch.randn(out_features, in_features, dtype=dtype)
            x = torch.randn(1, 1, in_features, dtype=dtype)
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)  # forced: prepack() would skip small fp32
            name = "float32" if dtype == torch.float32 else "bfloat16"
            row[f"{name}_linear_us"] = per_call_us(lambda: F.linear(x, weight), 2000)
            row[f"{name}_packed_us"] = per_call_us(lambda: linear(x, weight, None, packed), 2000)
        rows.append(row)
    return rows


def propose_times(variants: dict[str, ModelDrafter], prompt: list[int], rounds: int, gamma: int,
                  temperature: float) -> dict[str, list[float]]:
    """Seconds per propose() call, the variants taking turns round by round."""
    params = [SamplingParams(temperature=temperature, max_new_tokens=rounds * 2 + 8)]
    gens = {name: [torch.Generator().manual_seed(0)] for name in variants}
    for drafter in variants.values():
        drafter.allocate(1, len(prompt) + 2 * rounds + gamma + 8)
        drafter.add_rows([0], [prompt])
    times: dict[str, list[float]] = {name: [] for name in variants}
    for step in range(rounds):
        order = list(variants) if step % 2 else list(variants)[::-1]
        for name in order:
            drafter = variants[name]
            start = time.perf_counter()
            proposal = drafter.propose([0], gamma, [gamma], params, gens[name])
            times[name].append(time.perf_counter() - start)
            drafts = proposal.tokens[0].tolist()
            ours = 17 if len(drafts) < 2 or drafts[1] != 17 else 18  # a rejected draft is never the token after it
            drafter.commit([0], [[drafts[0], ours]])  # the first draft kept, then a token of ours
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4, help="Spec-Bench prompts (the first category's first ones)")
    parser.add_argument("--rounds", type=int, default=60, help="rounds per prompt and variant")
    parser.add_argument("--gammas", default="1,3")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--out", type=Path, default=None, help="also write the result here (.json, and .md beside)")
    args = parser.parse_args()
    torch.manual_seed(0)
    bf16 = load_model(DRAFT, dtype="bfloat16").model
    fp32 = load_model(DRAFT, dtype="float32").model
    tokenizer = load_model("smollm2-135m-instruct", dtype="bfloat16").tokenizer
    _, prompts = encode_fitting(load_prompts("spec-bench", 1, 0), tokenizer, 2048, 256)
    prompts = prompts[:args.prompts]
    with torch.inference_mode():
        matrices = matrix_table(bf16)
        variants = {}
        for dtype_name, model in (("bfloat16", bf16), ("float32", fp32)):
            for path in ("whole vocabulary", "output subset, last position"):
                drafter = ModelDrafter(model)
                drafter._last_only = path != "whole vocabulary"
                variants[f"{dtype_name}, {path}"] = drafter
        results = {}
        for gamma in (int(g) for g in args.gammas.split(",")):
            per_variant: dict[str, list[float]] = {name: [] for name in variants}
            for prompt in prompts:
                for name, seconds in propose_times(variants, prompt, args.rounds, gamma, args.temperature).items():
                    per_variant[name] += seconds
            results[str(gamma)] = {name: 1000 * statistics.median(v) for name, v in per_variant.items()}
    report = {"command": command_line("benchmarks/draft_step.py", args), "threads": torch.get_num_threads(), "matrices_us": matrices,
              "propose_ms": results, "temperature": args.temperature, "rounds": args.rounds, "prompts": len(prompts)}
    publish(report, render(report), args.out)


def render(report: dict) -> str:
    lines = [f"Command: `{report['command']}` ({report['threads']} threads)", "",
             "One token through each of the draft's matrix shapes, microseconds per call (median of 7 means):", "",
             "| weight (out × in) | float32 F.linear | float32 packed | bfloat16 F.linear | bfloat16 packed |",
             "|---|---|---|---|---|"]
    for row in report["matrices_us"]:
        out_features, in_features = row["shape"]
        lines.append(f"| {out_features} × {in_features} | {row['float32_linear_us']:.1f} | {row['float32_packed_us']:.1f} "
                     f"| {row['bfloat16_linear_us']:.1f} | {row['bfloat16_packed_us']:.1f} |")
    lines += ["", f"`ModelDrafter.propose` at batch 1, T {report['temperature']}, median ms per call over "
              f"{report['prompts']} prompts × {report['rounds']} rounds, variants taking turns:", ""]
    gammas = list(report["propose_ms"])
    lines += ["| weights, sampling | " + " | ".join(f"gamma {g}" for g in gammas) + " |",
              "|---|" + "---|" * len(gammas)]
    for name in report["propose_ms"][gammas[0]]:
        lines.append(f"| {name} | " + " | ".join(f"{report['propose_ms'][g][name]:.3f}" for g in gammas) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
