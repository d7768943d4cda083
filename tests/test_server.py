"""The OpenAI-compatible server, live on 127.0.0.1, driven by the official `openai` client."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from live_server import LiveServer, free_port
from model_factory import make_tokenizer, write_hf_model
from prometheus_client.parser import text_string_to_metric_families

from specsample.config import SamplingParams
from specsample.drafters.suffix import SuffixDrafter
from specsample.options import EngineOptions
from specsample.planner.base import BatchState, RoundPlan
from specsample.server.app import build_app
from specsample.server.options import ServerOptions
from specsample.server.protocol import TextAssembler
from specsample.server.serve import FLUSH_SECONDS, DrainingServer
from specsample.server.state import SpecServer
from specsample.speculator import load

MODEL = "tiny"
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


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("server")
    tokenizer = make_tokenizer()
    return {
        "target": write_hf_model(root / "target", "llama", tokenizer=tokenizer, max_position_embeddings=128),
        "draft": write_hf_model(root / "draft", "llama", tokenizer=tokenizer, seed=3, num_hidden_layers=1),
        "draft2": write_hf_model(root / "draft2", "qwen2", tokenizer=tokenizer, seed=4, num_hidden_layers=1),
        "other_vocab": write_hf_model(root / "other", "llama", tokenizer=tokenizer, vocab_size=512),
    }


def _server(folders, api_key=None, max_batch=8, **options) -> LiveServer:
    speculator = load(
        EngineOptions(target=str(folders["target"]), draft=str(folders["draft"]), gamma=4, dtype="float32")
    )
    return LiveServer(
        SpecServer(
            speculator,
            ServerOptions(
                model_name=MODEL,
                api_key=api_key,
                min_acceptance=0.7,
                max_batch_size=max_batch,
                max_seq_len=128,
                **options,
            ),
        )
    )


@pytest.fixture(scope="module")
def live(folders):
    server = _server(folders)
    yield server
    server.close()


def test_completions_and_chat_streamed_and_not(live) -> None:
    client = live.client()
    for kwargs in ({"temperature": 0}, {"temperature": 0.8, "seed": 7}):
        full = client.completions.create(model=MODEL, prompt="the quick brown fox", max_tokens=24, **kwargs)
        streamed = client.completions.create(
            model=MODEL, prompt="the quick brown fox", max_tokens=24, stream=True, **kwargs
        )
        assert "".join(c.choices[0].text for c in streamed) == full.choices[0].text
        assert full.usage.completion_tokens >= 1 and full.usage.prompt_tokens > 0
        messages = [{"role": "user", "content": "hello world"}]
        chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, **kwargs)
        chunks = list(
            client.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=24,
                stream=True,
                stream_options={"include_usage": True},
                **kwargs,
            )
        )
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
        assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
        assert chat.choices[0].finish_reason in ("stop", "length")
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_greedy_speculation_equals_plain(live) -> None:
    client = live.client()
    for prompt in PROMPTS[:4]:
        spec = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0)
        plain = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=30, temperature=0, extra_body={"speculative": False}
        )
        fixed = client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=30,
            temperature=0,
            extra_body={"num_speculative_tokens": 2, "top_k": 5},
        )
        assert spec.choices[0].text == plain.choices[0].text == fixed.choices[0].text


def test_n_choices_and_stop_strings(live) -> None:
    client = live.client()
    out = client.completions.create(model=MODEL, prompt="hello", max_tokens=20, n=3, temperature=1.0, seed=3)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    greedy = client.completions.create(model=MODEL, prompt="the quick brown fox", max_tokens=30, temperature=0)
    text = greedy.choices[0].text
    stop = text[8:12]
    assert stop and stop in text
    cut = client.completions.create(
        model=MODEL, prompt="the quick brown fox", max_tokens=30, temperature=0, stop=[stop]
    )
    assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=MODEL, prompt="the quick brown fox", max_tokens=30, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == text[: text.index(stop)]


class CharDecoder:
    """A stream decoder that pretends each token is one character."""

    def push(self, ids):
        return "".join(chr(i) for i in ids)

    def flush(self):
        return ""


def test_stop_string_across_round_boundaries() -> None:
    assembler = TextAssembler(CharDecoder(), ["STOP"])
    pieces = [assembler.push(tuple(map(ord, part))) for part in ("abcS", "T", "OPxyz")]
    assert "".join(pieces) == "abc" and assembler.stopped
    keep = TextAssembler(CharDecoder(), ["STOP"])
    assert keep.push(tuple(map(ord, "xxST"))) == "xx"  # "ST" might begin the stop string: held back
    assert keep.push(tuple(map(ord, "AR"))) == "STAR"
    assert keep.finish() == ""


def test_stop_strings_count_only_past_min_tokens() -> None:
    assembler = TextAssembler(CharDecoder(), ["ST"], min_tokens=4)
    pieces = [assembler.push(tuple(map(ord, part))) for part in ("aST", "bcSTd")]
    assert "".join(pieces) == "aSTbc" and assembler.stopped  # the first "ST" ends inside the first 4 tokens
    straddle = TextAssembler(CharDecoder(), ["ST"], min_tokens=4)
    assert straddle.push(tuple(map(ord, "abcST"))) == "abc" and straddle.stopped  # ends with the fifth token


def test_ignore_eos_and_min_tokens_fix_the_output_length(live) -> None:
    """With end-of-sequence forced by logit_bias: it ends the output at once; min_tokens holds it off that many
    tokens; ignore_eos generates through it to max_tokens. Chat and completions, speculative and plain."""
    client = live.client()
    eos = live.server.tokenizer.hf.eos_token_id
    for speculative in (True, False):
        for chat in (False, True):

            def create(**extra):
                body = {"logit_bias": {str(eos): 100}, "speculative": speculative} | extra
                common = {"model": MODEL, "max_tokens": 12, "temperature": 0.8, "seed": 5, "extra_body": body}
                if chat:
                    out = client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **common)
                else:
                    out = client.completions.create(prompt="hello world", **common)
                return out.usage.completion_tokens, out.choices[0].finish_reason

            assert create() == (1, "stop")
            assert create(min_tokens=5) == (6, "stop")
            assert create(ignore_eos=True) == (12, "length")
            assert create(ignore_eos=True, min_tokens=12) == (12, "length")


def test_usage_stops_counting_at_the_stop_string() -> None:
    """A round can commit tokens past a stop string; the response neither shows nor bills them (as vLLM)."""
    import asyncio

    from specsample.engine import RowUpdate
    from specsample.server.responses import Choice
    from specsample.server.runner import RequestHandle

    async def one_round() -> Choice:
        loop = asyncio.get_running_loop()
        handle = RequestHandle("r", prompt_tokens=3, queue=asyncio.Queue(), loop=loop)
        choice = Choice(0, handle, TextAssembler(CharDecoder(), ["ST"]))
        handle.queue.put_nowait(RowUpdate("r", tuple(map(ord, "abSTxyz")), 6, 6, None))  # 7 tokens in one round
        assert await choice.next() == [("ab", "stop")]
        return choice

    async def two_rounds(last_finish: str | None) -> Choice:
        loop = asyncio.get_running_loop()
        handle = RequestHandle("r", prompt_tokens=3, queue=asyncio.Queue(), loop=loop)
        choice = Choice(0, handle, TextAssembler(CharDecoder(), ["ST"]))
        handle.queue.put_nowait(RowUpdate("r", tuple(map(ord, "abS")), 2, 2, None))  # "S" held back
        assert await choice.next() == [("ab", None)]
        handle.queue.put_nowait(RowUpdate("r", tuple(map(ord, "Txy")), 2, 2, last_finish))
        assert await choice.next() == [("", "stop")]  # the stop string wins over "length"
        return choice

    assert asyncio.run(one_round()).tokens == 4  # a, b, S, T: not the x, y, z the round also committed
    for last_finish in (None, "length"):
        assert asyncio.run(two_rounds(last_finish)).tokens == 4


def test_concurrent_clients_are_batched_and_isolated(live) -> None:
    client = live.client()
    alone = {
        p: client.completions.create(model=MODEL, prompt=p, max_tokens=40, temperature=0).choices[0].text
        for p in PROMPTS
    }

    async def run_all():
        aclient = live.client(cls=openai.AsyncOpenAI)

        async def one(prompt):
            stream = await aclient.completions.create(
                model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stream=True
            )
            return "".join([c.choices[0].text async for c in stream])

        return await asyncio.gather(*(one(p) for p in PROMPTS))

    together = asyncio.run(run_all())
    assert dict(zip(PROMPTS, together)) == alone
    assert live.server.metrics.max_batch_seen > 1
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(live.url + "/metrics").text)}
    over_one = [
        s for s in families["specsample_batch_size"].samples if s.name.endswith("_bucket") and s.labels["le"] == "1.0"
    ]
    total = [s for s in families["specsample_batch_size"].samples if s.name.endswith("_count")]
    assert total[0].value > over_one[0].value  # some rounds ran more than one request


@pytest.mark.parametrize("max_batch", [16, 32])
def test_large_batches_serve_every_stream(folders, max_batch: int) -> None:
    """As many concurrent streams as the batch holds run together, each as it would alone."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(max_batch)]
    server = _server(folders, max_batch=max_batch)
    try:
        client = server.client()
        alone = {
            p: client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0).choices[0].text
            for p in PROMPTS
        }

        async def run_all() -> list[str]:
            aclient = server.client(cls=openai.AsyncOpenAI)

            async def one(prompt: str) -> str:
                out = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
                return out.choices[0].text

            return await asyncio.gather(*(one(p) for p in prompts))

        assert asyncio.run(run_all()) == [alone[p] for p in prompts]
        assert server.server.metrics.max_batch_seen > max_batch // 2
    finally:
        server.close()


