"""Load test of `specsample serve` with and without the draft: ShareGPT prompts at fixed request rates.

Starts two servers (speculative, and `--speculative-model none`), then for each rate replays the same
Poisson arrival schedule against each in turn, streaming with the async `openai` client. Reports
throughput, TTFT and TPOT p50/p99 per rate, and the rate above which speculation stops paying.

    python benchmarks/serve_load.py --rates 0.25,0.5,1,2,4 --requests 24 --out docs/results/serve_load.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

from specsample.datasets import sharegpt_prompts
from specsample.metrics import percentile


def start_server(model: str, draft: str | None, port: int, max_batch: int) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "specsample.cli",
        "serve",
        "--model",
        model,
        "--port",
        str(port),
        "--max-batch-size",
        str(max_batch),
        "--max-model-len",
        "1024",
    ]
    if draft:
        command += ["--speculative-model", draft]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            time.sleep(1)
    process.kill()
    raise SystemExit(f"server on port {port} did not come up")


async def one_request(client: openai.AsyncOpenAI, model: str, prompt: str, max_tokens: int) -> dict:
    sent = time.perf_counter()
    stamps = []
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0.7,
        stream=True,
        stream_options={"include_usage": True},
    )
    tokens = 0
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    done = time.perf_counter()
    ttft = stamps[0] - sent if stamps else None
    tpot = (done - stamps[0]) / max(tokens - 1, 1) if stamps else None
    return {"ttft": ttft, "tpot": tpot, "tokens": tokens, "sent": sent, "done": done}


async def run_rate(port: int, model: str, prompts: list[str], rate: float, max_tokens: int, seed: int) -> dict:
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=600)
    rng = random.Random(seed)
    tasks, started = [], time.perf_counter()
    for prompt in prompts:
        tasks.append(asyncio.ensure_future(one_request(client, model, prompt, max_tokens)))
        await asyncio.sleep(rng.expovariate(rate))  # Poisson arrivals, the same schedule for both servers
    results = await asyncio.gather(*tasks)
    wall = max(r["done"] for r in results) - started
    ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
    tpots = [r["tpot"] for r in results if r["tpot"] is not None]
    return {
        "rate": rate,
        "requests": len(results),
        "tokens": sum(r["tokens"] for r in results),
        "wall_s": wall,
        "throughput_tok_s": sum(r["tokens"] for r in results) / wall,
        "ttft_p50_ms": 1000 * percentile(ttfts, 50),
        "ttft_p99_ms": 1000 * percentile(ttfts, 99),
        "tpot_p50_ms": 1000 * percentile(tpots, 50),
        "tpot_p99_ms": 1000 * percentile(tpots, 99),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--draft", default=None, help="draft for the speculative server (default: the alias's)")
    parser.add_argument("--rates", default="0.25,0.5,1,2,4")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("docs/results/serve_load.json"))
    args = parser.parse_args()

    prompts = [p.turns[0][:1500] for p in sharegpt_prompts(skip=16500, limit=args.requests)]
    rates = [float(r) for r in args.rates.split(",")]
    servers = {
        "speculative": start_server(args.model, args.draft, 8101, args.max_batch_size),
        "plain": start_server(args.model, "none", 8102, args.max_batch_size),
    }
    ports = {"speculative": 8101, "plain": 8102}
    rows = []
    try:
        for rate in rates:
            for mode in ("speculative", "plain"):
                row = asyncio.run(
                    run_rate(ports[mode], args.model, prompts, rate, args.max_tokens, seed=int(rate * 1000))
                )
                row["mode"] = mode
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        for process in servers.values():
            process.terminate()
            process.wait(timeout=30)
    pays = [
        r
        for r in rates
        if next(x for x in rows if x["rate"] == r and x["mode"] == "speculative")["tpot_p50_ms"]
        < next(x for x in rows if x["rate"] == r and x["mode"] == "plain")["tpot_p50_ms"]
    ]
    stops_paying = next((r for r in rates if r not in pays), None)
    report = {
        "command": shlex.join(["python", *sys.argv]),
        "cpu_count": os.cpu_count(),
        "rows": rows,
        "speculation_stops_paying_at_rate": stops_paying,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    lines = [
        f"Command: `{report['command']}`",
        "",
        "| rate (req/s) | mode | throughput tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['rate']} | {r['mode']} | {r['throughput_tok_s']:.1f} | {r['ttft_p50_ms']:.0f} | "
            f"{r['ttft_p99_ms']:.0f} | {r['tpot_p50_ms']:.1f} | {r['tpot_p99_ms']:.1f} |"
        )
    lines += [
        "",
        f"Speculation stops paying (TPOT p50 no better than plain) at: "
        f"{stops_paying if stops_paying is not None else 'never, in the rates tried'} req/s",
    ]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    _plot(rows, rates, args.out.with_suffix(".png"))
    print("\n".join(lines))


def _plot(rows: list[dict], rates: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for mode in ("speculative", "plain"):
        mine = [r for r in rows if r["mode"] == mode]
        left.plot(rates, [r["throughput_tok_s"] for r in mine], "o-", label=mode)
        right.plot(rates, [r["tpot_p50_ms"] for r in mine], "o-", label=f"{mode} p50")
        right.plot(rates, [r["tpot_p99_ms"] for r in mine], "x:", label=f"{mode} p99")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("request rate (req/s)")
        ax.legend()
    left.set_ylabel("throughput (tokens/s)")
    right.set_ylabel("time per output token (ms)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
