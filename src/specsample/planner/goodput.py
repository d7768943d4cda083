"""The batch's goodput: each round, whether the whole batch speculates or decodes plainly, and how wide its drafting
round is, by the committed tokens per second the batch is expected to produce.

A round of width k (the most drafts a row proposes) at batch size B takes R(B, k) plain rounds' time, measured per
batch size and width (`costs.py`: every row is scored at the round's width, so B rows x (k + 1) tokens). A row that
planned d drafts at acceptance alpha commits E(alpha, min(d, k)) tokens in it, one that drafts nothing commits 1.

- The batch drafts at the width k maximising sum E / R(B, k), unless its rows' planned width (each row's gamma chosen
  with hysteresis) comes within HYSTERESIS of it.
- In batches of 2 rows and more (a single row's own fallback, `fallback.py`, decides for it), speculation stops where
  that is under OFF_BELOW times the B tokens a plain round commits even at the rows' acceptance a standard error up,
  once drafting rounds were timed at this very batch size. It stops too where what speculative rounds committed per
  second, measured over at least MEASURED_ROUNDS of them at this batch size, is under OFF_BELOW times B over a plain
  round's measured time: a prediction the rounds do not bear out (costs outside the round's model, such as a draft's
  prefills) does not keep speculation on. It comes back over ON_ABOVE, unless the measured goodput still says no.
- While off at a batch size, a drafting round now and then (a probe, its expected loss within PROBE_BUDGET of decode
  time) keeps that size's costs and the rows' acceptance measured, so speculation comes back where it pays again; a
  batch size it was never off at is priced from the nearest one measured, so it comes back as load falls.

Every decision reads the past only (timings and acceptance of earlier rounds), so sampling stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from specsample.planner.chain import HYSTERESIS
from specsample.planner.costs import CostModel, Ewma
from specsample.theory import expected_tokens_per_round

OFF_BELOW = 0.98  # the batch decodes plainly where speculation's predicted goodput is under 0.98x plain's...
ON_ABOVE = 1.02  # ...and speculates again over 1.02x (a gap against thrashing)
PROBE_BUDGET = 0.01  # share of decode time the expected loss of probes may cost while speculation is off
PROBE_EVERY = 8  # fewest rounds between probes at a batch size where speculation is off...
MAX_PROBE_EVERY = 256  # ...and most
MEASURED_ROUNDS = 16  # speculative rounds at a batch size before their measured goodput can turn speculation off
GOODPUT_WEIGHT = 0.05  # weight of one round in the expected and measured goodput reported (a memory of ~20 rounds)


@dataclass(frozen=True)
class Drafting:
    """One row's part in pricing the round: its planned drafts and the acceptance they are drawn at."""

    drafts: int
    alpha: float
    lookup: bool = False  # a prompt lookup's tokens (priced by lookup rounds' cost)
    generous: float | None = None  # alpha a standard error up (None: alpha): what turning speculation off is priced at


@dataclass(frozen=True)
class BatchChoice:
    """What the batch does this round, and what the planner predicted for it (tokens per plain round's time)."""

    width: int  # the most drafts a row proposes (0: the batch decodes plainly)
    speculative: float  # predicted tokens per plain round's time at the best width >= 1
    plain: float  # ...and of a plain round (the batch size)
    probe: bool = False  # a drafting round while speculation is off here, so it stays measured
    switch: str | None = None  # "off" or "on" where speculation switches at this batch size this round

    @property
    def ratio(self) -> float:
        """Predicted goodput of speculation over plain decoding."""
        return self.speculative / max(self.plain, 1e-12)


@dataclass(frozen=True)
class GoodputMemory:
    """What the policy carries from round to round, per batch size: where speculation is off and since when a probe
    or a switch last ran there."""

    off: frozenset[int] = frozenset()
    last: tuple[tuple[int, int], ...] = ()  # batch size -> round of its last probe or switch


@dataclass
class BatchSizeReport:
    """Per batch size, for /metrics: rounds by kind, and expected against measured goodput (tokens/s)."""

    speculative_rounds: int = 0
    plain_rounds: int = 0
    expected: Ewma = field(default_factory=Ewma)
    measured: Ewma = field(default_factory=Ewma)
    speculative: Ewma = field(default_factory=Ewma)  # measured goodput of the speculative rounds alone


