"""Gamma auto's token trees: whether a round drafts a tree, and of which budget.

A tree round scores each row's tree (`nodes` drafts) in one target forward and commits the accepted path and one
more token. Its yield, tokens per row-round, is measured per request and budget; the yield pooled over requests
stands in until a request's own was read, and before any, a chain of the tree's depth at the request's alpha. Its
cost is timed like a chain's (`CostModel.tree_cost`). A round drafts the budget predicted fastest for the rows that
draft with the model, only where it beats their chains by HYSTERESIS; every EXPLORE_EVERY rounds one round tries the
alternative tried least recently (a chain, or another budget), so each price stays measured.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from specsample.config import TreeShape
from specsample.planner.acceptance import Acceptance
from specsample.planner.chain import EXPLORE_EVERY, HYSTERESIS, ChainPolicy
from specsample.planner.costs import CostModel, Ewma, settled
from specsample.theory import expected_tokens_per_round

TREE_WARMUP = 4  # tries of each tree budget (and of chains) before trees are explored only every EXPLORE_EVERY...
TREE_WARMUP_EVERY = 4  # ...rounds, rather than every this many
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


@dataclass(frozen=True)
class TreeMemory:
    """What the tree policy carries from round to round: the option rounds draft outside explorations, and per
    option (node budget; 0: chains) the round it was last drafted and how often it was planned."""

    choice: TreeShape | None = None
    tried: tuple[tuple[int, int], ...] = ()
    tries: tuple[tuple[int, int], ...] = ()


class TreePolicy:
    """Chooses each round between chains and the tree budgets (see the module docstring)."""

    def __init__(self, largest: TreeShape | None, chain: ChainPolicy, acceptance: Acceptance, costs: CostModel):
        self.trees = budgets(largest) if largest is not None else ()
        self.yields = TreeYields()
        self.chain, self.acceptance, self.costs = chain, acceptance, costs
        self.memory = TreeMemory()

    def choose(
        self, request_ids: list[str], drafts: list[int], batch_size: int, round_index: int
    ) -> tuple[TreeShape | None, TreeMemory]:
        """The tree the round drafts (None: chains) for the rows the model drafts for (`drafts` each as chains), and
        the memory learning the round keeps: the fastest predicted, switched to only for a HYSTERESIS gain; every
        EXPLORE_EVERY rounds, half-way between gamma's explorations (every TREE_WARMUP_EVERY until each was tried
        TREE_WARMUP times), the alternative tried least recently."""
        memory = self.memory
        if not request_ids or not self.costs.timed_drafting(batch_size):
            return None, memory  # chains are timed first: a tree's prior prices it from them

        def speedup(shape: TreeShape | None) -> float:
            total = 0.0
            for rid, chain_drafts in zip(request_ids, drafts):
                alpha = self.acceptance.alpha(rid)
                if shape is None:
                    total += self.chain.speedup(alpha, chain_drafts, batch_size)
                else:
                    total += self.yields.tokens(rid, shape, alpha) / self.costs.tree_cost(
                        batch_size, shape.nodes, shape.depth
                    )
            return total / len(request_ids)

        tried, tries = dict(memory.tried), dict(memory.tries)
        options: list[TreeShape | None] = [None, *self.trees]
        counts = [tries.get(shape.nodes if shape else 0, 0) for shape in options]
        every = TREE_WARMUP_EVERY if min(counts) < TREE_WARMUP else EXPLORE_EVERY
        choice = memory.choice
        if round_index % every == every // 2:
            planned = min(options, key=lambda shape: tried.get(shape.nodes if shape else 0, -1))
        else:
            best = max(options, key=speedup)
            if speedup(best) > speedup(choice) * (1 + HYSTERESIS):
                choice = best
            planned = choice
        key = planned.nodes if planned else 0
        tried[key] = round_index
        tries[key] = tries.get(key, 0) + 1
        return planned, replace(memory, choice=choice, tried=tuple(tried.items()), tries=tuple(tries.items()))
