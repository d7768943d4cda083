"""Goodness-of-fit helpers for the sampling tests; thresholds follow from the sample size."""

from __future__ import annotations

import numpy as np
from scipy import stats

FALSE_ALARM = 1e-5  # per test; the suite runs well under 10 such tests, so < 1e-4 overall


def chi_square(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> tuple[float, float]:
    """Pearson chi-square of observed `counts` against `probs`; returns (statistic, threshold).

    Cells whose expected count is below `min_expected` are pooled into one cell so the chi-square
    approximation holds; the threshold is the (1 - FALSE_ALARM) quantile for the resulting degrees
    of freedom, so it scales with the sample size through the expected counts.
    Any sample in a zero-probability cell is an outright failure (infinite statistic).
    """
    counts = np.asarray(counts, dtype=np.float64)
    probs = np.asarray(probs, dtype=np.float64)
    total = counts.sum()
    if np.any(counts[probs <= 0] > 0):
        return float("inf"), 0.0
    expected = probs * total
    big = expected >= min_expected
    obs_cells = list(counts[big])
    exp_cells = list(expected[big])
    if (~big).any() and expected[~big].sum() > 0:
        obs_cells.append(counts[~big].sum())
        exp_cells.append(expected[~big].sum())
    obs, exp = np.array(obs_cells), np.array(exp_cells)
    statistic = float(((obs - exp) ** 2 / exp).sum())
    threshold = float(stats.chi2.ppf(1 - FALSE_ALARM, df=max(len(obs) - 1, 1)))
    return statistic, threshold
