"""What real OpenAI clients send, through the official `openai` client against a live server: structured output
that validates against its schema, logprobs consistent streamed and not, penalties and logit bias that change the
output, a 400 naming the parameter for everything we refuse, and a second chat turn that reuses the first's cache."""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import openai
import pytest
from live_server import LiveServer
from model_factory import make_tokenizer, write_hf_model
from prometheus_client.parser import text_string_to_metric_families

from specsample.options import EngineOptions
from specsample.server.options import ServerOptions
from specsample.server.state import SpecServer
from specsample.speculator import load

MODEL = "tiny"
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "mood": {"enum": ["fox", "dog"]}},
    "required": ["ok", "mood"],
    "additionalProperties": False,
}
HELLO = [{"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    root = tmp_path_factory.mktemp("structured")
    tokenizer = make_tokenizer()
    target = write_hf_model(root / "target", "llama", tokenizer=tokenizer, max_position_embeddings=256)
    draft = write_hf_model(root / "draft", "llama", tokenizer=tokenizer, seed=3, num_hidden_layers=1)
    speculator = load(EngineOptions(target=str(target), draft=f"hybrid:{draft}", gamma=3, dtype="float32"))
    server = LiveServer(
        SpecServer(speculator, ServerOptions(model_name=MODEL, max_batch_size=4, max_seq_len=256, prefix_cache_rows=2))
    )
    yield server
    server.close()


def test_json_schema_output_validates(live) -> None:
    client = live.client()
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    for temperature, seed in ((0, None), (1.0, 3)):  # more sampled documents: the corpus test below
        out = client.chat.completions.create(
            model=MODEL,
            messages=HELLO,
            max_tokens=40,
            temperature=temperature,
            seed=seed,
            response_format=response_format,
        )
        assert out.choices[0].finish_reason == "stop"
        answer = json.loads(out.choices[0].message.content)
        jsonschema.validate(answer, SCHEMA)
        assert list(answer) == ["ok", "mood"]  # the schema's order, not sorted
    chunks = client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=40, temperature=0, stream=True, response_format=response_format
    )
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in chunks if c.choices)), SCHEMA)
    free = client.completions.create(
        model=MODEL,
        prompt="the quick",
        max_tokens=60,
        temperature=0.8,
        seed=1,
        extra_body={"response_format": {"type": "json_object"}},
    )
    if free.choices[0].finish_reason == "stop":  # free JSON may need more tokens than it got
        assert isinstance(json.loads(free.choices[0].text), dict)
    else:
        assert free.choices[0].text.startswith("{")


def test_logprobs_consistent_streamed_and_not(live) -> None:
    client = live.client()
    full = client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3
    )
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens
    for entry in content:  # greedy: each token is its position's most likely, and its logprob is that one's
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.token == entry.top_logprobs[0].token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
    streamed = client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3, stream=True
    )
    entries = [e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 5)) for e in entries] == [(e.token, round(e.logprob, 5)) for e in content]
    legacy = client.completions.create(model=MODEL, prompt="the quick brown", max_tokens=10, temperature=0, logprobs=2)
    lp = legacy.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == legacy.usage.completion_tokens
    assert all(1 <= len(top) <= 2 and value <= 0 for top, value in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset == sorted(lp.text_offset)
    plain = client.completions.create(
        model=MODEL,
        prompt="the quick brown",
        max_tokens=10,
        temperature=0,
        logprobs=2,
        extra_body={"speculative": False},
    )  # target-only decoding of the same tokens
    assert plain.choices[0].logprobs.tokens == lp.tokens
    assert plain.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs, abs=1e-4)


def test_logprob_bytes_are_the_tokens_own(live) -> None:
    """A token holding part of a UTF-8 character reports its own bytes, not those of the replacement character
    its text shows."""
    lead = live.server.tokenizer.hf.convert_tokens_to_ids("\u00f0")  # byte-level BPE's symbol for the byte 0xF0
    out = live.client().chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=3, temperature=0, logprobs=True, logit_bias={str(lead): 100}
    )
    assert [e.bytes for e in out.choices[0].logprobs.content] == [[0xF0]] * 3


