"""What compiled models did in this thread: graphs compiled, and calls they could not take.

A compiled model (`models/compiled.py`) counts here every graph it compiles (a decode step, an output layer, a
feature draft's step) and every cached forward it ran eagerly instead (a token tree, a block of more than
MAX_BLOCK tokens per row, a row twice in one call; prefill is eager by design and not counted). The counts are per
thread: an engine steps its rounds in one thread (a server's engine thread, the benchmark's), so the difference
over a round is that round's, however many engines the process runs. Counting is two integer additions, made
where a graph is built or the eager path is chosen, never per guard.
"""

from __future__ import annotations

import threading


class _Counts(threading.local):
    def __init__(self) -> None:
        self.graphs = 0  # graphs compiled
        self.fallbacks = 0  # cached forwards of a compiled model that ran eagerly


_COUNTS = _Counts()


def graph_compiled() -> None:
    _COUNTS.graphs += 1


def fell_back() -> None:
    _COUNTS.fallbacks += 1


def counts() -> tuple[int, int]:
    """(graphs compiled, eager fallbacks) in this thread so far."""
    return _COUNTS.graphs, _COUNTS.fallbacks


def since(start: tuple[int, int]) -> tuple[int, int]:
    """(graphs compiled, eager fallbacks) in this thread since `counts()` returned `start`."""
    graphs, fallbacks = counts()
    return graphs - start[0], fallbacks - start[1]
