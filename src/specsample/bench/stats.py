"""Statistics for benchmarks: paired bootstrap intervals of speed ratios, acceptance summaries, a two-sample test."""

from __future__ import annotations

import random
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence

from specsample.metrics import percentile
from specsample.theory import expected_speedup

__all__ = ["percentile", "two_sample_test", "predicted_speedup", "acceptance_summary", "bootstrap", "PromptRow"]

PromptRow = tuple[str, dict[str, tuple[int, float]]]  # (category, {system: (tokens, seconds)}) of one prompt
Interval = list[float | None]  # [point, low, high]; low and high None where one prompt gives no interval


def _speeds(rows: Sequence[PromptRow]) -> dict[str, float]:
    """Each system's tokens per second over `rows` (their tokens and seconds summed)."""
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for _, systems in rows:
        for name, (tokens, seconds) in systems.items():
            sums[name][0] += tokens
            sums[name][1] += seconds
    return {name: tokens / seconds if seconds > 0 else 0.0 for name, (tokens, seconds) in sums.items()}


def bootstrap(
    rows: Sequence[PromptRow],
    statistic: Callable[[dict[str, float]], dict[str, float]],
    level: float = 0.9,
    resamples: int = 1000,
    seed: int = 0,
) -> dict[str, dict[str, Interval]]:
    """Paired bootstrap over prompts, per category and overall: `statistic(speeds)` (speeds: system -> tokens/s over
    the chosen prompts) at its point value and its `level` interval. Every system is paired on the same resampled
    prompts; prompts are resampled within their category (overall: every category at once, so its mix stays). A
    category of one prompt has no interval (low and high are None), and where any category has one prompt the overall
    interval resamples all prompts together. Returns {name: {category: [point, low, high]}}."""
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    groups: dict[str, list[PromptRow]] = defaultdict(list)
    for row in rows:
        groups[row[0]].append(row)
    cats = sorted(groups)
    rng = random.Random(seed)
    draws: dict[str, list[dict[str, float]]] = {cat: [] for cat in [*cats, "overall"]}
    stratified = all(len(group) > 1 for group in groups.values())
    for _ in range(resamples):
        chosen = {cat: [rng.choice(group) for _ in group] for cat, group in groups.items()}
        for cat in cats:
            draws[cat].append(statistic(_speeds(chosen[cat])))
        overall = [r for cat in cats for r in chosen[cat]] if stratified else [rng.choice(rows) for _ in rows]
        draws["overall"].append(statistic(_speeds(overall)))
    low, high = int((1 - level) / 2 * resamples), min(resamples - 1, int((1 + level) / 2 * resamples))
    out: dict[str, dict[str, Interval]] = defaultdict(dict)
    for cat in [*cats, "overall"]:
        point = statistic(_speeds(rows if cat == "overall" else groups[cat]))
        single = cat != "overall" and len(groups[cat]) == 1
        for name, value in point.items():
            values = sorted(d[name] for d in draws[cat])
            out[name][cat] = [value, None, None] if single else [value, values[low], values[high]]
    return dict(out)


def two_sample_test(
    first: Sequence[tuple[int, ...]], second: Sequence[tuple[int, ...]], min_expected: float = 5.0
) -> dict[str, float]:
    """Chi-square test of homogeneity: were two samples of token sequences drawn from one distribution?

    Categories whose expected count (under the pooled distribution) is below `min_expected` in either sample
    are pooled into one "other" category, so the chi-square approximation holds. Returns the statistic,
    degrees of freedom and p-value.
    """
    from scipy import stats

    a, b = Counter(first), Counter(second)
    n_a, n_b = sum(a.values()), sum(b.values())
    if n_a == 0 or n_b == 0:
        raise ValueError("both samples need at least one sequence")
    total = n_a + n_b
    rows_a, rows_b, other_a, other_b = [], [], 0, 0
    for key in set(a) | set(b):
        pooled = a[key] + b[key]
        if min(pooled * n_a / total, pooled * n_b / total) >= min_expected:
            rows_a.append(a[key])
            rows_b.append(b[key])
        else:
            other_a += a[key]
            other_b += b[key]
    if other_a + other_b > 0:
        rows_a.append(other_a)
        rows_b.append(other_b)
    if len(rows_a) < 2:
        return {"statistic": 0.0, "dof": 0, "p_value": 1.0, "categories": len(rows_a)}
    statistic, p_value, dof, _ = stats.chi2_contingency([rows_a, rows_b], correction=False)
    return {"statistic": float(statistic), "dof": int(dof), "p_value": float(p_value), "categories": len(rows_a)}


def acceptance_summary(stats: Sequence[dict]) -> dict[str, object]:
    """Pool engine statistics of several runs: acceptance rate, alpha (MLE), mean accepted length, acceptance
    per draft position, mean gamma."""
    drafted = sum(s["drafted"] for s in stats)
    accepted = sum(s["accepted"] for s in stats)
    drafts = sum(s["drafts"] for s in stats)
    rejections = sum(s["rejections"] for s in stats)
    width = max((len(s["drafted_per_position_counts"]) for s in stats), default=0)
    pos_a = [
        sum(s["accepted_per_position_counts"][i] for s in stats if i < len(s["accepted_per_position_counts"]))
        for i in range(width)
    ]
    pos_d = [
        sum(s["drafted_per_position_counts"][i] for s in stats if i < len(s["drafted_per_position_counts"]))
        for i in range(width)
    ]
    return {
        "drafted": drafted,
        "accepted": accepted,
        "drafts": drafts,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "alpha": accepted / (accepted + rejections) if accepted + rejections else 0.0,
        "mean_accepted_length": 1 + accepted / drafts if drafts else 1.0,
        "gamma_mean": drafted / drafts if drafts else 0.0,
        "acceptance_per_position": [a / d if d else 0.0 for a, d in zip(pos_a, pos_d)],
    }


def predicted_speedup(alpha: float, gamma: float, cost_ratio: float) -> float:
    """The theory's speedup E(alpha, gamma) / (1 + gamma c) at the (rounded) mean gamma."""
    return expected_speedup(min(max(alpha, 0.0), 1.0), max(1, round(gamma)), cost_ratio)
