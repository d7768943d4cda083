"""Structured output gives valid JSON or a clear refusal: schemas are checked before compiling (specsample.json_schema),
every document a served grammar can produce parses and validates against its schema (random walks through the
grammar, `jsonschema` as the judge, and the same walks through xgrammar's own grammar as the broken twin), and grammars
compile in worker processes that a time limit or a cancellation kills (specsample.server.grammar_pool)."""

from __future__ import annotations

import asyncio
import json
import random
import re
from datetime import datetime, time

import jsonschema
import pytest
import torch
from model_factory import make_tokenizer

from specsample.config import Grammar, SettingError
from specsample.grammar import GrammarCompiler, unpack_bitmask
from specsample.json_schema import MAX_PATTERN_SIZE, SchemaError, served_schema
from specsample.server.grammar_pool import GrammarPool

xgrammar = pytest.importorskip("xgrammar")

# every schema here is served; each keyword the grammar enforces appears in at least one
CORPUS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "ok": {"type": "boolean"},
            "mood": {"enum": ["fox", "dog", 'a"b\n']},
        },
        "required": ["name", "age", "ok", "mood"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z][a-z]{0,5}\\d?$"},
            "free": {"type": "string", "pattern": "^.{1,8}$"},
            "no_comma": {"type": "string", "pattern": "[^,]{2,4}"},
            "marks": {"type": "string", "pattern": "^\\W\\S\\D\\w\\s$"},
        },
        "required": ["code", "free", "no_comma", "marks"],
    },
    {
        "type": "array",
        "items": {"type": "number", "exclusiveMinimum": -1.5, "exclusiveMaximum": 2.5},
        "minItems": 1,
        "maxItems": 4,
    },
    {
        "type": "array",
        "prefixItems": [{"type": "string", "minLength": 2, "maxLength": 3}, {"type": "null"}],
        "items": False,
    },
    {"anyOf": [{"type": "integer", "minimum": 5, "maximum": 9}, {"type": ["string", "null"], "maxLength": 2}]},
    {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "v": {"type": "integer"},
                    "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
                },
                "required": ["v"],
            }
        },
        "$ref": "#/$defs/node",
    },
    {
        "type": "object",
        "properties": {
            "day": {"type": "string", "format": "date"},
            "mail": {"type": "string", "format": "email"},
            "id": {"type": "string", "format": "uuid"},
            "ip": {"type": "string", "format": "ipv6"},
        },
        "required": ["day", "mail", "id", "ip"],
    },
    {
        "type": "array",
        "prefixItems": [
            {"type": "string", "format": "date-time"},
            {"type": "string", "format": "time"},
            {"type": "string", "format": "duration"},
        ],
        "minItems": 3,
        "items": False,
    },
    {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 1, "maxProperties": 2},
    {
        "type": "object",
        "properties": {"inner": {"allOf": [{"$ref": "#/definitions/x"}], "description": "d"}},
        "definitions": {"x": {"type": "string", "minLength": 3}},
        "required": ["inner"],
    },
    {"type": "integer", "enum": [1, "two", 3]},
    {"type": "object"},
    {"type": "object", "properties": {'ключ "q"': {"const": "значение\t"}}, "required": ['ключ "q"']},
]
WALKS = 16  # random walks per schema
STEPS = 300  # tokens a walk may take before it is dropped as unfinished


