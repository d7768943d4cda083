"""Faults a server meets, replayed on tiny models: a request that fails inside the engine ends alone, clients that
hang up are cancelled, every bad input is a clear 4xx, big bodies neither stall the server nor get read, the admin
route is closed and says nothing about the filesystem, and the command line refuses bad flags before loading."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import gc
import json
import math
import random
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from live_server import LiveServer
from model_factory import make_tokenizer, write_hf_model
from prometheus_client.parser import text_string_to_metric_families
from test_cli import run_cli

import specsample.engine as engine_module
import specsample.server.drafts as drafts_module
from specsample import Engine, SamplingParams, SpecConfig
from specsample.drafters.model import ModelDrafter
from specsample.options import EngineOptions
from specsample.planner import FixedGamma
from specsample.sampling import sample, warp_probs
from specsample.server.app import build_app
from specsample.server.options import DEFAULT_MAX_BODY_BYTES, ServerOptions
from specsample.server.state import SpecServer
from specsample.speculator import load

MODEL = "tiny"
KEY, ADMIN = "inference-key", "admin-key"
BODY_LIMIT = 64 * 1024
POISON = [7, 11, 13, 17, 19, 23]  # the prompt (token ids) of the request the tests poison


# ----- the engine: a row whose distributions are unusable ends alone ----------------------------------------------


def _run(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> dict[str, tuple[list[int], str]]:
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    out = {i: ([], None) for i in ids}
    for result in engine.stream():
        for update in result.rows:
            tokens, _ = out[update.request_id]
            out[update.request_id] = (tokens + list(update.new_tokens), update.finish_reason)
    return {i: out[i] for i in ids}


@pytest.mark.parametrize("temperatures", [(0.8, 0.0, 0.8, 0.0), (0.0, 0.0, 0.0, 0.0)])
def test_rows_with_nan_logits_end_alone(tiny_target, tiny_draft, monkeypatch, temperatures) -> None:
    """After a few rounds row 1's target logits turn NaN (a greedy row, beside sampled rows or among greedy ones), and
    in a batch with sampled rows row 2's draft logits too: each ends with "error" and commits nothing more; the other
    rows give exactly the tokens they give without them."""
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]
    requests = [
        (p, SamplingParams(temperature=t, max_new_tokens=16, seed=10 + i))
        for i, (p, t) in enumerate(zip(prompts, temperatures))
    ]

    def engine() -> Engine:
        return Engine(tiny_target, ModelDrafter(tiny_draft), SpecConfig(max_batch_size=4), planner=FixedGamma(3))

    reference = list(_run(engine(), requests).values())
    poisoned = engine()
    calls = {"target": 0, "draft": 0}

    def poison(logits: torch.Tensor, slots: list[int], row: int, where: str) -> torch.Tensor:
        calls[where] += 1
        rows = [
            i
            for i, s in enumerate(slots)
            if s in poisoned.scheduler.by_slot() and poisoned.scheduler.by_slot()[s].prompt == prompts[row]
        ]
        if rows and calls[where] > 2:
            logits = logits.clone()
            logits[rows] = float("nan")
        return logits

    original_score, original_logits = engine_module.score_padded, poisoned.drafter._logits

    def score(model, tokens, cache, slots, width, features=False):
        logits, hidden = original_score(model, tokens, cache, slots, width, features)
        return poison(logits, slots.tolist(), 1, "target"), hidden

    def draft_logits(inputs, slot_tensor, last):
        logits, subset = original_logits(inputs, slot_tensor, last)
        return poison(logits, slot_tensor.tolist(), 2, "draft"), subset

    monkeypatch.setattr(engine_module, "score_padded", score)
    sampled = temperatures[2] > 0  # under greedy decoding the draft's probabilities are never read
    if sampled:
        monkeypatch.setattr(poisoned.drafter, "_logits", draft_logits)
    got = list(_run(poisoned, requests).values())
    failing = (1, 2) if sampled else (1,)
    for i in range(4):
        if i in failing:
            assert got[i][1] == "error" and got[i][0] == reference[i][0][: len(got[i][0])], i
            assert len(got[i][0]) < len(reference[i][0])
        else:
            assert got[i] == reference[i], i
    assert not poisoned.has_work() and poisoned.num_running == 0


def test_warping_keeps_the_most_likely_token() -> None:
    """A top_p below float32's smallest number still keeps the most likely token; NaN logits give a distribution
    that says it is unusable, also under greedy decoding; the sampler draws the usable rows as it would alone."""
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.9]])
    for top_p in (1e-300, 1e-46, 1e-45):
        assert warp_probs(logits, SamplingParams(top_p=top_p)).tolist() == [[0.0, 1.0, 0.0, 0.0]]
    assert warp_probs(logits.double(), SamplingParams(top_p=1e-300)).tolist() == [[0.0, 1.0, 0.0, 0.0]]
    nan = torch.tensor([[0.5, float("nan"), 1.0, 0.0]])
    for params in (SamplingParams(), SamplingParams(temperature=0)):
        assert warp_probs(nan, params).isnan().all()
    probs = torch.softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(0)), -1)
    alone = sample(probs, [torch.Generator().manual_seed(s) for s in range(3)])
    broken = probs.clone()
    broken[1] = float("nan")
    together = sample(broken, [torch.Generator().manual_seed(s) for s in range(3)])
    assert together[[0, 2]].tolist() == alone[[0, 2]].tolist()


def test_sampling_settings_that_cannot_be_sampled_are_refused() -> None:
    for kwargs in (
        {"temperature": 1e-40},
        {"temperature": 5e-5},
        {"temperature": math.inf},
        {"top_p": 0.0},
        {"top_p": math.nan},
        {"seed": -1},
        {"seed": 2**64},
        {"top_k": True},
        {"max_new_tokens": True},
    ):
        with pytest.raises(ValueError) as caught:
            SamplingParams(**kwargs)
        assert caught.value.name == next(iter(kwargs))
    SamplingParams(temperature=1e-4, top_p=1e-300, seed=2**64 - 1)


# ----- the server ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("faults")
    models = root / "models"
    tokenizer = make_tokenizer()
    return {
        "root": root,
        "models": models,
        "target": write_hf_model(root / "target", "llama", tokenizer=tokenizer, max_position_embeddings=128),
        "draft": write_hf_model(models / "draft", "llama", tokenizer=tokenizer, seed=3, num_hidden_layers=1),
        "other_vocab": write_hf_model(
            models / "other",
            "llama",
            tokenizer=tokenizer,
            vocab_size=512,
            num_hidden_layers=1,
            hidden_size=32,
            intermediate_size=64,
        ),
    }


@pytest.fixture(scope="module")
def live(folders):
    speculator = load(
        EngineOptions(target=str(folders["target"]), draft=str(folders["draft"]), gamma=4, dtype="float32")
    )
    options = ServerOptions(
        model_name=MODEL,
        api_key=KEY,
        admin_key=ADMIN,
        models_dir=str(folders["models"]),
        max_batch_size=8,
        max_seq_len=128,
        max_body_bytes=BODY_LIMIT,
    )
    server = LiveServer(SpecServer(speculator, options))
    yield server
    server.close()


AUTH = {"Authorization": f"Bearer {KEY}"}


def _post(live, path: str, body, headers=None, **kwargs) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        live.url + path,
        content=content,
        timeout=60,
        headers={"content-type": "application/json", **AUTH, **(headers or {})},
        **kwargs,
    )


def _metrics(live) -> dict[str, float]:
    values = {}
    metrics = httpx.get(live.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
    for family in text_string_to_metric_families(metrics.text):
        for sample_ in family.samples:
            values[sample_.name + json.dumps(sample_.labels, sort_keys=True)] = sample_.value
    return values


def _count(values: dict[str, float], status: str) -> float:
    return values.get('specsample_requests_total{"status": "%s"}' % status, 0.0)


async def _request(client: httpx.AsyncClient, body: dict) -> tuple[int, str, str | None]:
    """(status, text, finish_reason) of a completion, streamed or not; a stream must end with [DONE]."""
    if not body.get("stream"):
        response = await client.post("/v1/completions", json=body)
        if response.status_code != 200:
            return response.status_code, response.json()["error"]["type"], None
        choice = response.json()["choices"][0]
        return 200, choice["text"], choice["finish_reason"]
    text, finish, done = "", None, False
    async with client.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                finish = choice["finish_reason"] or finish
    assert done, "the stream ended without [DONE]"
    return response.status_code, text, finish


def _gather(live, bodies: list[dict]) -> list[tuple[int, str, str | None]]:
    async def run():
        async with httpx.AsyncClient(base_url=live.url, headers=AUTH, timeout=60) as client:
            return await asyncio.gather(*(_request(client, b) for b in bodies))

    return asyncio.run(run())


HEALTHY = [
    {"prompt": p, "max_tokens": 40, "temperature": 0.8, "seed": 5 + i, "stream": i != 1}
    for i, p in enumerate(["the quick brown fox", "hello world", "speculative sampling"])
]


@pytest.mark.parametrize("stream", [False, True])
def test_a_poisoned_request_fails_alone(live, monkeypatch, stream) -> None:
    """Beside three healthy requests (two streamed, one not), one whose target logits turn NaN once it shares a round:
    it alone ends in error (500, or finish_reason "error" and [DONE]) and is counted so; the healthy ones give the
    tokens they give without it."""
    reference = _gather(live, HEALTHY)
    engine = live.server.engine
    original = engine_module.score_padded

    def score(model, tokens, cache, slots, width, features=False):
        logits, hidden = original(model, tokens, cache, slots, width, features)
        rows = [
            i
            for i, s in enumerate(slots.tolist())
            if s in engine.scheduler.by_slot() and engine.scheduler.by_slot()[s].prompt == POISON
        ]
        if rows and len(slots) > 1:
            logits = logits.clone()
            logits[rows] = float("nan")
        return logits, hidden

    monkeypatch.setattr(engine_module, "score_padded", score)
    before = _metrics(live)
    poisoned = {"prompt": POISON, "max_tokens": 40, "temperature": 0.8, "seed": 1, "stream": stream}
    *healthy, bad = _gather(live, HEALTHY + [poisoned])
    after = _metrics(live)
    assert healthy == reference
    assert bad == ((200, bad[1], "error") if stream else (500, "server_error", None))
    assert _count(after, "error") - _count(before, "error") == 1
    assert _count(after, "finished") - _count(before, "finished") == 3
    assert _count(after, "cancelled") == _count(before, "cancelled")


def test_a_failed_round_ends_its_requests_with_an_error(live, monkeypatch) -> None:
    """A round that fails outside any one row (here: step raises) ends the requests in it as errors, streams with
    finish_reason "error" and [DONE]; the engine frees their rows and serves the next request."""
    engine = live.server.engine
    step = engine.step
    failed = []

    def failing_step():
        if engine.num_running >= 2 and not failed:
            failed.append(True)
            raise RuntimeError("a fault no row explains")
        return step()

    monkeypatch.setattr(engine, "step", failing_step)
    before = _metrics(live)
    results = _gather(live, [dict(body, max_tokens=100) for body in HEALTHY[:2]])
    monkeypatch.setattr(engine, "step", step)
    assert results[0][2] == "error" and results[1][:2] == (500, "server_error")
    assert _count(_metrics(live), "error") - _count(before, "error") == 2
    assert _post(live, "/v1/completions", {"prompt": "hi", "max_tokens": 3}).status_code == 200


def test_non_streamed_requests_are_cancelled_when_their_clients_hang_up(live, monkeypatch, caplog) -> None:
    """Four non-streamed requests whose clients close the connection mid-generation are cancelled: their rows free,
    each counted as cancelled, far fewer than max_tokens generated, and asyncio logs nothing about them."""
    engine, runner = live.server.engine, live.server.runner
    request = {"prompt": "the lazy dog", "max_tokens": 100, "temperature": 0.8, "seed": 0}
    whole = _post(live, "/v1/completions", request).json()
    assert whole["choices"][0]["finish_reason"] == "length"  # it would run to max_tokens if nobody hung up
    step = engine.step

    def slow_step():
        time.sleep(0.05)
        return step()

    monkeypatch.setattr(engine, "step", slow_step)
    before = _metrics(live)
    body = json.dumps(request).encode()
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    sockets = [socket.create_connection(("127.0.0.1", live.port)) for _ in range(4)]
    for sock in sockets:
        sock.sendall(request)
    deadline = time.time() + 20
    while runner.in_flight < 4 and time.time() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)  # a few rounds run
    for sock in sockets:
        sock.close()
    while runner.in_flight and time.time() < deadline:
        time.sleep(0.02)
    after = _metrics(live)
    assert runner.in_flight == 0 and engine.num_running == 0
    assert _count(after, "cancelled") - _count(before, "cancelled") == 4
    gc.collect()  # an abandoned future's unretrieved exception is logged when it is collected
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]
    generated = after["specsample_generation_tokens_total{}"] - before["specsample_generation_tokens_total{}"]
    assert generated < 4 * 100 * 0.75


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "\ud800 hi"}, "prompt"),
        ({"prompt": "hi", "temperature": 1e-40}, "temperature"),
        ({"prompt": "hi", "temperature": 5e-5}, "temperature"),
        ({"prompt": "hi", "max_tokens": True}, "max_tokens"),
        ({"prompt": "hi", "stream": "yes"}, "stream"),
        ({"prompt": "hi", "n": 2.0}, "n"),
        ({"prompt": [1, True]}, "prompt.1"),
        ({"prompt": [1, 99999]}, "prompt"),
        ({"prompt": "hi", "presence_penalty": -2.5}, "presence_penalty"),
        ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "hi", "echo": True}, "echo"),
        ({"prompt": "hi", "best_of": 3}, "best_of"),
        ({"prompt": "hi", "repetition_penalty": 1e-300}, "repetition_penalty"),  # logits / 1e-300 overflow
        ({"prompt": "hi", "repetition_penalty": 1e300}, "repetition_penalty"),
        ({"prompt": "hi", "logit_bias": {"\u00b2": 1}}, "logit_bias"),  # "²" is a digit to str.isdigit
        ({"prompt": "hi", "logit_bias": {"\u0661\u0662": 1}}, "logit_bias"),  # "١٢" would read as token 12
    ],
)
def test_bad_completion_requests_name_their_parameter(live, body, param) -> None:
    response = _post(live, "/v1/completions", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert "None" not in error["message"] and "Value error" not in error["message"]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": [{"role": "user", "content": "a \udfff b"}]}, "messages.0.content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
            "messages.0.content.0.text",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "regex"}},
            "response_format.type",
        ),
        ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": True}, "max_completion_tokens"),
    ],
)
def test_bad_chat_requests_name_their_parameter(live, body, param) -> None:
    response = _post(live, "/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_a_top_p_below_float32_keeps_the_top_token(live) -> None:
    """top_p 1e-300 (0 in the float32 the server warps in) samples the most likely token only: the greedy
    output."""
    greedy = _post(live, "/v1/completions", {"prompt": "hello world", "max_tokens": 20, "temperature": 0})
    tiny = _post(live, "/v1/completions", {"prompt": "hello world", "max_tokens": 20, "top_p": 1e-300, "seed": 3})
    assert tiny.status_code == 200, tiny.text
    assert tiny.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]


def test_deep_bodies_and_schemas_are_400(live) -> None:
    """A body nested 30,000 levels (past json's recursion limit) and one past MAX_JSON_DEPTH, on the inference and the
    admin routes, and schemas nested 900 and 80 levels: each a 400 in JSON, and the server carries on."""
    deep = b'{"prompt": "hi", "user": ' + b"[" * 30_000 + b"]" * 30_000 + b"}"
    over = json.dumps({"prompt": "hi", "user": json.loads("[" * 101 + "]" * 101)}).encode()

    def schema_request(levels: int) -> dict:
        schema = json.loads('{"type": "array", "items": ' * levels + "{}" + "}" * levels)
        return {
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}},
        }

    answers = [
        _post(live, "/v1/completions", deep),
        _post(live, "/v1/completions", over),
        _post(live, "/admin/draft", deep, headers={"Authorization": f"Bearer {ADMIN}"}),
        _post(live, "/v1/chat/completions", schema_request(900)),
        _post(live, "/v1/chat/completions", schema_request(80)),
    ]
    assert answers[-1].json()["error"]["param"] == "response_format.json_schema.schema"
    assert "the schema nests 81 levels deep; the limit is 64" in answers[-1].json()["error"]["message"]
    for response in answers:
        assert response.status_code == 400, response.text
        assert "nests" in response.json()["error"]["message"]
    assert _post(live, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_metrics_need_a_key_when_the_server_has_one(live, monkeypatch) -> None:
    """With --api-key, /metrics answers the metrics key or the admin key, not the inference key nor no key; a server
    with an API key but neither of the others says how to open it."""

    def status(key: str | None) -> int:
        return httpx.get(live.url + "/metrics", headers={"Authorization": f"Bearer {key}"} if key else {}).status_code

    assert [status(k) for k in (None, KEY, "wrong", ADMIN)] == [401, 401, 401, 200]
    monkeypatch.setattr(live.server, "options", dataclasses.replace(live.server.options, metrics_key="metrics-key"))
    assert [status(k) for k in (None, KEY, "metrics-key", ADMIN)] == [401, 401, 200, 200]
    monkeypatch.setattr(
        live.server, "options", dataclasses.replace(live.server.options, metrics_key=None, admin_key=None)
    )
    refused = httpx.get(live.url + "/metrics", headers=AUTH)
    assert refused.status_code == 401 and "--metrics-key" in refused.json()["error"]["message"]


def test_keys_are_compared_as_bytes(live) -> None:
    for token in ("ключ".encode(), b"\xff\xfe", KEY.encode() + b"\xe9"):
        response = httpx.post(
            live.url + "/v1/completions", json={"prompt": "hi"}, headers=[(b"authorization", b"Bearer " + token)]
        )
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(live.url + "/health").status_code == 200  # open without a key


def test_bodies_over_the_limit_are_refused_unread(live) -> None:
    """413 for a body whose Content-Length is over the limit (before reading it) and for a chunked one growing past
    it; at the limit the request is served."""
    big = json.dumps({"prompt": "x " * BODY_LIMIT}).encode()
    declared = _post(live, "/v1/completions", big)
    assert declared.status_code == 413 and "at most" in declared.json()["error"]["message"]

    def chunks():
        for start in range(0, len(big), 16 * 1024):
            yield big[start : start + 16 * 1024]

    chunked = httpx.post(
        live.url + "/v1/completions", content=chunks(), timeout=60, headers={"content-type": "application/json", **AUTH}
    )
    assert chunked.status_code == 413
    padded = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    padded = padded[:-1] + b" " * (BODY_LIMIT - len(padded)) + b"}"
    assert len(padded) == BODY_LIMIT and _post(live, "/v1/completions", padded).status_code == 200
    assert ServerOptions(model_name="m").max_body_bytes == DEFAULT_MAX_BODY_BYTES == 1 << 20


def test_tokenizing_runs_off_the_event_loop(live, monkeypatch) -> None:
    """While one request's prompt is being tokenized (held until /health has answered), /health answers: the
    tokenizer does not hold the event loop. Run on the loop, it would keep /health waiting until its hold timed out."""
    tokenizer = live.server.tokenizer
    encode = tokenizer.encode
    entered, released, held_until_released = threading.Event(), threading.Event(), []

    def held_encode(*args, **kwargs):
        entered.set()
        held_until_released.append(released.wait(timeout=20))
        return encode(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", held_encode)

    async def run():
        async with httpx.AsyncClient(base_url=live.url, headers=AUTH, timeout=60) as client:
            slow = asyncio.ensure_future(client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}))
            while not entered.is_set():  # its prompt is being tokenized now
                await asyncio.sleep(0.01)
            health = await client.get("/health")
            released.set()
            return (await slow).status_code, health.status_code

    assert asyncio.run(run()) == (200, 200)
    assert held_until_released == [True]  # /health answered while the tokenizer was held


def _swap(live, spec: str, key: str = ADMIN, body_extra: dict | None = None) -> httpx.Response:
    return httpx.post(
        live.url + "/admin/draft",
        json={"draft": spec, **(body_extra or {})},
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    )


def test_admin_needs_its_own_key_and_exists_only_with_one(live, monkeypatch) -> None:
    assert _swap(live, "ngram", key=KEY).status_code == 403  # the inference key is not enough
    assert _swap(live, "ngram", key="wrong").status_code == 403
    monkeypatch.setattr(live.server, "options", dataclasses.replace(live.server.options, admin_key=None))
    assert _swap(live, "ngram", key=ADMIN).status_code == 404


def test_admin_draft_loads_only_allowed_drafts_and_reveals_no_paths(live, folders, monkeypatch) -> None:
    """Specs outside the built-in drafts and the models folder, missing ones, files, folders elsewhere, escapes from
    the folder and drafts that do not fit the target all get the same answer; drafts in the folder swap in."""
    outside = folders["target"]
    refused = [
        str(outside),
        str(outside / "config.json"),
        str(folders["root"] / "missing"),
        "../target",
        "draft/../../target",
        "missing",
        "draft/config.json",
        "other",
        "hybrid:../target",
        "hybrid:other",
        "/etc",
        "none",
        "org/name",
        ".",
    ]
    messages = set()
    for spec in refused:
        response = _swap(live, spec)
        assert response.status_code == 400, spec
        messages.add(response.json()["error"]["message"])
    assert len(messages) == 1 and "unknown or unusable draft" in messages.pop()
    link = folders["models"] / "link"
    link.symlink_to(outside)
    try:
        assert _swap(live, "link").status_code == 400  # a link out of the folder
    finally:
        link.unlink()
    for spec in ("ngram", "suffix", "hybrid:draft", "draft"):
        response = _swap(live, spec)
        assert response.status_code == 200, response.text
    fetched = []  # an alias not in the cache is refused, never downloaded
    monkeypatch.setattr(drafts_module, "alias_cached", lambda name: False)
    monkeypatch.setattr(live.server.speculator.pair, "load_draft", lambda spec: fetched.append(spec))
    assert _swap(live, "gemma3-270m").status_code == 400 and not fetched
    assert _swap(live, "gemma3-270m", body_extra={"other": 1}).status_code == 400
    assert httpx.get(live.url + "/health").json()["draft"] == "draft"


# ----- the command line ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags, flag",
    [
        (["--temperature", "1e-40"], "--temperature"),
        (["--temperature", "-1"], "--temperature"),
        (["--top-p", "0"], "--top-p"),
        (["--top-p", "nan"], "--top-p"),
        (["--min-p", "1"], "--min-p"),
        (["--seed", "-1"], "--seed"),
        (["--max-new-tokens", "0"], "--max-new-tokens"),
        (["--device", "cuda:99"], "--device"),
        (["--device", "tpu"], "--device"),
        (["--dtype", "float17"], "--dtype"),
        (["--max-gamma", "0"], "--max-gamma"),
        (["--json-schema", "/no/such/schema.json"], "--json-schema"),
        (["--json-schema", __file__], "--json-schema"),  # not JSON
    ]
    + ([] if torch.cuda.is_available() else [(["--device", "cuda"], "--device")]),
)
def test_generate_refuses_bad_flags_before_loading(flags, flag) -> None:
    """Each names its flag on one line with exit status 2; the target does not exist, so a check that waited for
    the models would report that instead."""
    done = run_cli("generate", "hi", "--target", "no-such-model", *flags)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"argument {flag}" in lines[0] and "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "flags, flag",
    [
        (["--max-body-bytes", "0"], "--max-body-bytes"),
        (["--prefix-cache-rows", "-1"], "--prefix-cache-rows"),
        (["--models-dir", "/no/such/folder"], "--models-dir"),
        (["--admin-key", ""], "--admin-key"),
        (["--api-key", "same", "--admin-key", "same"], "--admin-key"),
        (["--max-batch-size", "0"], "--max-batch-size"),
        (["--port", "70000"], "--port"),
        (["--device", "cuda:99"], "--device"),
        (["--compiled-steps", __file__], "--compiled-steps"),
    ],
)
def test_serve_refuses_bad_flags_before_loading(flags, flag) -> None:
    done = run_cli("serve", "--model", "no-such-model", *flags)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"argument {flag}" in lines[0] and "Traceback" not in done.stderr


def test_generate_with_a_tiny_top_p_gives_the_greedy_text(folders) -> None:
    args = [
        "generate",
        "hello world",
        "--target",
        str(folders["target"]),
        "--draft",
        "ngram",
        "--no-chat",
        "--json",
        "--max-new-tokens",
        "8",
        "--dtype",
        "float32",
    ]
    tiny = run_cli(*args, "--top-p", "1e-300", "--seed", "0")
    assert tiny.returncode == 0, tiny.stderr
    assert json.loads(tiny.stdout)["token_ids"] == json.loads(run_cli(*args, "--temperature", "0").stdout)["token_ids"]


# ----- fuzzing: generated bad bodies never get a 5xx ------------------------------------------------------------

FUZZ_BODIES = 3000
EDGES = [
    None,
    True,
    False,
    0,
    -1,
    1,
    2**63,
    2**64,
    -(2**63) - 1,
    10**40,
    1e308,
    -1e308,
    5e-324,
    1e-300,
    0.5,
    -0.0,
    "",
    "x",
    "0",
    "1e999",
    "\u0000",
    "\u202e\u0661\u00b2",
    "\U0001f600" * 50,
    "x" * 5000,
    [],
    {},
    [[]],
    [1, 2],
    {"a": 1},
    {"type": "object"},
    ["a"] * 300,
]
RAW = [
    b"",
    b"{",
    b"[",
    b'{"prompt": "hi"',
    b"\xff\xfe{}",
    b'{"prompt": "\\ud800"}',
    b'{"prompt": NaN}',
    b'{"prompt": "hi", "temperature": Infinity}',
    b'{"prompt": "hi", "max_tokens": 1e999}',
    b"null",
    b"[]",
    b'{"prompt": "hi", "prompt": 5}',
    b'{"\\u0000": 1}',
    b"[" * 5000,
    b'{"a":' * 3000,
]
FIELDS = [
    "prompt",
    "messages",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "n",
    "stream",
    "stream_options",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "response_format",
    "cache_salt",
    "user",
    "model",
    "echo",
    "suffix",
    "num_speculative_tokens",
    "speculative",
    "max_completion_tokens",
    "best_of",
    "\u00e9",
    "a" * 300,
]
SCHEMA_KEYS = [
    "type",
    "properties",
    "required",
    "items",
    "enum",
    "const",
    "anyOf",
    "oneOf",
    "allOf",
    "not",
    "$ref",
    "pattern",
    "minLength",
    "maxLength",
    "minimum",
    "maximum",
    "format",
    "additionalProperties",
    "$defs",
    "prefixItems",
    "minItems",
    "uniqueItems",
    "description",
    "if",
]


def _fuzz_value(rng, depth: int = 0):
    roll = rng.random()
    if roll < 0.55 or depth > 3:
        return rng.choice(EDGES)
    if roll < 0.7:
        return [_fuzz_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    if roll < 0.85:
        return {rng.choice(FIELDS + SCHEMA_KEYS): _fuzz_value(rng, depth + 1) for _ in range(rng.randrange(4))}
    levels = rng.choice([50, 120, 2000])
    return json.loads("[" * levels + "]" * levels) if levels < 500 else "[" * levels


def _fuzz_schema(rng, depth: int = 0):
    if depth > 2 or rng.random() < 0.3:
        return rng.choice([{"type": t} for t in ("string", "integer", "boolean", "object", "bogus")] + EDGES[:8])
    return {
        rng.choice(SCHEMA_KEYS): rng.choice(
            [
                _fuzz_schema(rng, depth + 1),
                [_fuzz_schema(rng, depth + 1)],
                _fuzz_value(rng, depth + 1),
                "^.{1,5000}$",
                "#/$defs/x",
            ]
        )
        for _ in range(rng.randrange(1, 4))
    }


def _fuzz_body(rng) -> tuple[str, bytes]:
    """A path and a generated body: raw bytes, a wrong top-level value, or a valid request with fields replaced."""
    chat = rng.random() < 0.5
    path = "/v1/chat/completions" if chat else "/v1/completions"
    roll = rng.random()
    if roll < 0.1:
        return path, rng.choice(RAW)
    if roll < 0.15:
        return path, json.dumps(_fuzz_value(rng)).encode()
    body: dict = ({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}) | {"max_tokens": 1}
    for _ in range(rng.randrange(1, 4)):
        body[rng.choice(FIELDS)] = _fuzz_value(rng)
    if rng.random() < 0.2:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "f", "schema": _fuzz_schema(rng)}}
    text = json.dumps(body, ensure_ascii=rng.random() < 0.5)
    return path, text.encode("utf-8", "surrogatepass")


def test_generated_bad_bodies_get_no_5xx_and_leave_the_server_healthy(live) -> None:
    """FUZZ_BODIES generated bodies (types, sizes, depths, Unicode, numbers at the edges, random schemas) through an
    in-process client: no 5xx, every error in the OpenAI shape, and a healthy server afterwards."""
    server = SpecServer(
        live.server.speculator, ServerOptions(model_name=MODEL, max_batch_size=8, max_seq_len=128, grammar_workers=1)
    )
    app = build_app()
    app.state.server = server
    rng, statuses = random.Random(55), collections.Counter()

    async def run() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://fuzz", timeout=60) as client:
            for _ in range(FUZZ_BODIES):
                path, body = _fuzz_body(rng)
                response = await client.post(path, content=body, headers={"content-type": "application/json"})
                statuses[response.status_code] += 1
                assert response.status_code < 500, (body[:300], response.text[:300])
                if response.status_code >= 400:
                    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
            health = await client.get("/health")
            assert health.status_code == 200 and health.json()["running"] == 0
            ok = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
            assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in (
                "length",
                "stop",
            )  # EOS may come first

    async def serve() -> None:
        server.start()
        try:
            await run()
        finally:
            server.stop()  # in the loop its grammar workers were started in

    asyncio.run(serve())
    assert statuses[400] > FUZZ_BODIES / 2 and statuses[200] > 0, statuses
