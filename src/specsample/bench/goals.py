"""Issue 7's goal check as tables: gamma auto against the best fixed gamma and target-only, per category."""

from __future__ import annotations

import re

GOAL = 0.97  # within 3%
DEFAULT = "hybrid auto"  # the system `specsample generate` runs with no options (since session 24)


def fixed_gammas(table: dict[str, dict[str, float]]) -> list[str]:
    """The fixed-gamma systems in a table ("gamma=1", ...), by gamma."""
    return sorted((n for n in table if re.fullmatch(r"gamma=\d+", n)), key=lambda n: int(n.split("=")[1]))


def _check(table: dict[str, dict[str, float]]) -> None:
    missing = [n for n in ("target-only", "gamma=auto") if n not in table] + ([] if fixed_gammas(table) else ["a fixed gamma"])
    if missing:
        raise ValueError(f"the goal check needs target-only, gamma=auto and at least one fixed gamma; missing {missing}")


def passes(table: dict[str, dict[str, float]], name: str, cats: list[str]) -> tuple[int, int]:
    """Categories where `name` is within 3% of the best fixed gamma, and not over 3% slower than target-only."""
    _check(table)
    best = {c: max(table[g][c] for g in fixed_gammas(table)) for c in cats}
    return (sum(table[name][c] >= GOAL * best[c] for c in cats),
            sum(table[name][c] >= GOAL * table["target-only"][c] for c in cats))


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
    per_cat = cats[:-1]
    lines += ["", f"Every policy against the same two criteria ({len(per_cat)} categories):", "",
              "| system | within 3% of the best fixed gamma | not over 3% slower than target-only | overall / target-only |",
              "|---|---|---|---|"]
    for name in table:
        if name == "target-only":
            continue
        within, not_slower = passes(table, name, per_cat)
        lines.append(f"| {name} | {within} | {not_slower} | {table[name]['overall'] / base['overall']:.3f} |")
    return lines + [""]
