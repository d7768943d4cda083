"""The prompt-lookup rule spelt out, for the tests of `specsample.drafters.ngram.NgramIndex`."""

from __future__ import annotations


def reference_continuation(
    history: list[int], max_tokens: int, min_n: int = 1, max_n: int = 4
) -> tuple[list[int], int]:
    """The definition: tokens that followed the most recent earlier occurrence of the longest suffix n-gram
    (n from max_n down to min_n), and n; `([], 0)` when nothing matches."""
    for n in range(min(max_n, len(history) - 1), min_n - 1, -1):
        suffix = history[-n:]
        for end in range(len(history) - 2, n - 2, -1):  # an occurrence ending at `end` has a next token
            if history[end - n + 1 : end + 1] == suffix:
                return history[end + 1 : end + 1 + max_tokens], n
    return [], 0