def test_disconnect_frees_the_slot(live) -> None:
    engine = live.server.engine
    with httpx.Client(timeout=30) as http:
        with http.stream(
            "POST",
            live.url + "/v1/completions",
            json={"model": MODEL, "prompt": "hello", "max_tokens": 100, "stream": True},
        ) as response:
            for line in response.iter_lines():
                if line.startswith("data:"):
                    break  # first chunk received: hang up mid-stream
    deadline = time.time() + 10
    while (engine.num_running or engine.num_waiting or live.server.runner.in_flight) and time.time() < deadline:
        time.sleep(0.05)
    assert engine.num_running == 0 and live.server.runner.in_flight == 0
    out = live.client().completions.create(model=MODEL, prompt="hello", max_tokens=5, temperature=0)
    assert out.choices[0].text is not None


@pytest.mark.parametrize(
    "body, param",
    [
        (b"{not json", None),
        (json.dumps({"model": MODEL, "prompt": "hi", "temperature": "hot"}).encode(), "temperature"),
        (json.dumps({"model": MODEL, "prompt": "hi", "temperature": -0.5}).encode(), "temperature"),
        (json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 0}).encode(), "max_tokens"),
        (json.dumps({"model": MODEL, "prompt": "hi " * 60, "max_tokens": 100}).encode(), "max_tokens"),
        (json.dumps({"model": MODEL, "prompt": "hi", "frobnicate": True}).encode(), "frobnicate"),
        (json.dumps({"model": MODEL, "prompt": "hi", "presence_penalty": 2.5}).encode(), "presence_penalty"),
        (json.dumps({"model": MODEL, "prompt": "hi", "logit_bias": {"5": 300}}).encode(), "logit_bias"),
        (json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 4, "min_tokens": 5}).encode(), "min_tokens"),
        (json.dumps({"model": MODEL, "prompt": "hi", "min_tokens": -1}).encode(), "min_tokens"),
        (json.dumps({"model": MODEL, "prompt": "hi", "ignore_eos": 1}).encode(), "ignore_eos"),
        (json.dumps({"model": MODEL, "prompt": ""}).encode(), None),
        (json.dumps([1, 2]).encode(), None),
    ],
)
def test_bad_requests_get_400_and_the_server_carries_on(live, body, param) -> None:
    response = httpx.post(live.url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param:
        assert error["param"] == param
    assert live.client().completions.create(model=MODEL, prompt="hi", max_tokens=3).choices


def test_unknown_model_is_404(live) -> None:
    with pytest.raises(openai.NotFoundError):
        live.client().completions.create(model="gpt-5", prompt="hi", max_tokens=3)


def test_metrics_parse_and_move(live) -> None:
    def read() -> dict[str, float]:
        values = {}
        for family in text_string_to_metric_families(httpx.get(live.url + "/metrics").text):
            for sample in family.samples:
                values[sample.name + json.dumps(sample.labels, sort_keys=True)] = sample.value
        return values

    before = read()
    live.client().completions.create(model=MODEL, prompt="the quick brown fox", max_tokens=12, temperature=0)
    after = read()
    for name in (
        'specsample_requests_total{"status": "finished"}',
        "specsample_generation_tokens_total{}",
        "specsample_spec_decode_num_draft_tokens_total{}",
        "specsample_spec_decode_num_drafts_total{}",
        "specsample_time_to_first_token_seconds_count{}",
        "specsample_e2e_request_latency_seconds_count{}",
    ):
        assert after[name] > before.get(name, 0), name
    assert "specsample_spec_decode_recent_acceptance_rate{}" in after
    assert 'specsample_spec_decode_num_accepted_tokens_per_pos_total{"position": "0"}' in after


def test_metrics_count_what_the_controller_did() -> None:
    """The controller's row-rounds (fallback, lookup, past the plan, backlog scorings) and what compiled models did
    (recompiles, eager fallbacks) reach Prometheus as counters, each from its own field of the round's stats."""
    from specsample.engine import RoundResult, RoundStats
    from specsample.server.metrics import ServerMetrics

    metrics = ServerMetrics()
    values = {s.name: s.value for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}
    assert values["specsample_compile_recompiles_total"] == values["specsample_compile_eager_fallbacks_total"] == 0
    stats = RoundStats(
        4,
        3,
        6,
        3,
        7,
        (2, 2, 2),
        (2, 1, 0),
        0.0,
        0.0,
        0.0,
        0.0,
        fallback_rows=1,
        scored_rows=2,
        lookup_rows=3,
        extended_rows=4,
        recompiles=5,
        eager_fallbacks=6,
    )
    metrics.observe_round(RoundResult((), stats, 0.0), running=4, waiting=0)
    metrics.observe_round(RoundResult((), stats, 0.0), running=4, waiting=0)
    values = {s.name: s.value for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}
    assert [
        values[f"specsample_controller_{name}_total"]
        for name in ("fallback_row_rounds", "backlog_scorings", "lookup_row_rounds", "extended_row_rounds")
    ] == [2, 4, 6, 8]
    assert [values[f"specsample_compile_{name}_total"] for name in ("recompiles", "eager_fallbacks")] == [10, 12]


@pytest.mark.parametrize("scope", ["global", "request"])
def test_metrics_report_the_engines_shared_suffix_cache(folders, scope: str) -> None:
    """The server's /metrics reads its engine's suffix cache: a finished request's output (and its prompt's last
    tokens) stay there in global scope; in request scope there is none."""
    from specsample import SamplingParams

    speculator = load(
        EngineOptions(target=str(folders["target"]), draft="suffix", dtype="float32", suffix_cache_scope=scope)
    )
    server = SpecServer(speculator, ServerOptions(model_name=MODEL, max_batch_size=1, max_seq_len=64))
    server.engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=6, seed=0))
    output = [t for r in server.engine.stream() for u in r.rows for t in u.new_tokens]
    values = {
        s.name: s.value
        for f in text_string_to_metric_families(server.metrics_text().decode())
        for s in f.samples
        if s.name.startswith("specsample_suffix_cache")
    }
    if scope == "global":
        assert values["specsample_suffix_cache_tokens"] == 3 + len(output)
        assert values["specsample_suffix_cache_sequences"] == 1 and values["specsample_suffix_cache_bytes"] > 0
    else:
        assert set(values.values()) == {0.0}


