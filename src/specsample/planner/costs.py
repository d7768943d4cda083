"""What rounds cost, measured: per batch size, a plain round's time and every round length's time relative to it.

Timings are noisy on a shared machine: every mean starts from the median of its first SETTLE timings, a timing
over SPIKE times its running mean counts as SPIKE times it, and round lengths are compared at one pace (see
`RoundCosts`). Until a length was timed COST_MIN_ROUNDS times its cost is the affine 1 + k + gamma c.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar, cast

T = TypeVar("T")

SETTLE = 3  # timings each mean starts from as their median; no request falls back on costs timed fewer times
SPIKE = 1.5  # a round timed over 1.5x its running mean counts as 1.5x (the OS stalls single rounds by 2x and more)
RELATIVE_DECAY = 0.995  # forgetting of relative round costs per round timed (a memory of about 200 rounds)
RELATIVE_WEIGHT = 0.1  # most weight one timed round has in its length's relative cost...
RELATIVE_SPIKE = 1.2  # ...counted at most 1.2x that cost
PRIOR_COST_RATIO = 0.05  # c before any drafting round was timed
LOOKUP_COST = 0.04  # plain rounds one more prompt-lookup token adds to a round, until timed (the target scores it)
COST_MIN_ROUNDS = 2  # rounds of a length timed before their cost replaces the affine 1 + k + gamma c
GATE_MIN_ROUNDS = 8  # ...and before the gate prices one more draft by it (a difference of two noisy means)
CALIBRATE_EVERY = 64  # rounds per batch size between plain rounds that time plain decoding...
SETTLE_EVERY = 4  # ...every this many while fewer than SETTLE plain rounds were timed there


@dataclass
class Ewma:
    """A running mean: the median of its first `settle` values, then a plain mean up to 1 / weight values, then
    exponentially weighted."""

    value: float | None = None
    count: int = 0  # observations so far
    settle: int = 1
    first: list[float] = field(default_factory=list)  # the first `settle` values, until then

    def add(self, x: float, weight: float = 0.2, spike: float | None = None) -> None:
        """Average in `x`; with `spike`, first cap it at that multiple of the current value (a cap cannot help the
        first value, which is why the first ones enter as a median)."""
        if self.value is not None and spike is not None:
            x = min(x, spike * self.value)
        self.count += 1
        if self.count <= self.settle:
            self.first.append(x)
            self.value = sorted(self.first)[(len(self.first) - 1) // 2]  # the lower of two middles
            return
        weight = max(weight, 1.0 / self.count)
        self.value = (1 - weight) * self.mean + weight * x

    @property
    def mean(self) -> float:
        """The value, where one was added (what a caller reads once it knows that)."""
        if self.value is None:
            raise ValueError("nothing was averaged yet")
        return self.value


def settled() -> Ewma:
    return Ewma(settle=SETTLE)


@dataclass
class RoundCosts:
    """Round times at one batch size as pace x relative cost: the pace (seconds per unit) follows the machine and
    the context quickly, every round; each round length's relative cost moves slowly. Lengths timed minutes apart
    (a neighbour is tried every 16 rounds, a plain round every 64) are then compared like with like: a shared
    machine's pace drifts by 10% and more over minutes, more than what separates neighbouring gammas."""

    pace: Ewma = field(default_factory=settled)  # seconds per unit of relative cost
    relative: dict[int, Ewma] = field(default_factory=dict)  # drafts in the round (0: plain) -> cost in pace units
    rounds: int = 0  # rounds timed
    last: dict[int, int] = field(default_factory=dict)  # drafts -> when such a round was last timed

    def add(self, drafts: int, seconds: float, new_batch: bool = False) -> None:
        """Time one round of `drafts` drafts. `new_batch`: the rows changed since the last round timed (at batch 1,
        a new request, whose context may be far from the last one's): this round only re-seeds the pace."""
        if seconds <= 0:
            return  # a clock that did not move says nothing about cost
        if new_batch and drafts in self.relative:
            self.pace = settled()
            self.pace.add(seconds / self.relative[drafts].mean)
            return
        seeding = self.pace.value is None
        if seeding:
            self.pace.add(seconds)  # the first round timed sets the unit
        self.rounds += 1
        # relative costs forget per round timed, not per observation: a length timed every round must not follow the
        # pace (that is the pace's job), one tried every 16 rounds must not freeze
        elapsed = self.rounds - self.last.get(drafts, self.rounds - 1)
        self.last[drafts] = self.rounds
        cost = self.relative.setdefault(drafts, settled())
        cost.add(
            seconds / self.pace.mean, weight=min(1 - RELATIVE_DECAY**elapsed, RELATIVE_WEIGHT), spike=RELATIVE_SPIKE
        )
        if not seeding:  # counted twice, the first round would be the median of three
            self.pace.add(seconds / cost.mean, spike=RELATIVE_SPIKE)

    def count(self, drafts: int) -> int:
        return self.relative[drafts].count if drafts in self.relative else 0

    def since(self, drafts: int) -> int:
        """Rounds timed since a round of `drafts` was (all of them if never)."""
        return self.rounds - self.last.get(drafts, 0)

    def ratio(self, drafts: int, min_rounds: int) -> float | None:
        """A round of `drafts` over a plain round, once `min_rounds` such rounds and a plain one were timed."""
        if self.count(drafts) < min_rounds or self.count(0) < 1:
            return None
        return self.relative[drafts].mean / max(self.relative[0].mean, 1e-12)


