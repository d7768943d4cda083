"""How much prompt prefilling a round does while other requests decode (chunked prefill).

A round prefills at most `max_tokens` of the target's prompt tokens and, with a `time_ratio`, work that takes about
`time_ratio` times what the running requests' decoding takes per round (its draft, target and verify time, averaged
over recent rounds). Each model's work is priced at its own measured seconds per unit (the target's prompt tokens, a
drafter's units of prefill work: `ChunkedPrefill`), averaged over recent calls weighted by their size; a model not
measured yet is granted a first PROBE units. A budget in time is what keeps the rounds even: a chunk of the same
tokens costs the target several times more deep in a long prompt than at its start (each of its queries attends to
every position before it).

Every round prefills something while a prompt waits (at least one unit of its work), so every prompt progresses
whatever the budget.
"""

from __future__ import annotations

from dataclasses import dataclass

PROBE = 16  # units of a model's work granted before its cost is measured
DECODING_WEIGHT = 0.25  # the weight of the latest round in the decoding time's moving average
COST_MEMORY = 0.5  # the weight an earlier call's seconds and units keep at each new call of the same model


@dataclass
class _Cost:
    """A model's recent seconds and units of work, older calls decayed: their ratio is its seconds per unit."""

    seconds: float = 0.0
    units: float = 0.0

    def add(self, units: int, seconds: float) -> None:
        self.seconds = COST_MEMORY * self.seconds + seconds
        self.units = COST_MEMORY * self.units + units

    @property
    def per_unit(self) -> float | None:
        return self.seconds / self.units if self.units > 0 else None


class PrefillPacer:
    """Learns what decoding and each model's prefill work cost, and hands each round its budget (`round`)."""

    def __init__(self, max_tokens: int | None = None, time_ratio: float | None = None) -> None:
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 or None, got {max_tokens}")
        if time_ratio is not None and not time_ratio > 0:
            raise ValueError(f"time_ratio must be > 0 or None, got {time_ratio}")
        self.max_tokens, self.time_ratio = max_tokens, time_ratio
        self.decoding: float | None = None  # seconds per round of the running requests' decoding (moving average)
        self._costs: dict[str, _Cost] = {}

    @property
    def bounded(self) -> bool:
        """Whether rounds have a budget at all (else prompts are prefilled whole)."""
        return self.max_tokens is not None or self.time_ratio is not None

    def learn_decoding(self, seconds: float) -> None:
        """A round's decoding time (draft, target and verify)."""
        self.decoding = (
            seconds if self.decoding is None else self.decoding + DECODING_WEIGHT * (seconds - self.decoding)
        )

    def learn(self, model: str, units: int, seconds: float) -> None:
        """`units` of `model`'s prefill work took `seconds`."""
        if units > 0:
            self._costs.setdefault(model, _Cost()).add(units, max(seconds, 0.0))

    def per_unit(self, model: str) -> float | None:
        """`model`'s measured seconds per unit of prefill work (None: not measured yet)."""
        cost = self._costs.get(model)
        return None if cost is None else cost.per_unit

    def round(self) -> RoundBudget:
        """This round's budget: `max_tokens` target tokens, `time_ratio` times the decoding time (where set)."""
        seconds = None if self.time_ratio is None or self.decoding is None else self.time_ratio * self.decoding
        return RoundBudget(self, seconds, self.max_tokens)


@dataclass
class RoundBudget:
    """What is left of one round's prefill budget: seconds (None: no bound in time) and target tokens (None: none in
    tokens)."""

    pacer: PrefillPacer
    seconds: float | None
    tokens: int | None
    granted: bool = False  # whether the round granted any work yet

    def grant(self, model: str, wanted: int) -> int:
        """How many of `wanted` units of `model`'s work ("target": prompt tokens) the round affords now: within the
        tokens and the time left (at least one unit where it has granted nothing yet)."""
        if wanted <= 0:
            return 0
        affordable = wanted
        if model == "target" and self.tokens is not None:
            affordable = min(affordable, self.tokens)
        if self.seconds is not None:
            per_unit = self.pacer.per_unit(model)
            by_time = PROBE if per_unit is None else int(self.seconds / per_unit) if per_unit > 0 else wanted
            affordable = min(affordable, max(by_time, 0))
        if not self.granted:
            affordable = max(affordable, 1)
        if affordable > 0:
            self.granted = True
        return affordable

    def spend(self, model: str, units: int, seconds: float) -> None:
        """`units` of `model`'s work were done in `seconds`: taken from what is left, and learnt."""
        if model == "target" and self.tokens is not None:
            self.tokens -= units
        if self.seconds is not None:
            self.seconds -= seconds
        self.pacer.learn(model, units, seconds)
