"""The load suite: a concurrency sweep through a real `specsample serve`, speculation (the server's default) against
plain decoding (`"speculative": false`).

One server runs the whole sweep, with `--max-batch-size` the largest concurrency and compiled or eager as the bench's
engine options say (`--compile` / `--enforce-eager`). At each concurrency N, N clients each stream `REQUESTS_PER_CLIENT`
chat completions one after another; a phase is one such round of both modes' traffic in one mode, and the phases
alternate default / plain, `PHASES` each, the order rotating, so the host's drift hits both alike. Every request sends
`ignore_eos` and `min_tokens` = `max_tokens` (what vLLM's `bench serve` sends), so both modes decode the same number of
tokens whatever they sample. Every phase sends prompts no earlier phase sent (`_Prompts`; spread over the categories,
taken in turn): a prompt answered before would be drafted from its earlier answer by the server's suffix cache, a gain
no new traffic sees. Reported per concurrency and mode: output tokens/s (tokens over the phases' wall time),
TPOT and TTFT p50 and p99, each with a bootstrap interval (requests resampled; throughput: phases resampled per mode).
"""

from __future__ import annotations

import asyncio
import functools
import random
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specsample.bench.config import spread
from specsample.bench.context import Bench, Progress, Recorder
from specsample.metrics import percentile

MODES = ("default", "plain")  # the server's default (speculation as the planner decides) and "speculative": false
REQUESTS_PER_CLIENT = 2
PHASES = 2  # phases per mode and concurrency
START_TIMEOUT = 900.0  # seconds the server may take to come up (a compiled one warms up first)
RESAMPLES = 1000
LEVEL = 0.9


class _Prompts:
    """Prompt texts handed out in order, each once while they last, then again from the first (counted in `reused`)."""

    def __init__(self, texts: list[str]) -> None:
        self.texts, self.given, self.reused = texts, 0, 0

    def take(self, count: int) -> list[str]:
        out = [self.texts[(self.given + k) % len(self.texts)] for k in range(count)]
        self.reused += max(0, min(count, self.given + count - len(self.texts)))
        self.given += count
        return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(bench: Bench, port: int, max_batch: int, max_len: int) -> list[str]:
    """`specsample serve` for the bench's target and draft, dtype, quantization and compile setting."""
    engine = bench.config.engine
    command = [sys.executable, "-m", "specsample.cli", "serve", "--model", engine.target, "--port", str(port)]
    if engine.draft is not None:
        command += ["--speculative-model", engine.draft]
    command += ["--dtype", engine.dtype, "--quantize", engine.quantize]
    command += ["--max-batch-size", str(max_batch), "--max-model-len", str(max_len)]
    command += ["--compile" if engine.compile else "--enforce-eager"]
    return command


def start_server(command: list[str], port: int, log: Path) -> subprocess.Popen:
    """Start the server (its output to `log`) and wait for /health."""
    import httpx

    with log.open("w") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with status {process.returncode}; its log: {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"the server did not come up within {START_TIMEOUT:g} s; its log: {log}")


class _Traffic:
    """What every request of a phase asks: the served model, its temperature and its (fixed) output length."""

    def __init__(self, model: str, temperature: float, tokens: int) -> None:
        self.model, self.temperature, self.tokens = model, temperature, tokens


async def _request(client: Any, text: str, mode: str, traffic: _Traffic, seed: int) -> dict[str, Any]:
    """One streamed chat completion: its time to first token, time per output token after it, tokens."""
    sent = time.perf_counter()
    first = None
    count = 0
    stream = await client.chat.completions.create(
        model=traffic.model,
        messages=[{"role": "user", "content": text}],
        max_tokens=traffic.tokens,
        temperature=traffic.temperature,
        seed=seed,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "min_tokens": traffic.tokens, "speculative": mode == "default"},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content and first is None:
            first = time.perf_counter()
        if chunk.usage:
            count = chunk.usage.completion_tokens
    done = time.perf_counter()
    first = first if first is not None else done
    return {"ttft": first - sent, "tpot": (done - first) / max(count - 1, 1), "tokens": count}


