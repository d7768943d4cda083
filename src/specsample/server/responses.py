"""A completion's response: each choice read from the engine as text (stop strings applied), then streamed as
server-sent events or collected into one body. The chat and completion shapes (`Shape`), usage, log-probabilities
and error objects are written here once; a request whose client goes away is cancelled, and every choice is logged
and counted when its response ends.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from specsample.engine import RowUpdate
from specsample.server.disconnect import settle, until_disconnected
from specsample.server.protocol import ChatRequest, CompletionRequest, TextAssembler
from specsample.server.runner import RequestHandle
from specsample.server.state import SpecServer

log = logging.getLogger("specsample.server")


def error_object(
    message: str, param: str | None = None, kind: str = "invalid_request_error", code: str | None = None
) -> dict[str, Any]:
    """An OpenAI-style error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(
    status: int, message: str, param: str | None = None, kind: str = "invalid_request_error", code: str | None = None
) -> JSONResponse:
    """An OpenAI-style error response."""
    return JSONResponse(status_code=status, content=error_object(message, param, kind, code))


def shutting_down() -> JSONResponse:
    return error_response(
        503,
        "the server is shutting down: the request was ended before it finished",
        kind="server_error",
        code="shutting_down",
    )


@dataclass(frozen=True)
class Shape:
    """The objects of one response: a chat completion (`chat.completion`, streamed as `chat.completion.chunk`s whose
    choices carry a `delta`) or a completion (`text_completion`, streamed alike)."""

    request_id: str
    chat: bool
    model: str
    created: int

    def body(self, choices: list[dict[str, Any]], stream: bool, usage: dict[str, int] | None = None) -> dict[str, Any]:
        """The response (`stream`: one chunk of it) holding `choices`, and `usage` where given."""
        kind = ("chat.completion.chunk" if stream else "chat.completion") if self.chat else "text_completion"
        out = {"id": self.request_id, "object": kind, "created": self.created, "model": self.model, "choices": choices}
        return out if usage is None else out | {"usage": usage}

    def choice(
        self,
        index: int,
        text: str | None,
        finish: str | None,
        logprobs: dict[str, Any] | None,
        stream: bool,
        role: bool = False,
    ) -> dict[str, Any]:
        """Choice `index` with `text` (`stream`: the text it adds; a chat chunk's `role` announces the assistant)."""
        end = {"finish_reason": finish, "logprobs": logprobs}
        if not self.chat:
            return {"index": index, "text": text or ""} | end
        if not stream:
            return {"index": index, "message": {"role": "assistant", "content": text}} | end
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text:
            delta["content"] = text
        return {"index": index, "delta": delta} | end


def usage(prompt_tokens: int, choices: list[Choice]) -> dict[str, int]:
    completion = sum(c.tokens for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


class LogprobFormat:
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
class Choice:
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


async def respond(
    srv: SpecServer,
    request: Request,
    req: CompletionRequest | ChatRequest,
    handles: list[RequestHandle],
    prompt_tokens: int,
    chat: bool,
) -> Response:
    """The response to a submitted request (`handles`: its choices): a stream of server-sent events where it asked
    for one, else one body once every choice finished."""
    request_id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
    choices = [
        Choice(i, h, TextAssembler(srv.tokenizer.stream(), req.stop_strings(), req.min_tokens))
        for i, h in enumerate(handles)
    ]
    logprobs = LogprobFormat(srv, chat) if req.top_logprobs_asked() is not None else None
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        # a client that hangs up before the stream starts would never run the stream's cleanup
        asyncio.ensure_future(_cancel_on_disconnect(srv, request, choices))
        return StreamingResponse(
            _stream(srv, request_id, chat, choices, prompt_tokens, include_usage, logprobs),
            media_type="text/event-stream",
        )
    return await _complete(srv, request, request_id, chat, choices, prompt_tokens, logprobs)


async def _cancel_on_disconnect(srv: SpecServer, request: Request, choices: list[Choice]) -> None:
    """Watch a streaming request until its choices finish; cancel them if the client goes away."""
    while not all(c.done or c.closed for c in choices):
        if await request.is_disconnected():
            for choice in choices:
                srv.runner.cancel(choice.handle.request_id)
            return
        await asyncio.sleep(0.25)


def _finish(srv: SpecServer, request_id: str, choices: list[Choice], prompt_tokens: int) -> None:
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


async def _stream(
    srv: SpecServer,
    request_id: str,
    chat: bool,
    choices: list[Choice],
    prompt_tokens: int,
    include_usage: bool,
    logprobs: LogprobFormat | None = None,
) -> AsyncIterator[str]:
    shape = Shape(request_id, chat, srv.options.model_name, int(time.time()))
    pending: dict[asyncio.Future, Choice] = {}
    try:
        if chat:
            for choice in choices:
                yield _sse(
                    shape.body([shape.choice(choice.index, "", None, None, stream=True, role=True)], stream=True)
                )
        pending = {asyncio.ensure_future(c.next()): c for c in choices}
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                choice = pending.pop(task)
                for text, finish in task.result():
                    if finish == "shutdown":  # the shutdown limit passed: an error event, then the stream's end
                        message = "the server is shutting down: the response was cut short"
                        yield _sse(error_object(message, kind="server_error", code="shutting_down"))
                        yield "data: [DONE]\n\n"
                        return
                    new = choice.logprobs[choice.sent_logprobs :] if logprobs is not None else []
                    if text or finish or new:  # each chunk carries the logprobs of the tokens it adds
                        rendered = None
                        if logprobs is not None:
                            rendered = logprobs.render(new, offset=choice.text_offset)
                            choice.text_offset += sum(len(logprobs.text(e.token)) for e in new)
                        choice.sent_logprobs += len(new)
                        piece = shape.choice(choice.index, text, finish, rendered, stream=True)
                        yield _sse(shape.body([piece], stream=True))
                if not choice.done:
                    pending[asyncio.ensure_future(choice.next())] = choice
        if include_usage:
            yield _sse(shape.body([], stream=True, usage=usage(prompt_tokens, choices)))
        yield "data: [DONE]\n\n"
    finally:  # also runs when the client disconnects mid-stream: its rows are cancelled and freed
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
    choices: list[Choice],
    prompt_tokens: int,
    logprobs: LogprobFormat | None = None,
) -> Response:
    texts = {c.index: "" for c in choices}

    async def collect(choice: Choice) -> None:
        while not choice.done:
            for text, _ in await choice.next():
                texts[choice.index] += text

    work = asyncio.ensure_future(asyncio.gather(*(collect(c) for c in choices)))
    watcher = asyncio.ensure_future(until_disconnected(request))
    try:
        waiting: set[asyncio.Future[Any]] = {work, watcher}
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():  # the client hung up: _finish cancels its choices
            work.cancel()
            work.add_done_callback(settle)
            return Response(status_code=499)
        work.result()
    finally:
        watcher.cancel()
        _finish(srv, request_id, choices, prompt_tokens)
    if any(c.finish_reason == "shutdown" for c in choices):
        return shutting_down()
    if any(c.finish_reason == "error" for c in choices):
        return error_response(500, "generation failed inside the engine", kind="server_error")
    shape = Shape(request_id, chat, srv.options.model_name, int(time.time()))
    rendered = [
        shape.choice(
            c.index,
            texts[c.index],
            c.finish_reason,
            logprobs.render(c.logprobs) if logprobs is not None else None,
            stream=False,
        )
        for c in choices
    ]
    return JSONResponse(shape.body(rendered, stream=False, usage=usage(prompt_tokens, choices)))
