"""The OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions, /v1/models, /health,
/metrics and /admin/draft. One implementation of the routes, served by `specsample serve` and by
each Ray Serve replica alike; routes reach the engine through `request.app.state.server`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from specsample.config import SamplingParams
from specsample.drafters.routed import RoutedDrafter
from specsample.engine import RowUpdate
from specsample.server.metrics import ServerMetrics
from specsample.server.options import ServerOptions
from specsample.server.protocol import ChatRequest, CompletionRequest, ProtocolError, TextAssembler
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
        self.engine = speculator.engine(options.max_batch_size, options.max_model_len, drafter=drafter)
        self.draft_spec = speculator.draft_spec
        labels = {"replica": options.replica_id} if options.replica_id else {}
        self.metrics = ServerMetrics(options.min_acceptance, labels=labels | options.extra_labels)
        self.runner = EngineRunner(self.engine, self._observe)
        self.created = int(time.time())
        self.metrics_text = self.metrics.render  # replaced by the aggregate of all replicas under Ray Serve

    def _observe(self, result) -> None:
        self.metrics.observe_round(result, self.engine.num_running, self.engine.num_waiting)

    def start(self) -> None:
        self.runner.start()

    def stop(self) -> None:
        self.runner.stop()


def error_response(status: int, message: str, param: str | None = None,
                   kind: str = "invalid_request_error", code: str | None = None) -> JSONResponse:
    """An OpenAI-style error object."""
    return JSONResponse(status_code=status,
                        content={"error": {"message": message, "type": kind, "param": param, "code": code}})


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

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        srv: SpecServer | None = getattr(request.app.state, "server", None)
        if srv is None:
            return error_response(503, "the model is still loading", kind="server_error")
        open_paths = ("/health", "/metrics")
        if srv.options.api_key and request.url.path not in open_paths:
            header = request.headers.get("authorization", "")
            given = header.removeprefix("Bearer ").strip() if header.startswith("Bearer ") else ""
            if not secrets.compare_digest(given, srv.options.api_key):
                return error_response(401, "Incorrect or missing API key.", code="invalid_api_key")
        response = await call_next(request)
        if srv.options.replica_id:
            response.headers["x-specsample-replica"] = srv.options.replica_id
        return response

    @app.get("/health")
    async def health(request: Request) -> dict[str, Any]:
        srv: SpecServer = request.app.state.server
        return {"status": "ok", "running": srv.engine.num_running, "waiting": srv.engine.num_waiting,
                "draft": srv.draft_spec, "replica": srv.options.replica_id}

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        text = await asyncio.to_thread(request.app.state.server.metrics_text)
        return Response(text, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        srv: SpecServer = request.app.state.server
        return {"object": "list", "data": [{
            "id": srv.options.model_name, "object": "model", "created": srv.created, "owned_by": "specsample",
            "max_model_len": srv.engine.max_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(request, CompletionRequest, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _serve(request, ChatRequest, chat=True)

    @app.post("/admin/draft")
    async def replace_draft(request: Request):
        srv: SpecServer = request.app.state.server
        if not srv.options.api_key:
            return error_response(403, "admin endpoints need the server to run with --api-key", code="forbidden")
        try:
            body = _json(await request.body())
            spec = body.get("draft") if isinstance(body, dict) else None
            if not isinstance(spec, str) or not spec:
                raise ProtocolError("give the new draft as {\"draft\": \"SPEC\"}", "draft")
            drafter = await asyncio.to_thread(srv.speculator.pair.load_draft, spec)
            if drafter is None:
                raise ProtocolError(f"draft {spec!r} could not be loaded", "draft")
            if drafter.vocab_size is not None and drafter.vocab_size != srv.speculator.pair.target.model.vocab_size:
                raise ProtocolError(f"draft vocabulary ({drafter.vocab_size}) differs from target vocabulary "
                                    f"({srv.speculator.pair.target.model.vocab_size}): refused", "draft")
            await asyncio.to_thread(srv.runner.replace_drafter, drafter)
        except ProtocolError as exc:
            return error_response(exc.status, str(exc), exc.param, exc.kind)
        except ValueError as exc:
            return error_response(400, str(exc), "draft")
        srv.draft_spec = spec
        log.warning("draft replaced by %s: requests in flight finish on the previous draft", spec)
        return {"status": "ok", "draft": spec}

    return app


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"request body is not valid JSON: {exc}") from None


async def _serve(request: Request, schema: type, chat: bool):
    srv: SpecServer = request.app.state.server
    try:
        data = _json(await request.body())
        if not isinstance(data, dict):
            raise ProtocolError("request body must be a JSON object")
        try:
            req = schema.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            param = ".".join(str(p) for p in first["loc"]) or None
            message = ("Unrecognized request argument supplied: " + str(param)) if first["type"] == "extra_forbidden" \
                else f"{param}: {first['msg']}"
            raise ProtocolError(message, param) from None
        if req.model not in (None, srv.options.model_name):
            raise ProtocolError(f"The model `{req.model}` does not exist (this server serves "
                                f"`{srv.options.model_name}`)", "model", 404)
        prompt_ids, max_tokens = _prompt(srv, req, chat)
        handles = _submit(srv, req, prompt_ids, max_tokens)
    except ProtocolError as exc:
        return error_response(exc.status, str(exc), exc.param, exc.kind)
    request_id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
    choices = [_Choice(i, h, TextAssembler(srv.tokenizer.stream(), req.stop)) for i, h in enumerate(handles)]
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        # a client that hangs up before the stream starts would never run the stream's cleanup
        asyncio.ensure_future(_cancel_on_disconnect(srv, request, choices))
        return StreamingResponse(_stream(srv, request_id, chat, choices, len(prompt_ids), include_usage),
                                 media_type="text/event-stream")
    return await _complete(srv, request, request_id, chat, choices, len(prompt_ids))


async def _cancel_on_disconnect(srv: SpecServer, request: Request, choices: list[_Choice]) -> None:
    """Watch a streaming request until its choices finish; cancel them if the client goes away."""
    while not all(c.done or c.closed for c in choices):
        if await request.is_disconnected():
            for choice in choices:
                srv.runner.cancel(choice.handle.request_id)
            return
        await asyncio.sleep(0.25)


def _prompt(srv: SpecServer, req, chat: bool) -> tuple[list[int], int]:
    limit = srv.engine.max_len
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
        raise ProtocolError(f"This model's maximum context length is {limit} tokens. However, you requested "
                            f"{len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} for the "
                            "completion). Please reduce the prompt or max_tokens.", "max_tokens")
    return ids, max_tokens


def _submit(srv: SpecServer, req, prompt_ids: list[int], max_tokens: int) -> list[RequestHandle]:
    handles = []
    gamma = req.num_speculative_tokens
    if gamma is not None and gamma > srv.engine.config.gamma:
        raise ProtocolError(f"num_speculative_tokens must be <= {srv.engine.config.gamma}", "num_speculative_tokens")
    try:
        for i in range(req.n):
            params = SamplingParams(temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, min_p=req.min_p,
                                    max_new_tokens=max_tokens, seed=None if req.seed is None else req.seed + i)
            handles.append(srv.runner.submit(prompt_ids, params, speculative=req.speculative, gamma=gamma))
    except ValueError as exc:
        for handle in handles:
            srv.runner.cancel(handle.request_id)
        raise ProtocolError(str(exc)) from None
    return handles


@dataclass
class _Choice:
    index: int
    handle: RequestHandle
    text: TextAssembler
    tokens: int = 0
    finish_reason: str | None = None
    closed: bool = False  # the response is over (finished, or its stream was torn down)

    async def next(self) -> list[tuple[str, str | None]]:
        """Wait for the next round's update; return (text, finish_reason) pieces to emit."""
        update = await self.handle.queue.get()
        if isinstance(update, Exception):
            raise update
        assert isinstance(update, RowUpdate)
        pieces = []
        for token in update.new_tokens:  # one at a time: usage counts tokens up to the one completing a stop string
            pieces.append(self.text.push((token,)))
            self.tokens += 1
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


