"""What each kind of round cost in an adaptive benchmark run, in target-only's plain rounds on the same prompt.

For every system and every round kind (drafts in the round, 4 and more pooled; `S` marks a round in which the
draft model scored its backlog, `L` one where gamma auto had the row propose a prompt lookup, recorded since
session 35; a fixed-gamma ngram or hybrid system's rounds are not marked), the median over the prompts of that kind's median round time over
target-only's median round on the prompt; the same for minima. A ratio of medians within each prompt, so
neither context length nor a prompt's slow stretch of the box leaks into it (the systems took turns).

A second table pools every prompt's rounds of a kind and gives their mean and median over target-only's median
round, pooled the same way: the mean shows the stalls a kind's rounds meet, which the medians leave out.

Runs since session 36 also recorded each round's phases (the engine's draft, target and verify-and-commit
times; "draft" also holds the controller's planning and a backlog scoring's draft forward, which the engine runs
before drafting); for them a second table gives each kind's mean and median milliseconds per phase, and the rest
of the round (the controller's bookkeeping of the round's timing and statistics, and the harness). Means, not only medians: a stall that hits a third of a kind's
rounds leaves its median alone and shows in its mean, and the phase it lands in says what stalled.

A last table splits the rounds by whether an earlier round of the run had scored as many tokens at the same context
length, and gives each group's share of rounds over 30 ms above target-only's median round and its mean: a cost
paid once per attention shape (cuDNN's graphs, models/sdpa.py) shows as new >> met.

    python benchmarks/round_kinds.py docs/cuda/adaptive_cuda_t0.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path


def _kind(drafted: int, flags: list) -> str:
    """A stored round's kind: S (it scored a backlog), L (a prompt lookup; recorded since session 35), then its
    drafts, 4 and more pooled."""
    scored, lookup = bool(flags and flags[0]), bool(flags[1:] and flags[1])
    return ("S" if scored else "") + ("L" if lookup else "") + (str(drafted) if drafted < 4 else "4+")


def _baseline_times(rounds: dict[str, list[list]], baseline: str) -> dict[int, list[float]]:
    """Reply -> the baseline system's round times (ms) in it, for replies with rounds; an error naming the baseline
    where the run has none."""
    if baseline not in rounds:
        raise ValueError(f"the run has no {baseline!r} system to measure rounds against")
    return {row[0]: [r[2] for r in row[5]] for row in rounds[baseline] if row[5]}


def round_kinds(rounds: dict[str, list[list]], baseline: str = "target-only") -> dict[str, dict[str, dict]]:
    """system -> kind -> {"rounds": count, "median": ratio, "min": ratio} from one temperature's recorded rounds
    ([prompt, category, tokens, prompt tokens, prefill ms, [[drafted, context, ms, scored, lookup], ...]] per
    reply; runs before session 35 recorded no lookup)."""
    base = _baseline_times(rounds, baseline)
    out: dict[str, dict[str, dict]] = {}
    for name, replies in rounds.items():
        medians, minima, counts = defaultdict(list), defaultdict(list), defaultdict(int)
        for prompt, _, _, _, _, rows in replies:
            if not base.get(prompt):
                continue
            kinds: dict[str, list[float]] = defaultdict(list)
            for drafted, _, ms, *flags in rows:
                kinds[_kind(drafted, flags)].append(ms)
            for kind, times in kinds.items():
                counts[kind] += len(times)
                medians[kind].append(statistics.median(times) / statistics.median(base[prompt]))
                minima[kind].append(min(times) / min(base[prompt]))
        out[name] = {kind: {"rounds": counts[kind], "median": statistics.median(medians[kind]),
                            "min": statistics.median(minima[kind])} for kind in sorted(medians)}
    return out


def pooled_kinds(rounds: dict[str, list[list]], baseline: str = "target-only") -> dict[str, dict[str, dict]]:
    """system -> kind -> {"rounds": count, "mean": ratio, "median": ratio}: every prompt's rounds of the kind pooled,
    their mean and median over the baseline's median round pooled the same way. Means, where stalls show: a kind
    whose rounds stall often has a mean far above its median (on session 36's GPU, drafting rounds 5.2 against 2.1)."""
    unit = statistics.median(ms for times in _baseline_times(rounds, baseline).values() for ms in times)
    out: dict[str, dict[str, dict]] = {}
    for name, replies in rounds.items():
        kinds: dict[str, list[float]] = defaultdict(list)
        for *_, rows in replies:
            for drafted, _, ms, *flags in rows:
                kinds[_kind(drafted, flags)].append(ms)
        out[name] = {kind: {"rounds": len(times), "mean": statistics.fmean(times) / unit,
                            "median": statistics.median(times) / unit} for kind, times in sorted(kinds.items())}
    return out


PHASES = ("draft", "target", "verify", "rest")


def round_phases(rounds: dict[str, list[list]]) -> dict[str, dict[str, dict]]:
    """system -> kind -> {"rounds": count, "mean": {phase: ms}, "median": {phase: ms}} over the rounds that recorded
    their phases (runs since session 36); `rest`: the round's time beyond the three phases."""
    out: dict[str, dict[str, dict]] = {}
    for name, replies in rounds.items():
        kinds: dict[str, list[tuple[float, ...]]] = defaultdict(list)
        for *_, rows in replies:
            for drafted, _, ms, *flags in rows:
                if len(flags) < 3:
                    continue
                phases = flags[2]
                kinds[_kind(drafted, flags)].append((*phases, ms - sum(phases)))
        if kinds:
            out[name] = {kind: {"rounds": len(rows),
                                "mean": {p: statistics.fmean(r[i] for r in rows) for i, p in enumerate(PHASES)},
                                "median": {p: statistics.median(r[i] for r in rows) for i, p in enumerate(PHASES)}}
                         for kind, rows in sorted(kinds.items())}
    return out


STALL_MS = 30.0  # a round this much over the prompt's median target-only round stalled (GPU medians: 10-54 ms)


def shape_stalls(rounds: dict[str, list[list]], baseline: str = "target-only",
                 stall_ms: float = STALL_MS) -> dict[str, dict[str, dict]]:
    """system -> group -> {"rounds": count, "stalled": share over the prompt's median baseline round + `stall_ms`,
    "mean": the mean round over that median, "ms": the mean round in ms}.

    Each round's target forward has a shape, (tokens scored, context length). A round is "met" when an earlier turn
    of this temperature's rounds (any system's round, this reply's or an earlier reply's) had met its shape; "new"
    when this round alone met it first; "tied" when other systems' rounds met it in the same turn too (the systems
    take turns within a turn in an order the run does not store, so one of them met it first). Groups of one-token
    rounds are prefixed "plain". Backlog scorings are left out (their draft forward's shape is not recorded), and
    so are prompts without a baseline round (their rounds still mark shapes met). A cost paid once per attention
    shape and then cached (cuDNN's graphs) shows as new >> met, tied in between; see docs/cuda.md."""
    base = {prompt: statistics.median(times) for prompt, times in _baseline_times(rounds, baseline).items()}
    first: dict[tuple[int, int], tuple[int, int]] = {}  # (tokens, context length) -> (reply, turn) first met
    meeting: dict[tuple[int, int], int] = defaultdict(int)  # shape -> rounds that met it at that first (reply, turn)
    events = []
    for name, replies in rounds.items():
        for order, (prompt, _, _, _, _, rows) in enumerate(replies):  # every system's replies in the run's order
            for turn, (drafted, context, ms, *flags) in enumerate(rows):
                shape = (drafted + 1, context + drafted + 1)
                first[shape] = min(first.get(shape, (order, turn)), (order, turn))
                events.append((name, shape, (order, turn), ms, base.get(prompt), bool(flags and flags[0])))
    for _, shape, when, *_ in events:
        if first[shape] == when:
            meeting[shape] += 1
    out: dict[str, dict[str, dict]] = {}
    for name, shape, when, ms, unit, scored in events:
        if scored or unit is None:
            continue
        group = "met" if first[shape] < when else "new" if meeting[shape] == 1 else "tied"
        group = f"plain {group}" if shape[0] == 1 else group
        cell = out.setdefault(name, {}).setdefault(group, {"rounds": 0, "stalled": 0, "mean": 0.0, "ms": 0.0})
        cell["rounds"] += 1
        cell["stalled"] += ms > unit + stall_ms
        cell["mean"] += ms / unit
        cell["ms"] += ms
    for groups in out.values():
        for cell in groups.values():
            for key in ("stalled", "mean", "ms"):
                cell[key] /= cell["rounds"]
    return {name: dict(sorted(groups.items())) for name, groups in out.items()}


def _table(title: str, columns: list[str], by_system: dict[str, dict[str, dict]], cells) -> None:
    """Print a markdown table: a row per system and kind, `cells(row)` the cells after its round count."""
    print(f"{title}\n")
    print("| system | kind | rounds | " + " | ".join(columns) + " |\n|---|---|---|" + "---|" * len(columns))
    for name, kinds in by_system.items():
        for kind, row in kinds.items():
            print(f"| {name} | {kind} | {row['rounds']} | " + " | ".join(cells(row)) + " |")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("result", type=Path, help="a benchmarks/adaptive.py result (.json)")
    args = parser.parse_args()
    report = json.loads(args.result.read_text())
    if "rounds" not in report:
        raise SystemExit(f"{args.result} recorded no rounds (runs before session 21 did not)")
    for temperature, rounds in report["rounds"].items():
        _table(f"### Temperature {temperature}: round kinds in target-only plain rounds (median over prompts)",
               ["median / median", "min / min"], round_kinds(rounds),
               lambda row: [f"{row['median']:.2f}", f"{row['min']:.2f}"])
        _table(f"### Temperature {temperature}: round kinds over target-only's median round, all prompts pooled",
               ["mean", "median"], pooled_kinds(rounds), lambda row: [f"{row['mean']:.2f}", f"{row['median']:.2f}"])
        phases = round_phases(rounds)
        if phases:
            _table(f"### Temperature {temperature}: ms per phase, mean (median), all prompts pooled", list(PHASES),
                   phases, lambda row: [f"{row['mean'][p]:.2f} ({row['median'][p]:.2f})" for p in PHASES])
        _table(f"### Temperature {temperature}: rounds over {STALL_MS:g} ms above target-only's median round, by "
               "whether an earlier round had scored as many tokens at the same context length (new: this round "
               "first; tied: it and another system's in the same turn; met; plain: one token scored), and the mean "
               "round over target-only's median and in ms", ["stalled", "mean", "mean ms"],
               shape_stalls(rounds), lambda row: [f"{row['stalled']:.2f}", f"{row['mean']:.2f}", f"{row['ms']:.1f}"])


if __name__ == "__main__":
    main()
