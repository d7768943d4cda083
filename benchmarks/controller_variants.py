"""gamma auto's knobs on real timings: fixed gammas and controller variants, round by round, on tuning prompts.

Replays (benchmarks/adaptive_replay.py) charge modelled round costs with mild timing noise (5%); on a shared box
rounds stray more, in slow stretches, and the controller's round-cost estimates and its choices between gammas
feel that. Here target-only, fixed gammas and gamma auto under each `--variant` (ControllerConfig knobs)
decode the same replies taking turns round by round in an order drawn afresh every round (`run_lockstep`), on
tuning prompts only (HumanEval and ShareGPT: never Spec-Bench, the benchmark). Each variant keeps one controller over the whole run, as a server does.

    python benchmarks/controller_variants.py --humaneval 40 --sharegpt 40 --variant default --variant nogate:gate=false
    python benchmarks/controller_variants.py --models tiny --replies 4 --variant default --variant h1:hysteresis=0.01

Tokens/s per group (coding = HumanEval, chat = ShareGPT), each variant over the best fixed gamma run and over
target-only, and tokens per round.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time
from collections import defaultdict
from pathlib import Path

import torch
from tqdm import tqdm

from adaptive import make_systems, parse_variant  # a sibling script: its systems, with the variants added
from specsample.bench.report import command_line
from specsample.bench.systems import run_lockstep
from specsample.config import SamplingParams, SpecConfig
from specsample.drafters.model import ModelDrafter
from specsample.models.tiny import tiny_lm


def tables(totals: dict, systems: list[str], fixed: list[str]) -> list[str]:
    """Markdown: tokens/s per group, and each variant over the best fixed gamma and over target-only."""
    groups = sorted({g for (_, g) in totals} - {"all"}) + ["all"]
    rate = {key: tokens / seconds for key, (tokens, seconds, _) in totals.items() if seconds > 0}
    lines = ["| system | " + " | ".join(groups) + " | tokens per round (all) |", "|---|" + "---|" * (len(groups) + 1)]
    for s in systems:
        tokens, _, rounds = totals[(s, "all")]
        lines.append(f"| {s} | " + " | ".join(f"{rate[(s, g)]:.2f}" for g in groups) + f" | {tokens / max(rounds, 1):.3f} |")
    lines += ["", "| variant | " + " | ".join(f"{g}: / best fixed, / target-only" for g in groups) + " |",
              "|---|" + "---|" * len(groups)]
    for s in systems:
        if s == "target-only" or s in fixed:
            continue
        cells = []
        for g in groups:
            best = max(rate[(f, g)] for f in fixed)
            cells.append(f"{rate[(s, g)] / best:.3f}, {rate[(s, g)] / rate[('target-only', g)]:.3f}")
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", choices=("shipped", "tiny"), default="shipped",
                        help="the shipped SmolLM2 pair on tuning prompts, or tiny random models (a smoke run)")
    parser.add_argument("--humaneval", type=int, default=40, help="shipped: HumanEval prompts (group coding)")
    parser.add_argument("--sharegpt", type=int, default=40, help="shipped: ShareGPT prompts (group chat)")
    parser.add_argument("--replies", type=int, default=8, help="tiny: replies per group")
    parser.add_argument("--samples", type=int, default=1, help="replies sampled per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--fixed", default="2", help="comma-separated fixed gammas to run (the best is the bar)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME[:KEY=VALUE,...]",
                        help="a gamma auto system with these ControllerConfig knobs (repeat; 'default': none)")
    parser.add_argument("--out", type=Path, default=None, help="also write the result here (.json, and .md beside)")
    args = parser.parse_args()
    try:
        variants = [parse_variant(v) for v in args.variant]
        fixed = [int(g) for g in args.fixed.split(",") if g]
    except ValueError as error:
        parser.error(str(error))
    if not variants or not fixed or len({n for n, _ in variants}) != len(variants):
        parser.error("give at least one --variant (names distinct) and one --fixed gamma")
    if not 1 <= min(fixed) <= max(fixed) <= 8 or min(args.samples, args.max_new_tokens, args.replies) < 1 \
            or args.temperature < 0:
        parser.error("--fixed gammas must be in 1..8, --samples, --max-new-tokens and --replies >= 1, "
                     "--temperature >= 0")

    widths: tuple[int, ...] = ()
    if args.models == "tiny":
        torch.set_num_threads(1)
        target = tiny_lm(64, seed=1, init_scale=0.2, dtype=torch.float32)
        draft = ModelDrafter(tiny_lm(64, seed=2, init_scale=0.2, num_layers=1, dtype=torch.float32))
        eos: frozenset[int] = frozenset()
        rng = random.Random(0)
        groups = [(g, [rng.randrange(64) for _ in range(12)]) for g in ("coding", "chat") for _ in range(args.replies)]
    else:
        from specsample.bench.run import encode_fitting, load_model_draft_pair, load_prompts
        from specsample.models.row_padding import with_target_widths

        pair = load_model_draft_pair("smollm2-135m-instruct", None)
        target, draft, eos = pair.target.model, pair.drafter, pair.target.tokenizer.eos_token_ids
        chosen = [dataclasses.replace(p, category="coding") for p in load_prompts("humaneval", args.humaneval, 0)]
        chosen += [dataclasses.replace(p, category="chat") for p in load_prompts("sharegpt", args.sharegpt, 0)]
        kept, ids = encode_fitting(chosen, pair.target.tokenizer, target.max_seq_len, args.max_new_tokens)
        groups = [(p.category, x) for p, x in zip(kept, ids)]
        widths = with_target_widths(SpecConfig(gamma=8), target, "auto").target_widths
    max_len = max(len(x) for _, x in groups) + args.max_new_tokens + 16
    systems = make_systems(["target-only", *(f"gamma={g}" for g in fixed)], target, draft, eos, max_len, widths,
                           variants=variants)
    replies = [(i + k * len(groups), group, x) for i, (group, x) in enumerate(groups) for k in range(args.samples)]
    random.Random(0).shuffle(replies)  # groups mixed, as a server sees them
    totals: dict[tuple[str, str], list] = defaultdict(lambda: [0, 0.0, 0])  # tokens, seconds, rounds
    started = time.time()
    for seed, group, prompt in tqdm(replies, desc="controller variants"):
        params = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens, seed=seed)
        for system, records in zip(systems, run_lockstep(systems, [prompt], params, random.Random(seed))):
            for key in ((system.name, group), (system.name, "all")):
                totals[key][0] += len(records[0].tokens)
                totals[key][1] += records[0].seconds
                totals[key][2] += len(records[0].timing.rounds)
    names = [s.name for s in systems]
    command = command_line("benchmarks/controller_variants.py", args)
    lines = [f"Command: `{command}`", "",
             f"{len(replies)} replies, temperature {args.temperature}, {args.max_new_tokens} tokens each, "
             f"{(time.time() - started) / 60:.0f} min; systems take turns round by round in a shuffled order.", "",
             *tables(totals, names, [f"gamma={g}" for g in fixed])]
    print("\n".join(lines))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"command": command, "variants": {n: dataclasses.asdict(c) for n, c in variants},
                                        "totals": {f"{s}|{g}": v for (s, g), v in totals.items()}}))
        args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
