"""Start-up time of `specsample serve`: seconds from launching the process until /health answers, eager
(`--enforce-eager`), then compiled (the default) with an empty cache of compiled artefacts (cold), then again with
the cache the cold start filled (warm: a second process, as after a restart).

The compiled artefacts go to `--cache-dir` (TORCHINDUCTOR_CACHE_DIR for the servers; default: a new temporary
folder, so the cold start is cold), models come from the specsample cache as usual. Each server is stopped once it
answers. Its log lines about compiling are kept in the results.

    python benchmarks/serve_startup.py --out docs/results/compiled/startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_up(serve_args: list[str], cache: Path, timeout: float) -> dict:
    """Launch `specsample serve SERVE_ARGS`, time it until /health answers 200, stop it; its compile log lines."""
    port = free_port()
    command = [sys.executable, "-m", "specsample.cli", "serve", "--port", str(port), *serve_args]
    env = os.environ | {"TORCHINDUCTOR_CACHE_DIR": str(cache)}
    start = time.perf_counter()
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seconds = None
    try:
        while time.perf_counter() - start < timeout and process.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    seconds = time.perf_counter() - start
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
    finally:
        process.terminate()
        _, err = process.communicate(timeout=60)
    if seconds is None:
        raise RuntimeError(f"`{shlex.join(command)}` did not answer /health within {timeout:.0f} s:\n{err[-2000:]}")
    return {"seconds": seconds, "log": [line for line in err.splitlines() if "compil" in line]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--serve-args",
        default="",
        help="further `specsample serve` arguments (default: none, the default model, draft and batch size)",
    )
    parser.add_argument(
        "--cache-dir", type=Path, default=None, help="compiled artefacts (default: a new temporary folder)"
    )
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--out", type=Path, default=Path("docs/results/compiled/startup.json"))
    args = parser.parse_args()
    serve_args = shlex.split(args.serve_args)
    cache = args.cache_dir or Path(tempfile.mkdtemp(prefix="specsample-compiled-"))
    runs = {}
    for name, extra in (("eager", ["--enforce-eager"]), ("compiled, cold cache", []), ("compiled, warm cache", [])):
        runs[name] = start_up(serve_args + extra, cache, args.timeout)
        print(f"{name}: /health after {runs[name]['seconds']:.0f} s", flush=True)
    import torch

    report = {
        "command": "python benchmarks/serve_startup.py " + shlex.join(sys.argv[1:]),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "serve_args": serve_args,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