@pytest.fixture(scope="module")
def compiler():
    tokenizer = make_tokenizer()
    return tokenizer, GrammarCompiler.from_tokenizer(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def _walks(tokenizer, compiled, seed: int) -> list[str]:
    """The texts of random walks through `compiled`: each step a uniformly random allowed token (the end, when
    allowed, half the time); unfinished walks are dropped."""
    rng, texts = random.Random(seed), []
    words = (len(tokenizer) + 31) // 32
    for _ in range(WALKS):
        matcher, ids = xgrammar.GrammarMatcher(compiled), []
        for _ in range(STEPS):
            if matcher.is_terminated():
                texts.append(tokenizer.decode(ids))
                break
            bitmask = torch.full((1, words), -1, dtype=torch.int32)
            matcher.fill_next_token_bitmask(bitmask, 0)
            allowed = unpack_bitmask(bitmask, len(tokenizer))[0].nonzero().flatten().tolist()
            end = tokenizer.eos_token_id
            token = end if end in allowed and rng.random() < 0.5 else rng.choice(allowed)
            assert matcher.accept_token(token)
            if token != end:
                ids.append(token)
    return texts


# RFC 3339's date-time, time and duration (jsonschema checks them only with optional packages)
_TIME = r"\d{2}:\d{2}:\d{2}(?:\.\d+)?(?:[Zz]|[+-]\d{2}:\d{2})"
_DURATION_TIME = r"T(?:\d+H(?:\d+M(?:\d+S)?)?|\d+M(?:\d+S)?|\d+S)"
_DURATION = rf"P(?:\d+W|(?:\d+Y(?:\d+M(?:\d+D)?)?|\d+M(?:\d+D)?|\d+D)(?:{_DURATION_TIME})?|{_DURATION_TIME})"
FORMATS = jsonschema.FormatChecker()
FORMATS.checks("date-time")(
    lambda v: (
        not isinstance(v, str)
        or bool(re.fullmatch(rf"\d{{4}}-\d{{2}}-\d{{2}}[Tt]{_TIME}", v))
        and _parses(datetime.fromisoformat, v)
    )
)
FORMATS.checks("time")(
    lambda v: not isinstance(v, str) or bool(re.fullmatch(_TIME, v)) and _parses(time.fromisoformat, v)
)
FORMATS.checks("duration")(lambda v: not isinstance(v, str) or bool(re.fullmatch(_DURATION, v)))


def _parses(parse, value: str) -> bool:
    """Whether `parse` reads `value` (a leap second, :60, read as :59)."""
    try:
        parse(re.sub(r"(\d{2}:\d{2}):60", r"\1:59", value.upper().replace("Z", "+00:00")))
    except ValueError:
        return False
    return True


def _invalid(texts: list[str], schema: dict) -> list[str]:
    """The texts that are not JSON documents valid against `schema` (formats checked)."""
    validator = jsonschema.Draft202012Validator(schema, format_checker=FORMATS)
    bad = []
    for text in texts:
        try:
            validator.validate(json.loads(text))
        except (ValueError, jsonschema.ValidationError):
            bad.append(text)
    return bad


def test_every_walk_through_a_served_grammar_validates(compiler) -> None:
    """All walks through every corpus grammar validate; through xgrammar's grammars of the same schemas (the twin:
    raw control characters in length-bounded strings, quotes and unknown keywords unchecked), some do not."""
    tokenizer, grammars = compiler
    finished, twin_bad = 0, 0
    for i, schema in enumerate(CORPUS):
        texts = _walks(tokenizer, grammars.compile(Grammar.json_schema(schema)), seed=i)
        assert _invalid(texts, schema) == [], schema
        assert len(texts) >= 3, schema  # the judge saw documents of every schema
        finished += len(texts)
        raw = grammars._compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        twin_bad += len(_invalid(_walks(tokenizer, raw, seed=i), schema))
    assert finished >= len(CORPUS) * WALKS // 2
    assert twin_bad >= 5


@pytest.mark.parametrize(
    "schema, named",
    [
        ({"anyOf": []}, "anyOf"),
        ({"type": "integer", "const": "abc"}, "const"),
        ({"not": {"type": "string"}}, "'not'"),
        ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "'allOf'"),
        ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "'oneOf'"),
        ({"$ref": "https://example.com/schema.json"}, "$ref"),
        ({"$ref": "#/$defs/missing"}, "$ref"),
        ({"$defs": {"x": {}}, "$ref": "#/$defs/x", "minimum": 3}, "'minimum'"),
        ({"type": "string", "format": "credit-card"}, "format"),
        ({"type": "string", "format": "ipv4"}, "format"),
        ({"type": "array", "items": {}, "uniqueItems": True}, "'uniqueItems'"),
        ({"type": "integer", "multipleOf": 3}, "'multipleOf'"),
        ({"type": "object", "patternProperties": {"^a": {}}}, "'patternProperties'"),
        ({"if": {}, "then": {}}, "'if'"),
        ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "required"),
        ({"minLength": 2}, "'minLength'"),
        ({"type": "string", "pattern": "^a+$", "maxLength": 3}, "together"),
        ({"type": "string", "pattern": "^[0-9]{1,16000}$"}, f"the limit is {MAX_PATTERN_SIZE}"),
        ({"type": "string", "pattern": "^(?:a{40}){40}$"}, f"the limit is {MAX_PATTERN_SIZE}"),
        ({"type": "string", "pattern": '^say "hi"$'}, "JSON writes escaped"),
        ({"type": "string", "pattern": "^a\\\\b$"}, "JSON writes escaped"),
        ({"type": "string", "pattern": "^(a)\\1$"}, "backreference"),
        ({"type": "string", "pattern": "^a(?=b)"}, "lookaround"),
        ({"type": "string", "pattern": "(?i)abc"}, "flags"),
        ({"type": "string", "pattern": "^[\\x00-\\x1f]$"}, "no character"),
        ({"type": "string", "pattern": "[unclosed"}, "not a regular expression"),
        ({"type": "bogus"}, "type"),
    ],
)
def test_what_the_grammar_cannot_enforce_is_refused_by_name(schema, named) -> None:
    with pytest.raises(SchemaError, match=None) as caught:
        served_schema(schema)
    assert named in str(caught.value)


