"""What real OpenAI clients send, through the official `openai` client against a live server: structured output
that validates against its schema, logprobs consistent streamed and not, penalties and logit bias that change the
output, a 400 naming the parameter for everything we refuse, and a second chat turn that reuses the first's cache."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from live_server import LiveServer
from model_factory import make_tokenizer, write_hf_model
from specsample.server.app import SpecServer
from specsample.server.options import ServerOptions
from specsample.speculator import EngineOptions, load

MODEL = "tiny"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "mood": {"enum": ["fox", "dog"]}},
          "required": ["ok", "mood"], "additionalProperties": False}
HELLO = [{"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    root = tmp_path_factory.mktemp("structured")
    tokenizer = make_tokenizer()
    target = write_hf_model(root / "target", "llama", tokenizer=tokenizer, max_position_embeddings=256)
    draft = write_hf_model(root / "draft", "llama", tokenizer=tokenizer, seed=3, num_hidden_layers=1)
    speculator = load(EngineOptions(target=str(target), draft=f"hybrid:{draft}", gamma=3, dtype="float32"))
    server = LiveServer(SpecServer(speculator, ServerOptions(model_name=MODEL, max_batch_size=4, max_model_len=256,
                                                             prefix_cache_rows=2)))
    yield server
    server.close()


def test_json_schema_output_validates(live) -> None:
    client = live.client()
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    for temperature, seed in ((0, None), (1.0, 3), (1.0, 4)):
        out = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=40, temperature=temperature,
                                             seed=seed, response_format=response_format)
        assert out.choices[0].finish_reason == "stop"
        answer = json.loads(out.choices[0].message.content)
        jsonschema.validate(answer, SCHEMA)
        assert list(answer) == ["ok", "mood"]  # the schema's order, not sorted
    chunks = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=40, temperature=0, stream=True,
                                            response_format=response_format)
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in chunks if c.choices)), SCHEMA)
    free = client.completions.create(model=MODEL, prompt="the quick", max_tokens=60, temperature=0.8, seed=1,
                                     extra_body={"response_format": {"type": "json_object"}})
    if free.choices[0].finish_reason == "stop":  # free JSON may need more tokens than it got
        assert isinstance(json.loads(free.choices[0].text), dict)
    else:
        assert free.choices[0].text.startswith("{")


def test_logprobs_consistent_streamed_and_not(live) -> None:
    client = live.client()
    full = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=12, temperature=0, logprobs=True,
                                          top_logprobs=3)
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens
    for entry in content:  # greedy: each token is its position's most likely, and its logprob is that one's
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.token == entry.top_logprobs[0].token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
    streamed = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=12, temperature=0,
                                              logprobs=True, top_logprobs=3, stream=True)
    entries = [e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 5)) for e in entries] == [(e.token, round(e.logprob, 5)) for e in content]
    legacy = client.completions.create(model=MODEL, prompt="the quick brown", max_tokens=10, temperature=0, logprobs=2)
    lp = legacy.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == legacy.usage.completion_tokens
    assert all(1 <= len(top) <= 2 and value <= 0 for top, value in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset == sorted(lp.text_offset)
    plain = client.completions.create(model=MODEL, prompt="the quick brown", max_tokens=10, temperature=0, logprobs=2,
                                      extra_body={"speculative": False})  # target-only decoding of the same tokens
    assert plain.choices[0].logprobs.tokens == lp.tokens
    assert plain.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs, abs=1e-4)


def test_logprob_bytes_are_the_tokens_own(live) -> None:
    """A token holding part of a UTF-8 character reports its own bytes, not those of the replacement character
    its text shows."""
    lead = live.server.tokenizer.hf.convert_tokens_to_ids("\u00f0")  # byte-level BPE's symbol for the byte 0xF0
    out = live.client().chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3, temperature=0,
                                                logprobs=True, logit_bias={str(lead): 100})
    assert [e.bytes for e in out.choices[0].logprobs.content] == [[0xF0]] * 3


def test_penalties_and_bias_change_the_output(live) -> None:
    client = live.client()

    def text(**extra) -> str:
        return client.completions.create(model=MODEL, prompt="the quick brown fox", max_tokens=24, temperature=0,
                                         **extra).choices[0].text

    plain = text()
    assert text(frequency_penalty=2.0) != plain
    assert text(presence_penalty=2.0) != plain
    assert text(extra_body={"repetition_penalty": 3.0}) != plain
    fox = client.completions.create(model=MODEL, prompt="hello", max_tokens=4, temperature=0,
                                    logit_bias={"100": 100}, logprobs=0)
    assert fox.choices[0].logprobs.tokens[0] == live.server.tokenizer.hf.decode([100])


@pytest.mark.parametrize("path, body, param", [
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"response_format": {"type": "regex"}}, "response_format.type"),
    ("chat", {"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ("chat", {"response_format": {"type": "json_object", "json_schema": {"name": "x", "schema": {}}}},
     "response_format.json_schema"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "response_format.json_schema.schema"),
    ("chat", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("chat", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("chat", {"logit_bias": {"99999": 1}}, "logit_bias"),
    ("chat", {"frequency_penalty": 2.5}, "frequency_penalty"),
    ("chat", {"repetition_penalty": 0}, "repetition_penalty"),
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"logprobs": True}, "logprobs"),
    ("completions", {"echo": True, "logprobs": 1}, "echo"),
])
def test_unsupported_combinations_are_400_naming_the_parameter(live, path, body, param) -> None:
    base = {"messages": HELLO} if path == "chat" else {"prompt": "hi"}
    route = "/v1/chat/completions" if path == "chat" else "/v1/completions"
    response = httpx.post(live.url + route, json={"model": MODEL, "max_tokens": 4, **base, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


def test_second_turn_reuses_the_first_turns_cache(live) -> None:
    client = live.client()

    def counters() -> dict[str, float]:
        families = text_string_to_metric_families(httpx.get(live.url + "/metrics").text)
        return {s.name: s.value for f in families for s in f.samples if s.name.startswith("specsample_prefix_cache")}

    history = [{"role": "user", "content": "the quick brown fox jumps over the lazy dog " * 3}]
    first = client.chat.completions.create(model=MODEL, messages=history, max_tokens=8, temperature=0)
    before = counters()
    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "hello world"}]
    client.chat.completions.create(model=MODEL, messages=history, max_tokens=8, temperature=0)
    after = counters()
    assert after["specsample_prefix_cache_hits_total"] - before["specsample_prefix_cache_hits_total"] == 1
    reused = "specsample_prefix_cache_reused_tokens_total"
    assert after[reused] - before[reused] > 30
