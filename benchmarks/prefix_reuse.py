"""Time to first token of a second chat turn with a long history, with and without prefix reuse.

A first turn whose user message is ~1,000 tokens of Spec-Bench questions is answered (greedy, `--reply` tokens);
the second turn (the history, the reply and a short follow-up) is then timed from `add_request` to its first
committed token, on an engine that kept the first turn's row (`prefix_cache_rows=1`) and on one that did not (0).
Both engines run the same pair through `speculator.load`, one rep of each interleaved with the other.

    python benchmarks/prefix_reuse.py --out docs/results/prefix_reuse
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from specsample.config import SamplingParams
from specsample.datasets import spec_bench_prompts
from specsample.speculator import EngineOptions, load

FOLLOW_UP = "Thank you. Now summarise your answer in one sentence."


def history_text(tokenizer, tokens: int) -> str:
    """Spec-Bench questions, joined until the chat-rendered message holds about `tokens` tokens."""
    parts: list[str] = []
    for prompt in spec_bench_prompts():
        for turn in prompt.turns:
            parts.append(turn)
            if len(tokenizer.encode("\n\n".join(parts), chat=True)) >= tokens:
                return "\n\n".join(parts)
    return "\n\n".join(parts)


def first_token_seconds(engine, prompt: list[int], params: SamplingParams) -> tuple[float, list[int], dict]:
    """Seconds from submission to the first committed token, the whole reply, and the admission's counters."""
    started = time.perf_counter()
    engine.add_request(prompt, params)
    first, tokens, admission = None, [], {}
    for result in engine.stream():
        if result.stats.admitted:
            admission = {"prefix_hits": result.stats.prefix_hits, "reused_tokens": result.stats.reused_tokens,
                         "prompt_tokens": result.stats.admitted_tokens + 1}
        for update in result.rows:
            if update.new_tokens and first is None:
                first = time.perf_counter() - started
            tokens.extend(update.new_tokens)
    return first, tokens, admission


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--draft", default=None, help="draft spec (default: the target alias's)")
    parser.add_argument("--history-tokens", type=int, default=1000)
    parser.add_argument("--reply", type=int, default=32, help="tokens of the first turn's reply")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", type=Path, default=Path("docs/results/prefix_reuse"))
    args = parser.parse_args()
    speculator = load(EngineOptions(target=args.target, draft=args.draft, dtype=args.dtype))
    tokenizer = speculator.pair.target.tokenizer
    messages = [{"role": "user", "content": history_text(tokenizer, args.history_tokens)}]
    first_turn = tokenizer.encode_messages(messages)
    params = SamplingParams(temperature=0, max_new_tokens=args.reply)
    runs: dict[str, list[float]] = {"reuse": [], "no_reuse": []}
    admissions: dict[str, dict] = {}
    second_turn: list[int] = []
    for _ in range(args.reps):
        for mode, kept in (("reuse", 1), ("no_reuse", 0)):  # interleaved
            engine = speculator.engine(max_batch_size=1, max_seq_len=2048, prefix_cache_rows=kept)
            _, reply, _ = first_token_seconds(engine, first_turn, params)
            turn = messages + [{"role": "assistant", "content": tokenizer.decode(reply)},
                               {"role": "user", "content": FOLLOW_UP}]
            second_turn = tokenizer.encode_messages(turn)
            seconds, _, admissions[mode] = first_token_seconds(engine, second_turn, params)
            runs[mode].append(seconds)
    medians = {mode: statistics.median(times) for mode, times in runs.items()}
    ratios = sorted(a / b for a, b in zip(runs["no_reuse"], runs["reuse"]))
    report = {
        "target": args.target, "draft": speculator.draft_spec, "dtype": args.dtype,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads",
        "first_turn_tokens": len(first_turn), "second_turn_tokens": len(second_turn), "reply_tokens": args.reply,
        "reps": args.reps, "ttft_seconds": runs, "ttft_median_seconds": medians,
        "speedup_median": statistics.median(ratios), "speedup_range": [ratios[0], ratios[-1]],
        "admission": admissions,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefix_reuse.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
