"""Chain length: per request, the gamma that maximises the predicted speedup E(alpha, gamma) / R(gamma); the
neighbour an exploring round times; the round's confidence gate and extension.

Every price reads the past only (measured acceptance and round costs, and the draft's own probability of a token it
already drew), so sampling stays exact.
"""

from __future__ import annotations

from specsample.planner.acceptance import BINS, Acceptance
from specsample.planner.base import Extension
from specsample.planner.costs import CostModel
from specsample.theory import expected_tokens_per_round

HYSTERESIS = 0.03  # switch a request's gamma only for a > 3% better predicted speedup
EXPLORE_EVERY = 16  # rounds between tries of a neighbouring gamma, so round costs are measured


class ChainPolicy:
    """Prices chains of drafts from measured acceptance and round costs."""

    def __init__(self, max_gamma: int, acceptance: Acceptance, costs: CostModel) -> None:
        self.max_gamma, self.acceptance, self.costs = max_gamma, acceptance, costs

    def speedup(self, alpha: float, gamma: int, batch_size: int) -> float:
        """Predicted speedup over plain decoding: E(alpha, gamma) tokens per round over the round's cost."""
        return expected_tokens_per_round(alpha, gamma) / self.costs.round_cost(batch_size, gamma)

    def best_gamma(self, alpha: float, batch_size: int) -> tuple[int, float]:
        """The gamma in 1..max_gamma maximising the predicted speedup (the shorter on ties), and that speedup."""
        best, best_speedup = 1, -1.0
        for gamma in range(1, self.max_gamma + 1):
            speedup = self.speedup(alpha, gamma, batch_size)
            if speedup > best_speedup:
                best, best_speedup = gamma, speedup
        return best, best_speedup

    def keep_or_switch(self, alpha: float, current: int, batch_size: int) -> tuple[int, float]:
        """The gamma to draft: the best for `alpha` where none is chosen yet (`current` 0) or where it beats `current`
        by more than HYSTERESIS, else `current`; and the best gamma's predicted speedup."""
        best, speedup = self.best_gamma(alpha, batch_size)
        if not current or speedup > self.speedup(alpha, current, batch_size) * (1 + HYSTERESIS):
            return best, speedup
        return current, speedup

    def neighbour(self, gamma: int, batch_size: int) -> int:
        """The gamma next to `gamma` timed least recently (one more on ties): an exploring round measures it, so a
        cost the affine model overstates is found, and both neighbours stay fresh."""
        options = [g for g in (gamma + 1, gamma - 1) if 1 <= g <= self.max_gamma]
        return self.costs.least_recent(options, batch_size) if options else gamma

    def gate(self, batch_size: int, exploring: bool) -> tuple[list[float], Extension | None]:
        """The round's confidence gate and extension; an exploring round has neither (it times its gamma in full).

        A draft drawn with confidence q is accepted with probability a(q), estimated per bin. One more draft adds
        about a(q) a_mean tokens for R(j + 1) - R(j) plain rounds' time; worth it while that beats the S tokens per
        plain round drafting makes anyway (S: the best predicted speedup at the pooled alpha, at least 1). So the
        bar at position j is S (R(j + 1) - R(j)) / a_mean; the gate stops after the j-th draft below the top of the
        highest bin whose a(q) is under it, and past the plan a round draws draft j + 1 while a(q_1) ... a(q_j)
        reaches it, as one more draft adds tokens only if every draft so far is accepted."""
        acceptance = self.acceptance
        if not acceptance.calibrated() or exploring:
            return [], None
        mean = acceptance.mean_bin_acceptance()
        if mean <= 0:
            return [], None
        rate = max(self.best_gamma(acceptance.pooled_alpha(), batch_size)[1], 1.0)
        bars = [rate * self.costs.one_more_draft(batch_size, j) / mean for j in range(1, self.max_gamma)]
        thresholds = [self._threshold(bar) for bar in bars]
        # a bin not yet read counts as never accepted: no extension on a confidence without a past
        bins = tuple(acceptance.bin_acceptance(b) or 0.0 for b in range(BINS))
        return thresholds, Extension(bins, tuple(bars))

    def _threshold(self, bar: float) -> float:
        """Top of the highest confidence bin, counting up, whose acceptance stays under `bar`."""
        threshold = 0.0
        for b in range(BINS):
            accepted = self.acceptance.bin_acceptance(b)
            if accepted is not None:
                if accepted < bar:
                    threshold = (b + 1) / BINS
                else:
                    break
        return threshold
