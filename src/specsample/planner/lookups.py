"""Prompt lookups: per row, whether a round proposes what its drafter's lookup offers, and how much of it.

A lookup is sized from the lookups' own acceptance and measured cost (the length in 1..offered that maximises
E(alpha, n) over its cost; none where no length beats a plain round), and taken where it predicts at least the model's
plan at the model's estimate (a plain round, 1, in fallback).
"""

from __future__ import annotations

from specsample.planner.acceptance import Acceptance
from specsample.planner.base import RowState
from specsample.planner.chain import ChainPolicy
from specsample.planner.costs import CostModel
from specsample.theory import expected_tokens_per_round


class LookupPolicy:
    """Sends rows to their prompt lookup where it is predicted faster than their model's plan."""

    def __init__(self, max_gamma: int, chain: ChainPolicy, acceptance: Acceptance, costs: CostModel) -> None:
        self.max_gamma, self.chain, self.acceptance, self.costs = max_gamma, chain, acceptance, costs

    def length(self, request_id: str, available: int, batch_size: int) -> tuple[int, float]:
        """Lookup tokens to propose out of `available` and the predicted speedup: the count maximising E(alpha, n)
        over the round's cost at the request's lookup acceptance (0 and 1.0 when none beats a plain round)."""
        alpha, best, best_speedup = self.acceptance.lookup_alpha(request_id), 0, 1.0
        for tokens in range(1, min(available, self.max_gamma) + 1):
            speedup = expected_tokens_per_round(alpha, tokens) / self.costs.lookup_cost(batch_size, tokens)
            if speedup > best_speedup:
                best, best_speedup = tokens, speedup
        return best, best_speedup

    def assign(self, rows: list[RowState], drafts: list[int], batch_size: int) -> tuple[list[int], dict[str, int]]:
        """The rows' drafts once lookups are weighed against the model's `drafts`, and the rows sent to their lookup
        (request id -> tokens). A row with neither a lookup nor a model decodes plain."""
        out, lookups = list(drafts), {}
        for i, row in enumerate(rows):
            if row.lookup <= 0:
                if not row.drafts_otherwise:
                    out[i] = 0
                continue
            tokens, speedup = self.length(row.request_id, row.lookup, batch_size)
            alpha = self.acceptance.alpha(row.request_id)
            planned = self.chain.speedup(alpha, out[i], batch_size) if out[i] > 0 else 1.0
            if not row.drafts_otherwise or (tokens > 0 and speedup >= planned):
                out[i] = tokens
                if tokens > 0:
                    lookups[row.request_id] = tokens
        return out, lookups
