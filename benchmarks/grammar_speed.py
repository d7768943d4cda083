"""Speculative decoding speed with and without a JSON-schema grammar, interleaved on the same pair.

Each prompt asks for a JSON record; it is decoded once under `response_format`'s json_schema grammar and once
unconstrained, alternately, `--reps` times at each temperature. Reported: tokens per second of each (median over
the runs), their ratio per prompt and rep (median and range), and the acceptance of each.

    python benchmarks/grammar_speed.py --out docs/results/grammar_speed
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from specsample.config import Grammar, SamplingParams
from specsample.speculator import EngineOptions, load

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "year": {"type": "integer"}, "country": {"type": "string"},
    "known_for": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
    "required": ["name", "year", "country", "known_for"], "additionalProperties": False}
PROMPTS = ["Give a JSON record about Ada Lovelace with her name, birth year, country and what she is known for.",
           "Describe the city of Paris as JSON: name, founding year, country, and three things it is known for.",
           "Return JSON about the Python programming language: name, year created, country, and what it is known for.",
           "Write a JSON object about Marie Curie: name, year of birth, country, and her best-known achievements."]


def decode(engine, prompt: list[int], params: SamplingParams) -> tuple[float, int, int, int]:
    """Seconds, tokens, drafted and accepted tokens of one request."""
    started = time.perf_counter()
    engine.add_request(prompt, params)
    tokens = drafted = accepted = 0
    for result in engine.stream():
        for update in result.rows:
            tokens += len(update.new_tokens)
            drafted += update.num_drafted
            accepted += update.num_accepted
    return time.perf_counter() - started, tokens, drafted, accepted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--draft", default=None, help="draft spec (default: the target alias's)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperatures", default="0,0.7")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", type=Path, default=Path("docs/results/grammar_speed"))
    args = parser.parse_args()
    speculator = load(EngineOptions(target=args.target, draft=args.draft, dtype=args.dtype))
    tokenizer = speculator.pair.target.tokenizer
    engine = speculator.engine(max_batch_size=1, max_seq_len=1024)
    grammar = Grammar.json_schema(SCHEMA)
    report: dict = {"target": args.target, "draft": speculator.draft_spec, "dtype": args.dtype,
                    "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads",
                    "max_new_tokens": args.max_new_tokens, "reps": args.reps, "temperatures": {}}
    decode(engine, tokenizer.encode(PROMPTS[0], chat=True), SamplingParams(temperature=0, max_new_tokens=8,
                                                                          grammar=grammar))  # warm-up, compile
    for temperature in (float(t) for t in args.temperatures.split(",")):
        runs: dict[str, list[tuple[float, int, int, int]]] = {"grammar": [], "free": []}
        ratios = []
        for rep in range(args.reps):
            for i, text in enumerate(PROMPTS):
                prompt = tokenizer.encode(text, chat=True)
                speeds = {}
                for mode in (("grammar", "free") if (rep + i) % 2 == 0 else ("free", "grammar")):  # interleaved
                    params = SamplingParams(temperature=temperature, max_new_tokens=args.max_new_tokens, seed=rep,
                                            grammar=grammar if mode == "grammar" else None)
                    run = decode(engine, prompt, params)
                    runs[mode].append(run)
                    speeds[mode] = run[1] / run[0]
                ratios.append(speeds["grammar"] / speeds["free"])
        ratios.sort()
        report["temperatures"][str(temperature)] = {
            mode: {"tokens_per_second_median": statistics.median(t / s for s, t, _, _ in r),
                   "acceptance": sum(a for *_, a in r) / max(1, sum(d for *_, d, _ in r)),
                   "tokens": sum(t for _, t, _, _ in r)} for mode, r in runs.items()} | {
            "ratio_median": statistics.median(ratios), "ratio_range": [ratios[0], ratios[-1]]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "grammar_speed.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
