"""A completion request from its body to the engine's rows: parsed, validated and tokenized (off the event loop:
the work grows with the body), checked against the engine, its grammar compiled in the grammar pool, its choices
submitted. Every refusal is a `ProtocolError` naming the request's parameter.

A request reuses the cache of an earlier one sharing its prefix only when both presented the same bearer token and
the same `cache_salt` (`cache_scope`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
from typing import Any

from fastapi import Request

from specsample.config import Grammar, SettingError
from specsample.server.disconnect import settle, until_disconnected
from specsample.server.grammar_pool import CompileFailed, CompileTimeout
from specsample.server.protocol import MAX_JSON_DEPTH, PARAM_NAMES, ProtocolError, validate_request
from specsample.server.runner import RequestHandle
from specsample.server.state import SpecServer

log = logging.getLogger("specsample.server")


def json_body(body: bytes) -> Any:
    """The request body as JSON (`ProtocolError` where it is not JSON, or nests too deeply)."""
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise ProtocolError(f"the request body nests too deeply; the limit is {MAX_JSON_DEPTH} levels") from None


def prepare(srv: SpecServer, body: bytes, schema: type, chat: bool) -> tuple[Any, list[int], int]:
    """The validated request, its prompt's token ids and its max_tokens (raises `ProtocolError`)."""
    req = validate_request(schema, json_body(body))
    if req.model not in (None, srv.options.model_name):
        raise ProtocolError(
            f"The model `{req.model}` does not exist (this server serves `{srv.options.model_name}`)", "model", 404
        )
    prompt_ids, max_tokens = _prompt(srv, req, chat)
    try:  # all but the grammar, which compiles in the grammar pool (compile_grammar)
        grammar = None if srv.grammar_pool is not None else req.sampling_params(max_tokens).grammar
        srv.engine.check_request(prompt_ids, dataclasses.replace(req.sampling_params(max_tokens), grammar=grammar))
    except ValueError as exc:
        raise _protocol_error(exc) from None
    return req, prompt_ids, max_tokens


def _prompt(srv: SpecServer, req, chat: bool) -> tuple[list[int], int]:
    """The prompt's token ids and the request's max_tokens (a chat's default: the rest of the context)."""
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


async def compile_grammar(srv: SpecServer, request: Request, grammar: Grammar) -> bool:
    """Compile `grammar` in the server's grammar pool unless the client leaves first (False: it left, and the compile
    was stopped). Raises `ProtocolError` for a grammar refused or not compiled in time."""
    compiling = asyncio.ensure_future(srv.grammar_pool.compile(grammar))
    watcher = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait({compiling, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not compiling.done():
            compiling.cancel()  # kills its worker process
            compiling.add_done_callback(settle)
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


def cache_scope(request: Request, req) -> str:
    """Whose kept caches a request may reuse: those of requests that presented the same bearer token (API key) and
    the same `cache_salt`."""
    token = request.headers.get("authorization", "").encode("latin-1")
    salt = (req.cache_salt or "").encode("utf-8")
    return hashlib.sha256(len(token).to_bytes(4, "big") + token + salt).hexdigest()


def submit(srv: SpecServer, req, prompt_ids: list[int], max_tokens: int, cache_scope: str) -> list[RequestHandle]:
    """The request's `n` choices submitted to the engine (seeds `seed`, `seed + 1`, ...); all or none."""
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