def test_api_key_and_draft_swap(folders) -> None:
    server = _server(folders, api_key="secret", admin_key="admin", models_dir=str(folders["target"].parent))
    try:
        with pytest.raises(openai.AuthenticationError):
            server.client("wrong").completions.create(model=MODEL, prompt="hi", max_tokens=3)
        assert httpx.post(server.url + "/v1/completions", json={"prompt": "hi"}).status_code == 401
        client = server.client("secret")
        reference = client.completions.create(model=MODEL, prompt="hello world", max_tokens=60, temperature=0)

        def swap(spec: str, key: str = "admin") -> httpx.Response:
            return httpx.post(
                server.url + "/admin/draft",
                json={"draft": spec},
                headers={"Authorization": f"Bearer {key}"},
                timeout=60,
            )

        stream = client.completions.create(model=MODEL, prompt="hello world", max_tokens=60, temperature=0, stream=True)
        first = next(iter(stream))  # a request in flight on the first draft
        assert swap("draft2").status_code == 200  # swapped while it runs (a draft in the models folder, by name)
        rest = "".join(c.choices[0].text for c in stream)
        assert first.choices[0].text + rest == reference.choices[0].text  # finished, not dropped
        after = client.completions.create(model=MODEL, prompt="hello world", max_tokens=60, temperature=0)
        assert after.choices[0].text == reference.choices[0].text
        assert httpx.get(server.url + "/health").json()["draft"] == "draft2"
        refused = swap("other")  # its vocabulary differs from the target's
        assert refused.status_code == 400 and "unknown or unusable draft" in refused.json()["error"]["message"]
        assert swap("ngram", key="secret").status_code == 403  # the inference key is not the admin key
        assert server.server.engine.drafter.generations <= 2
    finally:
        server.close()


