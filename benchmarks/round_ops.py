"""Operations a round dispatches, by round kind: what a launch-bound GPU pays for, counted on any machine.

At batch 1 a small model on a GPU is bound by launching kernels, not by arithmetic (docs/cuda.md), so a round
costs about what it dispatches. This counts, per engine round, the aten operations dispatched (all, and those
that are not views: a view launches no kernel) and the calls that read a tensor's value on the host (`item`,
`is_nonzero`; `.tolist()` and `.cpu()` of a CPU tensor dispatch nothing, so on a CPU this column undercounts
what a GPU waits for), and on a GPU the waits: host reads of a GPU tensor and copies from it to the CPU
(`.cpu()`, `.tolist()`), each of which waits for the GPU's queued work. Target-only and fixed gammas (and with
`--auto` gamma auto, with `--hybrid` the hybrid drafter under gamma auto) decode the same Spec-Bench prompts; an
adaptive system's rounds are kinds of its own (`auto 1`, the hybrid's `hybrid 1`), those that proposed a prompt
lookup apart (`hybrid L3`), as are backlog scorings (`auto S0`). Counts, not times: they do not depend on the machine's load. (Counting slows every operation,
and gamma auto chooses by measured times, so its mix of rounds here is not its usual one: read its counts per
kind, not how many rounds of each it ran.)

    python benchmarks/round_ops.py --gammas 1,3 --out docs/round_ops.json
"""

from __future__ import annotations

import argparse
import statistics
from collections import Counter, defaultdict
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from round_phases import lockstep_setup  # a sibling script: the same prompts and systems
from specsample.bench.report import command_line, publish
from specsample.bench.run import add_pair_options, load_model_draft_pair
from specsample.bench.systems import run_lockstep
from specsample.config import SamplingParams
from specsample.drafters.hybrid import HybridDrafter
from specsample.engine import Engine

VIEWS = frozenset({"view", "_unsafe_view", "slice", "select", "transpose", "t", "permute", "unsqueeze", "squeeze",
                   "expand", "as_strided", "alias", "chunk", "split", "split_with_sizes", "unbind", "detach",
                   "detach_", "lift_fresh", "reshape", "resolve_conj", "resolve_neg", "narrow", "view_as"})
HOST_READS = frozenset({"item", "_local_scalar_dense", "is_nonzero", "equal"})
COPIES = frozenset({"_to_copy", "to", "copy_"})


