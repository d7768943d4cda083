"""What a round's planner sees, decides and learns from: values passed along, never state read in call order.

    plan = planner.plan(batch)        # BatchState -> RoundPlan
    ...                               # propose, score, verify, commit
    planner.learn(plan, outcome)      # the plan comes back with what happened (RoundOutcome)

Fixed gamma and gamma auto are both planners, so the engine's round has one path. What a planner learns from is in
the outcome (`RoundOutcome.evidence`): the engine computes nothing for a particular planner.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from torch import Tensor

from specsample.config import TreeShape


class DraftSource(enum.Enum):
    """Where a row's drafts come from this round."""

    EITHER = "either"  # the drafter's own rule (a planner that does not choose)
    LOOKUP = "lookup"  # its prompt lookup (n-gram or suffix match)
    MODEL = "model"  # its draft model


@dataclass(frozen=True)
class Extension:
    """Drafting past a row's plan on confident drafts (gamma auto): once a row has drawn its planned drafts, it
    draws one more after its j-th while its drafts so far were all accepted with probability at least
    `bars[j - 1]`, that probability read as the product of their confidence bins' past acceptance. The rule reads
    only the draft's own probabilities of tokens it already drew, so sampling stays exact."""

    bin_acceptance: tuple[float, ...]  # past acceptance of drafts per confidence bin, len(...) equal bins of [0, 1]
    bars: tuple[float, ...]  # per draft position j (index j - 1): the least chance all j were accepted to draw j + 1

    def __post_init__(self) -> None:
        if not self.bin_acceptance or any(not 0.0 <= a <= 1.0 for a in self.bin_acceptance):
            raise ValueError(f"bin_acceptance needs one probability per bin, got {self.bin_acceptance}")

    def draws_on(self, planned: int, confidences: Sequence[float]) -> bool:
        """Whether a row planned for `planned` drafts, having drawn tokens with these confidences (at least its
        plan), draws one more."""
        drawn = len(confidences)
        if drawn < max(planned, 1) or drawn > len(self.bars):
            return False
        bins = len(self.bin_acceptance)
        chance = 1.0
        for q in confidences:
            if not q == q:  # NaN: a draft without a confidence (deterministic) says nothing
                return False
            chance *= self.bin_acceptance[min(int(q * bins), bins - 1)]
        return chance >= self.bars[drawn - 1]


@dataclass(frozen=True)
class RowState:
    """One running request as a planner sees it."""

    request_id: str
    remaining: int  # tokens left in its budget
    gamma: int | None = None  # a fixed gamma the request asked for; None: the planner's choice
    speculative: bool = True  # False: the request decodes without drafting
    # tokens plain rounds committed since it last drafted, which its draft could score (a simulation's count; an
    # engine leaves it 0 and the planner counts what it kept from the round's evidence)
    backlog: int = 0
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
    source: DraftSource = DraftSource.EITHER
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
    # what the planner that made the plan keeps for later rounds once the round is learnt (its own type; None: nothing)
    update: object | None = None

    @property
    def width(self) -> int:
        """The most drafts any row may draw this round."""
        return max((r.reach for r in self.rows), default=0)

    @property
    def lookups(self) -> int:
        """Rows sent to their prompt lookup."""
        return sum(r.source is DraftSource.LOOKUP for r in self.rows)

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
    # accepted (sum of min(target, draft)); None where the coins themselves are exact (greedy, or no estimate).
    # An engine leaves it to the planner to read off `RoundOutcome.evidence`; a simulation may give it
    acceptance: tuple[float, ...] | None = None
    # per backlog token scored, min(1, q / p); None: none scored. An engine gives the draft's probabilities q
    # (`backlog_draft_probs`) and the planner pairs them with the target's it kept; a simulation may give the ratios
    backlog_scores: tuple[float, ...] | None = None
    backlog_draft_probs: tuple[float, ...] | None = None
    failed: bool = False  # its distributions were unusable: the round teaches nothing about it
    greedy: bool = False  # it decodes greedily: its accept-or-not coins are exact, no acceptance probability needed


@dataclass(frozen=True)
class RoundEvidence:
    """The round's tensors, for a planner that learns from them (the engine computes nothing for it): the drafts,
    the distributions they were drawn from, the target's warped distributions at the scored positions (None: every
    row greedy) and the token each row committed after its accepted drafts; whether sampling was coupled."""

    draft_tokens: Tensor  # [b, gamma]
    draft_probs: Tensor | None  # [b, gamma, vocab]; None: deterministic drafts
    target_probs: Tensor | None  # [b, gamma + 1, vocab]
    next_tokens: Tensor  # [b]
    coupled: bool = False
    tree: bool = False  # the drafts were token trees (their acceptance is a yield, not a chain's)


@dataclass(frozen=True)
class RoundOutcome:
    """A round's rows and its time, split at the draft / target / verify-and-commit boundaries."""

    rows: tuple[RowOutcome, ...]
    width: int  # drafts in the round's widest row (0: a plain round)
    draft_seconds: float
    target_seconds: float
    verify_seconds: float
    finished: tuple[str, ...] = field(default=())  # requests that ended this round: forgotten after learning
    evidence: RoundEvidence | None = None


class Planner(Protocol):
    """Plans each round's drafts and learns from how the round went."""

    max_gamma: int  # the most drafts it plans for a row's chain (and the most a request may ask for)
    tree: TreeShape | None  # the largest token tree it may plan (None: chains only)

    @property
    def most_drafts(self) -> int:
        """The most drafts a round may hold per row: what the engine's caches keep room for past a row's length."""
        ...

    def plan(self, batch: BatchState) -> RoundPlan: ...

    def learn(self, plan: RoundPlan, outcome: RoundOutcome) -> None: ...

    def forget(self, request_id: str) -> None: ...


def most_drafts(max_gamma: int, tree: TreeShape | None) -> int:
    """The most drafts a round of a planner with this chain bound and tree may hold per row (a tree's nodes, or its
    expanded nodes' children while it grows, whichever is more)."""
    if tree is None:
        return max_gamma
    return max(max_gamma, tree.nodes, tree.branch * tree.depth)


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

    max_gamma: int = 5
    tree: TreeShape | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_gamma, bool) or not isinstance(self.max_gamma, int) or self.max_gamma < 1:
            raise ValueError(f"gamma must be an integer >= 1, got {self.max_gamma!r}")
        if self.tree is not None and not isinstance(self.tree, TreeShape):
            raise ValueError(f"tree must be a TreeShape or None, got {self.tree!r}")

    @property
    def most_drafts(self) -> int:
        return most_drafts(self.max_gamma, self.tree)

    def plan(self, batch: BatchState) -> RoundPlan:
        if self.tree is not None and batch.can_tree:
            return RoundPlan(rows=tuple(tree_row(row, self.tree) for row in batch.rows), tree=self.tree)
        drafts = [fixed_drafts(row, self.max_gamma) for row in batch.rows]
        return RoundPlan(rows=tuple(RowPlan(drafts=d, reach=d) for d in drafts))

    def learn(self, plan: RoundPlan, outcome: RoundOutcome) -> None:
        return None

    def forget(self, request_id: str) -> None:
        return None
