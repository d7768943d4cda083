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
second fit and charged as rounds like them cost. Prefills likewise, over `PREFILL_STALL` times (a
prefill is one long timing per reply, and one stalled for a second moves the whole prefill line). A
system's modelled total is then its measured total less what its stalls cost beyond that.

Box speed (`fit_shared_speed`): the box also drifts, by several percent over minutes. An interleaved
run decodes each prompt with every system back to back, but a policy's rounds of one kind can sit in a
few stretches of the run: gamma auto decodes plain mostly in the categories where its draft fails, and
the benchmark runs Spec-Bench category by category. Fitted per system alone, its plain round is then
priced at the box's speed during those categories, while target-only's is priced at the run's mean,
and that difference lands on exactly the categories the policy decodes plain. So the shared fit
models a round's time as slowdown[prompt] x the system's cost: one factor per prompt for every system
(they decoded it within seconds of each other), the median ratio of its rounds' times to their
systems' costs, alternated with the systems' fits. Since the factor is shared, it cannot favour one
system on a prompt; the modelled times are at the run's mean speed (all systems' modelled total
equals their measured total).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

STALL = 3.0  # a round over 3x what rounds like it cost (relative to the median ratio) is a stall of the box
PREFILL_STALL = 1.5  # ...and a prefill over 1.5x: every prefill of a system is the same work, and between
# systems on one prompt of 300+ tokens they differ by 0.84-1.26x, but a one-second stall once put one at
# 2.8x and, fitted in, bent that system's whole prefill line (tests/test_bench.py has the case)


@dataclass(frozen=True)
class RoundTiming:
    """One decoding round of a batch-1 run."""

    drafted: int  # tokens drafted this round (0: plain decoding)
    context: int  # tokens the target had seen before the round
    seconds: float  # wall time of the round, prefill excluded
    scored: bool = False  # the draft also scored its backlog (gamma auto in fallback: one more draft forward)
    lookup: bool = False  # gamma auto had it propose a prompt lookup (fixed-gamma ngram/hybrid rounds are not marked)
    phases: tuple[float, float, float] | None = None  # the engine's draft (with planning and backlog scoring),
    # target and verify-and-commit seconds (RoundStats)


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
    stalls: int = 0  # rounds and prefills left out of the fit as stalls of the box
    scored_coef: float = 0.0  # what a round that scored a backlog costs beyond one that did not (0: none did)

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
        # a scoring round gets its own term, so the draft forward it adds is not spread over plain rounds
        design = np.stack([np.append(cls._round_features(r.drafted, r.context, counts), float(r.scored))
                           for r in rounds])
        seconds = np.array([r.seconds for r in rounds])
        coef = np.linalg.lstsq(design, seconds, rcond=None)[0]
        ratio = seconds / np.maximum(design @ coef, 1e-12)
        kept = ratio <= STALL * np.median(ratio)
        stalls = 0
        if not kept.all() and all(kept[[r.drafted == d for r in rounds]].any() for d in counts):
            coef = np.linalg.lstsq(design[kept], seconds[kept], rcond=None)[0]  # again, without the stalls
            stalls = int((~kept).sum())
        prefill = np.array([[1.0, run.prompt_tokens] for run in runs])
        prefill_seconds = np.array([run.prefill_seconds for run in runs])
        # stalls are judged against a line fitted by relative error: one stalled long prompt pulled a
        # least-squares line so far that short prompts' predictions went negative
        ratio = prefill_seconds / np.maximum(_reference_line(prefill[:, 1], np.maximum(prefill_seconds, 1e-12)), 1e-12)
        usual = ratio <= PREFILL_STALL * np.median(ratio)
        prefill_coef = np.linalg.lstsq(prefill[usual], prefill_seconds[usual], rcond=None)[0]
        stalls += int((~usual).sum())
        return cls(counts, tuple(float(x) for x in coef[:-1]), (float(prefill_coef[0]), float(prefill_coef[1])), stalls,
                   float(coef[-1]))

    @staticmethod
    def _round_features(drafted: int, context: int, counts: tuple[int, ...]) -> np.ndarray:
        onehot = [float(drafted == d) for d in counts]
        return np.array(onehot + [context / 1000.0, drafted * context / 1000.0])

    def round_seconds(self, drafted: int, context: int, scored: bool = False) -> float:
        """Mean cost of a round that drafts `drafted` tokens at a context of `context` tokens (and scored a
        backlog, if `scored`)."""
        if drafted not in self.draft_counts:
            raise ValueError(f"no fitted cost for rounds drafting {drafted} tokens (have {self.draft_counts})")
        extra = self.scored_coef if scored else 0.0
        return float(self._round_features(drafted, context, self.draft_counts) @ np.array(self.round_coef)) + extra

    def seconds(self, run: RunTiming) -> float:
        """Modelled wall time of a run: its prefill and each of its rounds at their mean cost."""
        prefill = self.prefill_coef[0] + self.prefill_coef[1] * run.prompt_tokens
        return prefill + sum(self.round_seconds(r.drafted, r.context, r.scored) for r in run.rounds)

    def scaled(self, factor: float) -> CostModel:
        """The same model with every cost multiplied by `factor` (the fit is linear in the times)."""
        return replace(self, round_coef=tuple(c * factor for c in self.round_coef),
                       prefill_coef=(self.prefill_coef[0] * factor, self.prefill_coef[1] * factor),
                       scored_coef=self.scored_coef * factor)


