"""llama.cpp (through llama-cpp-python) as a benchmark peer on the target's own GGUF file: decoding plainly
(`llama.cpp`), or with llama-cpp-python's prompt-lookup draft (`llama.cpp-lookup`: `LlamaPromptLookupDecoding`, the
next LOOKUP_TOKENS tokens after the latest earlier match of the context's last 1 to LOOKUP_NGRAM tokens, checked
by the target in one batch).

It is an optional extra (`pip install 'specsample[llama]'`, which builds llama.cpp for the machine): where it is
missing, `peer_or_reason` says so and the benchmark goes on without it. Prompts arrive as our token ids, so both
decode exactly the same prompt; llama.cpp samples with its own sampler (greedy at temperature 0) and its own random
numbers.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from specsample.bench.systems import RunRecord
from specsample.config import SamplingParams

LOOKUP_NGRAM = 2  # LlamaPromptLookupDecoding's max_ngram_size (its default)
LOOKUP_TOKENS = 2  # ...and num_pred_tokens: 2, which its documentation recommends on a CPU (10 on a GPU)
INSTALL_HINT = "pip install 'specsample[llama]' (builds llama.cpp; CMAKE_ARGS=\"-DGGML_NATIVE=ON\" for this CPU)"


def peer_or_reason(
    gguf: Path | None, context: int, eos: frozenset[int], threads: int | None = None, lookup: bool = False
) -> tuple[LlamaCpp | None, str | None]:
    """The llama.cpp peer for `gguf` (with its prompt-lookup draft where `lookup`), or None and why it cannot run
    (not installed, no GGUF file)."""
    name = "llama.cpp-lookup" if lookup else "llama.cpp"
    if gguf is None:
        return None, f"{name} skipped: the target was not loaded from a GGUF file"
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return None, f"{name} skipped: llama-cpp-python is not installed ({INSTALL_HINT})"
    return LlamaCpp(gguf, context, eos, threads or torch.get_num_threads(), lookup), None


class LlamaCpp:
    """llama.cpp decoding one prompt at a time (batch 1), timed like our systems; with `lookup`, drafting by
    llama-cpp-python's prompt lookup."""

    def __init__(self, gguf: Path, context: int, eos: frozenset[int], threads: int, lookup: bool = False) -> None:
        from llama_cpp import Llama

        draft = None
        if lookup:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            draft = LlamaPromptLookupDecoding(max_ngram_size=LOOKUP_NGRAM, num_pred_tokens=LOOKUP_TOKENS)
        self.name = "llama.cpp-lookup" if lookup else "llama.cpp"
        self.about = f"prompt lookup: max_ngram_size {LOOKUP_NGRAM}, num_pred_tokens {LOOKUP_TOKENS}" if lookup else ""
        self.gguf, self.eos, self.threads = gguf, eos, threads
        self.llm = Llama(
            model_path=str(gguf),
            n_ctx=context,
            n_threads=threads,
            n_threads_batch=threads,
            n_batch=min(512, context),
            draft_model=draft,
            verbose=False,
        )
        self.version = _version()

    def run(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[RunRecord]:
        return [self._one(prompt, p) for prompt, p in zip(prompts, params)]

    def _one(self, prompt: list[int], params: SamplingParams) -> RunRecord:
        sampling: dict[str, Any] = (
            {"temp": 0.0, "top_k": 1}
            if params.greedy
            else {"temp": params.temperature, "top_k": params.top_k or 0, "top_p": params.top_p, "min_p": params.min_p}
        )
        if params.seed is not None:
            self.llm.set_seed(params.seed % 2**31)
        tokens: list[int] = []
        stamps: list[float] = []
        started = time.perf_counter()
        for token in self.llm.generate(prompt, reset=True, **sampling):
            stamps.append(time.perf_counter())
            tokens.append(int(token))
            if token in self.eos or len(tokens) >= params.max_new_tokens:
                break
        wall = time.perf_counter() - started
        gaps = [b - a for a, b in zip(stamps, stamps[1:])]
        return RunRecord(tokens, wall, stamps[0] - started if stamps else None, gaps, {})


def _version() -> str:
    import llama_cpp

    return str(getattr(llama_cpp, "__version__", "unknown"))