class OpCounter(TorchDispatchMode):
    """Counts aten operations by name while active; `waits`: host reads of a tensor on an accelerator, and copies
    between it and the CPU (each waits for the accelerator's queued work)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.waits = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        out = func(*args, **(kwargs or {}))
        # copy_(destination, source) reads its second argument; the others their first
        source = args[1] if name == "copy_" and len(args) > 1 else (args[0] if args else None)
        if isinstance(source, torch.Tensor) and source.device.type != "cpu":
            if name in HOST_READS or (name in COPIES and isinstance(out, torch.Tensor) and out.device.type == "cpu"):
                self.waits += 1
        return out


def summarise(ops: Counter[str], waits: int = 0) -> tuple[int, int, int, int]:
    """(all operations, those that are not views, host reads, waits on an accelerator) of one round."""
    total = sum(ops.values())
    return (total, total - sum(n for name, n in ops.items() if name in VIEWS), sum(ops[name] for name in HOST_READS),
            waits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pair_options(parser)
    parser.add_argument("--prompts", type=int, default=4, help="Spec-Bench prompts (the first of each category)")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--gammas", default="1,3")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--auto", action="store_true", help="also gamma auto (the draft model), its rounds apart")
    parser.add_argument("--hybrid", action="store_true",
                        help="also the hybrid drafter under gamma auto: its rounds apart (hybrid N; hybrid L N: lookups)")
    parser.add_argument("--out", type=Path, default=None, help="also write the result here (.json, and .md beside)")
    args = parser.parse_args()
    gammas = [int(g) for g in args.gammas.split(",")]
    if min(gammas) < 1:
        parser.error("--gammas must be >= 1")
    pair = load_model_draft_pair(args.target, args.draft, args.draft_window, args.dtype, args.device)
    prompts, systems = lockstep_setup(pair, 1, args.prompts, args.tokens, gammas, args.auto, args.hybrid)
    # drafts per round ("auto N" for gamma auto's) -> per round; and the operations by name, summed
    counted: dict[str, list[tuple[int, int, int, int]]] = defaultdict(list)
    by_name: dict[str, Counter[str]] = defaultdict(Counter)
    step = Engine.step

    def counting_step(engine: Engine):
        admits = engine.num_waiting > 0  # a round that admits a request prefills it too: not a decoding round's cost
        with OpCounter() as counter:
            result = step(engine)
        if result.stats.batch_size and not admits:
            hybrid = isinstance(engine.drafter, HybridDrafter)
            system = ("hybrid " if hybrid else "auto ") if engine.config.adaptive else ""
            kind = (system + ("S" if result.stats.scored_rows else "") + ("L" if result.stats.lookup_rows else "")
                    + str(result.stats.drafted))
            counted[kind].append(summarise(counter.ops, counter.waits))
            by_name[kind].update(counter.ops)
        return result

    Engine.step = counting_step
    try:
        for i, prompt in enumerate(prompts):
            run_lockstep(systems, [prompt], SamplingParams(temperature=args.temperature, max_new_tokens=args.tokens,
                                                           seed=i))
    finally:
        Engine.step = step
    results = {kind: {"rounds": len(rows), "ops": statistics.median(r[0] for r in rows),
                      "kernel_ops": statistics.median(r[1] for r in rows),
                      "host_reads": statistics.median(r[2] for r in rows),
                      "device_waits": statistics.median(r[3] for r in rows)}
               for kind, rows in sorted(counted.items(), key=_order)}
    for kind, ops in by_name.items():  # per round, the operations that are not views, by name
        results[kind]["by_name"] = {name: round(n / len(counted[kind]), 2) for name, n in ops.most_common()
                                    if name not in VIEWS}
    report = {"command": command_line("benchmarks/round_ops.py", args), "device": args.device,
              "temperature": args.temperature, "results": results}
    publish(report, render(report), args.out)


def _order(item: tuple[str, list]) -> tuple:
    """Fixed gammas' kinds first, then gamma auto's, then the hybrid's; within them model rounds, then prompt
    lookups (L), backlog scorings (S), each by drafts."""
    *system, last = item[0].split()
    return ["auto", "hybrid"].index(system[0]) + 1 if system else 0, "S" in last, "L" in last, int(last.lstrip("LS"))


def render(report: dict) -> str:
    """The medians per round kind, and each over the plain round's."""
    rows = report["results"]
    plain = rows.get("0")
    lines = [f"Command: `{report['command']}`", "",
             f"Per decoding round at T {report['temperature']} on {report['device']} (medians over rounds; the rounds of "
             "target-only and every fixed gamma pooled by drafts in the round):", "",
             "| drafts | rounds | operations | not views | over a plain round's | host reads | waits on the device |",
             "|---|---|---|---|---|---|---|"]
    for kind, row in rows.items():
        ratio = f"{row['kernel_ops'] / plain['kernel_ops']:.2f}" if plain else "n/a"
        waits = f"{row['device_waits']:g}" if "device_waits" in row and report["device"] != "cpu" else "n/a (CPU)"
        lines.append(f"| {kind} | {row['rounds']} | {row['ops']:g} | {row['kernel_ops']:g} | {ratio} "
                     f"| {row['host_reads']:g} | {waits} |")
    pairs = [(kind, f"auto {kind}") for kind in rows if f"auto {kind}" in rows and kind != "0"]
    if pairs:
        lines += ["", "gamma auto's rounds over the fixed gammas' with as many drafts, by operation (per round; "
                  "those that differ by 0.5 or more):", ""]
        for fixed, auto in pairs:
            names = set(rows[fixed].get("by_name", {})) | set(rows[auto].get("by_name", {}))
            diffs = sorted(((rows[auto]["by_name"].get(n, 0) - rows[fixed]["by_name"].get(n, 0), n) for n in names),
                           reverse=True)
            shown = ", ".join(f"{n} {d:+.1f}" for d, n in diffs if abs(d) >= 0.5)
            lines.append(f"- {fixed} drafts: {shown or 'none'}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
