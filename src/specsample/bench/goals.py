"""Issue 7's goal check as tables: gamma auto against the best fixed gamma and target-only, per category."""

from __future__ import annotations

import random
import re
from collections import defaultdict

GOAL = 0.97  # within 3%
DEFAULT = "hybrid auto"  # the system `specsample generate` runs with no options (since session 24)
PLACEBO = "best fixed gamma again"  # per category, the copy of whichever fixed gamma measured best there


def again(name: str) -> str:
    """The name of `name` decoded a second time as a system of its own (a placebo for gamma auto)."""
    return f"{name} again"


def placebo_speeds(table: dict[str, dict[str, float]], cats: list[str]) -> dict[str, float] | None:
    """Per category, the speed of the copy of the best fixed gamma there (None unless every fixed gamma has
    a copy). A system that is in truth the best fixed gamma still measures below the best of several noisy
    fixed gammas; how far this copy falls short is the bar's own bias and noise."""
    fixed = fixed_gammas(table)
    if not all(again(g) in table for g in fixed):
        return None
    return {c: table[again(max(fixed, key=lambda g: table[g][c]))][c] for c in cats}


def fixed_gammas(table: dict[str, dict[str, float]]) -> list[str]:
    """The fixed-gamma systems in a table ("gamma=1", ...), by gamma."""
    return sorted((n for n in table if re.fullmatch(r"gamma=\d+", n)), key=lambda n: int(n.split("=")[1]))


def _check(table: dict[str, dict[str, float]]) -> None:
    missing = [n for n in ("target-only", "gamma=auto") if n not in table] + ([] if fixed_gammas(table) else ["a fixed gamma"])
    if missing:
        raise ValueError(f"the goal check needs target-only, gamma=auto and at least one fixed gamma; missing {missing}")


def passes(table: dict[str, dict[str, float]], name: str, cats: list[str],
           speeds: dict[str, float] | None = None) -> tuple[int, int]:
    """Categories where `name` (or the given per-category `speeds`) is within 3% of the best fixed gamma, and
    not over 3% slower than target-only."""
    _check(table)
    speeds = table[name] if speeds is None else speeds
    best = {c: max(table[g][c] for g in fixed_gammas(table)) for c in cats}
    return (sum(speeds[c] >= GOAL * best[c] for c in cats),
            sum(speeds[c] >= GOAL * table["target-only"][c] for c in cats))


def _goal_row(category: str, speed: float, best_fixed: float, target_only: float) -> str:
    """A category's ratios to the best fixed gamma and to target-only, and whether each meets the goal."""
    return (f"| {category} | {speed / best_fixed:.3f} | {speed / target_only:.3f} | "
            f"{'yes' if speed >= GOAL * best_fixed else 'no'} | {'yes' if speed >= GOAL * target_only else 'no'} |")


def goal_tables(table: dict[str, dict[str, float]]) -> list[str]:
    """Markdown: tokens/s per system and category, gamma auto's ratios per category, and every policy
    against the same two criteria (the fixed gammas too: how often they miss shows the noise). The best
    fixed gamma is the best of those in the table (a run may time only some)."""
    _check(table)
    fixed = fixed_gammas(table)
    cats = sorted(c for c in table["target-only"] if c != "overall") + ["overall"]
    lines = ["| system | " + " | ".join(cats) + " |", "|---|" + "---|" * len(cats)]
    for name in table:
        lines.append(f"| {name} | " + " | ".join(f"{table[name][c]:.1f}" for c in cats) + " |")
    best_fixed = {c: max(table[g][c] for g in fixed) for c in cats}
    auto = {c: table["gamma=auto"][c] for c in cats}
    fresh = {c: table["gamma=auto fresh"][c] for c in cats} if "gamma=auto fresh" in table else None
    base = {c: table["target-only"][c] for c in cats}
    if len(fixed) < 8:
        lines += ["", "Fixed gammas in this run: " + ", ".join(g.split("=")[1] for g in fixed)
                  + " (the best fixed gamma below is the best of these)."]
    header = "| category | auto / best fixed gamma | auto / target-only | within 3% of best | never 3% slower |"
    lines += ["", header + (" fresh auto / best fixed | fresh auto / target-only |" if fresh else ""),
              "|---|---|---|---|---|" + ("---|---|" if fresh else "")]
    for c in cats:
        row = _goal_row(c, auto[c], best_fixed[c], base[c])
        lines.append(row + (f" {fresh[c] / best_fixed[c]:.3f} | {fresh[c] / base[c]:.3f} |" if fresh else ""))
    if DEFAULT in table:  # what a user gets without options, against the same bars
        lines += ["", f"`{DEFAULT}` (the default drafter, prompt lookup and the draft model, with gamma auto):", "",
                  "| category | / best fixed gamma | / target-only | within 3% of best | never 3% slower |",
                  "|---|---|---|---|---|"]
        lines += [_goal_row(c, table[DEFAULT][c], best_fixed[c], base[c]) for c in cats]
    placebo = placebo_speeds(table, cats)
    if placebo:  # the bar's own noise: a copy of the best fixed gamma against the bar
        lines += ["", f"`{PLACEBO}` (a placebo: per category, the copy of the fixed gamma that measured best, "
                  "decoded as a system of its own):", "",
                  "| category | / best fixed gamma | / target-only | within 3% of best | never 3% slower |",
                  "|---|---|---|---|---|"]
        lines += [_goal_row(c, placebo[c], best_fixed[c], base[c]) for c in cats]
    per_cat = cats[:-1]
    lines += ["", f"Every policy against the same two criteria ({len(per_cat)} categories):", "",
              "| system | within 3% of the best fixed gamma | not over 3% slower than target-only | overall / target-only |",
              "|---|---|---|---|"]
    for name in table:
        if name == "target-only":
            continue
        within, not_slower = passes(table, name, per_cat)
        lines.append(f"| {name} | {within} | {not_slower} | {table[name]['overall'] / base['overall']:.3f} |")
    if placebo:
        within, not_slower = passes(table, PLACEBO, per_cat, placebo)
        lines.append(f"| {PLACEBO} | {within} | {not_slower} | {placebo['overall'] / base['overall']:.3f} |")
    return lines + [""]


