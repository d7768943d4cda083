"""Closed-loop load on a live server (tiny models, loopback): 8 clients for two minutes, a poisoned request every
10 s. Run with `pytest -m load` (excluded by default). No healthy request may be lost, resident memory may grow by
at most RSS_BOUND_MIB after warm-up, and the p99 latency is printed and written to the file SPECSAMPLE_LOAD_REPORT
names (docs/results/load.json comes from the command in docs/serving.md), else to the test's temporary folder."""

from __future__ import annotations

import asyncio
import json
import os
import platform
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from live_server import LiveServer
from model_factory import make_tokenizer, write_hf_model

import specsample.engine as engine_module
from specsample.options import EngineOptions
from specsample.server.options import ServerOptions
from specsample.server.state import SpecServer
from specsample.speculator import load

pytestmark = pytest.mark.load

SECONDS = float(os.environ.get("SPECSAMPLE_LOAD_SECONDS", 120))
CONCURRENCY = 8
POISON_EVERY = 10.0
WARM_UP = 15.0  # seconds before the memory baseline is taken
RSS_BOUND_MIB = 64  # most resident-memory growth allowed between the end of warm-up and the end of the run
POISON = [7, 11, 13, 17, 19, 23]
PROMPTS = [
    "the quick brown fox",
    "hello world",
    "speculative sampling",
    "the lazy dog jumps",
    "tokens for tests",
    "a tiny language model",
    "over the quick dog",
    "world hello fox",
]


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
    server = LiveServer(
        SpecServer(speculator, ServerOptions(model_name="tiny", max_batch_size=CONCURRENCY, max_seq_len=128))
    )
    yield server
    server.close()


def test_closed_loop_load_with_poisoned_requests(live, monkeypatch, tmp_path) -> None:
    engine = live.server.engine
    original = engine_module.score_padded

    def score(model, tokens, cache, slots, width, features=False):  # the poisoned request's logits are NaN
        logits, hidden = original(model, tokens, cache, slots, width, features)
        rows = [
            i
            for i, s in enumerate(slots.tolist())
            if s in engine.scheduler.by_slot() and engine.scheduler.by_slot()[s].prompt == POISON
        ]
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
            body = {
                "prompt": rng.choice(PROMPTS),
                "max_tokens": rng.randint(8, 48),
                "temperature": 0.8,
                "seed": rng.randrange(2**31),
                "stream": rng.random() < 0.5,
            }
            start = time.perf_counter()
            completed, finish = await _one(client, body)
            healthy.append((time.perf_counter() - start, completed, finish))

    async def poisoner(client: httpx.AsyncClient, end: float) -> None:
        while time.monotonic() + POISON_EVERY < end:
            await asyncio.sleep(POISON_EVERY)
            poisoned.append(
                await _one(
                    client, {"prompt": POISON, "max_tokens": 32, "temperature": 0.8, "stream": len(poisoned) % 2 == 0}
                )
            )

    async def sample_memory() -> None:
        await asyncio.sleep(WARM_UP)
        rss["after_warm_up"] = _rss_mib()

    async def run() -> float:
        started = time.monotonic()
        end = started + SECONDS
        limits = httpx.Limits(max_connections=CONCURRENCY + 2)
        async with httpx.AsyncClient(base_url=live.url, timeout=120, limits=limits) as client:
            await asyncio.gather(
                *(client_loop(client, w, end) for w in range(CONCURRENCY)), poisoner(client, end), sample_memory()
            )
        return time.monotonic() - started

    load_before = os.getloadavg()[0]  # other work on the machine while it ran
    wall = asyncio.run(run())
    rss["end"] = _rss_mib()
    latencies = sorted(latency for latency, _, _ in healthy)
    lost = [h for h in healthy if not h[1] or h[2] not in ("stop", "length")]
    p50, p99 = latencies[len(latencies) // 2], latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    growth = rss["end"] - rss["after_warm_up"]
    report = {
        "seconds": round(wall, 1),
        "concurrency": CONCURRENCY,
        "healthy_requests": len(healthy),
        "lost": len(lost),
        "poisoned_requests": len(poisoned),
        "poisoned_ended_in_error": sum(1 for p in poisoned if p[1] == "error" or not p[0]),
        "latency_p50_seconds": round(p50, 4),
        "latency_p99_seconds": round(p99, 4),
        "rss_mib_after_warm_up": round(rss["after_warm_up"], 1),
        "rss_mib_end": round(rss["end"], 1),
        "rss_growth_mib": round(growth, 1),
        "rss_bound_mib": RSS_BOUND_MIB,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "load_average_before": round(load_before, 2),
        "models": "tiny (tests/model_factory.py), float32",
    }
    print(json.dumps(report, indent=1))
    results = Path(os.environ.get("SPECSAMPLE_LOAD_REPORT") or tmp_path / "load.json")
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(report, indent=1) + "\n")
    assert not lost and len(healthy) > CONCURRENCY
    assert len(poisoned) >= int(SECONDS // POISON_EVERY) - 1 > 0
    assert all(not completed or finish == "error" for completed, finish in poisoned)
    assert live.server.runner.in_flight == 0 and engine.num_running == 0
    assert growth < RSS_BOUND_MIB


# ----- grammar compiles beside decoding -----------------------------------------------------------------------

SMOLLM2_TOKENIZER = Path.home() / ".cache" / "specsample" / "models" / "smollm2-135m-instruct"
FLOOD = 8  # heavy compiles in flight at once
UNRELATED = {"prompt": "the quick brown fox", "max_tokens": 24, "temperature": 0}


@pytest.fixture(scope="module")
def big_vocab(tmp_path_factory):
    """A tiny model with SmolLM2's tokenizer (49,152 tokens): its grammars take as long to compile as the real
    model's."""
    if not (SMOLLM2_TOKENIZER / "tokenizer.json").exists():
        pytest.skip("SmolLM2's tokenizer is not in the model cache (specsample generate fetches it)")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(SMOLLM2_TOKENIZER))
    target = write_hf_model(
        tmp_path_factory.mktemp("big_vocab") / "target", "llama", tokenizer=tokenizer, max_position_embeddings=128
    )
    speculator = load(EngineOptions(target=str(target), draft="ngram", gamma=4, dtype="float32"))
    server = LiveServer(
        SpecServer(
            speculator,
            ServerOptions(model_name="tiny", max_batch_size=CONCURRENCY, max_seq_len=128, grammar_compile_timeout=60),
        )
    )
    yield server
    server.close()