def test_the_format_judge_can_fail() -> None:
    assert (
        _invalid(
            ['"2020-01-01 10:00:00"', '"25:00"', '"P"', '"P1DT"'],
            {"anyOf": [{"type": "string", "format": f} for f in ("date-time", "time", "duration")]},
        )
        != []
    )


def test_annotations_do_not_change_the_served_form() -> None:
    """Two schemas differing in title, description, examples, default or $comment serve (and cache) as one; a
    property that happens to be named "title" is kept, and the served form is its own served form."""
    plain = {"type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]}
    annotated = {
        "type": "object",
        "title": "T",
        "description": "D",
        "$comment": "C",
        "examples": [{}],
        "properties": {"title": {"type": "string", "description": "the title", "default": "x"}},
        "required": ["title"],
    }
    assert served_schema(annotated) == served_schema(plain) == plain
    for schema in CORPUS:
        assert served_schema(served_schema(schema)) == served_schema(schema)


def test_a_pattern_produces_what_the_original_accepts() -> None:
    """The rewritten `.` and classes admit no quote, backslash or control character, and what they admit the
    original pattern matches (Python's reading, the judge's)."""
    import re

    rewritten = served_schema({"type": "string", "pattern": "^.[^a]\\D\\W\\S$"})["pattern"]
    probe = [chr(c) for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF][::97] + ['"', "\\", "\n", "\t", "\x7f"]
    for char in probe:
        text = char * 5
        if re.fullmatch(rewritten, text):
            assert char not in '"\\' and ord(char) >= 0x20
            assert re.search("^.[^a]\\D\\W\\S$", text)


def test_grammar_errors_carry_no_build_paths(compiler) -> None:
    _, grammars = compiler
    with pytest.raises(SettingError) as caught:
        grammars.compile(Grammar.json_schema({"type": "integer", "minimum": 5, "maximum": 3}))
    message = str(caught.value)
    assert "minimum greater than maximum" in message and ".cc" not in message and "[" not in message


def test_a_compile_cancelled_while_its_worker_starts_kills_the_worker(compiler) -> None:
    """A cancelled compile (its client left) kills its worker process, here while it starts; the time limit's kill,
    and the cache keyed by the served form, are tested through the server (test_server_structured.py)."""
    _, grammars = compiler

    async def run():
        pool = GrammarPool(grammars, workers=1, timeout=60)
        try:
            starting = asyncio.ensure_future(pool.compile(Grammar.json_schema({"type": "boolean"})))
            while not pool._busy:
                await asyncio.sleep(0.01)
            (worker,) = pool._busy
            starting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await starting
            assert await asyncio.wait_for(worker.process.wait(), 5) != 0
            assert pool.started == 0 and not pool._slots.locked()
        finally:
            pool.close()

    asyncio.run(run())
