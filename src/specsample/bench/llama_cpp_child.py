"""The llama.cpp peer's side in its child process (loaded by `worker.py` from this file: standard library and
llama-cpp-python only). One `Llama` per process, built once; each request decodes one prompt, timed here."""

from __future__ import annotations

import time
from typing import Any


def build(config: dict[str, Any]) -> LlamaPeer:
    return LlamaPeer(**config)


class LlamaPeer:
    """llama.cpp on a GGUF file, decoding plainly or, with `lookup_tokens` > 0, with llama-cpp-python's prompt-lookup
    draft. With a draft, llama-cpp-python evaluates every position's logits whatever `logits_all` says, but sizes its
    score buffer by `logits_all` (n_batch rows without it): `logits_all` is set, or a prompt longer than n_batch
    overruns the buffer. llama.cpp rounds n_ctx up to a multiple of 256 while llama-cpp-python sizes its token buffer
    by the n_ctx asked for, so `n_ctx` must be such a multiple."""

    def __init__(
        self,
        gguf: str,
        n_ctx: int,
        n_batch: int,
        threads: int,
        eos: list[int],
        lookup_ngram: int = 0,
        lookup_tokens: int = 0,
    ) -> None:
        import llama_cpp
        from llama_cpp import Llama

        if n_ctx % 256:
            raise ValueError(f"n_ctx must be a multiple of 256 (llama.cpp pads it to one), got {n_ctx}")
        draft = None
        if lookup_tokens:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            draft = LlamaPromptLookupDecoding(max_ngram_size=lookup_ngram, num_pred_tokens=lookup_tokens)
        self.llm = Llama(
            model_path=gguf,
            n_ctx=n_ctx,
            n_batch=n_batch,
            n_threads=threads,
            n_threads_batch=threads,
            logits_all=draft is not None,
            draft_model=draft,
            verbose=False,
        )
        if self.llm.n_ctx() != n_ctx:
            raise ValueError(f"llama.cpp made the context {self.llm.n_ctx()} tokens where {n_ctx} were asked for")
        self.eos, self.threads = frozenset(eos), threads
        self.version = str(getattr(llama_cpp, "__version__", "unknown"))

    def info(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "n_ctx": self.llm.n_ctx(),
            "n_batch": self.llm.n_batch,
            "threads": self.threads,
        }

    def run(self, request: dict[str, Any]) -> dict[str, Any]:
        """Decode `prompt` (token ids) until an end-of-sequence token or `max_new_tokens`: the tokens, the seconds
        the decoding took, the first token's latency and the gaps between tokens."""
        if request["seed"] is not None:
            self.llm.set_seed(request["seed"])
        tokens: list[int] = []
        stamps: list[float] = []
        started = time.perf_counter()
        for token in self.llm.generate(request["prompt"], reset=True, **request["sampling"]):
            stamps.append(time.perf_counter())
            tokens.append(int(token))
            if token in self.eos or len(tokens) >= request["max_new_tokens"]:
                break
        seconds = time.perf_counter() - started
        return {
            "tokens": tokens,
            "seconds": seconds,
            "ttft": stamps[0] - started if stamps else None,
            "gaps": [b - a for a, b in zip(stamps, stamps[1:])],
        }
