"""`specsample bench`: speed, acceptance and losslessness of speculative sampling, side by side with peers.

Every system sees the same prompts, seeds and token budget, interleaved prompt by prompt (the order rotates) or,
in the adaptive suite, round by round, so the machine's drift hits all alike. The baseline of every speedup is
target-only decoding through our own engine. Results are written as they are measured: a run that is cut off
or fails keeps everything it measured, in `results.json` and `results.md`. A peer that fails on a prompt is recorded
there with its cause, and the suite goes on.
"""

from __future__ import annotations

import dataclasses
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specsample.bench import suites
from specsample.bench.config import BenchConfig
from specsample.bench.context import Bench, Recorder, commit, environment


def run(
    config: BenchConfig,
    command: str = "specsample bench",
    say: Callable[[str], None] = lambda m: print(f"specsample bench: {m}", file=sys.stderr, flush=True),
) -> dict[str, Any]:
    """Run the chosen suites, writing results.json, results.md and the plots into `config.out` as they are
    measured; a suite that fails is recorded with its error and the run goes on to the next."""
    results: dict[str, Any] = {
        "command": command,
        "commit": commit(),
        "started": time.time(),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(config).items()},
        "status": "loading",
        "suites": {},
    }
    recorder = Recorder(config.out, results)
    recorder.save()
    bench = Bench(config, say)
    results.update(environment=environment(bench), notes=bench.notes, status="running")
    recorder.save()
    failed = []
    try:
        for name in config.suites:
            try:
                getattr(suites, name)(bench, results["suites"].setdefault(name, {}), recorder)
            except KeyboardInterrupt:
                results["status"] = f"interrupted in {name}"
                recorder.save(plots=True)
                raise
            except Exception as exc:  # the other suites still run; this one keeps what it measured
                results["suites"][name]["error"] = "".join(traceback.format_exception_only(exc)).strip()
                failed.append(name)
                say(f"suite {name} failed: {exc}")
            recorder.save(plots=True)
    finally:
        bench.close()
    results["status"] = "complete" if not failed else f"complete, failed: {', '.join(failed)}"
    recorder.save(plots=True)
    return results