def _finish(srv: SpecServer, request_id: str, choices: list[_Choice], prompt_tokens: int, status: str) -> None:
    """Cancel what still runs, and log and count every choice."""
    for choice in choices:
        choice.closed = True
        h = choice.handle
        if not choice.done or choice.text.stopped:
            srv.runner.cancel(h.request_id)  # client gone, or a stop string ended it early
        end = time.perf_counter()
        ttft = None if h.first_token is None else h.first_token - h.submitted
        tpot = (end - h.first_token) / (choice.tokens - 1) if h.first_token is not None and choice.tokens > 1 else None
        srv.metrics.observe_request(status if choice.done else "cancelled", prompt_tokens, ttft, tpot, end - h.submitted)
        log.info(json.dumps({
            "event": "request", "id": request_id, "choice": choice.index, "prompt_tokens": prompt_tokens,
            "completion_tokens": choice.tokens, "finish_reason": choice.finish_reason or "cancelled",
            "ttft_ms": None if ttft is None else round(1000 * ttft, 1),
            "tpot_ms": None if tpot is None else round(1000 * tpot, 2),
            "acceptance_rate": round(h.accepted / h.drafted, 3) if h.drafted else None,
            "gamma_mean": round(h.gamma_sum / h.rounds, 2) if h.rounds else 0.0,
        }))