@dataclass(frozen=True)
class BatchSizeSummary:
    """What the planner knows and did at one batch size (read by /metrics)."""

    batch_size: int
    speculating: bool  # speculation is on here (off: the batch decodes plainly, with a probe now and then)
    speculative_rounds: int  # rounds that drafted...
    plain_rounds: int  # ...and that decoded plainly, as the goodput policy chose
    expected: float | None  # goodput the policy predicted for its choices, committed tokens/s (recent rounds)
    measured: float | None  # ...and what those rounds committed
    plain_round_seconds: float | None  # a round without drafts
    draft_step_seconds: float | None  # one batched draft step
    round_costs: tuple[tuple[int, float], ...]  # (drafts, a drafting round's time over a plain round's), measured


class GoodputPolicy:
    """Chooses plain decoding or speculation for the whole batch, and the round's width (module docstring)."""

    def __init__(self, costs: CostModel) -> None:
        self.costs = costs
        self.memory = GoodputMemory()
        self.reports: dict[int, BatchSizeReport] = {}

    def speculating(self, batch_size: int) -> bool:
        """Whether speculation is on at this batch size (it is until the policy turns it off there)."""
        return batch_size not in self.memory.off

    def price(self, batch_size: int, rows: list[Drafting], width: int, generous: bool = False) -> float:
        """Predicted tokens per plain round's time of a round of at most `width` drafts per row (at the rows' generous
        alphas), rows not in `rows` committing one token each."""
        tokens = float(batch_size - len(rows))
        model = lookup = 0
        for row in rows:
            drafts = min(row.drafts, width)
            alpha = row.generous if generous and row.generous is not None else row.alpha
            tokens += expected_tokens_per_round(alpha, drafts)
            if row.lookup:
                lookup = max(lookup, drafts)
            else:
                model = max(model, drafts)
        cost = max(
            self.costs.round_cost(batch_size, model) if model else 1.0,
            self.costs.lookup_cost(batch_size, lookup) if lookup else 1.0,
        )
        return tokens / cost

    def choose(self, batch_size: int, rows: list[Drafting], round_index: int) -> tuple[BatchChoice, GoodputMemory]:
        """The batch's choice for a round whose planned drafting rows are `rows`, and the memory learning it keeps."""
        widest = max((r.drafts for r in rows), default=0)
        plain = float(batch_size)
        if widest == 0:
            return BatchChoice(0, plain, plain), self.memory
        if batch_size == 1:  # one row: its own fallback (`fallback.py`) is the batch's, on the same evidence
            return BatchChoice(widest, self.price(batch_size, rows, widest), plain), self.memory
        width, best = max(
            ((k, self.price(batch_size, rows, k)) for k in range(1, widest + 1)), key=lambda kv: (kv[1], -kv[0])
        )
        planned = self.price(batch_size, rows, widest)
        if best <= planned * (1 + HYSTERESIS):  # the rows' own plans (each chosen with hysteresis) unless clearly worse
            width, best = widest, planned
        choice = BatchChoice(width, best, plain)
        memory, last = self.memory, dict(self.memory.last)
        measured = self.costs.timed_drafting(batch_size) and not self.costs.settling(batch_size)
        if self.speculating(batch_size):
            # off only where even the rows' generous alphas predict a loss: near break-even, the noise of ~25 remembered
            # trials would turn off speculation that gains
            predicted_loss = measured and self.price(batch_size, rows, width, generous=True) < OFF_BELOW * plain
            if predicted_loss or self.measured_loss(batch_size):
                last[batch_size] = round_index
                memory = replace(memory, off=memory.off | {batch_size}, last=tuple(last.items()))
                return replace(choice, width=0, switch="off"), memory
            return choice, memory
        if choice.ratio > ON_ABOVE and not self.measured_loss(batch_size):
            last[batch_size] = round_index
            return replace(choice, switch="on"), replace(
                memory, off=memory.off - {batch_size}, last=tuple(last.items())
            )
        since = round_index - last.get(batch_size, round_index)
        if since >= self.probe_interval(batch_size, choice):
            last[batch_size] = round_index
            return replace(choice, probe=True), replace(memory, last=tuple(last.items()))
        return replace(choice, width=0), memory

    def measured_loss(self, batch_size: int) -> bool:
        """Whether speculative rounds at this batch size committed, per second measured, under OFF_BELOW times what
        plain rounds there commit (`measured_ratio`)."""
        ratio = self.measured_ratio(batch_size)
        return ratio is not None and ratio < OFF_BELOW

    def measured_ratio(self, batch_size: int) -> float | None:
        """Speculative rounds' measured goodput at this batch size over plain rounds' (B tokens a plain round's measured
        time); None before MEASURED_ROUNDS speculative rounds and a plain round were timed there."""
        report, plain = self.reports.get(batch_size), self.costs.plain_round.get(batch_size)
        if report is None or plain is None or not plain.value or report.speculative.count < MEASURED_ROUNDS:
            return None
        return report.speculative.mean * plain.mean / batch_size

    def probe_interval(self, batch_size: int, choice: BatchChoice) -> int:
        """Rounds between probes where speculation is off: a probe loses R - T / B plain rounds (T: its predicted
        tokens, or its measured ones where fewer), kept within PROBE_BUDGET of decode time, within [PROBE_EVERY,
        MAX_PROBE_EVERY]."""
        measured = self.measured_ratio(batch_size)
        ratio = choice.ratio if measured is None else min(choice.ratio, measured)
        loss = max(1.0 - ratio, 0.0) * self.costs.round_cost(batch_size, max(choice.width, 1))
        return int(min(max(int(loss / PROBE_BUDGET) + 1, PROBE_EVERY), MAX_PROBE_EVERY))

    def learn(
        self, batch_size: int, choice: BatchChoice | None, memory: GoodputMemory, tokens: int, seconds: float
    ) -> None:
        """Keep the memory the plan was made with, and report the round: its goodput measured (`tokens` committed in
        `seconds`) against the one predicted (None: the policy did not price it)."""
        self.memory = memory
        report = self.reports.setdefault(batch_size, BatchSizeReport())
        if choice is None:
            return
        if choice.width > 0:
            report.speculative_rounds += 1
            if seconds > 0:
                report.speculative.add(tokens / seconds, weight=GOODPUT_WEIGHT)
        else:
            report.plain_rounds += 1
        plain = self.costs.plain_round.get(batch_size)
        if seconds > 0 and plain is not None and plain.value:
            predicted = choice.speculative if choice.width > 0 else choice.plain
            report.expected.add(predicted / plain.value, weight=GOODPUT_WEIGHT)
            report.measured.add(tokens / seconds, weight=GOODPUT_WEIGHT)


