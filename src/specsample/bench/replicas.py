"""The replicas suite: the prefix suite's shared-system-prompt workload through `specsample serve --replicas N` on Ray
Serve, whose ingress routes completions by prefix affinity (deploy.py), and through one replica the same way: the
prefix cache's hit rate per replica and overall, read from the deployment's aggregated /metrics.

Each server is started fresh (its own local Ray instance, the bench's engine options, eager, `--max-batch-size` the
number of clients) and sent the same traffic: CLIENTS clients at once, each a streamed chat completion of one system
prompt of --history-tokens and a question of its own, in --prefix-reps waves, every request a question no earlier one
asked. A request's replica is read from its `x-specsample-replica` header; each replica's prefix-cache counters
(requests admitted, those that started from a cached prefix, their prompt tokens and those reused) from the aggregated
/metrics, once it counts every request sent (replicas push their metrics every few seconds).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specsample.bench.context import Bench, Progress, Recorder
from specsample.bench.load import free_port, serve_command, start_server
from specsample.bench.prefix_prompts import CLIENTS, distinct_questions, history_message

COUNTERS = {  # /metrics counter -> the field it is recorded as
    "specsample_prefix_cache_queries_total": "requests",
    "specsample_prefix_cache_hits_total": "hits",
    "specsample_prefix_cache_queried_tokens_total": "prompt_tokens",
    "specsample_prefix_cache_reused_tokens_total": "reused_tokens",
    "specsample_prefix_cache_prefilled_tokens_total": "prefilled_tokens",
}
COUNTERS_TIMEOUT = 60.0  # seconds for every replica's counters to reach /metrics
STOP_SECONDS = 120.0  # a server's Ctrl-C shutdown (Serve, then Ray) before it is killed


def replicas(bench: Bench, store: dict[str, Any], recorder: Recorder) -> None:
    """One replica, then --replicas, each through the whole workload (module docstring)."""
    if importlib.util.find_spec("ray") is None:  # the servers need it (not imported here: it sets up logging)
        raise ValueError("the replicas suite serves on Ray Serve: pip install 'ray[serve]'")
    config, tokenizer = bench.config, bench.tokenizer
    if not tokenizer.has_chat_template:
        raise ValueError(f"{config.engine.target} has no chat template: the replicas suite sends chats")
    system = history_message(tokenizer, config.history_tokens)
    questions = distinct_questions(bench, CLIENTS * config.prefix_reps)
    prompt_tokens = max(
        len(tokenizer.encode_messages([{"role": "system", "content": system}, {"role": "user", "content": q}]))
        for q in questions
    )
    store.update(clients=CLIENTS, waves=config.prefix_reps, system_tokens=prompt_tokens, runs={})
    counts = sorted({1, config.replicas})
    progress = Progress("replicas", len(counts) * (config.prefix_reps + 1))
    for count in counts:
        port = free_port()
        command = serve_command(bench, port, CLIENTS, prompt_tokens + config.max_new_tokens + 8)
        command += ["--replicas", str(count)]
        name = f"{count} replica{'s' if count > 1 else ''}"
        store["runs"][str(count)] = {"server": "specsample " + " ".join(command[3:])}
        recorder.save()
        process = start_server(command, port, Path(config.out) / f"replicas-{count}-server.log")
        try:
            progress.step(f"{name} up")
            run = measure(
                f"http://127.0.0.1:{port}",
                system,
                questions,
                CLIENTS,
                config.max_new_tokens,
                lambda wave: progress.step(f"{name}, wave {wave + 1}"),
            )
        finally:
            _stop(process)
        store["runs"][str(count)].update(run)
        recorder.save()
    progress.close()
    one, many = store["runs"]["1"]["overall"], store["runs"][str(config.replicas)]["overall"]
    if one["requests"] and many["requests"] and one["hits"]:
        store["hit_rate_ratio"] = (many["hits"] / many["requests"]) / (one["hits"] / one["requests"])


def measure(
    url: str,
    system: str,
    questions: list[str],
    clients: int,
    max_tokens: int,
    after_wave: Callable[[int], object] = lambda wave: None,
) -> dict[str, Any]:
    """`questions` sent to the server at `url` in waves of `clients` at once, each a chat of the shared `system` prompt
    and its question: every request's replica and time to first token; per replica and overall, how much its
    prefix-cache counters grew (requests admitted, hits, prompt tokens, those reused and those prefilled)."""
    before = _counters(url)
    requests: list[dict[str, Any]] = []
    for wave, first in enumerate(range(0, len(questions), clients)):
        requests += asyncio.run(_wave(url, system, questions[first : first + clients], max_tokens))
        after_wave(wave)
    deadline = time.monotonic() + COUNTERS_TIMEOUT
    while True:  # replicas push their metrics every few seconds
        grown = {
            replica: {k: v - before.get(replica, {}).get(k, 0.0) for k, v in row.items()}
            for replica, row in _counters(url).items()
        }
        if sum(row["requests"] for row in grown.values()) >= len(requests):
            break
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"/metrics counts fewer than the {len(requests)} requests sent after {COUNTERS_TIMEOUT:g} s"
            )
        time.sleep(1.0)
    overall = {k: sum(row[k] for row in grown.values()) for k in COUNTERS.values()}
    return {"requests": requests, "replicas": grown, "overall": overall}


async def _wave(url: str, system: str, asked: list[str], max_tokens: int) -> list[dict[str, Any]]:
    """Every question at once, each a streamed chat completion after the shared system prompt."""
    import httpx

    async def one(http: httpx.AsyncClient, question: str) -> dict[str, Any]:
        body = {
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
        }
        sent = time.perf_counter()
        first = None
        async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"the server answered {response.status_code}: {(await response.aread())[:300]!r}")
            async for line in response.aiter_lines():
                if first is None and line.startswith("data:") and line != "data: [DONE]":
                    delta = json.loads(line[5:])["choices"][0].get("delta", {})
                    if delta.get("content"):
                        first = time.perf_counter()
        return {"replica": response.headers.get("x-specsample-replica", ""), "ttft": (first or sent) - sent}

    async with httpx.AsyncClient(timeout=httpx.Timeout(3600)) as http:
        return list(await asyncio.gather(*(one(http, q) for q in asked)))


def _counters(url: str) -> dict[str, dict[str, float]]:
    """Each replica's prefix-cache counters on the aggregated /metrics (zeros for a replica that admitted nothing)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=60).text):
        for sample in family.samples:
            if "replica" in sample.labels:
                row = found.setdefault(sample.labels["replica"], dict.fromkeys(COUNTERS.values(), 0.0))
                if sample.name in COUNTERS:
                    row[COUNTERS[sample.name]] += sample.value
    return found


def _stop(process: subprocess.Popen) -> None:
    """Stop a server as Ctrl-C does (Serve and its Ray instance shut down), killing it if that takes too long."""
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=STOP_SECONDS)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
