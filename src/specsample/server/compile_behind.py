"""Serve at once, compile behind: a server whose compiled decode steps are not in the cache yet (models/artifacts.py)
serves on the eager or fused step while a separate process at low priority (`nice`) builds them
(`python -m specsample.server.compile_worker`: what `specsample compile` runs), and switches to them between two
rounds once that process has finished. Not a thread of the serving process: dynamo and inductor are not thread-safe,
and a build would hold the interpreter. The switch changes which code computes the same function (greedy outputs stay
equal); requests running at that moment go on. A build process that fails or is killed leaves the server serving as
it did, and says so (`/health`, `/metrics`, the log).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from typing import Any

from specsample.models import artifacts
from specsample.models.compiled import MAX_BLOCK, DecodeStep, PackagedDecode
from specsample.models.llama import LlamaModel
from specsample.options import EngineOptions
from specsample.precompile import options_json

log = logging.getLogger("specsample.server")

NICENESS = 10  # the build's scheduling priority below the server's: serving keeps the cores it needs
POLL_SECONDS = 1.0  # how often the engine thread looks at the build between rounds


class CompileBehind:
    """The compiled steps of `models` (a server's target and draft model): loaded now where the cache holds them all,
    else built by a process started now; `poll()`, called between rounds, switches to them once built."""

    def __init__(self, models: list[LlamaModel], options: EngineOptions, command: list[str] | None = None) -> None:
        """`command`: the build process (default: `python -m specsample.server.compile_worker OPTIONS`)."""
        self.models = models
        self.folders = [artifacts.folder(DecodeStep(m), MAX_BLOCK) for m in models]
        self.total = len(models) * len(artifacts.GRAPHS)
        self.started = time.perf_counter()
        self.state = "compiling"  # then "compiled", or "failed"
        self.reason = ""  # why it failed
        self.switched_after: float | None = None  # seconds from start until the compiled steps took over
        self._ready_at_start = self.ready()
        self._polled = 0.0
        self.process: subprocess.Popen[bytes] | None = None
        if self._ready_at_start == self.total and self._switch():
            log.info("loaded the compiled decode steps from %s", artifacts.root())
            return
        command = command or [sys.executable, "-m", "specsample.server.compile_worker", options_json(options)]
        self.process = subprocess.Popen(command, preexec_fn=_lower_priority, stdin=subprocess.DEVNULL)
        log.info(
            "serving on the %s step while a process at low priority (pid %d) compiles the decode steps (%d graphs, "
            "into %s); the server switches to them once they are built",
            getattr(models[0], "step_path", "eager"),
            self.process.pid,
            self.total - self._ready_at_start,
            artifacts.root(),
        )

    def ready(self) -> int:
        """Graphs built so far, of `total`."""
        return sum(artifacts.ready(folder) for folder in self.folders)

    def eta(self) -> float | None:
        """Seconds until the build ends, from the time each graph built so far took (None before the first)."""
        if self.state != "compiling":
            return 0.0 if self.state == "compiled" else None
        built = self.ready() - self._ready_at_start
        if built <= 0:
            return None
        return (time.perf_counter() - self.started) / built * (self.total - self.ready())

    def poll(self, force: bool = False) -> bool:
        """Between rounds (the engine thread, the only caller of the models): switch to the compiled steps once the
        build process has finished, or note that it failed. At most every POLL_SECONDS unless `force`; True once
        switched."""
        if self.state != "compiling" or self.process is None:
            return self.state == "compiled"
        now = time.perf_counter()
        if not force and now - self._polled < POLL_SECONDS:
            return False
        self._polled = now
        code = self.process.poll()
        if code is None:
            return False
        if code != 0:
            how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
            self._fail(f"the compile process {how}")
        elif not self._switch():
            self._fail("the compile process ended without building every graph")
        else:
            log.info(
                "switched to the compiled decode steps %.0f s after start (%d graphs built)",
                self.switched_after,
                self.ready() - self._ready_at_start,
            )
        return self.state == "compiled"

    def _switch(self) -> bool:
        """Load every model's packages and hand them to the models; False (nothing changed) where one is missing."""
        loaded = [PackagedDecode.open(model, build=False) for model in self.models]
        if any(step is None for step in loaded):
            return False
        for model, step in zip(self.models, loaded, strict=True):
            model.compiled = step
        self.state, self.switched_after = "compiled", time.perf_counter() - self.started
        return True

    def _fail(self, reason: str) -> None:
        self.state, self.reason = "failed", reason
        log.warning("%s: serving goes on without the compiled decode steps", reason)

    def status(self) -> dict[str, Any]:
        """What /health shows: the state, graphs ready of the total, the estimated seconds left."""
        eta = self.eta()
        return {
            "state": self.state,
            "graphs_ready": self.ready(),
            "graphs_total": self.total,
            "eta_s": None if eta is None else round(eta),
            "elapsed_s": round(time.perf_counter() - self.started),
            **({"reason": self.reason} if self.reason else {}),
        }

    def stop(self) -> None:
        """End the build process, if it still runs (the server is shutting down); what it built so far stays."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()


def _lower_priority() -> None:
    os.nice(NICENESS)
