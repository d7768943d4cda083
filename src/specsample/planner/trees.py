"""Gamma auto's token trees: whether a round drafts a tree, and of which budget.

A tree round scores each row's tree (`nodes` drafts) in one target forward and commits the accepted path and one
more token. Its yield, tokens per row-round, is measured per request and budget; the yield pooled over requests
stands in until a request's own was read, and before any, a chain of the tree's depth at the request's alpha. Its
cost is timed like a chain's (`CostModel.tree_cost`). A round drafts the budget predicted fastest for the rows that
draft with the model, only where it beats their chains by HYSTERESIS; every EXPLORE_EVERY rounds one round tries the
alternative tried least recently (a chain, or another budget), so each price stays measured.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specsample.config import TreeShape
from specsample.planner.costs import Ewma, settled
from specsample.theory import expected_tokens_per_round

LADDER = (8, 12, 16, 24, 32, 48, 64)  # node budgets gamma auto chooses among, up to the configured tree's
YIELD_WEIGHT = 0.1  # weight of one row-round in a yield's running mean (a memory of about 10 rounds)
POOLED_MIN_ROUNDS = 4  # tree rounds a request drafts before its own yield replaces the pooled one


def budgets(largest: TreeShape) -> tuple[TreeShape, ...]:
    """The trees gamma auto may draft: `largest`, and the smaller budgets of LADDER above its depth."""
    nodes = sorted({n for n in LADDER if largest.depth < n < largest.nodes} | {largest.nodes})
    return tuple(TreeShape(n, largest.branch, largest.depth) for n in nodes)


@dataclass
class TreeYields:
    """Measured tokens per row-round of tree rounds, per request and per node budget, and pooled per budget."""

    own: dict[str, dict[int, Ewma]] = field(default_factory=dict)
    pooled: dict[int, Ewma] = field(default_factory=dict)

    def observe(self, request_id: str, nodes: int, tokens: int) -> None:
        self.own.setdefault(request_id, {}).setdefault(nodes, Ewma()).add(tokens, weight=YIELD_WEIGHT)
        self.pooled.setdefault(nodes, settled()).add(tokens, weight=YIELD_WEIGHT)

    def tokens(self, request_id: str, shape: TreeShape, alpha: float) -> float:
        """Predicted tokens per round of `shape` for the request (see the module docstring)."""
        own = self.own.get(request_id, {}).get(shape.nodes)
        if own is not None and own.count >= POOLED_MIN_ROUNDS:
            return own.mean
        pooled = self.pooled.get(shape.nodes)
        if pooled is not None and pooled.value is not None:
            return pooled.value
        return expected_tokens_per_round(alpha, shape.depth)

    def forget(self, request_id: str) -> None:
        self.own.pop(request_id, None)
