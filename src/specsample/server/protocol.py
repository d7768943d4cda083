"""The OpenAI request schema we honour, and the text assembly (stop strings) for one choice.

Every field either changes what we do or is rejected: an unknown field, or a known one set to a
value that would change the output in a way we do not implement, is a 400 — never ignored. Types are
strict (JSON true is not 1, "yes" is not a boolean), and the sampling settings follow the engine's own
rules (`SamplingParams`), so a request that validates can be sampled.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from specsample.config import MAX_TOP_LOGPROBS, Grammar, SamplingParams, SettingError
from specsample.json_schema import SchemaError, json_depth, served_schema
from specsample.tokenizer import StreamDecoder

MAX_JSON_DEPTH = 100  # nesting of objects and arrays in a request body (a schema inside may nest 64 levels)


class ProtocolError(ValueError):
    """A request we refuse, with the offending parameter for the OpenAI error object."""

    def __init__(
        self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error"
    ) -> None:
        super().__init__(message)
        self.param, self.status, self.kind = param, status, kind


STRICT = ConfigDict(extra="forbid", strict=True)


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the output always follows the schema, strict or not


class ResponseFormat(BaseModel):
    model_config = STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    _served: dict[str, Any] | bool | None = PrivateAttr(None)  # the schema as the grammar compiles it

    @model_validator(mode="after")
    def _schema_where_needed(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ProtocolError(
                "response_format of type json_schema needs json_schema.schema", "response_format.json_schema"
            )
        if self.type != "json_schema" and self.json_schema is not None:
            raise ProtocolError(
                f"response_format of type {self.type} takes no json_schema", "response_format.json_schema"
            )
        if self.type == "json_schema":
            assert self.json_schema is not None  # checked above
            try:  # a keyword the grammar cannot enforce, or a schema past the limits, is refused here
                self._served = served_schema(self.json_schema.schema_)
            except SchemaError as exc:
                raise ProtocolError(
                    f"response_format.json_schema.schema: {exc}", "response_format.json_schema.schema"
                ) from None
        return self

    def grammar(self) -> Grammar | None:
        """The grammar the output follows; a schema in its served form (specsample.json_schema), which is what the
        compiled-grammar cache is keyed by."""
        if self.type == "json_object":
            return Grammar("json_object")
        if self.type == "json_schema":
            assert self._served is not None  # set by validation
            return Grammar.json_schema(self._served)
        return None


class _Sampling(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = STRICT
    model: str | None = None
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = None  # extension; None, 0 or -1 = off (vLLM's convention)
    min_p: float = Field(0.0, ge=0.0, lt=1.0)  # extension
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = Field(None, validate_default=True)
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    speculative: bool = True  # extension: false = plain decoding for this request
    num_speculative_tokens: int | None = Field(None, ge=1)  # extension: a fixed gamma for this request
    user: str | None = None  # recorded nowhere; does not change the output
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # extension (vLLM's)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    response_format: ResponseFormat | None = None
    # vLLM's length controls (load clients send them to fix output lengths): no end-of-sequence token (nor stop
    # string ending) before min_tokens output tokens; ignore_eos generates past end-of-sequence up to max_tokens
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    # vLLM's: requests reuse each other's cached prefixes only when they carry the same salt (and API key)
    cache_salt: str | None = Field(None, min_length=1, max_length=256)

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int | None) -> int | None:
        if value in (None, 0, -1):
            return None
        if value < 1:
            raise ValueError("top_k must be >= 1 (or 0 / -1 for no limit)")
        return value

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not (key.isascii() and key.isdigit()):  # "²" and "١٢" are digits to str.isdigit, not token ids
                raise ValueError(f"logit_bias keys are token ids written in ASCII digits, got {key!r}")
        return value

    @model_validator(mode="after")
    def _combinations(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:
            raise ProtocolError("stream_options is only allowed with stream: true", "stream_options")
        return self

    @model_validator(mode="after")
    def _samplable(self) -> _Sampling:
        """The engine's rules for the sampling settings (e.g. temperature 0 or at least MIN_TEMPERATURE)."""
        try:
            self.sampling_params(max_new_tokens=max(1, self.min_tokens))  # against max_tokens: once it is known
        except SettingError as exc:
            raise ProtocolError(str(exc), PARAM_NAMES.get(exc.name, exc.name)) from None
        return self

    def top_logprobs_asked(self) -> int | None:
        """How many alternatives to report per token (None: no logprobs)."""
        raise NotImplementedError

    def stop_strings(self) -> list[str]:
        """`stop` as validated: a list of strings."""
        return self.stop if isinstance(self.stop, list) else []

    def sampling_params(self, max_new_tokens: int, seed: int | None = None) -> SamplingParams:
        """The engine's settings for this request (one choice, seeded with `seed`)."""
        return SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            max_new_tokens=max_new_tokens,
            seed=seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=tuple((int(k), v) for k, v in (self.logit_bias or {}).items()),
            grammar=self.response_format.grammar() if self.response_format is not None else None,
            logprobs=self.top_logprobs_asked(),
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
        )


# SamplingParams' field names that the API spells otherwise
PARAM_NAMES = {"grammar": "response_format", "max_new_tokens": "max_tokens"}
S = TypeVar("S", bound=_Sampling)  # a request schema


