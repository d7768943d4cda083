"""Closed-loop load on a live server (tiny models, loopback): 8 clients for two minutes, a poisoned request every
10 s. Run with `pytest -m load` (excluded by default). No healthy request may be lost, resident memory may grow by
at most RSS_BOUND_MIB after warm-up, and the p99 latency is printed and written to docs/results/load.json."""

from __future__ import annotations

import asyncio
import json
import os
import platform
import random
import time
from pathlib import Path

import httpx
import pytest

import specsample.engine as engine_module
from live_server import LiveServer
from model_factory import make_tokenizer, write_hf_model
from specsample.server.app import SpecServer
from specsample.server.options import ServerOptions
from specsample.speculator import EngineOptions, load

pytestmark = pytest.mark.load

SECONDS = float(os.environ.get("SPECSAMPLE_LOAD_SECONDS", 120))
CONCURRENCY = 8
POISON_EVERY = 10.0
WARM_UP = 15.0  # seconds before the memory baseline is taken
RSS_BOUND_MIB = 64  # most resident-memory growth allowed between the end of warm-up and the end of the run
POISON = [7, 11, 13, 17, 19, 23]
PROMPTS = ["the quick brown fox", "hello world", "speculative sampling", "the lazy dog jumps", "tokens for tests",
           "a tiny language model", "over the quick dog", "world hello fox"]
RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results" / "load.json"


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


async def _one(client: httpx.AsyncClient, body: dict) -> tuple[bool, str | None]:
    """Whether the request completed (200, and a stream ended with [DONE]), and its finish_reason."""
    if not body["stream"]:
        response = await client.post("/v1/completions", json=body)
        if response.status_code != 200:
            return False, None
        return True, response.json()["choices"][0]["finish_reason"]
    finish, done = None, False
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            return False, None
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                finish = json.loads(line[6:])["choices"][0]["finish_reason"] or finish
    return done, finish


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    root = tmp_path_factory.mktemp("load")
    tokenizer = make_tokenizer()
    target = write_hf_model(root / "target", "llama", tokenizer=tokenizer, max_position_embeddings=128)
    draft = write_hf_model(root / "draft", "llama", tokenizer=tokenizer, seed=3, num_hidden_layers=1)
    speculator = load(EngineOptions(target=str(target), draft=str(draft), gamma="auto", max_gamma=4, dtype="float32"))
    server = LiveServer(SpecServer(speculator, ServerOptions(model_name="tiny", max_batch_size=CONCURRENCY,
                                                             max_model_len=128)))
    yield server
    server.close()


def test_closed_loop_load_with_poisoned_requests(live, monkeypatch) -> None:
    engine = live.server.engine
    original = engine_module.score_padded

    def score(model, tokens, cache, slots, width, features=False):  # the poisoned request's logits are NaN
        logits, hidden = original(model, tokens, cache, slots, width, features)
        rows = [i for i, s in enumerate(slots.tolist()) if s in engine._running and engine._running[s].prompt == POISON]
        if rows:
            logits = logits.clone()
            logits[rows] = float("nan")
        return logits, hidden

    monkeypatch.setattr(engine_module, "score_padded", score)
    healthy: list[tuple[float, bool, str | None]] = []  # (latency, completed, finish_reason)
    poisoned: list[tuple[bool, str | None]] = []
    rss: dict[str, float] = {}

    async def client_loop(client: httpx.AsyncClient, worker: int, end: float) -> None:
        rng = random.Random(worker)
        while time.monotonic() < end:
            body = {"prompt": rng.choice(PROMPTS), "max_tokens": rng.randint(8, 48), "temperature": 0.8,
                    "seed": rng.randrange(2**31), "stream": rng.random() < 0.5}
            start = time.perf_counter()
            completed, finish = await _one(client, body)
            healthy.append((time.perf_counter() - start, completed, finish))

    async def poisoner(client: httpx.AsyncClient, end: float) -> None:
        while time.monotonic() + POISON_EVERY < end:
            await asyncio.sleep(POISON_EVERY)
            poisoned.append(await _one(client, {"prompt": POISON, "max_tokens": 32, "temperature": 0.8,
                                                "stream": len(poisoned) % 2 == 0}))

    async def sample_memory() -> None:
        await asyncio.sleep(WARM_UP)
        rss["after_warm_up"] = _rss_mib()

    async def run() -> float:
        started = time.monotonic()
        end = started + SECONDS
        limits = httpx.Limits(max_connections=CONCURRENCY + 2)
        async with httpx.AsyncClient(base_url=live.url, timeout=120, limits=limits) as client:
            await asyncio.gather(*(client_loop(client, w, end) for w in range(CONCURRENCY)), poisoner(client, end),
                                 sample_memory())
        return time.monotonic() - started

    load_before = os.getloadavg()[0]  # other work on the machine while it ran
    wall = asyncio.run(run())
    rss["end"] = _rss_mib()
    latencies = sorted(latency for latency, _, _ in healthy)
    lost = [h for h in healthy if not h[1] or h[2] not in ("stop", "length")]
    p50, p99 = latencies[len(latencies) // 2], latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    growth = rss["end"] - rss["after_warm_up"]
    report = {
        "seconds": round(wall, 1), "concurrency": CONCURRENCY, "healthy_requests": len(healthy), "lost": len(lost),
        "poisoned_requests": len(poisoned), "poisoned_ended_in_error": sum(1 for p in poisoned if p[1] == "error"
                                                                           or not p[0]),
        "latency_p50_seconds": round(p50, 4), "latency_p99_seconds": round(p99, 4),
        "rss_mib_after_warm_up": round(rss["after_warm_up"], 1), "rss_mib_end": round(rss["end"], 1),
        "rss_growth_mib": round(growth, 1), "rss_bound_mib": RSS_BOUND_MIB,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "load_average_before": round(load_before, 2),
        "models": "tiny (tests/model_factory.py), float32",
    }
    print(json.dumps(report, indent=1))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=1) + "\n")
    assert not lost and len(healthy) > CONCURRENCY
    assert len(poisoned) >= int(SECONDS // POISON_EVERY) - 1 > 0
    assert all(not completed or finish == "error" for completed, finish in poisoned)
    assert live.server.runner.in_flight == 0 and engine.num_running == 0
    assert growth < RSS_BOUND_MIB
