"""What coupled sampling costs in acceptance against modified rejection sampling, and what deterministic mode costs in
speed, on the shipped default pair (SmolLM2-135M-Instruct and its hybrid draft, the default dtype).

Spec-Bench prompts (the first of each category), one request at a time, chat template, EOS ignored so every system
decodes the same length. Systems run interleaved prompt by prompt; each keeps one planner across prompts, as a server
does. Sampled systems use the same seed per prompt.

- acceptance: rejection vs coupled sampling at T 0.7, at a fixed gamma 4 (acceptance rates compare directly) and under
  gamma auto (the default: tokens per round, tokens per second);
- deterministic mode: tokens per second of gamma auto at T 0.7 (coupled) and T 0 against the default, and for greedy
  how many prompts' speculative tokens differ from plain decoding's, in each mode.

    python benchmarks/coupling.py --prompts 4 --out docs/results/coupling/coupling.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from specsample import SamplingParams, generate
from specsample.datasets import spec_bench_prompts
from specsample.planner import FixedGamma, GammaController
from specsample.speculator import EngineOptions, load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=4, help="Spec-Bench prompts, one per category (at most 13)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    speculator = load(EngineOptions(), say=lambda m: print(m, file=sys.stderr))
    model, drafter = speculator.pair.target.model, speculator.drafter
    tokenizer = speculator.pair.target.tokenizer
    seen, prompts = set(), []
    for p in spec_bench_prompts():
        if p.category not in seen and len(prompts) < args.prompts:
            seen.add(p.category)
            prompts.append(tokenizer.encode(p.turns[0], chat=True))

    sampled = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens)
    greedy = SamplingParams(temperature=0, max_new_tokens=args.max_new_tokens)
    # name -> (params, coupled, deterministic, planner: a new one, or None for plain decoding)
    systems = {
        "rejection, gamma 4": (sampled, False, False, lambda: FixedGamma(4)),
        "coupled, gamma 4": (sampled, True, False, lambda: FixedGamma(4)),
        "rejection, gamma auto": (sampled, False, False, lambda: GammaController(8)),
        "coupled, gamma auto": (sampled, True, False, lambda: GammaController(8)),
        "coupled deterministic, gamma auto": (sampled, True, True, lambda: GammaController(8)),
        "greedy, gamma auto": (greedy, False, False, lambda: GammaController(8)),
        "greedy deterministic, gamma auto": (greedy, True, True, lambda: GammaController(8)),
        "greedy plain": (greedy, False, False, None),
        "greedy deterministic plain": (greedy, True, True, None),
    }
    planners = {name: make() if make else None for name, (_, _, _, make) in systems.items()}
    totals = {name: {"new_tokens": 0, "seconds": 0.0, "drafted": 0, "accepted": 0, "rounds": 0} for name in systems}
    outputs: dict[str, list[list[int]]] = {name: [] for name in systems}
    load_before = os.getloadavg()
    for index, prompt in enumerate(prompts):
        for name, (params, coupled, deterministic, _) in systems.items():
            model.set_deterministic(deterministic)
            planner = planners[name]
            config = replace(
                speculator.spec_config(1),
                coupled=coupled,
                speculative=planner is not None,
                adaptive=isinstance(planner, GammaController),
            )
            start = time.perf_counter()
            result = generate(
                model, [prompt], replace(params, seed=1000 + index), draft=drafter, config=config, planner=planner
            )
            seconds = time.perf_counter() - start
            stats = result.stats
            total = totals[name]
            total["new_tokens"] += stats["new_tokens"]
            total["seconds"] += seconds
            total["drafted"] += stats["drafted"]
            total["accepted"] += stats["accepted"]
            total["rounds"] += stats["rounds"]
            outputs[name].append(result.completions[0].token_ids)
        print(f"prompt {index + 1}/{len(prompts)} done", file=sys.stderr)
    model.set_deterministic(False)

    report = {
        name: {
            **t,
            "tokens_per_second": t["new_tokens"] / t["seconds"],
            "acceptance_rate": t["accepted"] / t["drafted"] if t["drafted"] else None,
            "tokens_per_round": t["new_tokens"] / t["rounds"],
        }
        for name, t in totals.items()
    }

    def differing(a: str, b: str) -> int:
        return sum(x != y for x, y in zip(outputs[a], outputs[b]))

    results = {
        "command": shlex.join(["python", *sys.argv]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, load average before {load_before[0]:.1f}",
        "target": speculator.options.target,
        "draft": speculator.draft,
        "dtype": str(model.dtype),
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "systems": report,
        "greedy_prompts_differing_from_plain": {
            "default": differing("greedy, gamma auto", "greedy plain"),
            "deterministic": differing("greedy deterministic, gamma auto", "greedy deterministic plain"),
        },
        "seeded_prompts_differing": {
            "coupled gamma 4 vs coupled gamma auto": differing("coupled, gamma 4", "coupled, gamma auto"),
            "rejection gamma 4 vs rejection gamma auto": differing("rejection, gamma 4", "rejection, gamma auto"),
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
