"""The ingress's half of Ray Serve routing without Ray (server/relay.py): the prompt a prefix-aware router reads, and
an HTTP request answered by an app it is handed to as a value, streamed back and ended when the client leaves."""

from __future__ import annotations

import asyncio
import json

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from specsample.server.relay import HttpCall, read_body, replay, routing_prompt


def _body(obj) -> bytes:
    return json.dumps(obj).encode()


def test_the_routing_prompt_grows_with_the_token_prefix() -> None:
    assert routing_prompt("/v1/completions", _body({"prompt": "abc"})).prompt == "abc"
    ids = routing_prompt("/v1/completions", _body({"prompt": [1, 2, 3]})).prompt
    assert routing_prompt("/v1/completions", _body({"prompt": [1, 2, 3, 4]})).prompt.startswith(ids)
    system = {"role": "system", "content": "rules"}
    first = routing_prompt("/v1/chat/completions", _body({"messages": [system, {"role": "user", "content": "q1"}]}))
    parts = {"role": "user", "content": [{"type": "text", "text": "q1"}]}
    assert routing_prompt("/v1/chat/completions", _body({"messages": [system, parts]})) == first
    turn = [system, {"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}]
    assert routing_prompt("/v1/chat/completions", _body({"messages": turn})).prompt.startswith(first.prompt)
    other_role = [{"role": "user", "content": "rules"}, {"role": "user", "content": "q1"}]
    assert routing_prompt("/v1/chat/completions", _body({"messages": other_role})) != first  # roles count
    # no prompt to route by: the request goes by load, and the replica answers its error
    for path, body in [
        ("/v1/completions", b"{not json"),
        ("/v1/completions", _body({"prompt": ""})),
        ("/v1/completions", _body({"prompt": [1, True]})),
        ("/v1/completions", _body(["prompt"])),
        ("/v1/chat/completions", _body({"messages": "hi"})),
        ("/v1/chat/completions", _body({"messages": [{"role": "user", "content": 3}]})),
        ("/v1/chat/completions", _body({"messages": [{"role": "user", "content": None}]})),
        ("/v1/chat/completions", b"[" * 100_000),
        ("/v1/models", _body({"prompt": "abc"})),
    ]:
        assert routing_prompt(path, body) is None, body[:40]


def test_a_body_past_the_limit_is_not_read_whole() -> None:
    def receiver(chunks):
        messages = iter(
            [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
        )

        async def receive():
            return next(messages)

        return receive

    assert asyncio.run(read_body(receiver([b"ab", b"cd"]), 4)) == b"abcd"
    assert asyncio.run(read_body(receiver([b"ab", b"cde", b"never read"]), 4)) is None


def _app(stopped: list[str]) -> FastAPI:
    app = FastAPI()

    @app.post("/echo/{name}")
    async def echo(name: str, request: Request):
        body = await request.body()

        async def chunks():
            try:
                for i in range(1000):
                    yield f"{name}:{body.decode()}:{request.query_params.get('q')}:{request.headers['x-k']}:{i}\n"
                    await asyncio.sleep(0.01)
            finally:
                stopped.append(name)

        return StreamingResponse(chunks(), media_type="text/plain")

    return app


def test_a_call_names_its_path_inside_the_application() -> None:
    scope = {"type": "http", "method": "GET", "path": "/api/v1/models", "root_path": "/api", "headers": []}
    assert HttpCall.from_scope(scope, b"").path == "/v1/models"
    assert HttpCall.from_scope(scope | {"path": "/api"}, b"").path == "/"
    assert HttpCall.from_scope(scope | {"root_path": ""}, b"").path == "/api/v1/models"


def test_replay_streams_the_response_and_stops_when_closed() -> None:
    stopped: list[str] = []
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/echo/a",
        "query_string": b"q=1",
        "headers": [(b"x-k", b"v"), (b"content-type", b"text/plain")],
        "client": ("127.0.0.1", 5),
    }
    call = HttpCall.from_scope(scope, b"hello")

    async def run():
        messages = replay(_app(stopped), call)
        start = await anext(messages)
        first = await anext(messages)
        second = await anext(messages)
        await messages.aclose()  # the client left
        await asyncio.sleep(0.05)
        return start, first, second

    start, first, second = asyncio.run(run())
    assert start["type"] == "http.response.start" and start["status"] == 200
    assert first["body"] == b"a:hello:1:v:0\n" and second["body"] == b"a:hello:1:v:1\n"
    assert stopped == ["a"]  # the app's stream ended at once, not after its 1,000 chunks