def test_the_prefix_and_prefill_settings_reach_the_built_engine(folders) -> None:
    """What the server's prefix-cache and chunked-prefill settings say is what its engine runs with: the scheduler's
    bounds and the prefill pacer's (0 for the budget's bounds: none)."""
    speculator = load(EngineOptions(target=str(folders["target"]), draft="ngram", dtype="float32"))
    options = ServerOptions(
        model_name=MODEL,
        max_batch_size=2,
        max_seq_len=128,
        prefix_cache_rows=3,
        prefix_cache_tokens=500,
        prefill_chunk_tokens=64,
        prefill_time_ratio=0.5,
    )
    engine = SpecServer(speculator, options).engine
    assert (engine.config.prefix_cache_rows, engine.config.prefix_cache_tokens) == (3, 500)
    assert (engine.pacer.max_tokens, engine.pacer.time_ratio) == (64, 0.5)
    unbounded = replace(options, prefill_chunk_tokens=0, prefill_time_ratio=0)
    assert not SpecServer(speculator, unbounded).engine.pacer.bounded


# ----- what gamma auto plans with: the abilities of the drafter the server routes to ----------------------------


def _served_engine(folders, draft: str):
    """The engine of a server (not started) with `draft` under gamma auto, and the batch states its planner sees."""
    speculator = load(EngineOptions(target=str(folders["target"]), draft=draft, gamma="auto", dtype="float32"))
    engine = SpecServer(speculator, ServerOptions(model_name=MODEL, max_batch_size=2, max_seq_len=128)).engine
    seen: list[BatchState] = []
    plan = engine.planner.plan

    def recording(batch: BatchState) -> RoundPlan:
        seen.append(batch)
        return plan(batch)

    engine.planner.plan = recording  # type: ignore[method-assign]
    return engine, seen