def _reference_line(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """y's line in x fitted by relative error (least squares of (y - line) / y): a stalled point's weight
    falls as it grows, and short prompts count as much as long ones, so one stalled long prefill cannot
    bend it (the plain least-squares line it bent predicted negative times for short prompts)."""
    design = np.stack([np.ones_like(x), x], axis=1) / y[:, None]
    coef = np.linalg.lstsq(design, np.ones_like(y), rcond=None)[0]
    return coef[0] + coef[1] * x


def slowed(run: RunTiming, factor: float) -> RunTiming:
    """`run` with every time divided by `factor` (what it would have taken at speed 1)."""
    return RunTiming(run.prompt_tokens, run.prefill_seconds / factor,
                     tuple(replace(r, seconds=r.seconds / factor) for r in run.rounds))


@dataclass(frozen=True)
class SharedSpeedFit:
    """Per-system cost models at the run's mean speed, and the box's slowdown while each prompt ran."""

    models: dict[str, CostModel]
    slowdown: dict[Hashable, float]  # prompt -> its rounds' time over their systems' costs (1: the run's mean)


def fit_shared_speed(runs: Mapping[str, Sequence[tuple[Hashable, RunTiming]]], iterations: int = 5) -> SharedSpeedFit:
    """Fit every system's `CostModel` and one slowdown per prompt shared by all systems (module docstring).

    `runs`: system -> [(prompt key, its run)]; every system's runs should cover the same prompts.
    """
    if not runs or not all(runs.values()):
        raise ValueError("need at least one run of every system")
    keys = {key for rows in runs.values() for key, _ in rows}

    def fit(slowdown: dict[Hashable, float]) -> dict[str, CostModel]:
        return {name: CostModel.fit([slowed(run, slowdown[key]) for key, run in rows]) for name, rows in runs.items()}

    slowdown = dict.fromkeys(keys, 1.0)
    models = fit(slowdown)
    for _ in range(iterations):
        ratios: dict[Hashable, list[float]] = {key: [] for key in keys}
        for name, rows in runs.items():
            model = models[name]
            for key, run in rows:
                ratios[key] += [r.seconds / model.round_seconds(r.drafted, r.context, r.scored) for r in run.rounds]
        # the models price rounds at speed 1, so a prompt's ratios read its slowdown directly (median: stalls);
        # a prompt with no rounds (every reply one token) keeps its factor
        slowdown = {key: float(np.median(ratios[key])) if ratios[key] else slowdown[key] for key in keys}
        models = fit(slowdown)
    measured = sum(run.seconds for rows in runs.values() for _, run in rows)
    modelled = sum(models[name].seconds(run) for name, rows in runs.items() for _, run in rows)
    scale = measured / modelled  # put the costs at the run's mean speed
    return SharedSpeedFit({name: model.scaled(scale) for name, model in models.items()},
                          {key: value / scale for key, value in slowdown.items()})
