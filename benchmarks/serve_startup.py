"""Start-up time of `specsample serve`: seconds from launching the process until /health answers, and for a compiled
server until it runs its compiled steps, eager (`--enforce-eager`), then compiled (the default where the fused step does
not run the model; `--serve-args --compile` elsewhere) with an empty cache of compiled steps (cold: the server answers
at once and builds them in a process apart), then again with the cache the cold start filled (warm: a second process,
as after a restart or with `specsample compile` run ahead of time).

While a server builds, a greedy request is sent every few seconds: every one must be answered (`refused` counts those
that were not). The compiled steps go to `--cache-dir` (SPECSAMPLE_COMPILED_STEPS for the servers, inductor's cache
beside it; default: a new temporary folder, so the cold start is cold); models come from the specsample cache as
usual. Each server is stopped once it runs compiled. Its log lines about compiling are kept in the results.

    python benchmarks/serve_startup.py --serve-args=--compile --out docs/results/compiled/startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REQUEST_EVERY = 5.0  # seconds between the requests sent while a server builds
# run: (its name in the results, the flags it adds to --serve-args)
RUNS = {
    "eager": ("eager", ["--enforce-eager"]),
    "cold": ("compiled, cold cache", []),
    "warm": ("compiled, warm cache", []),
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _health(port: int) -> dict | None:
    try:
        answer = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    except httpx.HTTPError:
        return None
    return answer.json() if answer.status_code == 200 else None


def _request(port: int) -> bool:
    body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    try:
        return httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120).status_code == 200
    except httpx.HTTPError:
        return False


def start_up(serve_args: list[str], cache: Path, timeout: float) -> dict:
    """Launch `specsample serve SERVE_ARGS`, time it until /health answers 200 and, where it compiles, until its
    compiled steps run (requests sent meanwhile); stop it; its compile log lines."""
    port = free_port()
    command = [sys.executable, "-m", "specsample.cli", "serve", "--port", str(port), *serve_args]
    env = os.environ | {"SPECSAMPLE_COMPILED_STEPS": str(cache), "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")}
    start = time.perf_counter()
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    result: dict = {"health_seconds": None, "compiled_seconds": None, "requests": 0, "refused": 0}
    result["load_average"] = os.getloadavg()[0]  # the machine's business when the run began
    try:
        health = None
        while time.perf_counter() - start < timeout and process.poll() is None and health is None:
            health = _health(port)
            time.sleep(0.2)
        if health is None:
            raise RuntimeError(f"`{shlex.join(command)}` did not answer /health within {timeout:.0f} s")
        result["health_seconds"] = time.perf_counter() - start
        result["step_at_health"] = health["step"]
        last_request = 0.0
        while (health or {}).get("compile") and health["compile"]["state"] == "compiling":
            if time.perf_counter() - start > timeout or process.poll() is not None:
                break
            if time.perf_counter() - last_request > REQUEST_EVERY:
                last_request = time.perf_counter()
                result["requests"] += 1
                result["refused"] += not _request(port)
            time.sleep(0.5)
            health = _health(port)
        result["compile"] = (health or {}).get("compile")
        if result["compile"] and result["compile"]["state"] == "compiled":
            result["compiled_seconds"] = time.perf_counter() - start
        result["step"] = (health or {}).get("step")
    finally:
        process.terminate()
        _, err = process.communicate(timeout=60)
    result["log"] = [line for line in err.splitlines() if "compil" in line]
    return result


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
    parser.add_argument(
        "--runs",
        default=",".join(RUNS),
        help="the runs to measure, comma-separated; they replace the same runs in --out, whose others are kept "
        "(e.g. `--runs warm --cache-dir DIR` again with the cache an earlier cold run filled)",
    )
    parser.add_argument("--out", type=Path, default=Path("docs/results/compiled/startup.json"))
    args = parser.parse_args()
    serve_args = shlex.split(args.serve_args)
    cache = args.cache_dir or Path(tempfile.mkdtemp(prefix="specsample-compiled-"))
    kept = json.loads(args.out.read_text()) if args.out.exists() else {}
    runs = kept.get("runs", {}) if kept.get("serve_args") == serve_args else {}
    commands = dict(kept.get("commands", {}))
    for key in args.runs.split(","):
        name, extra = RUNS[key]
        commands[name] = "python benchmarks/serve_startup.py " + shlex.join(sys.argv[1:])
        args_for_run = [a for a in serve_args if a != "--compile"] + extra if extra else serve_args
        runs[name] = start_up(args_for_run, cache, args.timeout)
        run = runs[name]
        compiled = f", compiled after {run['compiled_seconds']:.0f} s" if run["compiled_seconds"] is not None else ""
        print(f"{name}: /health after {run['health_seconds']:.0f} s ({run['step_at_health']}){compiled}", flush=True)
    import torch

    from specsample.bench.context import cpu_name

    report = {
        "commands": commands,
        "machine": f"{cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "serve_args": serve_args,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
