"""The OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions, /v1/models, /health,
/metrics and /admin/draft. One implementation of the routes, served by `specsample serve` and by
each Ray Serve replica alike; routes reach the engine through `request.app.state.server`.

Every request passes `Gate` first (keys, body size, shutdown). A request is parsed, validated and tokenized off
the event loop, its grammar compiled in a worker process (server/grammar_pool.py); one that validates can be
sampled, and one that still fails inside the engine ends alone with finish_reason "error" while the others go on.
A request reuses the cache of an earlier one sharing its prefix only when both presented the same bearer token and
the same `cache_salt` (`_cache_scope`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from specsample.config import SettingError
from specsample.drafters.base import check_vocabulary
from specsample.drafters.routed import RoutedDrafter
from specsample.drafters.suffix import SuffixCacheHolder, SuffixCacheStats
from specsample.engine import RowUpdate
from specsample.models.hub import ALIASES, DRAFTS_DIR, alias_cached, builtin_draft
from specsample.pair import is_hybrid
from specsample.server.grammar_pool import CompileFailed, CompileTimeout, GrammarPool
from specsample.server.metrics import ServerMetrics
from specsample.server.options import ServerOptions
from specsample.server.protocol import (
    MAX_JSON_DEPTH,
    PARAM_NAMES,
    ChatRequest,
    CompletionRequest,
    ProtocolError,
    TextAssembler,
    validate_request,
)
from specsample.server.runner import EngineRunner, RequestHandle
from specsample.speculator import Speculator

log = logging.getLogger("specsample.server")


class SpecServer:
    """The engine, its runner thread, the tokenizer and the metrics of one serving process."""

    def __init__(self, speculator: Speculator, options: ServerOptions) -> None:
        target = speculator.pair.target
        if target.tokenizer is None:
            raise ValueError(f"{target.spec} has no tokenizer; serving text needs one")
        self.speculator, self.options, self.tokenizer = speculator, options, target.tokenizer
        drafter = RoutedDrafter(speculator.drafter) if speculator.drafter is not None else None
        self.engine = speculator.engine(
            options.max_batch_size, options.max_seq_len, drafter=drafter, prefix_cache_rows=options.prefix_cache_rows
        )
        self.draft = speculator.draft  # the draft in use (/admin/draft replaces it)
        labels = {"replica": options.replica_id} if options.replica_id else {}
        self.metrics = ServerMetrics(options.min_acceptance, labels=labels | options.extra_labels)
        self.metrics.watch_suffix_cache(self._suffix_cache)
        self.runner = EngineRunner(self.engine, self._observe)
        grammars = self.engine.grammars
        self.grammar_pool = (
            GrammarPool(grammars, options.grammar_workers, options.grammar_compile_timeout)
            if grammars is not None
            else None
        )
        self.created = int(time.time())
        self.metrics_text = self.metrics.render  # replaced by the aggregate of all replicas under Ray Serve
        self.active = 0  # requests being answered (all routes but /health and /metrics)
        self.draining = False  # shutting down: new requests get 503 (server/serve.py)
        self.ended = False  # the shutdown limit passed: requests still running were ended

    def _suffix_cache(self) -> SuffixCacheStats | None:
        """What the engine's drafters' shared suffix caches hold (None without one)."""
        drafter = self.engine.drafter
        return drafter.suffix_cache() if isinstance(drafter, SuffixCacheHolder) else None

    def _observe(self, result) -> None:
        self.metrics.observe_round(result, self.engine.num_running, self.engine.num_waiting)

    def start(self) -> None:
        self.runner.start()

    def stop(self) -> None:
        self.runner.stop()
        if self.grammar_pool is not None:
            self.grammar_pool.close()

    def end_all(self) -> None:
        """End every request still running (the shutdown limit passed): streams end with an error event and
        [DONE], other responses with 503."""
        self.ended = True
        self.runner.end_all("shutdown")
        if self.grammar_pool is not None:
            self.grammar_pool.close()


def error_response(
    status: int, message: str, param: str | None = None, kind: str = "invalid_request_error", code: str | None = None
) -> JSONResponse:
    """An OpenAI-style error object."""
    return JSONResponse(
        status_code=status, content={"error": {"message": message, "type": kind, "param": param, "code": code}}
    )


OPEN_PATHS = ("/health", "/metrics")  # answered without the API key (/metrics has keys of its own)


class _BodyTooLarge(Exception):
    """A request body grew past `max_body_bytes` while being read."""


class Gate:
    """Pure ASGI middleware before every route: 503 while the model loads; the admin key on /admin/* (404 when the
    server has none), the API key elsewhere but /health and /metrics; bodies over `max_body_bytes` refused with 413,
    by their Content-Length before reading or as soon as they grow past it; the replica tagged on responses.

    Pure ASGI (not a BaseHTTPMiddleware) so the routes read the client's own receive channel: a request notices its
    client hanging up while it waits for the engine."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        srv: SpecServer | None = getattr(scope["app"].state, "server", None)
        if srv is None:
            await error_response(503, "the model is still loading", kind="server_error")(scope, receive, send)
            return
        options = srv.options
        started = False

        async def tagged_send(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if options.replica_id:
                    headers = [*message.get("headers", []), (b"x-specsample-replica", options.replica_id.encode())]
                    message = {**message, "headers": headers}
            await send(message)

        refusal = _refusal(options, scope)
        if refusal is None and srv.draining and scope["path"] != "/metrics":
            refusal = error_response(503, "the server is shutting down", kind="server_error", code="shutting_down")
        if refusal is not None:
            await refusal(scope, receive, tagged_send)
            return
        counted = scope["path"] not in OPEN_PATHS
        srv.active += counted
        try:
            await self._limited(scope, receive, tagged_send, options.max_body_bytes, lambda: started)
        finally:
            srv.active -= counted

    async def _limited(self, scope, receive, send, limit: int, started) -> None:
        """The app, with the request body cut off past `limit` bytes (413 if no response started)."""
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise _BodyTooLarge
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _BodyTooLarge:
            if not started():
                await _too_large(limit)(scope, receive, send)
        except ClientDisconnect:  # gone while sending its body: nobody to answer
            pass


def _refusal(options: ServerOptions, scope) -> Response | None:
    """The answer to a request its keys or declared size do not allow, else None."""
    path = scope["path"]
    if path == "/admin" or path.startswith("/admin/"):
        if not options.admin_key:
            return error_response(404, "Not Found", kind="not_found_error")
        if not _bearer_matches(scope, options.admin_key):
            return error_response(
                403,
                "admin endpoints need the admin key: Authorization: Bearer ADMIN_KEY",
                kind="permission_error",
                code="forbidden",
            )
    elif path == "/metrics":
        keys = [k for k in (options.metrics_key, options.admin_key) if k]
        if (options.api_key or options.metrics_key) and not any(_bearer_matches(scope, k) for k in keys):
            return error_response(
                401,
                "/metrics needs the metrics key (--metrics-key) or the admin key: Authorization: Bearer KEY"
                if keys
                else "/metrics of a server with --api-key needs a key of its own: start the server with --metrics-key",
                code="invalid_api_key",
            )
    elif options.api_key and path not in OPEN_PATHS and not _bearer_matches(scope, options.api_key):
        return error_response(401, "Incorrect or missing API key.", code="invalid_api_key")
    declared = _header(scope, b"content-length")
    if declared is not None:
        if not declared.isdigit():
            return error_response(400, "Content-Length must be a number of bytes")
        if int(declared) > options.max_body_bytes:
            return _too_large(options.max_body_bytes)
    return None


def _header(scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return value
    return None


def _bearer_matches(scope, key: str) -> bool:
    """Whether the request carries `Authorization: Bearer KEY`, compared as bytes in constant time (any bytes a
    client sends compare; none raise)."""
    header = _header(scope, b"authorization") or b""
    given = header[len(b"Bearer ") :].strip() if header.startswith(b"Bearer ") else b""
    return secrets.compare_digest(given, key.encode("utf-8"))


def _too_large(limit: int) -> Response:
    return error_response(
        413,
        f"request body too large: this server accepts at most {limit} bytes (--max-body-bytes)",
        code="request_too_large",
    )


def build_app(server: SpecServer | None = None) -> FastAPI:
    """The FastAPI app. With `server`, its lifespan starts and stops that server's engine thread."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if server is not None:
            app.state.server = server
            server.start()
        yield
        if server is not None:
            server.stop()

    app = FastAPI(title="specsample", lifespan=lifespan)

    app.add_middleware(Gate)

    @app.get("/health")
    async def health(request: Request) -> dict[str, Any]:
        srv: SpecServer = request.app.state.server
        return {
            "status": "ok",
            "running": srv.engine.num_running,
            "waiting": srv.engine.num_waiting,
            "draft": srv.draft,
            "replica": srv.options.replica_id,
            "sampling": "coupled" if srv.engine.config.coupled else "rejection",
            "deterministic": srv.speculator.options.deterministic,
        }

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        text = await asyncio.to_thread(request.app.state.server.metrics_text)
        return Response(text, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        srv: SpecServer = request.app.state.server
        return {
            "object": "list",
            "data": [
                {
                    "id": srv.options.model_name,
                    "object": "model",
                    "created": srv.created,
                    "owned_by": "specsample",
                    "max_model_len": srv.engine.max_seq_len,
                }
            ],
        }

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(request, CompletionRequest, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _serve(request, ChatRequest, chat=True)

    @app.post("/admin/draft")
    async def replace_draft(request: Request):
        srv: SpecServer = request.app.state.server
        try:
            body = _json(await request.body())
            draft = body.get("draft") if isinstance(body, dict) and len(body) == 1 else None
            if not isinstance(draft, str) or not draft:
                raise ProtocolError('give the new draft as {"draft": "SPEC"}', "draft")
            drafter = await asyncio.to_thread(_load_allowed_draft, srv, draft)
            await asyncio.to_thread(srv.runner.replace_drafter, drafter)
        except ProtocolError as exc:
            return error_response(exc.status, str(exc), exc.param, exc.kind)
        except ValueError as exc:  # a server without a draft cannot swap one in
            return error_response(400, str(exc), "draft")
        srv.draft = draft
        log.warning("draft replaced by %s: requests in flight finish on the previous draft", draft)
        return {"status": "ok", "draft": draft}

    return app


UNUSABLE_DRAFT = (
    "unknown or unusable draft: give ngram, suffix, hybrid, a built-in draft ({builtin}), hybrid:NAME, "
    "or the name of a draft in the server's models folder (--models-dir)"
)


def _load_allowed_draft(srv: SpecServer, draft: str):
    """The drafter for an allowed draft: 'ngram', 'suffix', 'hybrid', a built-in alias or draft, or a folder or
    .gguf file inside `--models-dir` given by its name there, each also as 'hybrid:NAME'. Anything else, and anything
    that does not load or does not fit the target, gets one message that says nothing about the filesystem (the
    reason is logged)."""
    refusal = ProtocolError(UNUSABLE_DRAFT.format(builtin=", ".join(sorted(_builtin_names()))), "draft")
    resolved = _allowed_draft(draft, srv.options.models_dir)
    if resolved is None:
        log.warning("draft %r refused: not a built-in draft nor in the models folder", draft)
        raise refusal
    try:
        drafter = srv.speculator.pair.load_draft(resolved)
        if drafter is None:
            raise ValueError("it did not load")
        check_vocabulary(drafter.vocab_size, srv.speculator.pair.target.model.vocab_size)
    except Exception as exc:  # noqa: BLE001 - whatever went wrong, the client learns only that the draft is unusable
        log.warning("draft %r refused: %s", draft, exc)
        raise refusal from None
    return drafter


def _builtin_names() -> set[str]:
    """The model aliases and the names of the drafts shipped in the package."""
    shipped = [p.name for p in DRAFTS_DIR.iterdir() if builtin_draft(p.name) is not None] if DRAFTS_DIR.is_dir() else []
    return set(ALIASES) | set(shipped)


def _allowed_draft(draft: str, models_dir: str | None) -> str | None:
    """What to load for an allowed draft, else None."""
    if draft in ("ngram", "suffix", "hybrid"):
        return draft
    if is_hybrid(draft):
        model = _allowed_model(draft.partition(":")[2], models_dir)
        return None if model is None else "hybrid:" + model
    return _allowed_model(draft, models_dir)


def _allowed_model(name: str, models_dir: str | None) -> str | None:
    """A built-in alias or draft by name, or a folder or .gguf file inside `models_dir` by its relative path (which
    may not leave the folder, through '..' or a link)."""
    if name in ALIASES:  # loading an alias that is not cached would download it
        return name if alias_cached(name) else None
    if name in _builtin_names():
        return name
    if not models_dir or not name or Path(name).is_absolute() or "\\" in name or "\0" in name:
        return None
    root = Path(models_dir).resolve()
    try:
        candidate = (root / name).resolve()
    except (OSError, RuntimeError, ValueError):
        return None
    if candidate == root or not candidate.is_relative_to(root):
        return None
    if candidate.is_dir() or (candidate.is_file() and candidate.suffix == ".gguf"):
        return str(candidate)
    return None


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise ProtocolError(f"the request body nests too deeply; the limit is {MAX_JSON_DEPTH} levels") from None


async def _serve(request: Request, schema: type, chat: bool):
    srv: SpecServer = request.app.state.server
    try:
        body = await request.body()
        # parsing, validating and tokenizing take time in proportion to the body: never on the event loop
        req, prompt_ids, max_tokens = await asyncio.to_thread(_prepare, srv, body, schema, chat)
        grammar = req.response_format.grammar() if req.response_format is not None else None
        if grammar is not None and srv.grammar_pool is not None:
            if not await _compile(srv, request, grammar):
                return Response(status_code=499)  # the client left while its grammar compiled
        if srv.ended:
            return _shutting_down()
        handles = _submit(srv, req, prompt_ids, max_tokens, _cache_scope(request, req))
    except ProtocolError as exc:
        return error_response(exc.status, str(exc), exc.param, exc.kind)
    request_id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
    choices = [_Choice(i, h, TextAssembler(srv.tokenizer.stream(), req.stop)) for i, h in enumerate(handles)]
    logprobs = _LogprobFormat(srv, chat) if req.top_logprobs_asked() is not None else None
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        # a client that hangs up before the stream starts would never run the stream's cleanup
        asyncio.ensure_future(_cancel_on_disconnect(srv, request, choices))
        return StreamingResponse(
            _stream(srv, request_id, chat, choices, len(prompt_ids), include_usage, logprobs),
            media_type="text/event-stream",
        )
    return await _complete(srv, request, request_id, chat, choices, len(prompt_ids), logprobs)


def _prepare(srv: SpecServer, body: bytes, schema: type, chat: bool) -> tuple[Any, list[int], int]:
    """The validated request, its prompt's token ids and its max_tokens (raises `ProtocolError`)."""
    req = validate_request(schema, _json(body))
    if req.model not in (None, srv.options.model_name):
        raise ProtocolError(
            f"The model `{req.model}` does not exist (this server serves `{srv.options.model_name}`)", "model", 404
        )
    prompt_ids, max_tokens = _prompt(srv, req, chat)
    try:  # all but the grammar, which compiles in the grammar pool (_compile)
        grammar = None if srv.grammar_pool is not None else req.sampling_params(max_tokens).grammar
        srv.engine.check_request(prompt_ids, dataclasses.replace(req.sampling_params(max_tokens), grammar=grammar))
    except ValueError as exc:
        raise _protocol_error(exc) from None
    return req, prompt_ids, max_tokens


async def _compile(srv: SpecServer, request: Request, grammar) -> bool:
    """Compile `grammar` in the server's grammar pool unless the client leaves first (False: it left, and the compile
    was stopped). Raises `ProtocolError` for a grammar refused or not compiled in time."""
    compiling = asyncio.ensure_future(srv.grammar_pool.compile(grammar))
    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({compiling, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not compiling.done():
            compiling.cancel()  # kills its worker process
            compiling.add_done_callback(_retrieve)
    if not compiling.done() or compiling.cancelled():
        return False
    try:
        compiling.result()
    except SettingError as exc:
        raise _protocol_error(exc) from None
    except CompileTimeout:
        raise ProtocolError(
            f"response_format: the grammar did not compile within "
            f"{srv.options.grammar_compile_timeout:g} s (the server's --grammar-compile-timeout); "
            "a simpler schema compiles faster",
            "response_format",
        ) from None
    except CompileFailed as exc:
        if srv.draining:
            raise ProtocolError("the server is shutting down", None, 503, "server_error") from None
        log.error("grammar compile failed: %s", exc)
        raise ProtocolError("response_format: the grammar compiler failed on this grammar", "response_format") from None
    return True


def _retrieve(future: asyncio.Future) -> None:
    """Collect a cancelled or abandoned future's outcome, so asyncio logs no 'exception was never retrieved'."""
    if not future.cancelled():
        future.exception()


async def _until_disconnected(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.25)


def _cache_scope(request: Request, req) -> str:
    """Whose kept caches a request may reuse: those of requests that presented the same bearer token (API key) and
    the same `cache_salt`."""
    token = request.headers.get("authorization", "").encode("latin-1")
    salt = (req.cache_salt or "").encode("utf-8")
    return hashlib.sha256(len(token).to_bytes(4, "big") + token + salt).hexdigest()


def _shutting_down() -> JSONResponse:
    return error_response(
        503,
        "the server is shutting down: the request was ended before it finished",
        kind="server_error",
        code="shutting_down",
    )


async def _cancel_on_disconnect(srv: SpecServer, request: Request, choices: list[_Choice]) -> None:
    """Watch a streaming request until its choices finish; cancel them if the client goes away."""
    while not all(c.done or c.closed for c in choices):
        if await request.is_disconnected():
            for choice in choices:
                srv.runner.cancel(choice.handle.request_id)
            return
        await asyncio.sleep(0.25)


def _prompt(srv: SpecServer, req, chat: bool) -> tuple[list[int], int]:
    limit = srv.engine.max_seq_len
    if chat:
        try:
            ids = srv.tokenizer.encode_messages(req.conversation())
        except ValueError as exc:
            raise ProtocolError(str(exc), "messages") from None
        max_tokens = req.max_completion_tokens or req.max_tokens or max(1, limit - len(ids))
    else:
        ids = srv.tokenizer.encode(req.prompt) if isinstance(req.prompt, str) else list(req.prompt)
        if not ids:
            raise ProtocolError("prompt is empty", "prompt")
        max_tokens = req.max_tokens or 16
    if len(ids) + max_tokens > limit:
        raise ProtocolError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} for the "
            "completion). Please reduce the prompt or max_tokens.",
            "max_tokens",
        )
    return ids, max_tokens


def _submit(srv: SpecServer, req, prompt_ids: list[int], max_tokens: int, cache_scope: str) -> list[RequestHandle]:
    handles = []
    gamma = req.num_speculative_tokens
    if gamma is not None and gamma > srv.engine.planner.max_gamma:
        raise ProtocolError(
            f"num_speculative_tokens must be <= {srv.engine.planner.max_gamma}", "num_speculative_tokens"
        )
    try:
        for i in range(req.n):
            params = req.sampling_params(max_tokens, seed=None if req.seed is None else req.seed + i)
            handles.append(
                srv.runner.submit(prompt_ids, params, speculative=req.speculative, gamma=gamma, cache_scope=cache_scope)
            )
    except ValueError as exc:
        for handle in handles:
            srv.runner.cancel(handle.request_id)
        raise _protocol_error(exc) from None
    return handles


def _protocol_error(exc: ValueError) -> ProtocolError:
    """The engine's refusal as a 400 naming the request's parameter."""
    param = (
        PARAM_NAMES.get(exc.name, exc.name)
        if isinstance(exc, SettingError)
        else ("prompt" if "prompt" in str(exc) else None)
    )
    return ProtocolError(str(exc), param)


class _LogprobFormat:
    """Log-probabilities in the API's shapes: the legacy completions object, or chat's content list."""

    def __init__(self, srv: SpecServer, chat: bool) -> None:
        self.hf, self.chat = srv.tokenizer.hf, chat
        self.grammars = srv.speculator.grammars()  # built with the engine; it knows each token's bytes

    def text(self, token: int) -> str:
        return self.hf.decode([token], skip_special_tokens=False)

    def render(self, entries: list, offset: int = 0) -> dict[str, Any]:
        """`entries` (TokenLogprob) as the API's logprobs object; `offset`: the text length before them."""
        if self.chat:
            return {
                "content": [
                    self._chat_entry(e.token, e.logprob)
                    | {"top_logprobs": [self._chat_entry(t, lp) for t, lp in e.top]}
                    for e in entries
                ]
            }
        texts = [self.text(e.token) for e in entries]
        offsets = []
        for text in texts:
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": texts,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{self.text(t): lp for t, lp in e.top} for e in entries],
            "text_offset": offsets,
        }

    def _chat_entry(self, token: int, logprob: float) -> dict[str, Any]:
        """A token's entry; `bytes` are the token's own (its text shows a replacement character where the token holds
        part of a UTF-8 character; without a grammar compiler, the text's bytes)."""
        text = self.text(token)
        raw = self.grammars.token_bytes(token) if self.grammars is not None else text.encode("utf-8")
        return {"token": text, "logprob": logprob, "bytes": list(raw)}


@dataclass
class _Choice:
    index: int
    handle: RequestHandle
    text: TextAssembler
    tokens: int = 0
    finish_reason: str | None = None
    closed: bool = False  # the response is over (finished, or its stream was torn down)
    logprobs: list = field(default_factory=list)  # the engine's TokenLogprob of each counted token
    sent_logprobs: int = 0  # how many of them a stream has sent
    text_offset: int = 0  # the length of the tokens' text sent so far (completions' text_offset)

    async def next(self) -> list[tuple[str, str | None]]:
        """Wait for the next round's update; return (text, finish_reason) pieces to emit. A choice the engine failed
        ends with finish_reason "error" and nothing more."""
        update = await self.handle.queue.get()
        assert isinstance(update, RowUpdate)
        if update.finish_reason in ("error", "shutdown"):
            self.finish_reason = update.finish_reason
            return [("", update.finish_reason)]
        pieces = []
        for i, token in enumerate(update.new_tokens):  # one at a time: usage counts tokens up to the one completing
            pieces.append(self.text.push((token,)))  # a stop string
            self.tokens += 1
            if update.logprobs is not None:
                self.logprobs.append(update.logprobs[i])
            if self.text.stopped:
                break
        text = "".join(pieces)
        if self.text.stopped:
            self.finish_reason = "stop"
        elif update.finish_reason is not None:
            text += self.text.finish()
            stopped = self.text.stopped or update.finish_reason != "length"  # a stop string may match at the end
            self.finish_reason = "stop" if stopped else "length"
        return [(text, self.finish_reason)]

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


def _finish(srv: SpecServer, request_id: str, choices: list[_Choice], prompt_tokens: int) -> None:
    """Cancel what still runs, and log and count every choice: "error" if the engine failed it, "cancelled" if it
    had not finished (its client went away), else "finished"."""
    for choice in choices:
        choice.closed = True
        h = choice.handle
        if not choice.done or choice.text.stopped:
            srv.runner.cancel(h.request_id)  # client gone, or a stop string ended it early
        end = time.perf_counter()
        ttft = None if h.first_token is None else h.first_token - h.submitted
        tpot = (end - h.first_token) / (choice.tokens - 1) if h.first_token is not None and choice.tokens > 1 else None
        status = (
            "error"
            if choice.finish_reason == "error"
            else "finished"
            if choice.done and choice.finish_reason != "shutdown"
            else "cancelled"
        )
        srv.metrics.observe_request(status, prompt_tokens, ttft, tpot, end - h.submitted)
        log.info(
            json.dumps(
                {
                    "event": "request",
                    "id": request_id,
                    "choice": choice.index,
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": choice.tokens,
                    "finish_reason": choice.finish_reason or "cancelled",
                    "ttft_ms": None if ttft is None else round(1000 * ttft, 1),
                    "tpot_ms": None if tpot is None else round(1000 * tpot, 2),
                    "acceptance_rate": round(h.accepted / h.drafted, 3) if h.drafted else None,
                    "gamma_mean": round(h.gamma_sum / h.rounds, 2) if h.rounds else 0.0,
                }
            )
        )


def _chunk(
    request_id: str,
    chat: bool,
    model: str,
    created: int,
    index: int,
    text: str | None,
    finish: str | None,
    role: bool = False,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    if chat:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text:
            delta["content"] = text
        choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        return {
            "id": request_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [choice],
        }
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": index, "text": text or "", "finish_reason": finish, "logprobs": logprobs}],
    }


async def _stream(
    srv: SpecServer,
    request_id: str,
    chat: bool,
    choices: list[_Choice],
    prompt_tokens: int,
    include_usage: bool,
    logprobs: _LogprobFormat | None = None,
) -> AsyncIterator[str]:
    model, created = srv.options.model_name, int(time.time())
    try:
        if chat:
            for choice in choices:
                yield _sse(_chunk(request_id, chat, model, created, choice.index, "", None, role=True))
        pending = {asyncio.ensure_future(c.next()): c for c in choices}
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                choice = pending.pop(task)
                for text, finish in task.result():
                    if finish == "shutdown":  # the shutdown limit passed: an error event, then the stream's end
                        yield _sse(
                            {
                                "error": {
                                    "message": "the server is shutting down: the response was cut short",
                                    "type": "server_error",
                                    "param": None,
                                    "code": "shutting_down",
                                }
                            }
                        )
                        yield "data: [DONE]\n\n"
                        return
                    new = choice.logprobs[choice.sent_logprobs :] if logprobs is not None else []
                    if text or finish or new:  # each chunk carries the logprobs of the tokens it adds
                        rendered = logprobs.render(new, offset=choice.text_offset) if logprobs is not None else None
                        choice.sent_logprobs += len(new)
                        choice.text_offset += sum(len(logprobs.text(e.token)) for e in new) if new else 0
                        yield _sse(
                            _chunk(request_id, chat, model, created, choice.index, text, finish, logprobs=rendered)
                        )
                if not choice.done:
                    pending[asyncio.ensure_future(choice.next())] = choice
        if include_usage:
            completion = sum(c.tokens for c in choices)
            yield _sse(
                {
                    "id": request_id,
                    "object": "chat.completion.chunk" if chat else "text_completion",
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": {
                        "prompt_tokens": prompt_tokens,
                        "completion_tokens": completion,
                        "total_tokens": prompt_tokens + completion,
                    },
                }
            )
        yield "data: [DONE]\n\n"
    finally:  # also runs when the client disconnects mid-stream: its rows are cancelled and freed
        if "pending" in locals():
            for task in pending:
                task.cancel()
        _finish(srv, request_id, choices, prompt_tokens)


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _complete(
    srv: SpecServer,
    request: Request,
    request_id: str,
    chat: bool,
    choices: list[_Choice],
    prompt_tokens: int,
    logprobs: _LogprobFormat | None = None,
):
    texts = {c.index: "" for c in choices}

    async def collect(choice: _Choice) -> None:
        while not choice.done:
            for text, _ in await choice.next():
                texts[choice.index] += text

    work = asyncio.ensure_future(asyncio.gather(*(collect(c) for c in choices)))
    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():  # the client hung up: _finish cancels its choices
            work.cancel()
            work.add_done_callback(_retrieve)
            return Response(status_code=499)
        work.result()
    finally:
        watcher.cancel()
        _finish(srv, request_id, choices, prompt_tokens)
    if any(c.finish_reason == "shutdown" for c in choices):
        return _shutting_down()
    if any(c.finish_reason == "error" for c in choices):
        return error_response(500, "generation failed inside the engine", kind="server_error")
    completion = sum(c.tokens for c in choices)
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }
    created, model = int(time.time()), srv.options.model_name
    if chat:
        body = {
            "id": request_id,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "usage": usage,
            "choices": [
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": texts[c.index]},
                    "finish_reason": c.finish_reason,
                    "logprobs": logprobs.render(c.logprobs) if logprobs is not None else None,
                }
                for c in choices
            ],
        }
    else:
        body = {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "usage": usage,
            "choices": [
                {
                    "index": c.index,
                    "text": texts[c.index],
                    "finish_reason": c.finish_reason,
                    "logprobs": logprobs.render(c.logprobs) if logprobs is not None else None,
                }
                for c in choices
            ],
        }
    return JSONResponse(body)