def closest(sizes: list[int], batch_size: int) -> int | None:
    """The batch size in `sizes` nearest `batch_size` (None if there is none): it stands in for one not measured."""
    return min(sizes, key=lambda b: abs(b - batch_size)) if sizes else None


@dataclass
class RoundKind:
    """What a timed round was, for pricing: whether a lookup, a backlog scoring or a catch-up ran in it."""

    drafts: int  # drafts in its widest row (0: plain)
    lookups: bool = False
    scoring: bool = False
    model_drafting: bool = False
    catching_up: bool = False
    tree: int = 0  # a tree round's node budget (0: chains)


class CostModel:
    """Measured round costs per batch size: plain rounds, drafting rounds by length (with a draft step c and an
    overhead k for lengths not yet timed), prompt-lookup rounds by length, and what a backlog scoring adds."""

    def __init__(self) -> None:
        self.draft_step: dict[int, Ewma] = {}  # batch size -> seconds per draft step
        self.target_step: dict[int, Ewma] = {}  # batch size -> seconds per target forward
        self.plain_round: dict[int, Ewma] = {}  # batch size -> seconds per round without drafts
        self.extra: dict[int, Ewma] = {}  # batch size -> seconds a drafting round costs beyond plain + drafts
        self.scoring: dict[int, Ewma] = {}  # batch size -> what a backlog scoring adds to a plain round (plain rounds)
        self.drafting: dict[int, RoundCosts] = {}  # batch size -> round times by draft count
        self.lookups: dict[int, RoundCosts] = {}  # batch size -> times of prompt-lookup rounds (and plain ones)
        self.trees: dict[int, RoundCosts] = {}  # batch size -> times of tree rounds by node budget (and plain ones)
        self.last_plain: dict[int, int] = {}  # batch size -> round of the last plain round (or attempt)
        self.calibrations: dict[int, int] = {}  # batch size -> plain rounds planned to time plain decoding
        self.rows: dict[int, tuple[str, ...]] = {}  # batch size -> the requests of the last round timed there
        self._memo: dict[tuple, object] = {}  # prices computed since the last timing (they move only with timings)

    # ----- prices ---------------------------------------------------------------------------

    def _memoised(self, key: tuple, compute: Callable[[], T]) -> T:
        if key not in self._memo:
            self._memo[key] = compute()
        return cast(T, self._memo[key])

    def nearest(self, batch_size: int) -> int | None:
        """The batch size nearest `batch_size` where drafting rounds were timed."""
        return self._memoised(
            ("nearest", batch_size),
            lambda: closest(
                [b for b, step in self.draft_step.items() if step.value is not None and b in self.target_step],
                batch_size,
            ),
        )

    def timed_drafting(self, batch_size: int) -> bool:
        """Whether a drafting round was timed at this very batch size."""
        return batch_size in self.target_step

    def cost_ratio(self, batch_size: int) -> float:
        """c: what one more draft step adds to a round, over a plain round's time (until a plain round was timed,
        over a target forward), at the nearest batch size measured; PRIOR_COST_RATIO before any."""
        nearest = self.nearest(batch_size)
        if nearest is None:
            return PRIOR_COST_RATIO
        plain = self.plain_round.get(nearest)
        base = plain.mean if plain is not None else self.target_step[nearest].mean
        return self.draft_step[nearest].mean / max(base, 1e-9)

    def overhead(self, batch_size: int) -> float:
        """k: what a drafting round costs beyond a plain round and its draft steps, whatever its gamma (scoring and
        verifying more tokens), over a plain round's time; 0 until a plain round was timed. With c it prices round
        lengths not timed yet: a single c from whole rounds would charge this fixed part to every draft."""
        nearest = self.nearest(batch_size)
        if nearest is None:
            return 0.0
        plain, extra = self.plain_round.get(nearest), self.extra.get(nearest)
        if plain is None or extra is None:
            return 0.0
        return max(extra.mean, 0.0) / max(plain.mean, 1e-9)

    def round_cost(self, batch_size: int, drafts: int) -> float:
        """A round of `drafts` drafts in plain rounds' time: measured once COST_MIN_ROUNDS such rounds were timed at
        the nearest batch size, else 1 + k + drafts c (measured rounds are affine in gamma only roughly: a CPU's
        matrix kernels can run 2 rows slower than 3)."""
        if drafts == 0:
            return 1.0

        def compute() -> float:
            nearest = self.nearest(batch_size)
            cost = self.drafting[nearest].ratio(drafts, COST_MIN_ROUNDS) if nearest in self.drafting else None
            if cost is None:
                overhead, ratio = self._memoised(
                    ("affine", batch_size), lambda: (self.overhead(batch_size), self.cost_ratio(batch_size))
                )
                cost = 1.0 + overhead + drafts * ratio
            return cost

        return self._memoised(("cost", batch_size, drafts), compute)

    def lookup_cost(self, batch_size: int, tokens: int) -> float:
        """A round proposing `tokens` prompt-lookup tokens, in plain rounds: measured once COST_MIN_ROUNDS such
        rounds were timed at the nearest batch size, else 1 + tokens LOOKUP_COST (only the target scores more)."""
        nearest = closest(list(self.lookups), batch_size)
        measured = self.lookups[nearest].ratio(tokens, COST_MIN_ROUNDS) if nearest is not None else None
        return measured if measured is not None else 1.0 + tokens * LOOKUP_COST

    def tree_cost(self, batch_size: int, nodes: int, depth: int) -> float:
        """A round drafting trees of `nodes` nodes down to `depth`, in plain rounds: measured once COST_MIN_ROUNDS such
        rounds were timed at the nearest batch size, else a chain of `depth` plus LOOKUP_COST per further node (the
        target scores it; the draft grows a tree in about as many steps as a chain of its depth)."""
        nearest = closest(list(self.trees), batch_size)
        measured = self.trees[nearest].ratio(nodes, COST_MIN_ROUNDS) if nearest is not None else None
        if measured is not None:
            return measured
        return self.round_cost(batch_size, depth) + max(nodes - depth, 0) * LOOKUP_COST

    def scoring_cost(self, batch_size: int) -> float:
        """What a backlog scoring adds to a plain round, in plain rounds, at the nearest batch size where one was
        timed; c (one draft step) before."""
        nearest = closest([b for b, e in self.scoring.items() if e.value is not None], batch_size)
        return self.cost_ratio(batch_size) if nearest is None else self.scoring[nearest].mean

    def one_more_draft(self, batch_size: int, drafts: int) -> float:
        """R(drafts + 1) - R(drafts) from the timings once both lengths were timed GATE_MIN_ROUNDS times, else c."""
        nearest = self.nearest(batch_size)
        costs = self.drafting.get(nearest) if nearest is not None else None
        if costs is not None:
            before, after = (costs.ratio(d, GATE_MIN_ROUNDS) for d in (drafts, drafts + 1))
            if before is not None and after is not None:
                return max(after - before, 0.0)
        return self.cost_ratio(batch_size)

    def settling(self, batch_size: int) -> bool:
        """Whether drafting rounds were timed at the nearest batch size, but fewer than SETTLE times: their cost is
        then one or two timings, which a stall can make any size."""
        nearest = self.nearest(batch_size)
        return nearest is not None and self.draft_step[nearest].count < SETTLE

    def least_recent(self, options: list[int], batch_size: int) -> int:
        """The round length among `options` timed least recently at this batch size (the first on ties)."""
        timed = self.drafting.get(batch_size, RoundCosts())
        return max(options, key=timed.since)

    # ----- calibration ----------------------------------------------------------------------

    def calibration_due(self, batch_size: int, round_index: int) -> bool:
        """A plain round is due once drafting rounds were timed at this batch size and no plain round was run (or
        attempted: rows with a fixed gamma may draft anyway) in CALIBRATE_EVERY rounds, or in SETTLE_EVERY while
        fewer than SETTLE plain rounds were timed there (and planned)."""
        if batch_size not in self.target_step:
            return False  # nothing timed here yet
        last = self.last_plain.get(batch_size)
        if last is None:
            return True
        plain = self.plain_round.get(batch_size)
        timed = plain.count if plain is not None else 0
        soon = 0 < timed < SETTLE and self.calibrations.get(batch_size, 0) < SETTLE
        return round_index - last >= (SETTLE_EVERY if soon else CALIBRATE_EVERY)

    def calibrating(self, batch_size: int, round_index: int) -> None:
        """Note a plain round planned to time plain decoding."""
        self.last_plain[batch_size] = round_index
        self.calibrations[batch_size] = self.calibrations.get(batch_size, 0) + 1

    # ----- timings --------------------------------------------------------------------------

    def record(
        self,
        batch_size: int,
        kind: RoundKind,
        request_ids: tuple[str, ...],
        round_index: int,
        draft_seconds: float,
        target_seconds: float,
        verify_seconds: float,
    ) -> None:
        """Price one round from its draft, target and verify-and-commit time. A lookup round prices lookups only
        (one where a model drafted or scored too, nothing); a round with a backlog scoring prices only what the
        scoring added to a plain round; a catch-up forward (a draft feeding what plain rounds committed) is a cost
        of those plain rounds, so that round prices nothing."""
        total = draft_seconds + target_seconds + verify_seconds
        if total <= 0:
            return  # a clock that did not move says nothing about cost
        self._memo = {}
        new_batch = bool(request_ids) and self.rows.get(batch_size) != request_ids
        if request_ids:
            self.rows[batch_size] = request_ids
        drafts = kind.drafts
        if kind.tree:
            if not (kind.scoring or kind.catching_up):
                self.trees.setdefault(batch_size, RoundCosts()).add(kind.tree, total, new_batch)
            return
        if kind.lookups and drafts > 0:
            if not (kind.scoring or kind.model_drafting or kind.catching_up):
                self.lookups.setdefault(batch_size, RoundCosts()).add(drafts, total, new_batch)
            return
        if kind.scoring:
            plain = self.plain_round.get(batch_size)
            if drafts == 0 and plain is not None:
                self.scoring.setdefault(batch_size, settled()).add(max(total / plain.mean - 1.0, 0.0), spike=SPIKE)
            return
        if drafts == 0:
            self.plain_round.setdefault(batch_size, settled()).add(total, spike=SPIKE)
            self.drafting.setdefault(batch_size, RoundCosts()).add(0, total, new_batch)
            self.lookups.setdefault(batch_size, RoundCosts()).add(0, total, new_batch)
            self.trees.setdefault(batch_size, RoundCosts()).add(0, total, new_batch)
            self.last_plain[batch_size] = round_index
            return
        if kind.catching_up:
            return
        self.drafting.setdefault(batch_size, RoundCosts()).add(drafts, total, new_batch)
        step = self.draft_step.setdefault(batch_size, settled())
        step.add(draft_seconds / drafts, spike=SPIKE)
        self.target_step.setdefault(batch_size, settled()).add(target_seconds, spike=SPIKE)
        plain = self.plain_round.get(batch_size)
        if plain is not None:
            extra = total - plain.mean - drafts * step.mean
            self.extra.setdefault(batch_size, settled()).add(extra, weight=0.1)