def _heavy(i: int) -> dict:
    """A chat request whose schema takes about half a second to compile with SmolLM2's vocabulary (a 1,000-character
    pattern, at the limit), each one different."""
    schema = {"type": "object", "properties": {f"field{i}": {"type": "string", "pattern": "^.{1000}$"}}}
    return {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "response_format": {"type": "json_schema", "json_schema": {"name": "heavy", "schema": schema}},
    }


def test_an_unrelated_request_keeps_its_latency_while_grammars_compile(big_vocab) -> None:
    """The median latency of a plain request while FLOOD heavy compiles run stays within 2x of the idle server's
    (measured just before and just after, against the machine's other work drifting); a client that leaves during its
    compile has its worker killed."""
    pool = big_vocab.server.grammar_pool

    async def latencies(client: httpx.AsyncClient, count: int = 11) -> list[float]:
        times = []
        for _ in range(count):
            start = time.perf_counter()
            response = await client.post("/v1/completions", json=UNRELATED)
            assert response.status_code == 200
            times.append(time.perf_counter() - start)
            await asyncio.sleep(0.05)
        return times

    def median(times: list[float]) -> float:
        return sorted(times)[len(times) // 2]

    async def run() -> dict:
        async with httpx.AsyncClient(base_url=big_vocab.url, timeout=120) as client:
            await client.post("/v1/chat/completions", json=_heavy(-1))  # the workers started
            before = await latencies(client)
            compiled = pool.compiled
            flood = [asyncio.ensure_future(client.post("/v1/chat/completions", json=_heavy(i))) for i in range(FLOOD)]
            await asyncio.sleep(0.3)
            during = median(await latencies(client))
            busy_at_end = len(pool._busy)
            statuses = [r.status_code for r in await asyncio.gather(*flood)]
            idle = median(before + await latencies(client))
            started = pool.started
            with pytest.raises(httpx.ReadTimeout):  # leaves during its compile
                await client.post("/v1/chat/completions", json=_heavy(FLOOD), timeout=0.2)
            deadline = time.perf_counter() + 2
            while pool.started == started and time.perf_counter() < deadline:
                await asyncio.sleep(0.02)
            return {
                "idle_median_s": round(idle, 4),
                "during_compiles_median_s": round(during, 4),
                "compiles": pool.compiled - compiled,
                "busy_workers_at_end_of_measure": busy_at_end,
                "statuses": statuses,
                "worker_killed_after_leave": pool.started < started,
            }

    report = asyncio.run(run())
    print(json.dumps(report))
    assert report["statuses"] == [200] * FLOOD and report["compiles"] == FLOOD
    assert report["during_compiles_median_s"] <= 2 * report["idle_median_s"]
    assert report["worker_killed_after_leave"]


# ----- shutdown of a real `specsample serve` process --------------------------------------------------------------


def _serve_process(live_folder: Path, port: int, timeout: float) -> subprocess.Popen:
    """`specsample serve` on the tiny pair, one request at a time (the rest queue), once it answers /health."""
    command = [
        sys.executable,
        "-m",
        "specsample.cli",
        "serve",
        "--model",
        str(live_folder / "target"),
        "--speculative-model",
        str(live_folder / "draft"),
        "--dtype",
        "float32",
        "--pad-rows",
        "off",
        "--max-model-len",
        "128",
        "--max-batch-size",
        "1",
        "--port",
        str(port),
        "--shutdown-timeout",
        str(timeout),
        "--enforce-eager",
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            time.sleep(0.2)
    process.kill()
    raise AssertionError(f"the server did not start: {process.communicate()[1][-2000:]}")


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("shutdown")
    tokenizer = make_tokenizer()
    write_hf_model(root / "target", "llama", tokenizer=tokenizer, max_position_embeddings=128)
    write_hf_model(root / "draft", "llama", tokenizer=tokenizer, seed=3, num_hidden_layers=1)
    return root


LONG = {
    "prompt": "the quick brown fox",
    "max_tokens": 100,
    "temperature": 0.8,
    "seed": 1,
    "logit_bias": {"0": -100, "1": -100, "2": -100},
}  # no end of text: each runs to max_tokens


async def _ends(url: str, streams: int, plain: int, after_start) -> list[tuple[int, str]]:
    """(status, how it ended) of `streams` streamed and `plain` non-streamed long requests sent together; a stream
    ends "done" ([DONE] after a finish), "error-done" ([DONE] after an error event) or "cut" (no [DONE])."""

    async def stream(client):
        events = []
        async with client.stream("POST", "/v1/completions", json=LONG | {"stream": True}) as response:
            if response.status_code != 200:
                return response.status_code, "refused"
            events = [line async for line in response.aiter_lines() if line.startswith("data: ")]
        if not events or events[-1] != "data: [DONE]":
            return 200, "cut"
        return 200, "error-done" if "error" in json.loads(events[-2][6:]) else "done"

    async def one(client):
        response = await client.post("/v1/completions", json=LONG)
        return response.status_code, response.json().get("error", {}).get("code") or "done"

    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        tasks = [asyncio.ensure_future(stream(client)) for _ in range(streams)]
        tasks += [asyncio.ensure_future(one(client)) for _ in range(plain)]
        await asyncio.sleep(0.5)
        await after_start()
        return await asyncio.gather(*tasks)


@pytest.mark.parametrize("signals, timeout", [(["SIGTERM"], 2.0), (["SIGINT"], 2.0), (["SIGINT", "SIGINT"], 60.0)])
def test_a_serve_process_drains_then_exits_cleanly(pair, signals, timeout) -> None:
    """Sixteen long requests queued one at a time: after the signal those that fit in --shutdown-timeout finish, the
    rest end cleanly (streams with an error event and [DONE], the others 503); a second Ctrl-C ends them at once;
    the process exits with status 0 and no traceback."""
    from live_server import free_port

    port = free_port()
    process = _serve_process(pair, port, timeout)
    timing = {}

    async def send_signals():
        timing["signalled"] = time.perf_counter()
        for name in signals:
            process.send_signal(getattr(signal, name))
            await asyncio.sleep(0.2)

    try:
        ends = asyncio.run(_ends(f"http://127.0.0.1:{port}", 8, 8, send_signals))
        elapsed = time.perf_counter() - timing["signalled"]
        code = process.wait(timeout=30)
    finally:
        process.kill()
    stderr = process.communicate()[1]
    print(json.dumps({"signals": signals, "ends": ends, "seconds_after_signal": round(elapsed, 2), "exit": code}))
    assert code == 0 and "Traceback" not in stderr and "terminate called" not in stderr, stderr[-3000:]
    assert all(end in ((200, "done"), (200, "error-done"), (503, "shutting_down")) for end in ends), ends
    assert any(end != (200, "done") for end in ends)  # something was still running at the limit
    assert elapsed < (1.5 if len(signals) == 2 else timeout + 3)
