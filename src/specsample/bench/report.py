"""results.md (tables) and PNG plots from a benchmark's results, complete or not: each suite's section summarises
what it measured so far. Speedups are paired bootstrap ratios over prompts (90% intervals)."""

from __future__ import annotations

import re
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specsample.bench.stats import Interval, acceptance_summary, bootstrap, predicted_speedup

LEVEL = 0.9
GOAL = 0.97  # gamma auto within 3% of the best fixed gamma, and never more than 3% slower than target-only
BASELINE = "target-only"


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _interval(cell: Interval | None, digits: int = 2) -> str:
    if cell is None:
        return "–"
    point, low, high = cell
    if low is None:  # one prompt: no interval
        return f"{point:.{digits}f}"
    return f"{point:.{digits}f} ({low:.{digits}f}–{high:.{digits}f})"


def _verdict(cell: Interval) -> str:
    """Whether a ratio's interval clears the goal (met), misses it entirely (missed), or straddles it."""
    _, low, high = cell
    if low is None or high is None:
        return "one prompt: no interval"
    return "met" if low >= GOAL else "missed" if high < GOAL else "within noise"


def _point(cell: Interval) -> float:
    """An interval's point value (always there)."""
    point = cell[0]
    assert point is not None
    return point


def _errors(cell: Interval) -> tuple[float, float]:
    """Distances from an interval's point down to its low end and up to its high end (0 where it has none)."""
    point, low, high = _point(cell), cell[1], cell[2]
    return (point - low, high - point) if low is not None and high is not None else (0.0, 0.0)


def _prompt_rows(rows: list[dict[str, Any]]) -> list[tuple[str, dict[str, tuple[int, float]]]]:
    return [
        (row["category"], {name: (r["tokens"], r["seconds"]) for name, r in row["systems"].items()}) for row in rows
    ]


def _speedups(rows: list[dict[str, Any]], systems: list[str]) -> dict[str, dict[str, Interval]]:
    """Each system's speed over target-only, per category and overall, with its interval, paired on the prompts it
    ran: all of them, or, for a peer that failed on some, the others (no cells where it ran on none)."""

    def ratios(names: list[str]) -> Callable[[dict[str, float]], dict[str, float]]:
        def statistic(speeds: dict[str, float]) -> dict[str, float]:
            base = speeds.get(BASELINE, 0.0)
            return {name: speeds.get(name, 0.0) / base if base else 0.0 for name in names}

        return statistic

    complete = [name for name in systems if all(name in row["systems"] for row in rows)]
    out = bootstrap(_prompt_rows(rows), ratios(complete), LEVEL)
    for name in systems:
        if name not in complete:
            ran = [row for row in rows if name in row["systems"]]
            out[name] = bootstrap(_prompt_rows(ran), ratios([name]), LEVEL)[name] if ran else {}
    return out


def _ran(rows: list[dict[str, Any]], name: str) -> str:
    """A system's name, and on how many of the prompts it ran where it failed on some."""
    count = sum(name in row["systems"] for row in rows)
    return name if count == len(rows) else f"{name} (ran {count} of {len(rows)})"


def _failure_lines(rows: list[dict[str, Any]]) -> list[str]:
    """A table of the runs that failed (a peer that crashed or raised on a prompt), with their causes."""
    failed = [(name, row, why) for row in rows for name, why in row.get("failed", {}).items()]
    if not failed:
        return []
    lines = [
        "",
        f"Failed runs ({len(failed)}; each is left out of its system's figures, whose speedups pair the prompts it "
        "ran):",
        "",
        "| system | prompt | category | cause |",
        "|---|---|---|---|",
    ]
    return lines + [
        f"| {name} | {row['prompt']} | {row['category']} | {why.replace('|', '/')} |" for name, row, why in failed
    ]


