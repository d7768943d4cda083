"""The theory module: expected tokens per round, speedup, optimal gamma, alpha estimators."""

from __future__ import annotations

import random

import pytest

from specsample.theory import (
    acceptance_rate,
    estimate_alpha,
    expected_speedup,
    expected_tokens_per_round,
    mean_accepted_length,
    optimal_gamma,
)


def test_expected_tokens_matches_definition() -> None:
    # E = sum_{k=0..gamma} alpha^k
    for alpha in (0.0, 0.3, 0.8, 0.99):
        for gamma in range(0, 9):
            assert expected_tokens_per_round(alpha, gamma) == pytest.approx(sum(alpha**k for k in range(gamma + 1)))
    assert expected_tokens_per_round(1.0, 4) == 5.0


def test_speedup_and_optimal_gamma() -> None:
    assert expected_speedup(0.8, 4, 0.0) == pytest.approx(expected_tokens_per_round(0.8, 4))
    assert expected_speedup(0.8, 4, 0.05) == pytest.approx(expected_tokens_per_round(0.8, 4) / 1.2)
    for alpha, c in [(0.6, 0.05), (0.8, 0.05), (0.9, 0.01), (0.5, 0.3)]:
        brute = max(range(1, 17), key=lambda g: (expected_speedup(alpha, g, c), -g))
        assert optimal_gamma(alpha, c) == brute
    # Leviathan et al. Table: alpha 0.8, c 0.05 -> gamma around 8
    assert 6 <= optimal_gamma(0.8, 0.05) <= 9
    assert optimal_gamma(0.1, 0.5) == 1


def test_estimators() -> None:
    rng = random.Random(0)
    alpha, gamma = 0.7, 4
    accepted, drafted = [], []
    for _ in range(20_000):
        n = 0
        while n < gamma and rng.random() < alpha:
            n += 1
        accepted.append(n)
        drafted.append(gamma)
    assert estimate_alpha(accepted, drafted) == pytest.approx(alpha, abs=0.01)
    naive = acceptance_rate(sum(accepted), sum(drafted))
    assert naive < alpha - 0.05  # truncation biases accepted/drafted low
    assert mean_accepted_length(sum(accepted), len(accepted)) == pytest.approx(
        expected_tokens_per_round(alpha, gamma), abs=0.03
    )


def test_theory_errors() -> None:
    with pytest.raises(ValueError, match="alpha"):
        expected_tokens_per_round(1.2, 3)
    with pytest.raises(ValueError, match="cost ratio"):
        expected_speedup(0.5, 3, -1)
    with pytest.raises(ValueError, match="accepted"):
        acceptance_rate(5, 3)
