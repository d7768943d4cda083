"""What gamma auto's own work costs per round: the controller's calls and the engine's acceptance bookkeeping.

In the adaptive benchmark's rounds (round_kinds.py's phase table) gamma auto's one-draft rounds ran ~0.25 ms longer
than fixed gamma 1's on the same prompts: its draft phase (which holds the controller's planning and gate), its
verify phase (which holds the acceptance probabilities it learns from and its observation) and the rest (its timing
bookkeeping). This decodes with gamma auto (one controller kept across the prompts, as the server keeps it) and times
every call of the controller's per-round methods, of the engine's planning (which holds the controller's plan and,
with `--drafter hybrid`, the prompt lookups) and of its acceptance computation, in place, with `time.perf_counter`
around each (the wrappers are removed afterwards); it prints per call its count, median and mean microseconds, and
what it adds per engine round. Every call runs right after the target's forward has left the caches cold: a call
costs several times what it costs when timed in a loop.

    python benchmarks/controller_calls.py --per-category 1 --out docs/controller_calls.json
    python benchmarks/controller_calls.py --per-category 1 --drafter hybrid --out docs/controller_calls_hybrid.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from specsample.api import generate
from specsample.bench.report import command_line, machine_info, publish
from specsample.config import SamplingParams, SpecConfig
from specsample.controller import ControllerConfig, GammaController
from specsample.drafters.base import Drafter
from specsample.drafters import hybrid
from specsample.drafters.hybrid import HybridDrafter
from specsample.engine import Engine
from specsample.models.base import CausalLM

# (owner, method): the controller's per-round calls, the engine's acceptance probabilities (gamma auto only), and with
# the hybrid drafter its lookups and its merge of the model's and the lookups' proposals (a module's function: as named
# where the hybrid calls it)
TIMED = ((GammaController, "plan"), (GammaController, "scores_planned"), (GammaController, "lookups_planned"),
         (GammaController, "gate"), (GammaController, "observe"), (GammaController, "observe_scores"),
         (GammaController, "observe_timing"), (Engine, "_acceptance"), (Engine, "_plan"), (Engine, "_note_plain_tokens"),
         (HybridDrafter, "lookup_lengths"), (hybrid, "merge_proposals"))
# calls of TIMED that hold others of them (the engine's planning holds the controller's plan and the lookups): shown,
# not added into the total per round
HOLDERS = ("Engine._plan",)
DRAFTERS = {"model": "the draft model alone", "hybrid": "prompt lookup and the draft model (the hybrid drafter)"}


def _label(owner: object, name: str) -> str:
    """'Owner.method' (a module's function: 'module.function', the module's last name)."""
    return f"{owner.__name__.rsplit('.', 1)[-1]}.{name}"


@contextlib.contextmanager
def timed_calls(methods: Sequence[tuple[object, str]] = TIMED) -> Iterator[dict[str, list[float]]]:
    """Within the block every call of each method (a class's, or a module's function) records its seconds under
    'Owner.method' ('module.function'); the originals are restored on exit, an error inside included."""
    seconds: dict[str, list[float]] = {_label(owner, name): [] for owner, name in methods}
    originals = [(owner, name, owner.__dict__[name]) for owner, name in methods]

    def timer(function, label: str):
        @functools.wraps(function)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                seconds[label].append(time.perf_counter() - start)
        return timed

    try:
        for owner, name, function in originals:
            setattr(owner, name, timer(function, _label(owner, name)))
        yield seconds
    finally:
        for owner, name, function in originals:
            setattr(owner, name, function)


def call_costs(target: CausalLM, drafter: Drafter, prompts: list[list[int]], params: list[SamplingParams],
               eos: frozenset[int], max_gamma: int = 8, warm_up: int = 1,
               controller_config: ControllerConfig | None = None) -> dict:
    """Decode every prompt with gamma auto (one controller throughout; the first `warm_up` prompts untimed, so the
    controller is calibrated as in a running server; `controller_config` replaces the default one) and return per
    timed call its count, median and mean microseconds and microseconds per round, and the timed rounds."""
    if not prompts or len(params) != len(prompts) or not 0 <= warm_up < len(prompts):
        raise ValueError(f"need prompts, one SamplingParams each and 0 <= warm_up < {len(prompts)} prompts")
    controller = GammaController(controller_config or ControllerConfig(max_gamma=max_gamma))
    config = SpecConfig(gamma=max_gamma, adaptive=True, max_batch_size=1)
    for prompt, p in zip(prompts[:warm_up], params[:warm_up]):
        generate(target, [prompt], p, drafter, config, eos, controller)
    rounds = 0
    with timed_calls() as seconds:
        for prompt, p in zip(prompts[warm_up:], params[warm_up:]):
            rounds += generate(target, [prompt], p, drafter, config, eos, controller).stats["rounds"]
    calls = {label: {"calls": len(times), "median_us": 1e6 * statistics.median(times),
                     "mean_us": 1e6 * statistics.fmean(times), "per_round_us": 1e6 * sum(times) / rounds}
             for label, times in seconds.items() if times}
    return {"rounds": rounds, "calls": calls,
            "per_round_us": sum(c["per_round_us"] for label, c in calls.items() if label not in HOLDERS)}


def render(report: dict) -> str:
    lines = [f"Command: `{report['command']}`", "",
             "Machine: " + ", ".join(f"{k} {v}" for k, v in report["machine"].items()), "",
             f"gamma auto decoding with {DRAFTERS[report.get('drafter', 'model')]}, one controller kept across the prompts "
             "(the first untimed); each call timed in place. Microseconds.", ""]
    for temperature, result in report["results"].items():
        lines += [f"Temperature {temperature}, {result['rounds']} rounds: {result['per_round_us']:.1f} us per round in "
                  "all.", "", "| call | calls | median | mean | per round |", "|---|---|---|---|---|"]
        lines += [f"| `{label}`{' (holds others: not in the total)' if label in HOLDERS else ''} | {c['calls']} | "
                  f"{c['median_us']:.1f} | {c['mean_us']:.1f} | {c['per_round_us']:.1f} |"
                  for label, c in result["calls"].items()]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-category", type=int, default=1, help="Spec-Bench prompts per category")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--temperatures", default="0.7,0")
    parser.add_argument("--drafter", choices=tuple(DRAFTERS), default="model",
                        help="the draft model alone, or with prompt lookup (the default drafter of the CLI and server)")
    parser.add_argument("--out", type=Path, default=None, help="also write the result here (.json, and .md beside)")
    args = parser.parse_args()
    if args.per_category < 1 or args.tokens < 2:
        parser.error("--per-category must be >= 1 and --tokens >= 2")
    from specsample.bench.run import encode_fitting, load_model_draft_pair, load_prompts

    pair = load_model_draft_pair("smollm2-135m-instruct", None)
    tokenizer = pair.target.tokenizer
    _, prompts = encode_fitting(load_prompts("spec-bench", args.per_category, 0), tokenizer,
                                pair.target.model.max_seq_len, args.tokens)
    if len(prompts) < 2:
        raise SystemExit("need at least two prompts (the first warms the controller up)")
    drafter = HybridDrafter(pair.drafter) if args.drafter == "hybrid" else pair.drafter
    results = {}
    for temperature in (float(t) for t in args.temperatures.split(",")):
        params = [SamplingParams(temperature=temperature, max_new_tokens=args.tokens, seed=i)
                  for i in range(len(prompts))]
        results[str(temperature)] = call_costs(pair.target.model, drafter, prompts, params,
                                               frozenset(tokenizer.eos_token_ids))
    report = {"command": command_line("benchmarks/controller_calls.py", args), "drafter": args.drafter,
              "machine": machine_info(pair.target.model.device), "results": results}
    publish(report, render(report), args.out)


if __name__ == "__main__":
    main()