def summarise(policy: GoodputPolicy, costs: CostModel) -> tuple[BatchSizeSummary, ...]:
    """Per batch size the planner has seen, what it knows and did there (safe from another thread: it copies each
    table before reading it, and computes no price, so it leaves the planner's memoised prices alone)."""
    reports, off = dict(policy.reports), policy.memory.off
    plain, steps, drafting = dict(costs.plain_round), dict(costs.draft_step), dict(costs.drafting)
    out = []
    for size in sorted(set(reports) | set(plain) | set(drafting) | off):
        report = reports.get(size, BatchSizeReport())
        rounds = drafting.get(size)
        relative = dict(rounds.relative) if rounds is not None else {}
        base = relative.get(0)
        ratios = tuple(
            (drafts, cost.value / base.value)
            for drafts, cost in sorted(relative.items())
            if drafts > 0 and base is not None and base.value and cost.value is not None
        )
        out.append(
            BatchSizeSummary(
                batch_size=size,
                speculating=size not in off,
                speculative_rounds=report.speculative_rounds,
                plain_rounds=report.plain_rounds,
                expected=report.expected.value,
                measured=report.measured.value,
                plain_round_seconds=plain[size].value if size in plain else None,
                draft_step_seconds=steps[size].value if size in steps else None,
                round_costs=ratios,
            )
        )
    return tuple(out)