def _chunk(request_id: str, chat: bool, model: str, created: int, index: int, text: str | None,
           finish: str | None, role: bool = False) -> dict[str, Any]:
    if chat:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text:
            delta["content"] = text
        choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}
        return {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [choice]}
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text or "", "finish_reason": finish, "logprobs": None}]}


async def _stream(srv: SpecServer, request_id: str, chat: bool, choices: list[_Choice], prompt_tokens: int,
                  include_usage: bool) -> AsyncIterator[str]:
    model, created = srv.options.model_name, int(time.time())
    status = "finished"
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
                    if text or finish:
                        yield _sse(_chunk(request_id, chat, model, created, choice.index, text, finish))
                if not choice.done:
                    pending[asyncio.ensure_future(choice.next())] = choice
        if include_usage:
            completion = sum(c.tokens for c in choices)
            yield _sse({"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
                        "created": created, "model": model, "choices": [],
                        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                                  "total_tokens": prompt_tokens + completion}})
        yield "data: [DONE]\n\n"
    except Exception:
        status = "error"
        raise
    finally:  # also runs when the client disconnects mid-stream: its rows are cancelled and freed
        if "pending" in locals():
            for task in pending:
                task.cancel()
        _finish(srv, request_id, choices, prompt_tokens, status)


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _complete(srv: SpecServer, request: Request, request_id: str, chat: bool, choices: list[_Choice],
                    prompt_tokens: int):
    texts = {c.index: "" for c in choices}

    async def collect(choice: _Choice) -> None:
        while not choice.done:
            for text, _ in await choice.next():
                texts[choice.index] += text

    async def watch_disconnect() -> None:
        while True:
            if await request.is_disconnected():
                return
            await asyncio.sleep(0.25)

    work = asyncio.ensure_future(asyncio.gather(*(collect(c) for c in choices)))
    watcher = asyncio.ensure_future(watch_disconnect())
    status = "finished"
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            status = "cancelled"
            work.cancel()
            return Response(status_code=499)
        work.result()
    except RuntimeError as exc:
        status = "error"
        return error_response(500, str(exc), kind="server_error")
    finally:
        watcher.cancel()
        _finish(srv, request_id, choices, prompt_tokens, status)
    completion = sum(c.tokens for c in choices)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}
    created, model = int(time.time()), srv.options.model_name
    if chat:
        body = {"id": request_id, "object": "chat.completion", "created": created, "model": model, "usage": usage,
                "choices": [{"index": c.index, "message": {"role": "assistant", "content": texts[c.index]},
                             "finish_reason": c.finish_reason, "logprobs": None} for c in choices]}
    else:
        body = {"id": request_id, "object": "text_completion", "created": created, "model": model, "usage": usage,
                "choices": [{"index": c.index, "text": texts[c.index], "finish_reason": c.finish_reason,
                             "logprobs": None} for c in choices]}
    return JSONResponse(body)
