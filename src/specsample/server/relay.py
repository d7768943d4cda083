"""An HTTP request handed from one process to another and answered there by the same app: what the Ray Serve ingress
(deploy.py) sends each engine replica through a `DeploymentHandle`.

Ray Serve's HTTP proxy picks a replica before it reads a request's body, so a router that places requests by their
prompt sees them only on handle calls. The ingress reads the request (`read_body`), names its prompt for the router
(`routing_prompt`) and passes it on as a value (`HttpCall`); the replica runs its own FastAPI app on it (`replay`) and
streams back the app's ASGI messages, which the ingress sends to the client as they come. The routes, the `Gate`, the
responses and the streaming are the server's own (server/app.py); nothing about the API is written twice.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope

log = logging.getLogger("specsample.server")

ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")  # routed by their prompt; the others by load alone


@dataclass(frozen=True)
class HttpCall:
    """One HTTP request as a value: its scope's fields that the app reads, and its whole body."""

    method: str
    path: str
    query_string: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    client: tuple[str, int] | None = None
    scheme: str = "http"
    http_version: str = "1.1"

    @classmethod
    def from_scope(cls, scope: Scope, body: bytes) -> HttpCall:
        client = scope.get("client")
        return cls(
            method=scope["method"],
            path=app_path(scope),
            query_string=scope.get("query_string", b""),
            headers=tuple((bytes(k), bytes(v)) for k, v in scope.get("headers", [])),
            body=body,
            client=tuple(client) if client else None,
            scheme=scope.get("scheme", "http"),
            http_version=scope.get("http_version", "1.1"),
        )

    def scope(self) -> Scope:
        """The ASGI scope the app is called with (ASGI spec 2.3: a streaming response watches `receive` for the
        client's departure)."""
        return {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": self.http_version,
            "method": self.method,
            "scheme": self.scheme,
            "path": self.path,
            "raw_path": self.path.encode(),
            "root_path": "",
            "query_string": self.query_string,
            "headers": list(self.headers),
            "client": list(self.client) if self.client else None,
            "server": None,
        }


def app_path(scope: Scope) -> str:
    """The request's path inside the application: without the prefix the application is served under (Serve's
    `route_prefix`, the scope's `root_path`)."""
    path, root = scope["path"], scope.get("root_path", "")
    return (path[len(root) :] or "/") if root and path.startswith(root) else path


@dataclass(frozen=True)
class RoutingPrompt:
    """What a prefix-aware request router reads of a completion request: its prompt as text, in `prompt` (the field
    Ray Serve's `PrefixCacheAffinityRouter` looks for among a handle call's positional arguments)."""

    prompt: str


def routing_prompt(path: str, body: bytes) -> RoutingPrompt | None:
    """The prompt of a completion or chat request as text that grows as its token prefix does (a chat: each
    message's role and text in turn; token ids: their numbers), or None where the body names none (the engine
    replica answers such a request with its error)."""
    if path not in ROUTED_PATHS:
        return None
    try:
        request = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(request, dict):
        return None
    text = _chat_text(request.get("messages")) if path.endswith("/chat/completions") else _prompt_text(request)
    return RoutingPrompt(text) if text else None


def _prompt_text(request: dict[str, Any]) -> str:
    prompt = request.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return "".join(f"{t} " for t in prompt)
    return ""


def _chat_text(messages: Any) -> str:
    if not isinstance(messages, list):
        return ""
    parts = []
    for message in messages:
        if not isinstance(message, dict):
            return ""
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(
                p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
            )
        if not isinstance(content, str):
            return ""
        parts.append(f"{message.get('role')}: {content}\n")
    return "".join(parts)


async def read_body(receive: Receive, limit: int) -> bytes | None:
    """The request's body, or None as soon as it grows past `limit` bytes (or the client leaves while sending it)."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def replay(app: ASGIApp, call: HttpCall) -> AsyncIterator[Message]:
    """Run `app` on `call` and yield the ASGI messages of its response as it sends them. Closing the iterator early
    (the client left) tells the app its client disconnected and cancels what it still runs."""
    messages: asyncio.Queue[Message | None] = asyncio.Queue()
    gone = asyncio.Event()
    body_given = False

    async def receive() -> Message:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": call.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await messages.put(message)

    async def run() -> None:
        try:
            await app(call.scope(), receive, send)
        finally:
            await messages.put(None)

    task = asyncio.ensure_future(run())
    try:
        while (message := await messages.get()) is not None:
            yield message
        try:
            await task
        except Exception:  # the app answered with its own error response (500) before raising
            log.exception("%s %s failed", call.method, call.path)
    finally:
        gone.set()
        if not task.done():
            task.cancel()