def _finish(engine, prompt: list[int]) -> None:
    engine.add_request(prompt, SamplingParams(max_new_tokens=12, seed=0))
    while engine.has_work():
        engine.step()


def test_serving_ngram_drafting_plans_lookups_not_a_draft_model(folders) -> None:
    engine, seen = _served_engine(folders, "ngram")
    _finish(engine, [5, 6, 7, 8, 5, 6, 7, 8, 5, 6])
    assert seen and all(b.offers_lookups and not b.can_score for b in seen)  # no draft model to score backlogs


def test_a_swap_to_suffix_drafting_brings_its_abilities(folders) -> None:
    engine, seen = _served_engine(folders, str(folders["draft"]))
    _finish(engine, [5, 6, 7, 8, 5, 6])
    assert all(b.can_score and not b.offers_lookups for b in seen)  # a draft model: backlogs, no lookups
    engine.drafter.replace(SuffixDrafter())
    seen.clear()
    _finish(engine, [5, 6, 7, 8, 5, 6])
    assert seen and all(b.offers_lookups and not b.can_score for b in seen)  # the same wrapper, the new drafter's


# ----- shutdown: in flight requests drain until --shutdown-timeout, then end cleanly -----------------------------


class _Draining:
    """A server run by `DrainingServer` in a thread; `signal()` does what SIGTERM or Ctrl-C does."""

    def __init__(self, spec: SpecServer) -> None:
        self.port = free_port()
        config = uvicorn.Config(
            build_app(spec),
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            timeout_graceful_shutdown=FLUSH_SECONDS,
        )
        self.server = DrainingServer(config, spec)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def signal(self) -> None:
        self.server.handle_exit(signal.SIGTERM, None)


