"""What a draft model should attend to: its acceptance with the whole context against DraftWindow views.

    python benchmarks/draft_window.py --out docs/draft_window.json

The target answers each tuning prompt greedily (sharegpt and sharegpt-hard: never Spec-Bench); both
models then score the reply teacher-forced, the draft once per window (specsample.bench.replay's
reply_logits, which sees what a windowed ModelDrafter sees). It also times the draft's prefill (what a
request pays before its first round) by prompt length, interleaved with the target's, at the end. Per reply token it counts greedy agreement
(the draft's argmax is the target's) and the acceptance rate at temperature 0.7 (sum of min(p, q) over
the vocabulary), and averages them per reply, grouped by prompt length. The shipped draft was trained
on sequences of at most 512 tokens (docs/draft.md), so long prompts are where a window can matter.
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
from tqdm import tqdm

from specsample.api import generate
from specsample.bench.replay import reply_logits
from specsample.bench.run import encode_fitting, load_model_draft_pair, load_prompts
from specsample.config import SamplingParams, SpecConfig
from specsample.drafters.model import DraftWindow
from specsample.sampling import warp_probs

WINDOWS = {"whole context": None, **{f"sink {s}, recent {r}": DraftWindow(sink=s, recent=r, limit=512)
                                     for s, r in ((0, 256), (4, 256), (32, 64), (32, 128), (32, 256), (32, 384))}}
LENGTHS = ((0, 256), (256, 512), (512, 800), (800, 100_000))
PREFILL_TOKENS = (64, 288, 512, 768, 1024)  # 288: what the shipped window keeps (32 + 256)


def time_prefills(models: dict, repeats: int = 7) -> dict[str, dict[int, float]]:
    """Median seconds of each model's prefill of PREFILL_TOKENS tokens (interleaved; first pass warms up)."""
    times: dict[str, dict[int, list[float]]] = {name: {n: [] for n in PREFILL_TOKENS} for name in models}
    tokens = torch.randint(0, 1000, (1, max(PREFILL_TOKENS)), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        for rep in range(repeats + 1):
            for n in PREFILL_TOKENS:
                for name, model in models.items():
                    cache = model.new_cache(1, n)
                    start = time.perf_counter()
                    model.prefill(tokens[:, :n].to(model.device), cache, torch.tensor([0]))
                    if rep:
                        times[name][n].append(time.perf_counter() - start)
    return {name: {n: statistics.median(v) for n, v in per.items()} for name, per in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--draft", default=None, help="draft spec (default: the alias's)")
    parser.add_argument("--sharegpt", type=int, default=120, help="ShareGPT prompts (besides 30 of each hard kind)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("docs/draft_window.json"))
    args = parser.parse_args()
    pair = load_model_draft_pair(args.target, args.draft, "off")
    tokenizer, target, draft = pair.target.tokenizer, pair.target.model, pair.drafter.model
    prompts, ids = encode_fitting(load_prompts("sharegpt-hard", 30, 0) + load_prompts("sharegpt", args.sharegpt, 0),
                                  tokenizer, target.max_seq_len, args.max_new_tokens)
    greedy = SamplingParams(temperature=0, max_new_tokens=args.max_new_tokens)
    warm = SamplingParams(temperature=0.7)
    rows = []
    for prompt, prompt_ids in tqdm(list(zip(prompts, ids)), desc="replies"):
        result = generate(target, [prompt_ids], greedy,
                          config=SpecConfig(speculative=False), eos_token_ids=tokenizer.eos_token_ids)
        reply = result.completions[0].token_ids
        if len(reply) < 8:
            continue  # too short to say anything
        with torch.inference_mode():
            target_logits = reply_logits(target, prompt_ids, reply)
            row = {"kind": prompt.category, "prompt_tokens": len(prompt_ids), "reply_tokens": len(reply)}
            for name, window in WINDOWS.items():
                draft_logits = reply_logits(draft, prompt_ids, reply, window)
                agree = (draft_logits.argmax(-1) == target_logits.argmax(-1)).float().mean()
                alpha = torch.minimum(warp_probs(target_logits, warm), warp_probs(draft_logits, warm)).sum(-1).mean()
                row[name] = [float(agree), float(alpha)]
        rows.append(row)
    table = []
    for low, high in LENGTHS:
        group = [r for r in rows if low <= r["prompt_tokens"] < high]
        if group:
            table.append({"prompt_tokens": [low, high], "replies": len(group),
                          **{name: [statistics.mean(r[name][k] for r in group) for k in (0, 1)] for name in WINDOWS}})
    prefill = time_prefills({"target": target, "draft": draft})
    report = {"command": "python benchmarks/draft_window.py " + " ".join(sys.argv[1:]),
              "machine": {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__},
              "draft": pair.draft_spec, "windows": {n: None if w is None else [w.sink, w.recent, w.limit]
                                                    for n, w in WINDOWS.items()},
              "by_prompt_length": table, "prefill_seconds": prefill, "replies": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    markdown = [f"Command: `{report['command']}`", "",
                f"Draft `{pair.draft_spec}`; per cell: greedy agreement / acceptance at temperature 0.7, mean over "
                "replies (the target's greedy replies to sharegpt and sharegpt-hard prompts).", "",
                "| prompt tokens | replies | " + " | ".join(WINDOWS) + " |", "|---|---|" + "---|" * len(WINDOWS)]
    for t in table:
        low, high = t["prompt_tokens"]
        span = f"{low}-{high - 1}" if high < 100_000 else f"{low}+"
        markdown.append(f"| {span} | {t['replies']} | " + " | ".join(f"{t[n][0]:.3f} / {t[n][1]:.3f}" for n in WINDOWS) + " |")
    markdown += ["", "Prefill, median ms (the draft's is what a request pays for drafting before its first round):", "",
                 "| model | " + " | ".join(f"{n} tokens" for n in PREFILL_TOKENS) + " |", "|---|" + "---|" * len(PREFILL_TOKENS)]
    for name, per in prefill.items():
        markdown.append(f"| {name} | " + " | ".join(f"{per[n] * 1000:.1f}" for n in PREFILL_TOKENS) + " |")
    args.out.with_suffix(".md").write_text("\n".join(markdown) + "\n")
    print("\n".join(markdown))


if __name__ == "__main__":
    main()
