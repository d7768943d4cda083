"""A benchmark peer in a child process of its own, so that a crash in its native code (a segmentation fault ends the
process it happens in) is recorded as that peer's failure on that prompt and the run goes on.

The child is this file run as a script: it loads the peer's module from a file (stdlib imports only here, so it
starts in a fraction of a second and never imports torch), calls its `build(config)` once (the model loads once),
then answers requests with `peer.run(request)` over a pipe until the pipe closes. The peer times its own work, so a
reply carries no inter-process time. A Python exception in `run` is sent back and the child lives on; a child that
dies is replaced at the next request (the model loads again), and after MAX_DEATHS deaths the peer is given up for
the rest of the run. Every failure is a `PeerFailed` naming the cause: the exception, or the signal or exit code
and, from faulthandler, the innermost Python frame the child was in.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

MAX_DEATHS = 3  # deaths after which a peer is given up for the rest of the run
LOAD_TIMEOUT = 600.0  # seconds a child may take to load its peer


class PeerFailed(RuntimeError):
    """A peer could not generate for a prompt; the suites record it as that peer's failure there and go on."""


def describe(exc: BaseException) -> str:
    """An exception in one line, with the innermost frame it was raised in."""
    message = "".join(traceback.format_exception_only(type(exc), exc)).strip().replace("\n", " ")
    frames = traceback.extract_tb(exc.__traceback__)
    if frames:
        frame = frames[-1]
        message += f" (in {Path(frame.filename).name}:{frame.lineno} {frame.name})"
    return message


def death_cause(returncode: int, stderr: str) -> str:
    """Why a child ended: its signal or exit code, faulthandler's fatal error, and the innermost Python frame."""
    if returncode < 0:
        try:
            cause = f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            cause = f"killed by signal {-returncode}"
    else:
        cause = f"exit code {returncode}"
    lines = [line.strip() for line in stderr.splitlines()]
    fatal = next((line for line in lines if line.startswith("Fatal Python error:")), None)
    if fatal and fatal.removeprefix("Fatal Python error:").strip():  # cut short where two threads crashed at once
        cause += f", {fatal.removeprefix('Fatal Python error:').strip()}"
    if "(most recent call first):" in stderr:  # faulthandler's dump: the first frame listed is the innermost
        stack = stderr.split("(most recent call first):", 1)[1].splitlines()
        frame = next((line.strip() for line in stack if line.strip().startswith("File ")), None)
        if frame:  # File "/path/x.py", line 12 in run
            path, _, rest = frame.removeprefix("File ").partition(", line ")
            where = Path(path.strip('"')).name
            cause += f", in {where}:{rest.replace(' in ', ' ', 1)}"
    elif lines and not fatal:
        cause += f": {lines[-1]}"  # a Python error the child printed as it ended
    return cause