async def _stream_events(client: httpx.AsyncClient, body: dict) -> list[str]:
    async with client.stream("POST", "/v1/completions", json=body | {"stream": True}) as response:
        return [line async for line in response.aiter_lines() if line.startswith("data: ")]


def _draining(live, monkeypatch, timeout: float) -> _Draining:
    spec = SpecServer(
        live.server.speculator,
        ServerOptions(model_name=MODEL, max_batch_size=8, max_seq_len=128, shutdown_timeout=timeout),
    )
    step = spec.engine.step

    def slow_step():
        time.sleep(0.1)
        return step()

    monkeypatch.setattr(spec.engine, "step", slow_step)
    return _Draining(spec)


# runs to max_tokens (the special tokens, end of text among them, banned): at least 24 rounds of 0.1 s
LONG = {
    "prompt": "the quick brown fox",
    "max_tokens": 120,
    "temperature": 0.8,
    "seed": 1,
    "logit_bias": {"0": -100, "1": -100, "2": -100},
}


def test_shutdown_finishes_what_fits_in_its_limit_and_ends_the_rest(live, monkeypatch) -> None:
    """After the signal: a new request gets 503, a short request in flight finishes, and at the limit a long stream
    ends with an error event then [DONE] and a long non-streamed request gets 503; then the server stops."""
    server = _draining(live, monkeypatch, timeout=1.0)

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            stream = asyncio.ensure_future(_stream_events(client, LONG))
            plain = asyncio.ensure_future(client.post("/v1/completions", json=LONG))
            short = asyncio.ensure_future(client.post("/v1/completions", json=LONG | {"max_tokens": 4}))
            await asyncio.sleep(0.3)
            server.signal()
            signalled = time.perf_counter()
            await asyncio.sleep(0.1)
            refused = await client.post("/v1/completions", json=LONG)
            events, plain, short = await stream, await plain, await short
            return refused, events, plain, short, time.perf_counter() - signalled

    refused, events, plain, short, elapsed = asyncio.run(run())
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    assert short.status_code == 200 and short.json()["choices"][0]["finish_reason"] == "length"
    assert plain.status_code == 503 and plain.json()["error"]["code"] == "shutting_down"
    assert events[-1] == "data: [DONE]" and json.loads(events[-2][6:])["error"]["code"] == "shutting_down"
    assert 0.9 < elapsed < 2.5
    server.thread.join(timeout=10)
    assert not server.thread.is_alive()


