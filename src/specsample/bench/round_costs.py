"""Modelled time: charge every round of a run the mean cost of rounds like it, fitted over a whole run.

On a shared CPU box the wall time of one short generation varies by about 6% between two identical
runs, so per-category comparisons of a few prompts (gamma auto against the best of eight fixed
gammas) drown in timing noise. A system's cost per round, though, is measured over thousands of its
rounds. This module fits, per system, a round that drafts d tokens at context length L costing
u[d] + v L + w d L seconds and a prefill of P prompt tokens a + b P (least squares), then charges each
run what its rounds would cost on average. What is left between two policies on the same prompts is
only what they chose to do (how many rounds, how many drafts each), not when the box was busy.
Because every d has its own intercept, a system's modelled time summed over all its runs equals its
measured time (stalls aside, below): the model moves noise between categories, never time in or out
of a system.

Stalls: a shared box sometimes runs a few seconds at a fraction of its speed (another tenant). A
least-squares mean charges such a stretch to every round of the system that happened to be running,
in every category (one reasoning prompt decoded at a quarter of its neighbours' speed once made a
whole fixed-gamma system look 10% slow). So the fit is made twice: rounds that took over `STALL`
times what the first fit predicts for them (relative to the median such ratio) are left out of the
second fit and charged as rounds like them cost. A system's modelled total is then its measured
total less what its stalls cost beyond that.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

STALL = 3.0  # a round over 3x what rounds like it cost (relative to the median ratio) is a stall of the box


@dataclass(frozen=True)
class RoundTiming:
    """One decoding round of a batch-1 run."""

    drafted: int  # tokens drafted this round (0: plain decoding)
    context: int  # tokens the target had seen before the round
    seconds: float  # wall time of the round, prefill excluded


@dataclass(frozen=True)
class RunTiming:
    """One generation: its prompt length, prefill time and rounds."""

    prompt_tokens: int
    prefill_seconds: float
    rounds: tuple[RoundTiming, ...]

    @property
    def seconds(self) -> float:
        return self.prefill_seconds + sum(r.seconds for r in self.rounds)


@dataclass(frozen=True)
class CostModel:
    """Mean round and prefill costs of one system (see the module docstring)."""

    draft_counts: tuple[int, ...]  # the d values with their own intercept, in column order
    round_coef: tuple[float, ...]  # [u[d] for d in draft_counts] + [v, w]
    prefill_coef: tuple[float, float]  # a, b
    stalls: int = 0  # rounds left out of the fit as stalls of the box

    @classmethod
    def from_dict(cls, stored: dict) -> CostModel:
        """A model as a result file stores it (`dataclasses.asdict`: tuples read back as lists)."""
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in stored.items()})

    @classmethod
    def fit(cls, runs: Sequence[RunTiming]) -> CostModel:
        """Least-squares costs over every round and prefill of `runs` (one system's)."""
        rounds = [r for run in runs for r in run.rounds]
        if not rounds:
            raise ValueError("cannot fit round costs without any rounds")
        counts = tuple(sorted({r.drafted for r in rounds}))
        design = np.stack([cls._round_features(r.drafted, r.context, counts) for r in rounds])
        seconds = np.array([r.seconds for r in rounds])
        coef = np.linalg.lstsq(design, seconds, rcond=None)[0]
        ratio = seconds / np.maximum(design @ coef, 1e-12)
        kept = ratio <= STALL * np.median(ratio)
        stalls = 0
        if not kept.all() and all(kept[[r.drafted == d for r in rounds]].any() for d in counts):
            coef = np.linalg.lstsq(design[kept], seconds[kept], rcond=None)[0]  # again, without the stalls
            stalls = int((~kept).sum())
        prefill = np.array([[1.0, run.prompt_tokens] for run in runs])
        prefill_coef = np.linalg.lstsq(prefill, np.array([run.prefill_seconds for run in runs]), rcond=None)[0]
        return cls(counts, tuple(float(x) for x in coef), (float(prefill_coef[0]), float(prefill_coef[1])), stalls)

    @staticmethod
    def _round_features(drafted: int, context: int, counts: tuple[int, ...]) -> np.ndarray:
        onehot = [float(drafted == d) for d in counts]
        return np.array(onehot + [context / 1000.0, drafted * context / 1000.0])

    def round_seconds(self, drafted: int, context: int) -> float:
        """Mean cost of a round that drafts `drafted` tokens at a context of `context` tokens."""
        if drafted not in self.draft_counts:
            raise ValueError(f"no fitted cost for rounds drafting {drafted} tokens (have {self.draft_counts})")
        return float(self._round_features(drafted, context, self.draft_counts) @ np.array(self.round_coef))

    def seconds(self, run: RunTiming) -> float:
        """Modelled wall time of a run: its prefill and each of its rounds at their mean cost."""
        prefill = self.prefill_coef[0] + self.prefill_coef[1] * run.prompt_tokens
        return prefill + sum(self.round_seconds(r.drafted, r.context) for r in run.rounds)