Reply = tuple[int, str, int, float]  # (reply key, category, tokens, seconds); key % prompts names the prompt


def goal_intervals(replies: dict[str, list[Reply]], prompts: int, names: tuple[str, ...] = (DEFAULT, "gamma=auto", PLACEBO),
                   level: float = 0.9, resamples: int = 2000, seed: int = 0) -> dict[str, dict[str, list[float]]]:
    """Paired bootstrap intervals of the goal ratios, per category: resample a category's prompts (with all
    their sampled replies, every system's on the same prompts) and recompute, in each resample, each of
    `names` over the best fixed gamma *of that resample* (so picking the best of several noisy fixed gammas
    is part of the interval) and over target-only. `PLACEBO` among `names` is the copy of that best fixed
    gamma, where the runs decoded every fixed gamma twice (`again`). Returns {name: {category: [/ best, lo, hi, / target-only,
    lo, hi]}}, each ratio on all replies then its interval; "overall" resamples every category at once."""
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if prompts < 1:
        raise ValueError(f"prompts must be >= 1, got {prompts}")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    _check({name: {} for name in replies})
    fixed = fixed_gammas({name: {} for name in replies})
    copies = [again(g) for g in fixed] if PLACEBO in names and all(again(g) in replies for g in fixed) else []
    names = tuple(n for n in names if n in replies or (n == PLACEBO and copies))
    systems = ["target-only", *fixed, *(n for n in names if n != PLACEBO), *copies]
    by_key = {name: {key: (category, tokens, seconds) for key, category, tokens, seconds in replies[name]}
              for name in systems}
    keys = sorted(by_key["target-only"])
    for name in systems:
        if sorted(by_key[name]) != keys:
            raise ValueError(f"{name} did not decode the same replies as target-only: the bootstrap pairs them")
    clusters: dict[str, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))  # category -> prompt -> keys
    for key in keys:
        clusters[by_key["target-only"][key][0]][key % prompts].append(key)
    cats = sorted(clusters)

    def ratios(chosen: dict[str, list[list[int]]]) -> dict[str, dict[str, tuple[float, float]]]:
        """Each name's (/ best fixed gamma, / target-only) per category over the chosen prompts' replies."""
        sums = {name: defaultdict(lambda: [0, 0.0]) for name in systems}  # category -> [tokens, seconds]
        for cat, groups in chosen.items():
            for key in (k for group in groups for k in group):
                for name in systems:
                    _, tokens, seconds = by_key[name][key]
                    for where in (cat, "overall"):
                        sums[name][where][0] += tokens
                        sums[name][where][1] += seconds
        found: dict[str, dict[str, tuple[float, float]]] = {name: {} for name in names}
        for cat in [*cats, "overall"]:
            speed = {name: sums[name][cat][0] / sums[name][cat][1] for name in systems}
            best = max(speed[g] for g in fixed)
            if copies:  # the copy of this resample's best fixed gamma
                speed[PLACEBO] = speed[again(max(fixed, key=lambda g: speed[g]))]
            for name in names:
                found[name][cat] = (speed[name] / best, speed[name] / speed["target-only"])
        return found

    rng = random.Random(seed)
    groups = {cat: list(clusters[cat].values()) for cat in cats}
    draws = [ratios({cat: [rng.choice(g) for _ in g] for cat, g in groups.items()}) for _ in range(resamples)]
    point = ratios(groups)
    low, high = int((1 - level) / 2 * resamples), min(resamples - 1, int((1 + level) / 2 * resamples))
    out: dict[str, dict[str, list[float]]] = {name: {} for name in names}
    for name in names:
        for cat in [*cats, "overall"]:
            to_best = sorted(d[name][cat][0] for d in draws)
            to_base = sorted(d[name][cat][1] for d in draws)
            out[name][cat] = [point[name][cat][0], to_best[low], to_best[high],
                              point[name][cat][1], to_base[low], to_base[high]]
    return out


def interval_table(intervals: dict[str, dict[str, list[float]]], level: float = 0.9,
                   unit: str = "prompts") -> list[str]:
    """Markdown: each system's ratios and bootstrap intervals per category, and whether each goal is out of
    reach of the noise (the whole interval below 0.97), met beyond it (all at or above), or within noise."""
    def cell(point: float, low: float, high: float) -> str:
        call = "met" if low >= GOAL else "missed" if high < GOAL else "within noise"
        return f"{point:.3f} ({low:.3f} to {high:.3f}) | {call}"

    lines = []
    for name, by_cat in intervals.items():
        cats = sorted(c for c in by_cat if c != "overall") + ["overall"]
        lines += [f"`{name}` with {level:.0%} bootstrap intervals (`goal_intervals`: a category's {unit} resampled, "
                  "every system paired on them, the best fixed gamma picked afresh in each resample):", "",
                  "| category | / best fixed gamma | within 3% of best | / target-only | never 3% slower |",
                  "|---|---|---|---|---|"]
        lines += [f"| {c} | {cell(*by_cat[c][:3])} | {cell(*by_cat[c][3:])} |" for c in cats]
        lines += [""]
    return lines