def test_a_second_signal_ends_requests_at_once(live, monkeypatch) -> None:
    server = _draining(live, monkeypatch, timeout=60.0)

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            stream = asyncio.ensure_future(_stream_events(client, LONG))
            plain = asyncio.ensure_future(client.post("/v1/completions", json=LONG))
            await asyncio.sleep(0.3)
            server.signal()
            server.signal()
            signalled = time.perf_counter()
            events, plain = await stream, await plain
            return events, plain, time.perf_counter() - signalled

    events, plain, elapsed = asyncio.run(run())
    assert events[-1] == "data: [DONE]" and plain.status_code == 503 and elapsed < 1.0
    server.thread.join(timeout=10)
    assert not server.thread.is_alive()


# ----- what a seed reproduces (docs/serving.md#reproducibility) -------------------------------------------------

SEEDED = {"prompt": "the quick brown fox", "max_tokens": 24, "temperature": 0.9, "seed": 2024}
OTHERS = [{"prompt": p, "max_tokens": 24, "temperature": 0.9, "seed": i} for i, p in enumerate(PROMPTS[1:4])]


def _texts(server: LiveServer, bodies: list[dict]) -> list[str]:
    """The texts of `bodies`, sent together (batched by the server)."""

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            answers = await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))
        return [c["text"] for a in answers for c in a.json()["choices"]]

    return asyncio.run(run())


@pytest.fixture(scope="module")
def bf16_servers(folders):
    """The server's defaults (rejection sampling, gamma auto) in bfloat16, and deterministic mode in bfloat16."""
    servers = [
        LiveServer(
            SpecServer(
                load(
                    EngineOptions(
                        target=str(folders["target"]),
                        draft=str(folders["draft"]),
                        gamma="auto",
                        max_gamma=4,
                        dtype="bfloat16",
                        **extra,
                    )
                ),
                ServerOptions(model_name=MODEL, max_batch_size=8, max_seq_len=128),
            )
        )
        for extra in ({}, {"deterministic": True})
    ]
    yield servers
    for server in servers:
        server.close()


def test_a_seed_reproduces_alone_with_a_fixed_gamma_under_the_default_sampling(bf16_servers) -> None:
    """Rejection sampling in bfloat16: a seeded request run alone with a fixed num_speculative_tokens, or without
    speculation, gives the same text each time."""
    default, _ = bf16_servers
    for extra in ({"num_speculative_tokens": 3}, {"speculative": False}):
        texts = [_texts(default, [SEEDED | extra])[0] for _ in range(3)]
        assert texts[0] == texts[1] == texts[2]


def test_a_seed_reproduces_whatever_the_batch_in_deterministic_mode(bf16_servers) -> None:
    """Deterministic mode in bfloat16 with gamma auto: a seeded request gives the same text alone, three times in one
    batch beside other requests, and without speculation; choice i of n equals n=1 with seed + i."""
    _, deterministic = bf16_servers
    alone = _texts(deterministic, [SEEDED])[0]
    batched = _texts(deterministic, [SEEDED] * 3 + OTHERS)[:3]
    plain = _texts(deterministic, [SEEDED | {"speculative": False}])[0]
    assert batched == [alone] * 3 and plain == alone
    choices = _texts(deterministic, [SEEDED | {"n": 3}])
    assert choices == [_texts(deterministic, [SEEDED | {"seed": 2024 + i}])[0] for i in range(3)]
