"""Score a round's tokens at the width the target runs fastest: measured per device, once, at start-up.

Matrix kernels do not get dearer monotonically with the number of rows: on a 2-core AVX512-BF16 CPU the
bfloat16 oneDNN kernels were measured scoring 2 tokens a few percent slower than 3 to 5 (`--pad-rows auto` prints
the timings it measures at start-up).
A round of one draft scores 2 tokens (the pending token and the draft), so it pays for the slow shape.
Scoring a wider block (the extra positions repeat the last token) and reading only the real positions'
logits leaves the verifier's inputs as they were: attention is causal, so padding after a position
cannot reach it, and the commit rolls the cache back to the accepted length, so the padded entries
are overwritten later like any rejected draft's. (As with batching, another block shape may run
another kernel: in low precision the real positions' logits can differ in the last bits.)
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from typing import cast

import torch
from torch import Tensor

from specsample.models.base import CausalLM, FeatureLM, ModelCache

log = logging.getLogger("specsample")

PAD_MODES = ("auto", "off")  # --pad-rows
MIN_GAIN = 0.03  # pad only where the wider block measured at least 3% faster: below that it is noise


def score_padded(
    model: CausalLM, tokens: Tensor, cache: ModelCache, slots: Tensor, width: int, features: bool = False
) -> tuple[Tensor, Tensor | None]:
    """Logits `[b, n, vocab]` of `tokens [b, n]` appended to rows `slots`, scored as a block of `width` >= n
    tokens (the last one repeated), and with `features` the final hidden states `[b, n, hidden]` (a `FeatureLM`;
    else None). Each row's cache length grows by `width`: the caller rolls it back."""
    scored = tokens.shape[1]
    if width > scored:
        tokens = torch.cat([tokens, tokens[:, -1:].expand(-1, width - scored)], dim=1)
    if features:
        logits, hidden = cast(FeatureLM, model).forward_cached_features(tokens, cache, slots)
        return logits[:, :scored], hidden[:, :scored]
    return model.forward_cached(tokens, cache, slots)[:, :scored], None


def fastest_widths(seconds: Sequence[float], min_gain: float = MIN_GAIN) -> tuple[int, ...]:
    """From the time to score 1..n tokens (`seconds[w - 1]`), the width to score for each count: the
    cheapest width >= it when that is at least `min_gain` faster, else the count itself. One token is
    never padded: plain decoding is the baseline, and compiled runtimes take a path of their own for it."""
    widths = [1] if seconds else []
    for tokens in range(2, len(seconds) + 1):
        own = seconds[tokens - 1]
        best = min(range(tokens, len(seconds) + 1), key=lambda w: (seconds[w - 1], w))
        widths.append(best if seconds[best - 1] < (1 - min_gain) * own else tokens)
    return tuple(widths)


def measure_target_widths(
    model: CausalLM,
    max_tokens: int,
    context: int = 128,
    repeats: int = 12,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[int, ...]:
    """Time one row's forward over 1..`max_tokens` new tokens after `context` cached ones (interleaved,
    after a warm-up pass) and return the width to score each count at (`fastest_widths`). A count is
    padded only where the medians of both halves of the repeats pick the same width (on a shared machine one pass can
    cross the 3% bar by noise). Takes ~`repeats` x `max_tokens` forwards (about 2 s for the default 135M target at
    gamma 8 on a 2-core CPU).
    Applies to batches of one row, where it was measured: pass it as `SpecConfig(target_widths=...)`."""
    if repeats < 2:
        raise ValueError(f"repeats must be >= 2 (two halves must agree), got {repeats}")
    times = time_forward_widths(model, max_tokens, context, repeats, clock)
    medians = [statistics.median(times[w]) for w in times]
    first, second = (
        fastest_widths([statistics.median(times[w][part]) for w in times])
        for part in (slice(0, repeats // 2), slice(repeats // 2, None))
    )
    widths = tuple(a if a == b else n for n, (a, b) in enumerate(zip(first, second), start=1))
    log.info(
        "target forward by tokens scored (ms): %s; scoring widths %s",
        ", ".join(f"{w}: {m * 1000:.2f}" for w, m in zip(times, medians)),
        widths,
    )
    return widths


def time_forward_widths(
    model: CausalLM,
    max_tokens: int,
    context: int = 128,
    repeats: int = 12,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[int, list[float]]:
    """Seconds of one row's forward over each of 1..`max_tokens` new tokens after `context` cached ones,
    `repeats` times, interleaved by width, after a warm-up pass."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    context = max(1, min(context, model.max_seq_len - max_tokens))
    cache = model.new_cache(1, context + max_tokens)
    slot = torch.tensor([0])
    generator = torch.Generator().manual_seed(0)  # any tokens will do; leave the global random state alone
    tokens = torch.randint(0, model.vocab_size, (1, context + max_tokens), generator=generator).to(model.device)
    times: dict[int, list[float]] = {w: [] for w in range(1, max_tokens + 1)}
    with torch.inference_mode():
        model.prefill(tokens[:, :context], cache, slot)
        for rep in range(repeats + 1):
            for width in times:
                _sync(model.device)
                start = clock()
                model.forward_cached(tokens[:, context : context + width], cache, slot)
                _sync(model.device)
                if rep:  # the first pass warms kernels and allocators up
                    times[width].append(clock() - start)
                cache.truncate(slot, torch.tensor([context]))
    return times


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
