"""The server's token against `generate`'s: the same prompts decoded at batch 1 by a running `specsample serve`
(streamed over HTTP, as a client sees it) and by the engine `generate` runs, in this process, prompt by prompt in turn.

Both load the same options (the default target, plain decoding unless `--speculative`, temperature 0); the server
gets `--max-batch-size 1`. TPOT is measured where each path's user sees it: from the first streamed token to the
last, over the tokens between. Reports per prompt and overall the median TPOT of each, and the server over
generate with a paired bootstrap 90% interval.

    python benchmarks/serve_vs_generate.py --out docs/results/serve_vs_generate.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

from specsample.bench.context import cpu_name
from specsample.bench.stats import bootstrap
from specsample.config import SamplingParams
from specsample.datasets import spec_bench_prompts
from specsample.options import EngineOptions
from specsample.speculator import load


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, extra: list[str], timeout: float = 600) -> subprocess.Popen:
    command = [sys.executable, "-m", "specsample.cli", "serve", "--port", str(port), "--max-batch-size", "1", *extra]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with status {process.returncode}: {shlex.join(command)}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            time.sleep(1)
    process.kill()
    raise SystemExit(f"the server on port {port} did not answer /health within {timeout:.0f} s")


def served_tpot(port: int, prompt: str, max_tokens: int, speculative: bool) -> tuple[int, float]:
    """Tokens streamed and seconds per token after the first, for one chat request."""
    model = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"][0]["id"]
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "speculative": speculative,
    }
    first = last = None
    tokens = 0
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                last = time.perf_counter()
                first = first or last
    return tokens, (last - first) / max(tokens - 1, 1) if first is not None else 0.0


def generated_tpot(speculator, prompt: str, max_tokens: int, speculative: bool) -> tuple[int, float]:
    """The same through the engine `generate` runs (its chat template, batch 1)."""
    tokenizer = speculator.pair.target.tokenizer
    ids = tokenizer.encode(prompt, chat=True)
    engine = speculator.engine(max_batch_size=1, max_seq_len=len(ids) + max_tokens)
    engine.add_request(ids, SamplingParams(temperature=0.0, max_new_tokens=max_tokens), speculative=speculative)
    first = last = None
    tokens = 0
    for result in engine.stream():
        for update in result.rows:
            if update.new_tokens:
                tokens += len(update.new_tokens)
                last = time.perf_counter()
                first = first or last
    return tokens, (last - first) / max(tokens - 1, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=13, help="Spec-Bench prompts, one per category first")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--speculative", action="store_true", help="the default drafting instead of plain decoding")
    parser.add_argument("--serve-args", default="", help="more flags for `specsample serve`, e.g. --enforce-eager")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    by_category: dict[str, list[str]] = {}
    for p in spec_bench_prompts():
        by_category.setdefault(p.category, []).append(p.turns[0])
    rounds = zip(*by_category.values(), strict=False)  # one per category, then the next of each
    prompts = [prompt for round_ in rounds for prompt in round_][: args.num_prompts]
    port = free_port()
    server = start_server(port, shlex.split(args.serve_args))
    try:
        speculator = load(EngineOptions(speculative=args.speculative))
        for prompt in prompts[:2]:  # both warm up
            served_tpot(port, prompt, 16, args.speculative)
            generated_tpot(speculator, prompt, 16, args.speculative)
        rows = []
        for i, prompt in enumerate(prompts):
            order = ("serve", "generate") if i % 2 == 0 else ("generate", "serve")
            measured = {}
            for path in order:
                if path == "serve":
                    measured[path] = served_tpot(port, prompt, args.max_new_tokens, args.speculative)
                else:
                    measured[path] = generated_tpot(speculator, prompt, args.max_new_tokens, args.speculative)
            rows.append(measured)
            print(f"prompt {i}: " + ", ".join(f"{p} {1e3 * t:.2f} ms ({n} tokens)" for p, (n, t) in measured.items()))
    finally:
        server.terminate()
        server.wait(timeout=30)
    pairs = [("prompt", {p: (n, t * max(n - 1, 1)) for p, (n, t) in row.items()}) for row in rows]
    interval = bootstrap(pairs, lambda speeds: {"serve/generate": speeds["generate"] / speeds["serve"]})[
        "serve/generate"
    ]
    result = {
        "command": "python " + shlex.join(sys.argv),
        "machine": f"{cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, {platform.python_version()}",
        "speculative": args.speculative,
        "serve_args": args.serve_args,
        "tpot_ms": {
            path: {
                "p50": 1e3 * statistics.median(r[path][1] for r in rows),
                "per_prompt": [1e3 * r[path][1] for r in rows],
            }
            for path in ("generate", "serve")
        },
        "serve_over_generate": interval["overall"],  # TPOT ratio: point, low, high
    }
    print(json.dumps({k: result[k] for k in ("tpot_ms", "serve_over_generate")}, indent=1))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
