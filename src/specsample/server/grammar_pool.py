"""Grammar compiles apart from the decoding loop: a few worker processes (specsample.server.grammar_worker), each
compiling one grammar at a time at a low scheduling priority, so a heavy compile neither holds the engine's
interpreter nor outweighs its rounds on the CPU.

A compile has a time limit (`--grammar-compile-timeout`), counting the wait for a free worker and the compile (not a
worker's start); past it, or when its client leaves, the worker is killed (its CPU freed at once) and a fresh one is
started for the next compile. Compiled grammars come back serialized and join the engine's grammar cache, keyed by
the grammar's served form (specsample.grammar.served_grammar), so a repeat does not reach a worker.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import struct
import sys
from pathlib import Path

from specsample.config import Grammar, SettingError
from specsample.grammar import GrammarCompiler
from specsample.server.grammar_worker import frame

log = logging.getLogger("specsample.server")

WORKER_START_TIMEOUT = 120.0  # seconds for a worker to import xgrammar and read the tokenizer


class CompileTimeout(Exception):
    """A grammar did not compile within the pool's time limit."""


class CompileFailed(Exception):
    """A worker died while compiling (the grammar is not known to be at fault)."""


class GrammarPool:
    """Up to `workers` compiling processes for `compiler`'s tokenizer, started when first needed."""

    def __init__(self, compiler: GrammarCompiler, workers: int, timeout: float) -> None:
        self.compiler, self.workers, self.timeout = compiler, workers, timeout
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self._slots: asyncio.Semaphore | None = None  # made in the serving loop, on first use
        self._tokenizer: bytes | None = None
        self._closed = False
        self.compiled = 0  # grammars the workers compiled (cache hits not counted)

    async def compile(self, grammar: Grammar) -> None:
        """Make `grammar` compiled in the compiler's cache. Raises `SettingError` for a grammar the compiler refuses,
        `CompileTimeout` past the time limit, `CompileFailed` if its worker died; cancelled, it kills the worker."""
        if self.compiler.cached(grammar) is not None:
            return
        if self._closed:
            raise CompileFailed("the server is shutting down")
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.workers)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        try:
            async with asyncio.timeout_at(deadline):
                await self._slots.acquire()
        except TimeoutError:
            raise CompileTimeout from None
        try:
            worker = self._idle.pop() if self._idle else None
            if worker is None:
                worker = await self._start()
                deadline = loop.time() + self.timeout  # a worker's start does not count
            self._busy.add(worker)
            try:
                async with asyncio.timeout_at(deadline):
                    answer = await worker.ask({"kind": grammar.kind, "text": grammar.text})  # raw JSON
            except BaseException as exc:  # timed out, cancelled (client gone) or the worker died: it goes
                worker.kill()
                if isinstance(exc, TimeoutError):
                    raise CompileTimeout from None
                if isinstance(exc, (asyncio.IncompleteReadError, ConnectionError, BrokenPipeError)):
                    raise CompileFailed(f"the grammar compiler process exited ({worker.returncode})") from None
                raise
            finally:
                self._busy.discard(worker)
            self._idle.append(worker)
        finally:
            self._slots.release()
        self.compiled += 1
        # a compiled grammar is megabytes of JSON (its token masks): read it back off the event loop
        error = await asyncio.to_thread(self._adopt, grammar, answer)
        if error is not None:
            raise SettingError("grammar", error)

    def _adopt(self, grammar: Grammar, answer: bytes) -> str | None:
        """Cache the worker's compiled grammar; the compiler's refusal instead, if it refused."""
        reply = json.loads(answer)
        if "error" in reply:
            return reply["error"]
        self.compiler.adopt(grammar, reply["compiled"])
        return None

    async def warm(self) -> None:
        """Start one worker ahead of the first compile (a start takes seconds: xgrammar's import)."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.workers)
        async with self._slots:
            if self._idle or self._closed:
                return
            try:
                worker = await self._start()
            except (CompileFailed, OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
                log.warning("could not start a grammar compiler process ahead of time: %s", exc)
                return
            self._busy.discard(worker)
            self._idle.append(worker)

    async def _start(self) -> _Worker:
        if self._tokenizer is None:
            self._tokenizer = await asyncio.to_thread(lambda: self.compiler.tokenizer_json.encode())
        package_root = str(Path(__file__).resolve().parents[2])  # the folder holding specsample
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "specsample.server.grammar_worker",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
            env=env,
        )
        worker = _Worker(process)
        self._busy.add(worker)  # from its start: close() kills it
        try:
            async with asyncio.timeout(WORKER_START_TIMEOUT):
                worker.stdin.write(struct.pack(">I", len(self._tokenizer)) + self._tokenizer)
                await worker.stdin.drain()
                ready = json.loads(await worker.answer())
        except BaseException:
            worker.kill()
            self._busy.discard(worker)
            raise
        if not ready.get("ready"):
            worker.kill()
            self._busy.discard(worker)
            raise CompileFailed("the grammar compiler process did not start")
        return worker

    def close(self) -> None:
        """Kill every worker (compiles in progress fail with `CompileFailed`); later compiles are refused. Called in
        the serving loop."""
        self._closed = True
        for worker in [*self._idle, *self._busy]:
            worker.kill()
        self._idle.clear()

    @property
    def started(self) -> int:
        """Worker processes alive now."""
        return len(self._idle) + len(self._busy)


class _Worker:
    def __init__(self, process: asyncio.subprocess.Process) -> None:
        if process.stdin is None or process.stdout is None:
            raise ValueError("a grammar worker needs pipes to its stdin and stdout")
        self.process, self.stdin, self.stdout = process, process.stdin, process.stdout

    async def ask(self, request: dict) -> bytes:
        self.stdin.write(frame(request))
        await self.stdin.drain()
        return await self.answer()

    async def answer(self) -> bytes:
        """The next frame's JSON, unparsed."""
        (size,) = struct.unpack(">I", await self.stdout.readexactly(4))
        return await self.stdout.readexactly(size)

    def kill(self) -> None:
        """Kill the process and close its pipes (in the loop that started it: asyncio's transport is not
        thread-safe)."""
        if self.process.returncode is None:
            try:
                self.process.kill()
            except ProcessLookupError:
                pass
        # its pipes now, not when collected after the loop has closed (asyncio's Process has no public call for it)
        self.process._transport.close()  # type: ignore[attr-defined]

    @property
    def returncode(self) -> int | None:
        return self.process.returncode
