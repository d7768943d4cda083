"""Frozen configuration: how to sample (`SamplingParams`) and how to speculate (`SpecConfig`)."""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, cast

# the smallest temperature above 0 (greedy): float32 logits divided by it stay finite up to |logit| 3.4e34, far
# beyond any model's, so warping never overflows
MIN_TEMPERATURE = 1e-4
SEED_LIMIT = 2**64  # seeds are 0 <= seed < SEED_LIMIT (torch.Generator's range of non-negative seeds)
MAX_TOP_LOGPROBS = 20  # most alternatives a request may ask log-probabilities of, per token
MAX_LOGIT_BIAS = 100.0  # |bias| per token, as OpenAI bounds it
GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "ebnf")
# repetition_penalty's range: a logit divided or multiplied by it stays finite in float32 and bfloat16 up to
# |logit| 3.4e34, far beyond any model's (a penalty of 1e-300 would make it infinite)
REPETITION_PENALTY_RANGE = (1e-4, 1e4)


class SettingError(ValueError):
    """A bad setting; `name` is the setting's field name, for callers that name their own flag or parameter."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True)
class Grammar:
    """A constraint on the output: `json_object` (any JSON object; `text` empty), `json_schema` (`text` the schema as
    JSON), `regex` or `ebnf` (`text` the pattern or the grammar, GBNF as xgrammar reads it)."""

    kind: str
    text: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise SettingError("grammar", f"a grammar's kind is one of {', '.join(GRAMMAR_KINDS)}, got {self.kind!r}")
        if not isinstance(self.text, str):
            raise SettingError("grammar", f"a grammar's text must be a string, got {type(self.text).__name__}")
        if self.kind == "json_object" and self.text:
            raise SettingError("grammar", "a json_object grammar takes no text")
        if self.kind != "json_object" and not self.text:
            raise SettingError("grammar", f"a {self.kind} grammar needs its text")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.text)
            except json.JSONDecodeError as exc:
                raise SettingError("grammar", f"the JSON schema is not valid JSON: {exc}") from None
            if not isinstance(schema, dict):
                raise SettingError("grammar", "a JSON schema must be a JSON object")

    @classmethod
    def json_schema(cls, schema: Mapping | bool | str) -> Grammar:
        """A `json_schema` grammar from a schema given as a mapping or as JSON text. Key order is kept: the output
        writes an object's properties in the order the schema lists them."""
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings; the draft and the target are processed and warped by the same ones.

    Order: the processors act on the logits (repetition penalty, frequency and presence penalties, logit bias,
    grammar mask), each at a position from the tokens before it; then warping: temperature, top-k, top-p, min-p.
    Temperature is 0 (greedy) or at least MIN_TEMPERATURE; any top-p in (0, 1] keeps at least the most likely token.
    """

    temperature: float = 1.0  # 0 means greedy
    top_k: int | None = None  # keep the k most likely tokens; None keeps all
    top_p: float = 1.0  # nucleus: smallest set whose mass reaches top_p; 1.0 keeps all
    min_p: float = 0.0  # drop tokens below min_p * (probability of the most likely token)
    max_new_tokens: int = 128
    seed: int | None = None  # None draws a fresh seed per request
    # processors (OpenAI's and vLLM's definitions); presence and frequency count the generated tokens, repetition the
    # prompt's and the generated ones
    presence_penalty: float = 0.0  # in [-2, 2]: subtracted once from a token that appeared
    frequency_penalty: float = 0.0  # in [-2, 2]: subtracted per appearance
    repetition_penalty: float = 1.0  # in [1e-4, 1e4]: a seen token's positive logit divided by it, a negative one
    # multiplied
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]) added to the logits; a mapping
    # is accepted and stored as sorted pairs
    grammar: Grammar | None = None  # the output must follow it (a token it disallows has probability 0)
    logprobs: int | None = None  # report each emitted token's log-probability and this many top alternatives
    # vLLM's length controls: end-of-sequence tokens get probability 0 until min_tokens are generated (a processor,
    # so the output follows the target with them masked); ignore_eos keeps generating past an end-of-sequence token
    # up to max_new_tokens
    min_tokens: int = 0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        t = self.temperature
        if not _is_real(t) or not math.isfinite(t):
            raise SettingError("temperature", f"temperature must be a finite number, got {t!r}")
        if t < 0 or 0 < t < MIN_TEMPERATURE:
            raise SettingError(
                "temperature", f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {t:g}"
            )
        if self.top_k is not None and (not _is_int(self.top_k) or self.top_k < 1):
            raise SettingError("top_k", f"top_k must be an integer >= 1 or None, got {self.top_k!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise SettingError("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p < 1.0:
            raise SettingError("min_p", f"min_p must be in [0, 1), got {self.min_p!r}")
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise SettingError("max_new_tokens", f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < SEED_LIMIT):
            raise SettingError("seed", f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2.0 <= value <= 2.0:
                raise SettingError(name, f"{name} must be in [-2, 2], got {value!r}")
        rp = self.repetition_penalty
        low, high = REPETITION_PENALTY_RANGE
        if not _is_real(rp) or not low <= rp <= high:
            raise SettingError("repetition_penalty", f"repetition_penalty must be in [{low:g}, {high:g}], got {rp!r}")
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            raise SettingError("grammar", f"grammar must be a Grammar or None, got {type(self.grammar).__name__}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise SettingError(
                "logprobs", f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}] or None, got {self.logprobs!r}"
            )
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise SettingError(
                "min_tokens",
                f"min_tokens must be an integer in [0, {self.max_new_tokens}] (up to max_new_tokens), "
                f"got {self.min_tokens!r}",
            )
        if not isinstance(self.ignore_eos, bool):
            raise SettingError("ignore_eos", f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        if self.ignore_eos and self.grammar is not None:
            raise SettingError(
                "ignore_eos",
                "ignore_eos cannot be combined with a grammar: the grammar's output ends at end-of-sequence",
            )

    @property
    def processed(self) -> bool:
        """True when a processor changes the logits (penalties, logit bias, a grammar or min_tokens)."""
        return (
            self.min_tokens > 0
            or self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
            or bool(self.logit_bias)
            or self.grammar is not None
        )

    @property
    def greedy(self) -> bool:
        """True when decoding takes the argmax (temperature 0)."""
        return self.temperature == 0


def _bias_pairs(bias: object) -> tuple[tuple[int, float], ...]:
    """`logit_bias` as sorted (token, bias) pairs, checked: ids integers >= 0, each once, biases in [-100, 100]."""
    # anything but a mapping or pairs raises TypeError or ValueError below
    given = list(bias.items()) if isinstance(bias, Mapping) else cast(Iterable[tuple[Any, Any]], bias)
    try:
        pairs = [(token, value) for token, value in given]
    except (TypeError, ValueError):
        raise SettingError("logit_bias", "logit_bias is a mapping or pairs of token id and bias") from None
    for token, value in pairs:
        if not _is_int(token) or token < 0:
            raise SettingError("logit_bias", f"logit_bias keys are token ids (integers >= 0), got {token!r}")
        if not _is_real(value) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise SettingError("logit_bias", f"logit_bias values must be in [-100, 100], got {value!r} for {token}")
    if len({t for t, _ in pairs}) != len(pairs):
        raise SettingError("logit_bias", "logit_bias names a token more than once")
    return tuple(sorted((int(t), float(v)) for t, v in pairs))


@dataclass(frozen=True)
class TreeShape:
    """A token tree to draft per row (EAGLE-2's rule): the `branch` most likely children of each expanded node, the
    `branch` nodes of highest cumulative draft probability expanded at each depth, down to `depth`; then the `nodes`
    of highest cumulative probability kept (ancestors always outrank their descendants, so they form a tree)."""

    nodes: int = 16
    branch: int = 4
    depth: int = 6

    def __post_init__(self) -> None:
        for name in ("nodes", "branch", "depth"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise SettingError("tree", f"a tree's {name} must be an integer >= 1, got {value!r}")
        if self.depth > self.nodes:
            raise SettingError("tree", f"a tree of {self.nodes} nodes cannot reach depth {self.depth}")

    @classmethod
    def parse(cls, text: str) -> TreeShape:
        """`NODES` or `NODESxBRANCHxDEPTH` (e.g. `16` or `16x4x6`); the defaults fill what is left out."""
        parts = text.lower().split("x")
        try:
            numbers = [int(p) for p in parts]
        except ValueError:
            numbers = []
        if not 1 <= len(numbers) <= 3 or len(parts) == 2:
            raise SettingError("tree", f"a tree is NODES or NODESxBRANCHxDEPTH (e.g. 16 or 16x4x6), got {text!r}")
        if len(numbers) == 1:
            return cls(numbers[0], cls.branch, min(cls.depth, numbers[0]))
        return cls(*numbers)

    def __str__(self) -> str:
        return f"{self.nodes}x{self.branch}x{self.depth}"


SAMPLING_MODES = ("coupled", "rejection")  # how sampled drafts are verified (SpecConfig.coupled; docs/exactness.md)


@dataclass(frozen=True)
class SpecConfig:
    """What an engine holds: its rows, their length, how sampled tokens are verified. How many drafts a round
    proposes is the planner's (`specsample.planner`); the engine's caches keep room for the most it may plan."""

    speculative: bool = True  # False: plain autoregressive decoding through the same loop
    max_batch_size: int = 16
    max_seq_len: int | None = None  # cache length per row; None = the target's context window
    # tokens the target scores per round at batch 1 for 1, 2, ... tokens asked (extra positions are padding,
    # never read; counts past the table are scored as asked): from row_padding.measure_target_widths
    target_widths: tuple[int, ...] = ()
    # coupled sampling (specsample.verification.coupled): each output position's token is the Gumbel-max of the
    # target with noise keyed by (seed, position), shared with the draft, so a seeded request gives the same tokens
    # whatever the plan and the batch; False: modified rejection sampling (accepts more often; a seed reproduces only
    # under the same plan)
    coupled: bool = False
    # rows of finished requests whose caches are kept (least recently finished dropped first) for a request sharing
    # their prefix, such as the next turn of a chat: it prefills only what follows the shared part; 0: none kept
    prefix_cache_rows: int = 0
    # the most tokens the kept rows hold together (least recently used dropped first); None: bounded by rows alone;
    # 0: no prefix is shared at all (not even a running row's: each request prefills its whole prompt)
    prefix_cache_tokens: int | None = None
    # while other requests decode, a round prefills at most this many prompt tokens (chunked prefill: a longer prompt
    # is prefilled over several rounds, so the running streams keep their pace); None: no bound in tokens
    prefill_chunk_tokens: int | None = None
    # while other requests decode, a round's prefill work (every model's: specsample.prefill_budget) takes about this
    # many times the time their decoding takes per round; None: no bound in time (with no bound in tokens either,
    # whole prompts at once)
    prefill_time_ratio: float | None = None

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {self.max_seq_len}")
        if not isinstance(self.prefix_cache_rows, int) or self.prefix_cache_rows < 0:
            raise ValueError(f"prefix_cache_rows must be an integer >= 0, got {self.prefix_cache_rows!r}")
        if self.prefix_cache_tokens is not None and (
            not _is_int(self.prefix_cache_tokens) or self.prefix_cache_tokens < 0
        ):
            raise SettingError(
                "prefix_cache_tokens", f"prefix_cache_tokens must be an integer >= 0, got {self.prefix_cache_tokens!r}"
            )
        if self.prefill_chunk_tokens is not None and (
            not _is_int(self.prefill_chunk_tokens) or self.prefill_chunk_tokens < 1
        ):
            raise SettingError(
                "prefill_chunk_tokens",
                f"prefill_chunk_tokens must be an integer >= 1, got {self.prefill_chunk_tokens!r}",
            )
        if self.prefill_time_ratio is not None and (
            not _is_real(self.prefill_time_ratio) or not 0 < self.prefill_time_ratio < math.inf
        ):
            raise SettingError(
                "prefill_time_ratio",
                f"prefill_time_ratio must be a number > 0, got {self.prefill_time_ratio!r}",
            )
        for tokens, width in enumerate(self.target_widths, start=1):
            if not isinstance(width, int) or width < tokens:
                raise ValueError(
                    f"target_widths[{tokens - 1}] (the width to score {tokens} tokens at) must be an "
                    f"integer >= {tokens}, got {width!r}"
                )
