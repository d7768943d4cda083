"""Frozen configuration: how to sample (`SamplingParams`) and how to speculate (`SpecConfig`)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings; the draft and the target are warped by the same ones.

    Warping order: temperature, then top-k, then top-p, then min-p.
    """

    temperature: float = 1.0  # 0 means greedy
    top_k: int | None = None  # keep the k most likely tokens; None keeps all
    top_p: float = 1.0  # nucleus: smallest set whose mass reaches top_p; 1.0 keeps all
    min_p: float = 0.0  # drop tokens below min_p * (probability of the most likely token)
    max_new_tokens: int = 128
    seed: int | None = None  # None draws a fresh seed per request

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number, got {self.temperature!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise ValueError(f"top_k must be an integer >= 1 or None, got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p < 1.0):
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")

    @property
    def greedy(self) -> bool:
        """True when decoding takes the argmax (temperature 0)."""
        return self.temperature == 0


@dataclass(frozen=True)
class SpecConfig:
    """How the engine speculates. `gamma` is the number of draft tokens per round."""

    gamma: int = 5  # drafts per round; with `adaptive`, the most gamma auto may choose
    adaptive: bool = False  # choose gamma per request online (gamma auto: specsample.planner.GammaController)
    speculative: bool = True  # False: plain autoregressive decoding through the same loop
    max_batch_size: int = 16
    max_seq_len: int | None = None  # cache length per row; None = the target's context window
    # tokens the target scores per round at batch 1 for 1, 2, ... tokens asked (extra positions are padding,
    # never read; counts past the table are scored as asked): from row_padding.measure_target_widths
    target_widths: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.gamma, int) or self.gamma < 1:
            raise ValueError(f"gamma must be an integer >= 1, got {self.gamma!r}")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {self.max_seq_len}")
        for tokens, width in enumerate(self.target_widths, start=1):
            if not isinstance(width, int) or width < tokens:
                raise ValueError(f"target_widths[{tokens - 1}] (the width to score {tokens} tokens at) must be an "
                                 f"integer >= {tokens}, got {width!r}")
