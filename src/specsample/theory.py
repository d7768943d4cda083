"""Speculative decoding theory (Leviathan et al. 2022, section 3; Chen et al. 2023).

With per-token acceptance rate `alpha` (assumed i.i.d.), `gamma` drafts per round and a draft step
costing `cost_ratio` target steps, a round yields E(alpha, gamma) = (1 - alpha^(gamma+1)) / (1 - alpha)
tokens for the price of 1 + gamma * cost_ratio target steps. An `overhead` adds what any speculative
round costs beyond that, whatever its gamma (verification, scoring more than one token): measured
engines are affine in gamma, not proportional.
"""

from __future__ import annotations

from collections.abc import Sequence


def _check_alpha(alpha: float) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"acceptance rate alpha must be in [0, 1], got {alpha}")


def expected_tokens_per_round(alpha: float, gamma: int) -> float:
    """E(alpha, gamma): expected tokens committed per round, the bonus or recovered token included."""
    _check_alpha(alpha)
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")
    if alpha == 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def expected_speedup(alpha: float, gamma: int, cost_ratio: float, overhead: float = 0.0) -> float:
    """Expected wall-clock speedup over target-only decoding: E(alpha, gamma) / (1 + k + gamma * c),
    with k = `overhead`, the fixed cost of a speculative round in plain rounds (0 in the papers)."""
    if cost_ratio < 0:
        raise ValueError(f"cost ratio c must be >= 0, got {cost_ratio}")
    if overhead < 0:
        raise ValueError(f"overhead k must be >= 0, got {overhead}")
    return expected_tokens_per_round(alpha, gamma) / (1.0 + overhead + gamma * cost_ratio)


def optimal_gamma(alpha: float, cost_ratio: float, max_gamma: int = 16, overhead: float = 0.0) -> int:
    """The gamma in 1..max_gamma that maximises the expected speedup (smallest on ties)."""
    if max_gamma < 1:
        raise ValueError(f"max_gamma must be >= 1, got {max_gamma}")
    speedups = [expected_speedup(alpha, g, cost_ratio, overhead) for g in range(1, max_gamma + 1)]
    return 1 + speedups.index(max(speedups))


def acceptance_rate(accepted: int, drafted: int) -> float:
    """Fraction of drafted tokens that were accepted (vLLM's draft acceptance rate)."""
    if accepted < 0 or drafted < 0 or accepted > drafted:
        raise ValueError(f"need 0 <= accepted <= drafted, got accepted={accepted}, drafted={drafted}")
    return accepted / drafted if drafted else 0.0


def estimate_alpha(accepted_per_round: Sequence[int], drafted_per_round: Sequence[int]) -> float:
    """Maximum-likelihood alpha from per-round counts under the i.i.d. acceptance model.

    Each round is a run of Bernoulli(alpha) trials that stops at the first rejection or at the end
    of the drafts: successes are the accepted drafts, failures the rounds that ended in a rejection.
    Unlike accepted/drafted this is unbiased by the truncation at gamma.
    """
    if len(accepted_per_round) != len(drafted_per_round):
        raise ValueError("accepted_per_round and drafted_per_round must have the same length")
    successes = failures = 0
    for accepted, drafted in zip(accepted_per_round, drafted_per_round):
        if not 0 <= accepted <= drafted:
            raise ValueError(f"need 0 <= accepted <= drafted, got {accepted} of {drafted}")
        successes += accepted
        failures += int(accepted < drafted)
    if successes + failures == 0:
        return 0.0
    return successes / (successes + failures)


def mean_accepted_length(accepted: int, rounds: int) -> float:
    """Mean tokens committed per round: 1 + accepted / rounds (vLLM's mean acceptance length)."""
    if rounds < 0 or accepted < 0:
        raise ValueError(f"need accepted >= 0 and rounds >= 0, got {accepted}, {rounds}")
    return 1.0 + accepted / rounds if rounds else 0.0
