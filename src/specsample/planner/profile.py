"""Gamma auto's profile: its measured round costs (per batch size and width) and acceptance priors, saved in the
specsample cache and loaded at start, so a one-shot `generate` or a fresh server replica does not pay to explore.

A profile is keyed by machine (CPU and core count), model pair, runtime (the target's step path), dtype and
quantization: another key's profile is never read. A loaded time in seconds is replaced by the first one measured, a
loaded relative cost counts as SETTLE timings, and loaded acceptance as at most PRIOR_TRIALS trials: a stale profile
gives way to the first few rounds measured. A file that cannot be read
or parsed is ignored with a warning (the planner starts from its priors), and is replaced by the next save.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specsample.planner.acceptance import Acceptance
from specsample.planner.costs import SETTLE, CostModel, Ewma, RoundCosts

log = logging.getLogger("specsample.controller")

VERSION = 1
PRIOR_TRIALS = 20.0  # the most pooled trials a loaded acceptance pool is worth
BIN_TRIALS = 200  # the most drafts loaded confidence bins are worth, all bins together
SAVE_EVERY = 256  # rounds learnt between saves of a long-running planner


@dataclass(frozen=True)
class ProfileKey:
    """What a profile's timings and acceptance hold for."""

    machine: str
    model: str  # the target and the draft
    runtime: str  # which code runs the target's steps (e.g. fused-amx, torch, transformers)
    dtype: str
    quantization: str

    def path(self, cache: Path) -> Path:
        digest = hashlib.sha256(json.dumps(vars(self), sort_keys=True).encode()).hexdigest()[:16]
        return cache / "planner" / f"{digest}.json"


def machine() -> str:
    """This machine as a profile key names it: its CPU model, architecture and the cores this process may use."""
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{name} ({platform.machine()}, {cores} cores)"


# ----- what is saved ----------------------------------------------------------------------


def _ewma(e: Ewma) -> dict[str, Any] | None:
    return None if e.value is None else {"value": e.value, "count": min(e.count, SETTLE)}


def _read_ewma(d: dict[str, Any] | None, seconds: bool = False) -> Ewma:
    """A saved mean: a time in seconds as a value the first timing replaces (the machine's pace drifts from one
    process to the next), a relative cost as SETTLE timings."""
    e = Ewma(settle=SETTLE)
    if d is not None:
        e.value = float(d["value"])
        e.count = 0 if seconds else min(int(d["count"]), SETTLE)
        e.first = [e.value] * e.count
    return e


def _round_costs(r: RoundCosts) -> dict[str, Any]:
    return {"relative": {str(k): _ewma(v) for k, v in r.relative.items() if v.value is not None}}


def _read_round_costs(d: dict[str, Any]) -> RoundCosts:
    """Relative costs; the pace (seconds per unit, this process's) is seeded by the first round timed."""
    r = RoundCosts()
    r.relative = {int(k): _read_ewma(v) for k, v in d["relative"].items()}
    r.rounds = max((e.count for e in r.relative.values()), default=0)
    r.last = {k: r.rounds for k in r.relative}
    return r


EWMA_TABLES = ("draft_step", "target_step", "plain_round", "extra", "scoring")
SECONDS = ("draft_step", "target_step", "plain_round", "extra")  # the tables of times (the others: relative costs)
ROUND_TABLES = ("drafting", "lookups", "trees")


def dump(costs: CostModel, acceptance: Acceptance) -> dict[str, Any]:
    """The profile's content: measured costs per batch size, the acceptance pools and confidence bins."""
    return {
        "costs": {
            **{name: {str(b): _ewma(e) for b, e in getattr(costs, name).items()} for name in EWMA_TABLES},
            **{name: {str(b): _round_costs(r) for b, r in getattr(costs, name).items()} for name in ROUND_TABLES},
        },
        "acceptance": {
            "pooled": acceptance.pooled,
            "lookup_pooled": acceptance.lookup_pooled,
            "bin_trials": acceptance.bin_trials,
            "bin_accepts": acceptance.bin_accepts,
        },
    }


def _scaled(pool: list[float], most: float) -> list[float]:
    total = sum(pool)
    return [float(x) * min(1.0, most / total) for x in pool] if total > 0 else [0.0, 0.0]


def restore(costs: CostModel, acceptance: Acceptance, data: dict[str, Any]) -> None:
    """Load `dump`'s content into fresh estimates (`ValueError`, `KeyError` or `TypeError` where it is malformed;
    nothing is changed then)."""
    tables = data["costs"]
    ewmas = {
        name: {int(b): _read_ewma(e, name in SECONDS) for b, e in tables[name].items() if e is not None}
        for name in EWMA_TABLES
    }
    rounds = {name: {int(b): _read_round_costs(r) for b, r in tables[name].items()} for name in ROUND_TABLES}
    given = data["acceptance"]
    pooled = _scaled(given["pooled"], PRIOR_TRIALS)
    lookup_pooled = _scaled(given["lookup_pooled"], PRIOR_TRIALS)
    trials, accepts = [int(x) for x in given["bin_trials"]], [int(x) for x in given["bin_accepts"]]
    if len(trials) != len(acceptance.bin_trials) or len(accepts) != len(trials) or len(pooled) != 2:
        raise ValueError("acceptance bins or pools of another shape")
    scale = min(1.0, BIN_TRIALS / max(sum(trials), 1))
    for name, table in {**ewmas, **rounds}.items():
        setattr(costs, name, table)
    costs._memo = {}
    acceptance.pooled, acceptance.lookup_pooled = pooled, lookup_pooled
    acceptance.bin_trials = [round(t * scale) for t in trials]
    acceptance.bin_accepts = [min(round(a * scale), t) for a, t in zip(accepts, acceptance.bin_trials)]


class ProfileStore:
    """Where one key's profile lives: `load` at start, `save` now and then and at the end."""

    def __init__(self, key: ProfileKey, cache: Path) -> None:
        self.key, self.path = key, key.path(cache)

    def load(self, costs: CostModel, acceptance: Acceptance) -> bool:
        """Load the profile into the estimates; False where there is none. A corrupt or foreign file is ignored with
        a warning."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return False
        except OSError as exc:
            log.warning("planner profile %s cannot be read (%s): starting from the priors", self.path, exc)
            return False
        try:
            data = json.loads(text)
            if data.get("version") != VERSION or data.get("key") != vars(self.key):
                raise ValueError("written for another version or key")
            restore(costs, acceptance, data["profile"])
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("planner profile %s is corrupt (%s): ignored, starting from the priors", self.path, exc)
            return False
        return True

    def save(self, costs: CostModel, acceptance: Acceptance) -> None:
        """Write the profile atomically (a failure to write is logged, never raised: a profile only saves time)."""
        payload = {"version": VERSION, "key": vars(self.key), "profile": dump(costs, acceptance)}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
            with os.fdopen(fd, "w") as handle:
                json.dump(payload, handle)
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("planner profile %s cannot be written: %s", self.path, exc)