async def _phase(
    url: str, texts: list[str], seeds: list[int], mode: str, clients: int, cfg: _Traffic
) -> dict[str, Any]:
    """`clients` clients, client c sending texts c, c + clients, ... one after another; the phase's wall time."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=3600)

    async def one_client(c: int) -> list[dict[str, Any]]:
        return [await _request(client, texts[i], mode, cfg, seeds[i]) for i in range(c, len(texts), clients)]

    start = time.perf_counter()
    try:
        done = await asyncio.gather(*(one_client(c) for c in range(clients)))
    finally:
        await client.close()
    return {"seconds": time.perf_counter() - start, "requests": [r for rows in done for r in rows]}


def _interval(values: list[Any], statistic: Callable[[list[Any]], float], rng: random.Random) -> list[float | None]:
    """[point, low, high]: `statistic` of `values` and its bootstrap interval (None bounds under 2 values)."""
    point = statistic(values)
    if len(values) < 2:
        return [point, None, None]
    draws = sorted(statistic([rng.choice(values) for _ in values]) for _ in range(RESAMPLES))
    return [point, draws[int((1 - LEVEL) / 2 * RESAMPLES)], draws[min(RESAMPLES - 1, int((1 + LEVEL) / 2 * RESAMPLES))]]


def _percentile_of(values: list[float], q: float) -> float:
    return percentile(values, q)


def _speed(pairs: list[tuple[float, float]]) -> float:
    """Tokens per second over (tokens, seconds) pairs."""
    return sum(t for t, _ in pairs) / sum(s for _, s in pairs)


def summarise(phases: list[dict[str, Any]], seed: int = 0) -> dict[str, Any]:
    """Per mode: throughput, TPOT and TTFT p50/p99 with intervals; and default over plain throughput."""
    rng = random.Random(seed)
    out: dict[str, Any] = {}
    by_mode = {mode: [p for p in phases if p["mode"] == mode] for mode in MODES}
    for mode, runs in by_mode.items():
        if not runs:
            continue
        requests = [r for p in runs for r in p["requests"]]
        pairs = [(sum(r["tokens"] for r in p["requests"]), p["seconds"]) for p in runs]
        out[mode] = {
            "tokens_per_s": _interval(pairs, _speed, rng),
            **{
                f"{key}_p{q}_ms": _interval(
                    [r[key] * 1000 for r in requests], functools.partial(_percentile_of, q=q), rng
                )
                for key in ("tpot", "ttft")
                for q in (50, 99)
            },
            "requests": len(requests),
        }
    if all(by_mode.values()):
        per_mode = {m: [(sum(r["tokens"] for r in p["requests"]), p["seconds"]) for p in by_mode[m]] for m in MODES}

        def speed(ps: list[tuple[float, float]]) -> float:
            return sum(t for t, _ in ps) / sum(s for _, s in ps)

        point = speed(per_mode["default"]) / speed(per_mode["plain"])
        draws = sorted(
            speed([rng.choice(per_mode["default"]) for _ in per_mode["default"]])
            / speed([rng.choice(per_mode["plain"]) for _ in per_mode["plain"]])
            for _ in range(RESAMPLES)
        )
        low, high = int((1 - LEVEL) / 2 * RESAMPLES), min(RESAMPLES - 1, int((1 + LEVEL) / 2 * RESAMPLES))
        both = min(len(per_mode["default"]), len(per_mode["plain"])) >= 2
        out["ratio"] = [point, draws[low] if both else None, draws[high] if both else None]
    return out


def load(bench: Bench, store: dict[str, Any], recorder: Recorder) -> None:
    """The sweep at every --concurrency and --temperature (module docstring); rows saved after every phase."""
    config = bench.config
    tokenizer = bench.speculator.pair.target.tokenizer
    if tokenizer is None or not tokenizer.has_chat_template:
        raise ValueError(f"{config.engine.target} has no chat template: the load suite sends chats")
    largest = max(config.concurrency)
    indices = spread(list(range(len(bench.prompts))), len(bench.prompts), lambda i: bench.prompts[i].category)
    texts_all = [bench.prompts[i].turns[0] for i in indices]
    longest = max(len(tokenizer.encode(t, chat=True)) for t in texts_all)
    port = free_port()
    command = serve_command(bench, port, largest, longest + config.max_new_tokens + 8)
    log = Path(config.out) / "load-server.log"
    store.update(
        server="specsample " + " ".join(command[3:]),
        compiled=config.engine.compile,
        concurrency=list(config.concurrency),
        requests_per_client=REQUESTS_PER_CLIENT,
        phases_per_mode=PHASES,
        max_tokens=config.max_new_tokens,
        runs={},
    )
    recorder.save()
    process = start_server(command, port, log)
    url = f"http://127.0.0.1:{port}"
    try:
        import httpx

        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        prompts = _Prompts(texts_all)
        steps = len(config.temperatures) * len(config.concurrency) * PHASES * len(MODES)
        progress = Progress("load", steps)
        for temperature in config.temperatures:
            rows = store["runs"].setdefault(str(temperature), [])
            traffic = _Traffic(model, temperature, config.max_new_tokens)
            for clients in config.concurrency:
                count = clients * REQUESTS_PER_CLIENT
                seeds = [config.seed + k for k in range(count)]
                row: dict[str, Any] = {"concurrency": clients, "phases": []}
                rows.append(row)
                for rep in range(PHASES):
                    order = MODES if (rep + clients) % 2 == 0 else MODES[::-1]
                    for mode in order:
                        texts = prompts.take(count)
                        store["reused_prompts"] = prompts.reused
                        phase = asyncio.run(_phase(url, texts, seeds, mode, clients, traffic))
                        short = [r["tokens"] for r in phase["requests"] if r["tokens"] != config.max_new_tokens]
                        if short:
                            raise RuntimeError(f"requests returned {short} tokens, not {config.max_new_tokens}")
                        row["phases"].append({"mode": mode, "rep": rep, **phase})
                        row["summary"] = summarise(row["phases"], config.seed)
                        recorder.save()
                        ratio = row["summary"].get("ratio")
                        progress.step(
                            f"T={temperature} N={clients} {mode} rep {rep}"
                            + (f": default/plain {ratio[0]:.2f}x" if ratio else "")
                        )
        progress.close()
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
