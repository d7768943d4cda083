"""llama.cpp (through llama-cpp-python) as a benchmark peer on the target's own GGUF file: decoding plainly
(`llama.cpp`), or with llama-cpp-python's prompt-lookup draft (`llama.cpp-lookup`: `LlamaPromptLookupDecoding`, the
next LOOKUP_TOKENS tokens after the latest earlier match of the context's last 1 to LOOKUP_NGRAM tokens, checked
by the target in one batch).

It is an optional extra, built from source for the machine (INSTALL_HINT): where it is missing, `peer_or_reason`
says so and the benchmark goes on without it. Each peer runs in a child process of its own (`worker.py`, the child's
side in `llama_cpp_child.py`), so a crash inside llama.cpp is recorded as that peer's failure on that prompt and the
run goes on. Prompts arrive as our token ids, so both decode exactly the same prompt; llama.cpp samples with its own
sampler (greedy at temperature 0) and its own random numbers.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch

from specsample.bench.systems import RunRecord
from specsample.bench.worker import PeerFailed, Worker
from specsample.config import SamplingParams

LOOKUP_NGRAM = 2  # LlamaPromptLookupDecoding's max_ngram_size (its default)
LOOKUP_TOKENS = 2  # ...and num_pred_tokens: 2, which its documentation recommends on a CPU (10 on a GPU)
CONTEXT_MULTIPLE = 256  # llama.cpp pads n_ctx to a multiple of this (see llama_cpp_child.LlamaPeer)
MAX_BATCH = 512  # prompt tokens llama.cpp evaluates per call
# ggml's AMX kernels, which GGML_NATIVE builds on a CPU with AMX, crash in batched decoding: the compiler is told to
# leave AMX out (the GGML_AMX_* switches apply only where GGML_NATIVE is off)
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
INSTALL_HINT = (
    f"CMAKE_ARGS=\"-DGGML_NATIVE=ON -DCMAKE_C_FLAGS='{NO_AMX}' -DCMAKE_CXX_FLAGS='{NO_AMX}'\" "
    "pip install --no-cache-dir 'specsample[llama]'"
)
CHILD = Path(__file__).with_name("llama_cpp_child.py")


def context_size(tokens: int) -> int:
    """The n_ctx that holds `tokens` tokens and a draft past the last of them: a multiple of CONTEXT_MULTIPLE."""
    if tokens < 1:
        raise ValueError(f"a context must hold at least one token, got {tokens}")
    return -(-(tokens + LOOKUP_TOKENS + 1) // CONTEXT_MULTIPLE) * CONTEXT_MULTIPLE


def peer_or_reason(
    gguf: Path | None, context: int, eos: frozenset[int], threads: int | None = None, lookup: bool = False
) -> tuple[LlamaCpp | None, str | None]:
    """The llama.cpp peer for `gguf` (with its prompt-lookup draft where `lookup`), holding `context` tokens, or
    None and why it cannot run (not installed, no GGUF file, it failed to load)."""
    name = "llama.cpp-lookup" if lookup else "llama.cpp"
    if gguf is None:
        return None, f"{name} skipped: the target was not loaded from a GGUF file"
    if importlib.util.find_spec("llama_cpp") is None:
        return None, f"{name} skipped: llama-cpp-python is not installed ({INSTALL_HINT})"
    try:
        return LlamaCpp(gguf, context, eos, threads or torch.get_num_threads(), lookup), None
    except PeerFailed as exc:
        return None, f"{name} skipped: {exc}"


class LlamaCpp:
    """llama.cpp decoding one prompt at a time (batch 1) in its own process, timed there like our systems; with
    `lookup`, drafting by llama-cpp-python's prompt lookup. A prompt it fails on raises `PeerFailed`."""

    def __init__(self, gguf: Path, context: int, eos: frozenset[int], threads: int, lookup: bool = False) -> None:
        self.name = "llama.cpp-lookup" if lookup else "llama.cpp"
        self.about = f"prompt lookup: max_ngram_size {LOOKUP_NGRAM}, num_pred_tokens {LOOKUP_TOKENS}" if lookup else ""
        self.gguf, self.threads = gguf, threads
        n_ctx = context_size(context)
        config = {
            "gguf": str(gguf),
            "n_ctx": n_ctx,
            "n_batch": min(MAX_BATCH, n_ctx),
            "threads": threads,
            "eos": sorted(eos),
            "lookup_ngram": LOOKUP_NGRAM if lookup else 0,
            "lookup_tokens": LOOKUP_TOKENS if lookup else 0,
        }
        self.worker = Worker(self.name, CHILD, config)
        self.version = self.worker.info["version"]
        self.n_ctx = self.worker.info["n_ctx"]

    def run(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[RunRecord]:
        return [self._one(prompt, p) for prompt, p in zip(prompts, params)]

    def _one(self, prompt: list[int], params: SamplingParams) -> RunRecord:
        sampling: dict[str, Any] = (
            {"temp": 0.0, "top_k": 1}
            if params.greedy
            else {"temp": params.temperature, "top_k": params.top_k or 0, "top_p": params.top_p, "min_p": params.min_p}
        )
        request = {
            "prompt": [int(t) for t in prompt],
            "sampling": sampling,
            "seed": None if params.seed is None else params.seed % 2**31,
            "max_new_tokens": params.max_new_tokens,
        }
        reply = self.worker.call(request)
        return RunRecord(reply["tokens"], reply["seconds"], reply["ttft"], reply["gaps"], {})

    def close(self) -> None:
        self.worker.close()