class CompletionRequest(_Sampling):
    prompt: str | list[int]
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # alternatives per token (the legacy API's form)

    def top_logprobs_asked(self) -> int | None:
        return self.logprobs

    @model_validator(mode="after")
    def _completion_only(self) -> CompletionRequest:
        if self.echo:
            raise ProtocolError("echo is not supported", "echo")
        if self.best_of not in (None, self.n):
            raise ProtocolError("best_of is not supported (only equal to n)", "best_of")
        if self.suffix:
            raise ProtocolError("suffix is not supported", "suffix")
        if not self.prompt:
            raise ProtocolError("prompt is empty", "prompt")
        return self


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _chat_only(self) -> ChatRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ProtocolError("top_logprobs needs logprobs: true", "top_logprobs")
        return self

    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def conversation(self) -> list[dict[str, str]]:
        """Messages for the chat template ('developer' is the newer name of 'system')."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


def validate_request(schema: type[S], data: Any) -> S:
    """Validate a parsed JSON body against `schema`; raise `ProtocolError` naming the parameter at fault."""
    if not isinstance(data, dict):
        raise ProtocolError("request body must be a JSON object")
    depth = json_depth(data)
    if depth > MAX_JSON_DEPTH:
        raise ProtocolError(f"the request body nests {depth} levels deep; the limit is {MAX_JSON_DEPTH}")
    where = _lone_surrogate(data)
    if where is not None:
        param = ".".join(map(str, where)) or None
        raise ProtocolError(
            f"{param or 'a field name'}: text must be valid Unicode (it holds a lone UTF-16 surrogate)", param
        )
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise _protocol_error(exc, data) from None


def _lone_surrogate(value: Any, path: tuple = ()) -> tuple | None:
    """The path to the first string that is not valid Unicode (a lone surrogate), or None; for a field name, the
    path of the object holding it."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            found = _lone_surrogate(key, path)
            found = found if found is not None else _lone_surrogate(item, path + (key,))
            if found is not None:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found = _lone_surrogate(item, path + (index,))
            if found is not None:
                return found
    return None


def _protocol_error(exc: ValidationError, data: dict) -> ProtocolError:
    """The validation error that got deepest into the request, as a `ProtocolError` naming its parameter: a rule of
    ours names its own; otherwise the parameter is the error's location in the body (union branch names left out)."""
    error = max(exc.errors(), key=lambda e: len(e["loc"]))
    cause = (error.get("ctx") or {}).get("error")
    if isinstance(cause, ProtocolError):
        return cause
    path, value = [], data
    for part in error["loc"]:
        if (
            isinstance(value, dict)
            and part in value
            or isinstance(value, list)
            and isinstance(part, int)
            and 0 <= part < len(value)
        ):
            path.append(part)
            value = value[part]
        elif error["type"] == "missing" and part == error["loc"][-1]:
            path.append(part)
    param = ".".join(map(str, path)) or None
    if error["type"] == "extra_forbidden":
        return ProtocolError(f"Unrecognized request argument supplied: {param}", param)
    if cause is not None:  # our own rules' messages name what they check
        return ProtocolError(str(cause), param)
    return ProtocolError(f"{param}: {error['msg']}" if param else error["msg"], param)


class TextAssembler:
    """Detokenises one choice incrementally and applies stop strings, also across round boundaries.

    Text that could still be the start of a stop string is held back until it cannot be. With `min_tokens`, a stop
    string counts only where it ends after the text of the first `min_tokens` tokens (vLLM's rule).
    """

    def __init__(self, decoder: StreamDecoder, stops: list[str], min_tokens: int = 0) -> None:
        self.decoder = decoder
        self.stops = stops
        self.pending = ""
        self.stopped = False
        self.min_tokens = min_tokens
        self.tokens = 0  # tokens pushed
        self.released = 0  # characters released before `pending`
        self.guard = 0  # a stop string must end after this character (text of the first min_tokens tokens)

    def push(self, token_ids: tuple[int, ...]) -> str:
        """Add tokens; return the text that is final now (empty once a stop string matched)."""
        if self.stopped:
            return ""
        early = max(0, min(len(token_ids), self.min_tokens - self.tokens))  # tokens still under min_tokens
        if early:
            self.pending += self.decoder.push(tuple(token_ids[:early]))
            self.guard = self.released + len(self.pending)
        self.pending += self.decoder.push(tuple(token_ids[early:])) if early < len(token_ids) else ""
        self.tokens += len(token_ids)
        return self._release(final=False)

    def finish(self) -> str:
        """Flush at the end of generation."""
        if self.stopped:
            return ""
        self.pending += self.decoder.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        guard = self.guard - self.released  # in `pending`: a stop string ends after it
        hits = [i for i in (self.pending.find(s, max(0, guard - len(s) + 1)) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            out, self.pending = self.pending[: min(hits)], ""
            return out
        keep = 0 if final else self._holdback()
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep :]
        self.released += len(out)
        return out

    def _holdback(self) -> int:
        """Length of the longest tail of `pending` that begins some stop string."""
        best = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(self.pending)), best, -1):
                if stop.startswith(self.pending[-size:]):
                    best = size
                    break
        return best
