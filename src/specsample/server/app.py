"""The OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions, /v1/models, /health,
/metrics and /admin/draft. One implementation of the routes, served by `specsample serve` and by
each Ray Serve replica alike; routes reach the serving process's state (server/state.py) through
`request.app.state.server`, and the app's lifespan starts and stops it.

Every request passes `Gate` first (keys, body size, shutdown: server/middleware.py). A completion request is
prepared (parsed, validated and tokenized off the event loop, its grammar compiled in a worker process:
server/prepare.py), submitted, and answered as a stream or one body (server/responses.py); one that validates can be
sampled, and one that still fails inside the engine ends alone with finish_reason "error" while the others go on.
/admin/draft swaps in only the drafts its sandbox allows (server/drafts.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from specsample.models import artifacts
from specsample.server.drafts import load_allowed_draft
from specsample.server.middleware import Gate
from specsample.server.prepare import cache_scope, compile_grammar, json_body, prepare, submit
from specsample.server.protocol import ChatRequest, CompletionRequest, ProtocolError
from specsample.server.responses import error_response, respond, shutting_down
from specsample.server.state import SpecServer

log = logging.getLogger("specsample.server")


def build_app(server: SpecServer | None = None) -> FastAPI:
    """The FastAPI app. With `server`, its lifespan starts and stops that server's engine thread."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
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
            "step": srv.speculator.step_path,
            "compile": srv.compile_behind.status() if srv.compile_behind is not None else None,
            "compiled_steps": str(artifacts.root()),
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
    async def completions(request: Request) -> Response:
        return await _serve(request, CompletionRequest, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _serve(request, ChatRequest, chat=True)

    @app.post("/admin/draft", response_model=None)
    async def replace_draft(request: Request) -> Response | dict[str, Any]:
        srv: SpecServer = request.app.state.server
        try:
            body = json_body(await request.body())
            draft = body.get("draft") if isinstance(body, dict) and len(body) == 1 else None
            if not isinstance(draft, str) or not draft:
                raise ProtocolError('give the new draft as {"draft": "SPEC"}', "draft")
            drafter = await asyncio.to_thread(load_allowed_draft, srv.speculator.pair, srv.options.models_dir, draft)
            await asyncio.to_thread(srv.runner.replace_drafter, drafter)
        except ProtocolError as exc:
            return error_response(exc.status, str(exc), exc.param, exc.kind)
        except ValueError as exc:  # a server without a draft cannot swap one in
            return error_response(400, str(exc), "draft")
        srv.draft = draft
        log.warning("draft replaced by %s: requests in flight finish on the previous draft", draft)
        return {"status": "ok", "draft": draft}

    return app


async def _serve(request: Request, schema: type[CompletionRequest] | type[ChatRequest], chat: bool) -> Response:
    """A completion route: the request prepared, its grammar compiled, its choices submitted, then answered."""
    srv: SpecServer = request.app.state.server
    try:
        body = await request.body()
        # parsing, validating and tokenizing take time in proportion to the body: never on the event loop
        req, prompt_ids, max_tokens = await asyncio.to_thread(prepare, srv, body, schema)
        grammar = req.response_format.grammar() if req.response_format is not None else None
        if grammar is not None and srv.grammar_pool is not None:
            if not await compile_grammar(srv, request, grammar):
                return Response(status_code=499)  # the client left while its grammar compiled
        if srv.ended:
            return shutting_down()
        handles = submit(srv, req, prompt_ids, max_tokens, cache_scope(request, req))
    except ProtocolError as exc:
        return error_response(exc.status, str(exc), exc.param, exc.kind)
    return await respond(srv, request, req, handles, len(prompt_ids), chat)
