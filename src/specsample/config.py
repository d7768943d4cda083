"""Frozen configuration: how to sample (`SamplingParams`) and how to speculate (`SpecConfig`)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

# the smallest temperature above 0 (greedy): float32 logits divided by it stay finite up to |logit| 3.4e34, far
# beyond any model's, so warping never overflows
MIN_TEMPERATURE = 1e-4
SEED_LIMIT = 2**64  # seeds are 0 <= seed < SEED_LIMIT (torch.Generator's range of non-negative seeds)


class SettingError(ValueError):
    """A bad setting; `name` is the setting's field name, for callers that name their own flag or parameter."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings; the draft and the target are warped by the same ones.

    Warping order: temperature, then top-k, then top-p, then min-p. Temperature is 0 (greedy) or at least
    MIN_TEMPERATURE; any top-p in (0, 1] keeps at least the most likely token.
    """

    temperature: float = 1.0  # 0 means greedy
    top_k: int | None = None  # keep the k most likely tokens; None keeps all
    top_p: float = 1.0  # nucleus: smallest set whose mass reaches top_p; 1.0 keeps all
    min_p: float = 0.0  # drop tokens below min_p * (probability of the most likely token)
    max_new_tokens: int = 128
    seed: int | None = None  # None draws a fresh seed per request

    def __post_init__(self) -> None:
        t = self.temperature
        if not _is_real(t) or not math.isfinite(t):
            raise SettingError("temperature", f"temperature must be a finite number, got {t!r}")
        if t < 0 or 0 < t < MIN_TEMPERATURE:
            raise SettingError("temperature", f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, "
                                              f"got {t:g}")
        if self.top_k is not None and (not _is_int(self.top_k) or self.top_k < 1):
            raise SettingError("top_k", f"top_k must be an integer >= 1 or None, got {self.top_k!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise SettingError("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p < 1.0:
            raise SettingError("min_p", f"min_p must be in [0, 1), got {self.min_p!r}")
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise SettingError("max_new_tokens", f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < SEED_LIMIT):
            raise SettingError("seed", f"seed must be an integer in [0, 2**64), got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        """True when decoding takes the argmax (temperature 0)."""
        return self.temperature == 0


@dataclass(frozen=True)
class TreeShape:
    """A token tree to draft per row (EAGLE-2's rule): the `branch` most likely children of each expanded node, the
    `branch` nodes of highest cumulative draft probability expanded at each depth, down to `depth`; then the `nodes`
    of highest cumulative probability kept (ancestors always outrank their descendants, so they form a tree)."""

    nodes: int = 16
    branch: int = 4
    depth: int = 6

    def __post_init__(self) -> None:
        for name in ("nodes", "branch", "depth"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise SettingError("tree", f"a tree's {name} must be an integer >= 1, got {value!r}")
        if self.depth > self.nodes:
            raise SettingError("tree", f"a tree of {self.nodes} nodes cannot reach depth {self.depth}")

    @classmethod
    def parse(cls, text: str) -> TreeShape:
        """`NODES` or `NODESxBRANCHxDEPTH` (e.g. `16` or `16x4x6`); the defaults fill what is left out."""
        parts = text.lower().split("x")
        try:
            numbers = [int(p) for p in parts]
        except ValueError:
            numbers = []
        if not 1 <= len(numbers) <= 3 or len(parts) == 2:
            raise SettingError("tree", f"a tree is NODES or NODESxBRANCHxDEPTH (e.g. 16 or 16x4x6), got {text!r}")
        if len(numbers) == 1:
            return cls(numbers[0], cls.branch, min(cls.depth, numbers[0]))
        return cls(*numbers)

    def __str__(self) -> str:
        return f"{self.nodes}x{self.branch}x{self.depth}"


SAMPLING_MODES = ("coupled", "rejection")  # how sampled drafts are verified (SpecConfig.coupled; docs/exactness.md)


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
    # draft token trees (scored in one forward, verified exactly) where the target's runtime can: with a fixed gamma
    # this tree every round, with gamma auto the budgets up to its nodes, each taken only where it measures faster
    # than a chain; None: chains only
    tree: TreeShape | None = None
    # coupled sampling (specsample.coupling): each output position's token is the Gumbel-max of the target with noise
    # keyed by (seed, position), shared with the draft, so a seeded request gives the same tokens whatever the plan and
    # the batch; False: modified rejection sampling (accepts more often; a seed reproduces only under the same plan)
    coupled: bool = False

    @property
    def most_drafts(self) -> int:
        """The most draft tokens a round may score per row, and the draft's own look-ahead: what caches keep room for
        past a row's length."""
        if self.tree is None:
            return self.gamma
        return max(self.gamma, self.tree.nodes, self.tree.branch * self.tree.depth)

    def __post_init__(self) -> None:
        if not isinstance(self.gamma, int) or self.gamma < 1:
            raise ValueError(f"gamma must be an integer >= 1, got {self.gamma!r}")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {self.max_seq_len}")
        if self.tree is not None and not isinstance(self.tree, TreeShape):
            raise ValueError(f"tree must be a TreeShape or None, got {self.tree!r}")
        for tokens, width in enumerate(self.target_widths, start=1):
            if not isinstance(width, int) or width < tokens:
                raise ValueError(f"target_widths[{tokens - 1}] (the width to score {tokens} tokens at) must be an "
                                 f"integer >= {tokens}, got {width!r}")