def _pooled(rows: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """A system's tokens/s, latencies and acceptance over rows."""
    records = [row["systems"][name] for row in rows if name in row["systems"]]
    tokens, seconds = sum(r["tokens"] for r in records), sum(r["seconds"] for r in records)
    ttfts = [r["ttft"] for r in records if r["ttft"] is not None]
    tpots = [r["tpot_p50"] for r in records if r["tpot_p50"] is not None]
    out: dict[str, Any] = {
        "tokens_per_s": tokens / seconds if seconds else (None if not records else 0.0),
        "ms_per_token": 1000 * seconds / tokens if tokens else 0.0,
        "ttft_ms": 1000 * statistics.median(ttfts) if ttfts else None,
        "tpot_ms": 1000 * statistics.median(tpots) if tpots else None,
    }
    rounds = sum(r["stats"].get("rounds", 0) for r in records)
    out["tokens_per_forward"] = tokens / rounds if rounds else None  # a round is one target forward
    stats = [r["stats"] for r in records if r["stats"].get("drafted")]
    if stats:
        out.update(acceptance_summary(stats))
    return out


def _tree_use(rows: list[dict[str, Any]], name: str) -> str | None:
    """Share of a system's rounds that drafted trees, and the budgets drafted (None: no tree round)."""
    budgets: dict[str, int] = {}
    rounds = 0
    for row in rows:
        stats = row["systems"].get(name, {}).get("stats", {})
        rounds += stats.get("rounds", 0)
        for nodes, count in stats.get("tree_budgets", {}).items():
            budgets[nodes] = budgets.get(nodes, 0) + count
    trees = sum(budgets.values())
    if not trees:
        return None
    drafted = ", ".join(f"{n} nodes {c / trees:.0%}" for n, c in sorted(budgets.items(), key=lambda x: -x[1]))
    return f"{trees / rounds:.0%} of rounds ({drafted})"


def _cost_ratio(rows: list[dict[str, Any]], name: str) -> float | None:
    """c from whole rounds: what each drafted position adds to a round, over a target-only round's time."""

    def per_round(system: str) -> tuple[float, int, float]:
        stats = [row["systems"][system]["stats"] for row in rows]
        rounds = sum(s.get("rounds", 0) for s in stats)
        seconds = sum(
            s.get("draft_seconds", 0) + s.get("target_seconds", 0) + s.get("verify_seconds", 0) for s in stats
        )
        gamma = sum(s.get("gamma_mean", 0) * s.get("rounds", 0) for s in stats) / rounds if rounds else 0.0
        return (seconds / rounds if rounds else 0.0), rounds, gamma

    plain, _, _ = per_round(BASELINE)
    spec, rounds, gamma = per_round(name)
    gamma = max(1, round(gamma))
    return max(0.0, (spec / plain - 1) / gamma) if plain and spec and rounds else None


def _compile_events(rows: list[dict[str, Any]], systems: list[str]) -> list[str]:
    """A line on what compiled models did past start-up, per system: graphs compiled (each stalls its round for
    seconds to minutes) and forwards run eagerly."""
    counted = {name: [row["systems"][name]["stats"] for row in rows if name in row["systems"]] for name in systems}
    parts = [
        f"{name} {sum(s.get('recompiles', 0) for s in runs)} and {sum(s.get('eager_fallbacks', 0) for s in runs)}"
        for name, runs in counted.items()
    ]
    return ["", "Graphs compiled after start-up and forwards run eagerly by compiled models: " + "; ".join(parts) + "."]


def compare_section(store: dict[str, Any]) -> list[str]:
    systems = store.get("systems", [])
    lines = ["## Speed and acceptance (baseline: target-only on our runtime)", ""]
    for temperature, rows in store.get("runs", {}).items():
        if not rows:
            continue
        speed = _speedups(rows, systems)
        lines += [
            f"### Temperature {temperature} ({len(rows)} prompts)",
            "",
            "| system | tokens/s | speedup (90% interval) | tokens/forward | acceptance | accepted/round | "
            "TTFT p50 ms | TPOT p50 ms |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name in systems:
            pooled = _pooled(rows, name)
            accepted = pooled["mean_accepted_length"] - 1 if "mean_accepted_length" in pooled else None
            lines.append(
                f"| {_ran(rows, name)} | {_fmt(pooled['tokens_per_s'], 1)} | {_interval(speed[name].get('overall'))} "
                f"| {_fmt(pooled['tokens_per_forward'])} | {_fmt(pooled.get('acceptance_rate'))} | "
                f"{_fmt(accepted)} | {_fmt(pooled['ttft_ms'], 0)} | {_fmt(pooled['tpot_ms'], 1)} |"
            )
        if store.get("compiled"):
            lines += _compile_events(rows, systems)
        cats = sorted(c for c in speed[BASELINE] if c != "overall")
        others = [n for n in systems if n != BASELINE]
        lines += [
            "",
            "Speedup by category:",
            "",
            "| category | " + " | ".join(others) + " |",
            "|---" * (len(others) + 1) + "|",
        ]
        lines += [f"| {c} | " + " | ".join(_interval(speed[n].get(c)) for n in others) + " |" for c in cats]
        for name in others:
            by_category = {c: _tree_use([r for r in rows if r["category"] == c], name) for c in cats}
            if any(by_category.values()):
                lines += [
                    "",
                    f"Trees drafted by `{name}`, per category:",
                    "",
                    "| category | tree rounds |",
                    "|---|---|",
                ]
                lines += [f"| {c} | {use or 'none'} |" for c, use in by_category.items()]
        lines += _ratio_lines(
            rows,
            [n for n in others if n.startswith("specsample ")],
            [n for n in COMPARE_REFERENCES if n in systems] + list(store.get("other_drafts", [])),
            cats,
        )
        lines += _failure_lines(rows)
        for name in others:
            per_pos = _pooled(rows, name).get("acceptance_per_position")
            if per_pos:
                lines += ["", f"Acceptance by draft position ({name}): " + ", ".join(f"{a:.2f}" for a in per_pos)]
        lines.append("")
    return lines


COMPARE_REFERENCES = ("hybrid, n-gram lookup gamma=auto", "llama.cpp", "llama.cpp-lookup")


def _ratio_lines(rows: list[dict[str, Any]], ours: list[str], references: list[str], cats: list[str]) -> list[str]:
    """A table of each of `ours` over each reference system, overall and per category (paired bootstrap over the
    prompts the reference ran)."""
    if not ours or not references:
        return []

    def ratios(reference: str) -> Callable[[dict[str, float]], dict[str, float]]:
        def statistic(speeds: dict[str, float]) -> dict[str, float]:
            return {f"{a} / {reference}": speeds[a] / speeds[reference] if speeds.get(reference) else 0.0 for a in ours}

        return statistic

    between: dict[str, dict[str, Interval]] = {}
    for reference in references:
        ran = [row for row in rows if reference in row["systems"]]
        if ran:
            between.update(bootstrap(_prompt_rows(ran), ratios(reference), LEVEL))
    if not between:
        return []
    lines = ["", "Speed ratios:", "", "| ratio | overall | " + " | ".join(cats) + " |", "|---" * (len(cats) + 2) + "|"]
    return lines + [
        f"| {key} | {_interval(cells.get('overall'))} | " + " | ".join(_interval(cells.get(c)) for c in cats) + " |"
        for key, cells in between.items()
    ]


def gamma_section(store: dict[str, Any]) -> list[str]:
    rows = store.get("rows", [])
    if not rows:
        return []
    systems = store["systems"]
    speed = _speedups(rows, systems)
    lines = [
        "## Gamma sweep",
        "",
        f"Temperature {store['temperature']}, {len(rows)} prompts; the prediction is the theory's "
        "E(alpha, gamma) / (1 + gamma c) at the alpha and c measured for that gamma.",
        "",
        "| gamma | speedup (90% interval) | ms/token | alpha | c | predicted |",
        "|---|---|---|---|---|---|",
    ]
    for gamma, name in zip(store["gammas"], systems[1:]):
        pooled, cost = _pooled(rows, name), _cost_ratio(rows, name)
        alpha = pooled.get("alpha")
        predicted = (
            predicted_speedup(alpha, pooled["gamma_mean"], cost) if alpha is not None and cost is not None else None
        )
        lines.append(
            f"| {gamma} | {_interval(speed[name]['overall'])} | {pooled['ms_per_token']:.1f} | "
            f"{_fmt(alpha)} | {_fmt(cost, 3)} | {_fmt(predicted)} |"
        )
    return lines + [""]


def batch_section(store: dict[str, Any]) -> list[str]:
    rows = store.get("rows", [])
    if not rows:
        return []
    lines = [
        "## Batch size",
        "",
        f"Temperature {store['temperature']}, gamma {store['gamma']}.",
        "",
        "| batch | target-only tokens/s | speculative tokens/s | speedup |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {b['batch_size']} | {b['target_only_tokens_per_s']:.1f} | {b['speculative_tokens_per_s']:.1f} | "
        f"{b['speedup']:.2f}x |"
        for b in rows
    ]
    return lines + [""]


def lossless_section(store: dict[str, Any]) -> list[str]:
    tests = store.get("tests", [])
    if not tests:
        return []
    lines = [
        "## Losslessness (two-sample chi-square test, speculative against target-only, temperature 1)",
        "",
        "| prompt | category | samples each | tokens | cells | chi2 | dof | p-value |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {t['prompt']} | {t['category']} | {t['samples']} | {t['tokens']} | {t['categories']} | "
        f"{t['statistic']:.1f} | {t['dof']} | {t['p_value']:.3f} |"
        for t in tests
    ]
    return lines + [""]


def goal_intervals(rows: list[dict[str, Any]], systems: list[str]) -> dict[str, dict[str, Interval]]:
    """Per category, each gamma auto policy's speed over the best fixed gamma (picked afresh in every resample, so
    picking the best of several noisy ones is part of the interval) and over target-only."""
    fixed = [n for n in systems if re.fullmatch(r"gamma=\d+", n)]
    policies = [n for n in systems if n != BASELINE and n not in fixed]

    def ratios(speeds: dict[str, float]) -> dict[str, float]:
        best = max(speeds[g] for g in fixed)
        out = {}
        for name in policies:
            out[f"{name} / best fixed"] = speeds[name] / best if best else 0.0
            out[f"{name} / target-only"] = speeds[name] / speeds[BASELINE] if speeds[BASELINE] else 0.0
        return out

    return bootstrap(_prompt_rows(rows), ratios, LEVEL) if fixed and policies else {}


def adaptive_section(store: dict[str, Any]) -> list[str]:
    systems = store.get("systems", [])
    lines = [
        "## Adaptive gamma",
        "",
        "Every policy decodes every prompt, taking turns round by round (turns shuffled each round). Goals per "
        "category: gamma auto within 3% of the best fixed gamma, and never more than 3% slower than "
        "target-only; 'met' when the whole 90% interval clears 0.97, 'missed' when it lies below, else "
        "'within noise'.",
        "",
    ]
    for temperature, rows in store.get("runs", {}).items():
        if not rows:
            continue
        speed = _speedups(rows, systems)
        cats = sorted(c for c in speed[BASELINE] if c != "overall") + ["overall"]
        others = [n for n in systems if n != BASELINE]
        lines += [
            f"### Temperature {temperature} ({len(rows)} prompts)",
            "",
            "Speed over target-only:",
            "",
            "| category | " + " | ".join(others) + " |",
            "|---" * (len(others) + 1) + "|",
        ]
        lines += [f"| {c} | " + " | ".join(f"{speed[n][c][0]:.3f}" for n in others) + " |" for c in cats]
        goals = goal_intervals(rows, systems)
        policies = [n for n in systems if f"{n} / best fixed" in goals]
        for name in policies:
            to_best, to_base = goals[f"{name} / best fixed"], goals[f"{name} / target-only"]
            lines += [
                "",
                f"`{name}`:",
                "",
                "| category | / best fixed gamma | within 3% of best | / target-only | not 3% slower |",
                "|---|---|---|---|---|",
            ]
            lines += [
                f"| {c} | {_interval(to_best[c], 3)} | {_verdict(to_best[c])} | {_interval(to_base[c], 3)} | "
                f"{_verdict(to_base[c])} |"
                for c in cats
            ]
        lines.append("")
    return lines


def structured_section(store: dict[str, Any]) -> list[str]:
    systems = store.get("systems", [])
    lines = [
        "## Structured output",
        "",
        "Each system with a JSON-schema grammar and without, on prompts asking for a JSON record; speed is "
        "pooled tokens/s, the ratio a paired bootstrap over prompts (90% interval).",
        "",
    ]
    for temperature, rows in store.get("runs", {}).items():
        if not rows:
            continue
        pairs = [(n, f"{n} json_schema") for n in systems if f"{n} json_schema" in systems]

        def ratios(speeds: dict[str, float]) -> dict[str, float]:
            return {free: speeds[constrained] / speeds[free] if speeds[free] else 0.0 for free, constrained in pairs}

        kept = bootstrap(_prompt_rows(rows), ratios, LEVEL)
        lines += [
            f"### Temperature {temperature} ({len(rows)} prompts)",
            "",
            "| system | tokens/s free | tokens/s json_schema | kept | acceptance free | acceptance json_schema |",
            "|---|---|---|---|---|---|",
        ]
        for free, constrained in pairs:
            a, b = _pooled(rows, free), _pooled(rows, constrained)
            lines.append(
                f"| {free} | {a['tokens_per_s']:.1f} | {b['tokens_per_s']:.1f} | "
                f"{_interval(kept[free]['overall'], 3)} | {_fmt(a.get('acceptance_rate'))} | "
                f"{_fmt(b.get('acceptance_rate'))} |"
            )
        lines.append("")
    return lines


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{1000 * seconds:.0f}"


def prefix_section(store: dict[str, Any]) -> list[str]:
    shared = store.get("shared_system", {})
    runs = shared.get("runs", {})
    if not runs.get("cache on") or not runs.get("cache off"):
        return []
    pooled = {m: [t for run in r for t in run["ttft_seconds"]] for m, r in runs.items()}
    tpots = {m: [t for run in r for t in run["tpot_seconds"]] for m, r in runs.items()}
    lines = [
        "## Prefix cache",
        "",
        f"{store['clients']} clients send one system prompt ({shared['prompt_tokens']} tokens with the question) with "
        f"different questions at once; {len(runs['cache on'])} runs each with the prefix cache on and off "
        "(`--prefix-cache-tokens 0`), interleaved. TTFT and TPOT pool every request of the runs.",
        "",
        "| prefix cache | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | output tokens/s (median) | "
        "prompt tokens prefilled per run | hit rate |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode, rs in runs.items():
        hits = sum(r["prefix_hits"] for r in rs) / (store["clients"] * len(rs))
        lines.append(
            f"| {mode.split()[1]} | {_ms(_pct(pooled[mode], 50))} | {_ms(_pct(pooled[mode], 99))} | "
            f"{_ms(_pct(tpots[mode], 50))} | {_ms(_pct(tpots[mode], 99))} | "
            f"{statistics.median(r['tokens_per_second'] for r in rs):.1f} | "
            f"{statistics.median(r['prefilled_tokens'] for r in rs):.0f} | {hits:.2f} |"
        )
    if "ttft_speedup" in shared:
        low, mid, high = shared["ttft_speedup"]
        g_low, g_mid, g_high = shared["throughput_gain"]
        lines += [
            "",
            f"With the cache: TTFT p50 {mid:.1f}x better (runs {low:.1f}x–{high:.1f}x), output tokens/s "
            f"{g_mid:.2f}x (runs {g_low:.2f}x–{g_high:.2f}x).",
        ]
    samples = store.get("samples", {}).get("runs", {})
    if samples:
        lines += [
            "",
            f"n = {store['samples']['n']} samples of one prompt ({store['samples']['prompt_tokens']} tokens), arriving "
            "together:",
            "",
            "| prefix cache | TTFT p50 ms | prompt tokens prefilled | output tokens/s |",
            "|---|---|---|---|",
        ]
        for mode, run in samples.items():
            lines.append(
                f"| {mode.split()[1]} | {_ms(_pct(run['ttft_seconds'], 50))} | {run['prefilled_tokens']} | "
                f"{run['tokens_per_second']:.1f} |"
            )
    chat = store.get("chat", {}).get("runs", {})
    if chat:
        lines += [
            "",
            f"A {store['chat']['turns']}-turn chat, each turn the conversation so far and a new question:",
            "",
            "| prefix cache | prompt tokens prefilled | conversation's final length | ratio | last turn's TTFT ms |",
            "|---|---|---|---|---|",
        ]
        for mode, run in chat.items():
            lines.append(
                f"| {mode.split()[1]} | {run['prefilled_tokens']} | {run['final_tokens']} | "
                f"{run['prefilled_tokens'] / run['final_tokens']:.2f} | {_ms(run['ttft_seconds'][-1])} |"
            )
    long = store.get("long_prompt", {}).get("runs", {})
    if long:
        lines += [
            "",
            f"{store['long_prompt']['streams']} clients sending question after question, then one "
            f"{store['long_prompt']['prompt_tokens']}-token prompt arriving: the clients' time per output token (each "
            "round's time over the tokens a client's request emitted in it, its first token left out) before the "
            "prompt arrives and while it is prefilled, prefilled in chunks of at most "
            f"{store['long_prompt']['chunk_tokens']} tokens per round"
            + (
                f" taking about {store['long_prompt']['time_ratio']}x the clients' decoding time"
                if store["long_prompt"].get("time_ratio")
                else ""
            )
            + " (the server's default) or whole.",
            "",
            "| prefill | clients' TPOT p99 before ms | while it is prefilled ms | ratio | long prompt's TTFT ms |",
            "|---|---|---|---|---|",
        ]
        for label, run in long.items():
            idle, busy = _pct(run["tpot_seconds"]["idle"], 99), _pct(run["tpot_seconds"]["long prompt"], 99)
            ratio = f"{busy / idle:.2f}" if idle and busy else "–"
            lines.append(f"| {label} | {_ms(idle)} | {_ms(busy)} | {ratio} | {_ms(run['long_prompt_ttft_seconds'])} |")
    return lines + [""]


def replicas_section(store: dict[str, Any]) -> list[str]:
    """Per server (one replica, N replicas): a row per replica and one overall, with the requests it answered, its
    prefix-cache hits and hit rate, the prompt tokens it reused, and its requests' TTFT p50."""
    runs = store.get("runs", {})
    if not runs:
        return []
    lines = [
        "## Replicas",
        "",
        f"{store['clients']} clients send one system prompt (up to {store['system_tokens']} tokens with the question) "
        "with "
        f"different questions at once, {store['waves']} waves, through `specsample serve --replicas N` on Ray Serve "
        "(completions routed by prefix affinity); each replica's prefix-cache counters from the aggregated /metrics. "
        "Hit rate: requests that started from a cached prefix over requests admitted; tokens reused: prompt tokens "
        "copied from a cached prefix over prompt tokens admitted.",
        "",
        "| replicas | replica | requests | prefix hits | hit rate | tokens reused | TTFT p50 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for count, run in runs.items():
        rows = dict(run.get("replicas", {}))
        if "overall" in run:
            rows["all"] = run["overall"]
        for name, row in rows.items():
            ttfts = [r["ttft"] for r in run.get("requests", []) if name in ("all", r["replica"])]
            median = _pct(ttfts, 50)
            lines.append(
                f"| {count} | {name} | {row['requests']:.0f} | {row['hits']:.0f} | "
                f"{_fmt(row['hits'] / row['requests'] if row['requests'] else None)} | "
                f"{_fmt(row['reused_tokens'] / row['prompt_tokens'] if row['prompt_tokens'] else None)} | "
                f"{_ms(median)} |"
            )
    lines.append("")
    if "hit_rate_ratio" in store:
        lines += [
            f"Hit rate with {max(runs, key=int)} replicas over one replica's: {store['hit_rate_ratio']:.2f}x.",
            "",
        ]
    return lines


def _pct(values: list[float], q: float) -> float | None:
    """The q-th percentile (nearest rank) of `values`; None for none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


REPEAT_REFERENCES = ("hybrid, n-gram lookup", "n-gram lookup", "llama.cpp-lookup", "llama.cpp")


def _draft_ms(rows: list[dict[str, Any]], name: str) -> float | None:
    """A system's drafting time per round (looking up, proposing, the draft model's steps), in ms."""
    stats = [row["systems"][name].get("stats", {}) for row in rows if name in row["systems"]]
    rounds = sum(s.get("rounds", 0) for s in stats)
    return 1000 * sum(s.get("draft_seconds", 0.0) for s in stats) / rounds if rounds else None


def repeat_section(store: dict[str, Any]) -> list[str]:
    systems = store.get("systems", [])
    kinds = ", ".join(f"{n} {k}" for k, n in store.get("kinds", {}).items() if n)
    lines = [
        "## Repetitive traffic",
        "",
        f"A stream of {store.get('requests', 0)} requests ({kinds}), each system on one engine kept for the whole "
        "stream at a temperature (repeat suite, docs/benchmarks.md). Speedups over target-only and ratios between "
        "systems are paired bootstrap ratios over requests (90% intervals).",
        "",
    ]
    for temperature, rows in store.get("runs", {}).items():
        if not rows:
            continue
        names = [n for n in systems if any(n in row["systems"] for row in rows)]
        speed = _speedups(rows, names)
        lines += [
            f"### Temperature {temperature} ({len(rows)} requests)",
            "",
            "| system | tokens/s | speedup (90% interval) | tokens/forward | acceptance | draft ms/round |",
            "|---|---|---|---|---|---|",
        ]
        for name in names:
            pooled = _pooled(rows, name)
            lines.append(
                f"| {_ran(rows, name)} | {_fmt(pooled['tokens_per_s'], 1)} | {_interval(speed[name].get('overall'))} "
                f"| {_fmt(pooled['tokens_per_forward'])} | {_fmt(pooled.get('acceptance_rate'))} | "
                f"{_fmt(_draft_ms(rows, name), 3)} |"
            )
        cats = sorted(c for c in speed[BASELINE] if c != "overall")
        others = [n for n in names if n != BASELINE]
        lines += [
            "",
            "Speedup over target-only by kind of request:",
            "",
            "| kind | " + " | ".join(others) + " |",
            "|---" * (len(others) + 1) + "|",
        ]
        lines += [f"| {c} | " + " | ".join(_interval(speed[n].get(c)) for n in others) + " |" for c in cats]
        references = [r for r in REPEAT_REFERENCES if r in names]
        lines += _ratio_lines(rows, [n for n in others if "suffix (global)" in n], references, cats)
        lines += _failure_lines(rows)
        for name, why in store.get("warm_up_failed", {}).get(temperature, {}).items():
            lines += ["", f"`{name}` failed on its untimed warm-up request: {why}"]
        cache = store.get("suffix_cache", {}).get(temperature, {})
        for name, held in cache.items():
            lines += [
                "",
                f"Shared suffix cache of `{name}` at the end: {held['tokens']} tokens of {held['sequences']} "
                f"requests, {held['bytes'] / 2**20:.1f} MiB (capacity {held['capacity']} tokens, "
                f"{held['evicted']} requests evicted).",
            ]
        lines.append("")
    return lines


def load_section(store: dict[str, Any]) -> list[str]:
    """Per temperature, a row per concurrency: default and plain throughput, their ratio, TPOT and TTFT."""
    mode = "compiled" if store.get("compiled") else "eager"
    lines = [
        "## load",
        "",
        f"`{store.get('server', 'specsample serve')}` ({mode}); per concurrency N, N clients each stream "
        f"{store.get('requests_per_client')} chat completions of exactly {store.get('max_tokens')} tokens "
        '(`ignore_eos`), the server\'s default against `"speculative": false`, '
        f"{store.get('phases_per_mode')} phases each, alternated, every phase on Spec-Bench prompts no earlier phase "
        "sent (so the suffix cache never drafts from an earlier answer to the same prompt)"
        + (
            f"; {store['reused_prompts']} requests reused a prompt once the dataset ran out"
            if store.get("reused_prompts")
            else ""
        )
        + ". Point estimates with 90% bootstrap intervals.",
        "",
    ]

    def cell(summary: dict[str, Any], mode: str, key: str, digits: int = 1) -> str:
        return _interval(summary.get(mode, {}).get(key), digits)

    for temperature, rows in store.get("runs", {}).items():
        lines += [
            f"T = {temperature}:",
            "",
            "| N | default tok/s | plain tok/s | default ÷ plain | TPOT p50 ms (default / plain) "
            "| TPOT p99 ms | TTFT p50 ms | TTFT p99 ms |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for row in rows:
            s = row.get("summary", {})
            lines.append(
                f"| {row['concurrency']} | {cell(s, 'default', 'tokens_per_s')} | {cell(s, 'plain', 'tokens_per_s')} "
                f"| {_interval(s.get('ratio'))} | "
                + " | ".join(
                    f"{cell(s, 'default', key, 0)} / {cell(s, 'plain', key, 0)}"
                    for key in ("tpot_p50_ms", "tpot_p99_ms", "ttft_p50_ms", "ttft_p99_ms")
                )
                + " |"
            )
        lines.append("")
    return lines


SECTIONS = {
    "compare": compare_section,
    "gamma": gamma_section,
    "batch": batch_section,
    "lossless": lossless_section,
    "adaptive": adaptive_section,
    "structured": structured_section,
    "prefix": prefix_section,
    "replicas": replicas_section,
    "repeat": repeat_section,
    "load": load_section,
}


def write_report(results: dict[str, Any], out: Path, plots: bool = False) -> None:
    """results.md (and, with `plots`, the PNG plots) from the results dict alone."""
    cfg, env = results["config"], results.get("environment", {})
    lines = [
        "# specsample bench",
        "",
        f"`{results['command']}`",
        "",
        f"Status: {results['status']}; wall time {results.get('wall_seconds', 0) / 60:.1f} min; commit "
        f"{results.get('commit') or 'unknown'}.",
        "",
    ]
    if env:
        machine = (
            f"{env['cpu']}, {env['cores']} cores, {env['threads']} torch threads, torch {env['torch']}, "
            f"device {env['device']}" + (f" ({env['gpu']})" if env.get("gpu") else "")
        )
        held = {"auto": "the GGUF's quantized", "int8": "int8", "int4": "int4"}.get(env.get("weights"))
        weights = f"{held} weights, " if held else ""
        compiled = ", compiled one-token steps" if cfg["engine"]["compile"] else ""
        lines += [
            f"Target `{env['target']}` ({weights}{env['dtype']} compute{compiled}), draft `{env['draft']}`; "
            f"dataset `{cfg['dataset']}`, {cfg['max_new_tokens']} new tokens. Machine: {machine}.",
            "",
        ]
    for note in results.get("notes", []):
        lines += [f"> note: {note}", ""]
    for name, store in results.get("suites", {}).items():
        if "skipped" in store:
            lines += [f"## {name}", "", f"Skipped ({store['skipped']}).", ""]
            continue
        lines += SECTIONS[name](store)
        if "error" in store:
            lines += [f"> suite {name} failed: {store['error']}", ""]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    if plots:
        _plots(results, out)


def _yerr(cells: list[list[float | None]]) -> list[list[float]]:
    """Error bars from [point, low, high] cells (none where a bound is missing)."""
    return [
        [c[0] - c[1] if c[0] is not None and c[1] is not None else 0.0 for c in cells],
        [c[2] - c[0] if c[0] is not None and c[2] is not None else 0.0 for c in cells],
    ]


def _plots(results: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    suites = results.get("suites", {})
    gamma_rows = suites.get("gamma", {}).get("rows", [])
    if gamma_rows:
        store = suites["gamma"]
        speed = _speedups(gamma_rows, store["systems"])
        points = [(g, speed[n]["overall"]) for g, n in zip(store["gammas"], store["systems"][1:]) if g != "auto"]
        if points:
            fig, ax = plt.subplots(figsize=(6, 4))
            ax.errorbar(
                [g for g, _ in points],
                [_point(c) for _, c in points],
                yerr=[[_errors(c)[0] for _, c in points], [_errors(c)[1] for _, c in points]],
                fmt="o-",
            )
            ax.axhline(1.0, color="black", linewidth=0.5)
            ax.set_xlabel("gamma")
            ax.set_ylabel("speedup over target-only")
            fig.tight_layout()
            fig.savefig(out / "speedup_vs_gamma.png", dpi=110)
            plt.close(fig)
    load_runs = {
        t: [r for r in rows if r.get("summary", {}).get("ratio")]
        for t, rows in suites.get("load", {}).get("runs", {}).items()
    }
    if any(load_runs.values()):
        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
        for temperature, rows in load_runs.items():
            xs = [r["concurrency"] for r in rows]
            for mode, style in (("default", "o-"), ("plain", "s--")):
                cells = [r["summary"][mode]["tokens_per_s"] for r in rows]
                left.errorbar(xs, [c[0] for c in cells], yerr=_yerr(cells), fmt=style, label=f"{mode}, T={temperature}")
                tpot = [r["summary"][mode]["tpot_p50_ms"] for r in rows]
                right.errorbar(xs, [c[0] for c in tpot], yerr=_yerr(tpot), fmt=style, label=f"{mode}, T={temperature}")
        for ax, label in ((left, "output tokens/s"), (right, "TPOT p50 (ms)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent clients")
            ax.set_ylabel(label)
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "load.png", dpi=110)
        plt.close(fig)
    batch_rows = suites.get("batch", {}).get("rows", [])
    if batch_rows:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([b["batch_size"] for b in batch_rows], [b["speedup"] for b in batch_rows], "o-")
        ax.axhline(1.0, color="black", linewidth=0.5)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("speculative / target-only throughput")
        fig.tight_layout()
        fig.savefig(out / "speedup_vs_batch.png", dpi=110)
        plt.close(fig)
    compare = suites.get("compare", {})
    runs = {t: rows for t, rows in compare.get("runs", {}).items() if rows}
    if runs:
        ours = compare["systems"][1]
        fig, ax = plt.subplots(figsize=(8, 4))
        for i, (temperature, rows) in enumerate(runs.items()):
            ours_speed = _speedups(rows, compare["systems"])[ours]
            cats = sorted(c for c in ours_speed if c != "overall") + ["overall"]
            ax.bar(
                [j + 0.8 * i / len(runs) for j in range(len(cats))],
                [_point(ours_speed[c]) for c in cats],
                width=0.8 / len(runs),
                label=f"T={temperature}",
            )
            ax.set_xticks(range(len(cats)))
            ax.set_xticklabels(cats, rotation=45, ha="right")
        ax.axhline(1.0, color="black", linewidth=0.5)
        ax.set_ylabel(f"speedup ({ours})")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "speedup_by_category.png", dpi=110)
        plt.close(fig)
