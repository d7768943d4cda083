"""A stand-in for the llama.cpp peer's child side (`llama_cpp_child.py`), loaded by `specsample.bench.worker` into a
child process: it answers llama.cpp requests (its reply: the prompt reversed), and crashes, exits or raises when the
prompt holds one of the tokens below."""

from __future__ import annotations

import os
import signal
import time

SEGFAULT, EXIT, RAISE = 666, 777, 888


def build(config: dict) -> FakePeer:
    if config.get("gguf") == "missing.gguf":
        raise FileNotFoundError("missing.gguf")
    return FakePeer(config)


class FakePeer:
    def __init__(self, config: dict) -> None:
        self.config = config

    def info(self) -> dict:
        return {"version": "fake", "n_ctx": self.config["n_ctx"], "pid": os.getpid()}

    def run(self, request: dict) -> dict:
        prompt = request["prompt"]
        if SEGFAULT in prompt:
            os.kill(os.getpid(), signal.SIGSEGV)
        if EXIT in prompt:
            os._exit(3)
        if RAISE in prompt:
            raise ValueError("the scores buffer is too small")
        started = time.perf_counter()
        tokens = prompt[::-1][: request["max_new_tokens"]]
        return {"tokens": tokens, "seconds": time.perf_counter() - started + 1e-3, "ttft": 1e-4, "gaps": [1e-4]}