def test_penalties_and_bias_change_the_output(live) -> None:
    client = live.client()

    def text(**extra) -> str:
        return (
            client.completions.create(model=MODEL, prompt="the quick brown fox", max_tokens=24, temperature=0, **extra)
            .choices[0]
            .text
        )

    plain = text()
    assert text(frequency_penalty=2.0) != plain
    assert text(presence_penalty=2.0) != plain
    assert text(extra_body={"repetition_penalty": 3.0}) != plain
    fox = client.completions.create(
        model=MODEL, prompt="hello", max_tokens=4, temperature=0, logit_bias={"100": 100}, logprobs=0
    )
    assert fox.choices[0].logprobs.tokens[0] == live.server.tokenizer.hf.decode([100])


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("chat", {"top_logprobs": 2}, "top_logprobs"),
        ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("chat", {"response_format": {"type": "regex"}}, "response_format.type"),
        ("chat", {"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            "chat",
            {"response_format": {"type": "json_object", "json_schema": {"name": "x", "schema": {}}}},
            "response_format.json_schema",
        ),
        (
            "chat",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
            "response_format.json_schema.schema",
        ),
        (
            "chat",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
            "response_format.json_schema.schema",
        ),
        (
            "chat",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {
                            "type": "object",
                            "properties": {"s": {"type": "string", "pattern": "^[0-9]{1,16000}$"}},
                        },
                    },
                }
            },
            "response_format.json_schema.schema",
        ),
        ("chat", {"logit_bias": {"abc": 1}}, "logit_bias"),
        ("chat", {"logit_bias": {"5": 101}}, "logit_bias"),
        ("chat", {"logit_bias": {"99999": 1}}, "logit_bias"),
        ("chat", {"frequency_penalty": 2.5}, "frequency_penalty"),
        ("chat", {"repetition_penalty": 0}, "repetition_penalty"),
        ("completions", {"logprobs": 21}, "logprobs"),
        ("completions", {"logprobs": True}, "logprobs"),
        ("completions", {"echo": True, "logprobs": 1}, "echo"),
    ],
)
def test_unsupported_combinations_are_400_naming_the_parameter(live, path, body, param) -> None:
    base = {"messages": HELLO} if path == "chat" else {"prompt": "hi"}
    route = "/v1/chat/completions" if path == "chat" else "/v1/completions"
    response = httpx.post(live.url + route, json={"model": MODEL, "max_tokens": 4, **base, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


def test_second_turn_reuses_the_first_turns_cache_of_its_own_key_and_salt(live) -> None:
    """The second turn reuses the first's cache, but only when it presents the same API key and cache_salt: another
    key, or another salt, reuses nothing (and leaves the row for its owner)."""
    client = live.client(key="tenant-a")

    def counters() -> dict[str, float]:
        families = text_string_to_metric_families(httpx.get(live.url + "/metrics").text)
        return {s.name: s.value for f in families for s in f.samples if s.name.startswith("specsample_prefix_cache")}

    history = [{"role": "user", "content": "the quick brown fox jumps over the lazy dog " * 3}]
    first = client.chat.completions.create(model=MODEL, messages=history, max_tokens=8, temperature=0)
    history += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "hello world"},
    ]
    hits, reused = "specsample_prefix_cache_hits_total", "specsample_prefix_cache_reused_tokens_total"

    def turn(other, **extra) -> tuple[float, float]:
        before = counters()
        other.chat.completions.create(model=MODEL, messages=history, max_tokens=8, temperature=0, extra_body=extra)
        after = counters()
        return after[hits] - before[hits], after[reused] - before[reused]

    assert turn(live.client(key="tenant-b")) == (0, 0)
    hit, tokens = turn(client)
    assert hit == 1 and tokens > 30
    assert turn(client, cache_salt="session-2") == (0, 0)
    held = counters()  # what the kept rows hold, read at the scrape
    assert held["specsample_prefix_cache_rows"] >= 1 and held["specsample_prefix_cache_tokens"] > 30
    assert held["specsample_prefix_cache_bytes"] > held["specsample_prefix_cache_tokens"]
    assert held["specsample_prefix_cache_capacity_tokens"] == -1
    assert held["specsample_prefix_cache_prefilled_tokens_total"] > 0


# documents served under a schema, sampled from the random tiny model (valid only when the grammar is right)
SERVED_CORPUS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "n": {"type": "integer", "minimum": -5, "maximum": 120},
            "tags": {"type": "array", "items": {"enum": ["a", 'b"', "c\n"]}, "maxItems": 3},
        },
        "required": ["name", "n", "tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"free": {"type": "string", "pattern": "^.{1,12}$"}, "day": {"type": "string", "format": "date"}},
        "required": ["free", "day"],
    },
    {
        "anyOf": [
            {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
            {"type": ["string", "null"], "minLength": 2, "maxLength": 4},
        ]
    },
]


def test_completions_that_stop_under_a_schema_validate_against_it(live) -> None:
    """Four sampled choices per schema at temperature 1: every one that ends "stop" parses and validates (most do)."""
    client, stopped = live.client(), 0
    for i, schema in enumerate(SERVED_CORPUS):
        out = client.chat.completions.create(
            model=MODEL,
            messages=HELLO,
            max_tokens=80,
            temperature=1.0,
            seed=i,
            n=4,
            response_format={"type": "json_schema", "json_schema": {"name": "doc", "schema": schema}},
        )
        for choice in out.choices:
            if choice.finish_reason == "stop":
                jsonschema.validate(
                    json.loads(choice.message.content),
                    schema,
                    format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER,
                )
                stopped += 1
    assert stopped >= len(SERVED_CORPUS) * 4 // 2


def test_a_schema_compiles_once_whatever_its_annotations_and_within_its_time_limit(live, monkeypatch) -> None:
    """Schemas differing only in title and description compile once; a compile past --grammar-compile-timeout is a
    400 naming response_format and the limit."""
    pool, client = live.server.grammar_pool, live.client()

    def ask(schema: dict):
        return client.chat.completions.create(
            model=MODEL,
            messages=HELLO,
            max_tokens=4,
            temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "doc", "schema": schema}},
        )

    before = pool.compiled
    for note in ("first", "second", "third"):
        ask({"type": "object", "title": note, "properties": {"z": {"type": "integer", "description": note}}})
    assert pool.compiled - before == 1
    idle = list(pool._idle)  # the late compile takes the last
    monkeypatch.setattr(pool, "timeout", 1e-4)
    with pytest.raises(openai.BadRequestError) as caught:
        ask({"type": "object", "properties": {"late": {"type": "string", "pattern": "^.{900}$"}}})
    error = caught.value.body
    assert error["param"] == "response_format" and "--grammar-compile-timeout" in error["message"]
    deadline = time.time() + 5
    while idle[-1].returncode is None and time.time() < deadline:  # reaped in the server's loop
        time.sleep(0.02)
    assert idle[-1].returncode is not None and pool.started == len(idle) - 1  # its worker was killed
