"""What every request passes before a route (`Gate`): the server is up and not draining, the request carries the key
its path needs (the admin key on /admin/*, the metrics key on /metrics, the API key elsewhere but /health), and its
body is within `max_body_bytes`. Replies to the request are tagged with the replica that answered."""

from __future__ import annotations

import secrets
from collections.abc import Callable

from fastapi.responses import Response
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specsample.server.options import ServerOptions
from specsample.server.responses import error_response
from specsample.server.state import SpecServer

OPEN_PATHS = ("/health", "/metrics")  # answered without the API key (/metrics has keys of its own)


class _BodyTooLarge(Exception):
    """A request body grew past `max_body_bytes` while being read."""


class Gate:
    """Pure ASGI middleware before every route: 503 while the model loads; the admin key on /admin/* (404 when the
    server has none), the API key elsewhere but /health and /metrics; bodies over `max_body_bytes` refused with 413,
    by their Content-Length before reading or as soon as they grow past it; the replica tagged on responses.

    Pure ASGI (not a BaseHTTPMiddleware) so the routes read the client's own receive channel: a request notices its
    client hanging up while it waits for the engine."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        srv: SpecServer | None = getattr(scope["app"].state, "server", None)
        if srv is None:
            await error_response(503, "the model is still loading", kind="server_error")(scope, receive, send)
            return
        options = srv.options
        started = False

        async def tagged_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if options.replica_id:
                    headers = [*message.get("headers", []), (b"x-specsample-replica", options.replica_id.encode())]
                    message = {**message, "headers": headers}
            await send(message)

        refused = refusal(options, scope)
        if refused is None and srv.draining and scope["path"] != "/metrics":
            refused = error_response(503, "the server is shutting down", kind="server_error", code="shutting_down")
        if refused is not None:
            await refused(scope, receive, tagged_send)
            return
        counted = scope["path"] not in OPEN_PATHS
        srv.active += counted
        try:
            await self._limited(scope, receive, tagged_send, options.max_body_bytes, lambda: started)
        finally:
            srv.active -= counted

    async def _limited(
        self, scope: Scope, receive: Receive, send: Send, limit: int, started: Callable[[], bool]
    ) -> None:
        """The app, with the request body cut off past `limit` bytes (413 if no response started)."""
        received = 0

        async def limited_receive() -> Message:
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
                await too_large(limit)(scope, receive, send)
        except ClientDisconnect:  # gone while sending its body: nobody to answer
            pass


def refusal(options: ServerOptions, scope: Scope) -> Response | None:
    """The answer to a request its keys or declared size do not allow, else None (also what the Ray Serve ingress
    checks before it reads a body: deploy.py)."""
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
            return too_large(options.max_body_bytes)
    return None


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return value
    return None


def _bearer_matches(scope: Scope, key: str) -> bool:
    """Whether the request carries `Authorization: Bearer KEY`, compared as bytes in constant time (any bytes a
    client sends compare; none raise)."""
    header = _header(scope, b"authorization") or b""
    given = header[len(b"Bearer ") :].strip() if header.startswith(b"Bearer ") else b""
    return secrets.compare_digest(given, key.encode("utf-8"))


def too_large(limit: int) -> Response:
    return error_response(
        413,
        f"request body too large: this server accepts at most {limit} bytes (--max-body-bytes)",
        code="request_too_large",
    )