class Worker:
    """The parent's end of a peer in a child process: `call(request)` returns the peer's reply or raises
    `PeerFailed`. `module` is the peer's file (a `build(config)` returning an object with `info()` and
    `run(request)`); `info` is what the built peer said of itself."""

    def __init__(self, name: str, module: Path, config: Any) -> None:
        self.name, self.module, self.config = name, Path(module), config
        self.deaths = 0
        self.given_up: str | None = None
        self._process: subprocess.Popen | None = None
        self._stderr: Any = None
        self._requests: Connection | None = None
        self._replies: Connection | None = None
        self.info: dict[str, Any] = self._start()

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def call(self, request: Any) -> Any:
        """The peer's reply to `request`, from the running child (a new one where the last died)."""
        if self.given_up is not None:
            raise PeerFailed(self.given_up)
        if self._process is None:
            try:
                self._start()
            except PeerFailed as exc:
                self.given_up = f"not run: restarting {self.name} failed ({exc})"
                raise PeerFailed(self.given_up) from None
        try:
            self._requests.send(request)
        except OSError:
            pass  # the child is gone: its death is read below
        kind, payload = self._receive(None)
        if kind == "failed":
            raise PeerFailed(payload)
        return payload

    def close(self) -> None:
        """End the child (it exits when its requests pipe closes)."""
        if self._process is None:
            return
        process, self._process = self._process, None
        self._close_pipes()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        self._stderr.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # ----- the child -----------------------------------------------------------------------------------------

    def _start(self) -> dict[str, Any]:
        to_child, requests = os.pipe()
        replies, from_child = os.pipe()
        self._stderr = tempfile.TemporaryFile()
        self._process = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _BOOT,
                str(Path(__file__).resolve()),
                str(self.module),
                str(to_child),
                str(from_child),
            ],
            pass_fds=(to_child, from_child),
            stdin=subprocess.DEVNULL,
            stdout=self._stderr,  # native code printing to stdout cannot corrupt the pipes
            stderr=self._stderr,
        )
        os.close(to_child)
        os.close(from_child)
        self._requests, self._replies = Connection(requests, readable=False), Connection(replies, writable=False)
        try:
            self._requests.send(self.config)
        except OSError:
            pass  # the child is gone: its death is read below
        kind, payload = self._receive(LOAD_TIMEOUT)
        if kind == "failed":
            self.close()
            raise PeerFailed(f"{self.name} could not load: {payload}")
        return payload

    def _receive(self, timeout: float | None) -> tuple[str, Any]:
        """The child's next message, or PeerFailed (and the child's end) where it dies or exceeds `timeout`."""
        waited, timed_out = 0.0, False
        while not self._replies.poll(0.2):
            if self._process.poll() is not None:
                break
            waited += 0.2
            if timeout is not None and waited >= timeout:
                self._process.kill()
                timed_out = True
                break
        try:
            return self._replies.recv()
        except (EOFError, OSError):
            pass
        process, self._process = self._process, None
        returncode = process.wait()
        self._close_pipes()
        self._stderr.seek(0)
        stderr = self._stderr.read()[-8192:].decode(errors="replace")
        self._stderr.close()
        self.deaths += 1
        cause = f"no answer in {timeout:.0f} s" if timed_out else death_cause(returncode, stderr)
        if self.deaths >= MAX_DEATHS:
            self.given_up = f"not run: the {self.name} worker died {self.deaths} times (last: {cause})"
        raise PeerFailed(f"the {self.name} worker died ({cause})")

    def _close_pipes(self) -> None:
        for connection in (self._requests, self._replies):
            if connection is not None:
                connection.close()
        self._requests = self._replies = None


def _serve(module_file: str, requests: Connection, replies: Connection) -> None:
    """The child's loop: build the peer from the first message, then answer each request until the pipe closes."""
    import faulthandler
    import importlib.util

    faulthandler.enable()  # a fatal signal prints the Python stack to stderr, which the parent reads
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a crash is reported, not dumped
    except (ImportError, ValueError, OSError):
        pass
    spec = importlib.util.spec_from_file_location("specsample_peer", module_file)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        peer = module.build(requests.recv())
        info = peer.info()
    except Exception as exc:
        replies.send(("failed", describe(exc)))
        return
    replies.send(("ready", info))
    while True:
        try:
            request = requests.recv()
        except EOFError:
            return
        try:
            reply = ("done", peer.run(request))
        except Exception as exc:
            reply = ("failed", describe(exc))
        replies.send(reply)


# The child runs this file as __main__ without the package (no torch) and without the working folder on its path
# (a file there must not shadow what the peer imports): `python -c _BOOT this-file module-file fd-in fd-out`.
_BOOT = "import runpy, sys; del sys.path[0]; runpy.run_path(sys.argv[1], run_name='__main__')"

if __name__ == "__main__":
    _serve(sys.argv[2], Connection(int(sys.argv[3]), writable=False), Connection(int(sys.argv[4]), readable=False))
