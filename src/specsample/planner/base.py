"""What a round's planner sees, decides and learns from: values passed along, never state read in call order.

    plan = planner.plan(batch)        # BatchState -> RoundPlan
    ...                               # propose, score, verify, commit
    planner.learn(plan, outcome)      # the plan comes back with what happened (RoundOutcome)

Fixed gamma and gamma auto are both planners, so the engine's round has one path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from specsample.config import TreeShape
from specsample.drafters.base import Extension


@dataclass(frozen=True)
class RowState:
    """One running request as a planner sees it."""

    request_id: str
    remaining: int  # tokens left in its budget
    gamma: int | None = None  # a fixed gamma the request asked for; None: the planner's choice
    speculative: bool = True  # False: the request decodes without drafting
    backlog: int = 0  # tokens plain rounds committed that its draft could score teacher-forced
    lookup: int = 0  # prompt-lookup tokens its drafter offers now (0: none)
    drafts_otherwise: bool = True  # whether it could draft with a model instead of its lookup

    @property
    def chosen(self) -> bool:
        """Whether the planner chooses this row's drafts (speculative, without a gamma of its own)."""
        return self.speculative and self.gamma is None


@dataclass(frozen=True)
class BatchState:
    """The running rows in slot order, and what the drafter can do for them."""

    rows: tuple[RowState, ...]
    can_score: bool = False  # the drafter scores backlogs (a model draft) and the engine keeps them
    offers_lookups: bool = False  # the drafter offers prompt lookups (`RowState.lookup`)
    can_tree: bool = False  # the target scores token trees in one forward (a round may draft trees)

    def __len__(self) -> int:
        return len(self.rows)


@dataclass(frozen=True)
class RowPlan:
    """One row's part of a round."""

    drafts: int = 0  # planned drafts (0: a plain round); the gate may stop the row sooner. In a tree round: its depth
    reach: int = 0  # most drafts it may draw (> drafts only under the round's extension). In a tree round: its nodes
    source: bool | None = None  # True: its prompt lookup; False: its draft model; None: the drafter's own rule
    score_backlog: int = 0  # tokens of its backlog its draft scores this round (0: none)
    fallback: bool = False  # gamma auto kept it from drafting (a plain round in place of a drafting one)


@dataclass(frozen=True)
class RoundPlan:
    """A round's drafts per row, the round's confidence gate and extension, and what the planner needs back
    to learn from the round's timing."""

    rows: tuple[RowPlan, ...]
    stop_thresholds: tuple[float, ...] = ()  # per draft position j (index j - 1): stop after a less confident draft
    extension: Extension | None = None
    chosen_ids: tuple[str, ...] = ()  # the requests gamma auto planned (empty: it planned none this round)
    exploring: bool = False  # some row drafts a neighbouring gamma, in full, so its cost is timed
    catching_up: bool = False  # some row drafts right after a plain round: its draft first feeds what it missed
    model_drafting: bool = False  # some planned row drafts with the draft model
    tree: TreeShape | None = None  # draft a token tree per row, each row's `reach` nodes at most; None: chains
    # rows sent to their lookup may propose token trees of their `reach` nodes (every drafting row is a lookup's, and
    # the target scores trees): `DraftRequest.lookup_trees`
    lookup_trees: bool = False

    @property
    def width(self) -> int:
        """The most drafts any row may draw this round."""
        return max((r.reach for r in self.rows), default=0)

    @property
    def lookups(self) -> int:
        """Rows sent to their prompt lookup."""
        return sum(r.source is True for r in self.rows)

    @property
    def scoring(self) -> int:
        """Rows whose draft scores its backlog."""
        return sum(r.score_backlog > 0 for r in self.rows)


@dataclass(frozen=True)
class RowOutcome:
    """What one row's round did."""

    request_id: str
    num_drafted: int
    num_accepted: int
    confidence: tuple[float, ...] | None = None  # the draft's temperature-1 probability of each token it drew
    # per position reached (the accepted drafts and the first rejected one), the probability a draft there is
    # accepted (sum of min(target, draft)); None where the coins themselves are exact (greedy, or no estimate)
    acceptance: tuple[float, ...] | None = None
    backlog_scores: tuple[float, ...] | None = None  # per backlog token scored, min(1, q / p); None: none scored


@dataclass(frozen=True)
class RoundOutcome:
    """A round's rows and its time, split at the draft / target / verify-and-commit boundaries."""

    rows: tuple[RowOutcome, ...]
    width: int  # drafts in the round's widest row (0: a plain round)
    draft_seconds: float
    target_seconds: float
    verify_seconds: float
    finished: tuple[str, ...] = field(default=())  # requests that ended this round: forgotten after learning


class Planner(Protocol):
    """Plans each round's drafts and learns from how the round went."""

    max_gamma: int  # the most drafts it plans for a row (the engine's caches hold that many)
    adaptive: bool  # whether it reads lookup offers and backlogs (the engine computes them only then)

    def plan(self, batch: BatchState) -> RoundPlan: ...

    def learn(self, plan: RoundPlan, outcome: RoundOutcome) -> None: ...

    def forget(self, request_id: str) -> None: ...


def fixed_drafts(row: RowState, gamma: int) -> int:
    """Drafts of a row the planner does not choose for: its own gamma (else `gamma`), 0 when it does not
    speculate, never more than its budget can use (the last token of a budget is never drafted)."""
    if not row.speculative:
        return 0
    return max(0, min(row.gamma or gamma, gamma, row.remaining - 1))


def tree_row(row: RowState, tree: TreeShape, nodes: int | None = None) -> RowPlan:
    """A row's part of a tree round: `nodes` (else the tree's), at most its own gamma, down to the tree's depth but
    never deeper than its budget can use; nothing when it does not speculate."""
    depth = fixed_drafts(row, tree.depth) if row.gamma is None else min(fixed_drafts(row, tree.nodes), tree.depth)
    if depth == 0:
        return RowPlan()
    return RowPlan(drafts=depth, reach=max(depth, min(nodes or tree.nodes, row.gamma or tree.nodes)))


@dataclass
class FixedGamma:
    """The same gamma every round for every row (a request may ask for its own, up to `max_gamma`); with `tree`, that
    tree every round where the target can score one (a request's own gamma then bounds its tree's nodes)."""

    max_gamma: int
    tree: TreeShape | None = None
    adaptive: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_gamma, int) or self.max_gamma < 1:
            raise ValueError(f"gamma must be an integer >= 1, got {self.max_gamma!r}")

    def plan(self, batch: BatchState) -> RoundPlan:
        if self.tree is not None and batch.can_tree:
            return RoundPlan(rows=tuple(tree_row(row, self.tree) for row in batch.rows), tree=self.tree)
        drafts = [fixed_drafts(row, self.max_gamma) for row in batch.rows]
        return RoundPlan(rows=tuple(RowPlan(drafts=d, reach=d) for d in drafts))

    def learn(self, plan: RoundPlan, outcome: RoundOutcome) -> None:
        return None

    def forget(self, request_id: str) -> None:
        return None
