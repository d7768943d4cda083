"""What gamma auto adds to a plain round: the engine's and the controller's own work, without the models.

A request in fallback decodes plain, but its round still runs the controller (plan, observe, timing),
keeps the target's probability of the committed token for backlog scoring, and commits to the draft.
On the real pair a plain round takes ~14 ms and this is a fraction of a percent of it, too little to
see through the box's noise; on tiny models (a forward of well under a millisecond) it stands out.
Target-only and gamma auto held in fallback (it never resumes) decode the same prompt, alternating,
and the script prints the median round of each (rounds that scored a backlog left out) and the
difference.

    python benchmarks/plain_round_overhead.py --repeats 12
"""

from __future__ import annotations

import argparse
import statistics

import torch

from specsample.api import generate_stream
from specsample.config import SamplingParams, SpecConfig
from specsample.controller import ControllerConfig, GammaController
from specsample.drafters.model import ModelDrafter
from specsample.models.tiny import tiny_lm


def plain_rounds(target, draft, temperature: float, tokens: int) -> list[float]:
    """Seconds of each plain round of one request (gamma auto kept in fallback when `draft` is given)."""
    params = SamplingParams(temperature=temperature, max_new_tokens=tokens, seed=0)
    if draft is None:
        stream = generate_stream(target, [[1, 2, 3]], params, None, SpecConfig(gamma=4), frozenset())
    else:  # a speedup under 100 falls back, none over 1e9 resumes: every round after the first few is plain
        controller = GammaController(ControllerConfig(max_gamma=4, fallback_below=100.0, resume_above=1e9))
        stream = generate_stream(target, [[1, 2, 3]], params, ModelDrafter(draft), SpecConfig(gamma=4, adaptive=True),
                                 frozenset(), controller)
    times, previous = [], None
    for _, result in stream:
        if previous is not None and result.stats.drafted == 0 and not result.stats.scored_rows:
            times.append(result.finished_at - previous)
        previous = result.finished_at
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=12, help="requests per system, alternating")
    parser.add_argument("--tokens", type=int, default=200, help="tokens per request")
    parser.add_argument("--temperatures", default="0,0.7")
    args = parser.parse_args()
    if args.repeats < 1 or args.tokens < 2:
        parser.error("--repeats must be >= 1 and --tokens >= 2")
    torch.set_num_threads(1)
    target = tiny_lm(32, seed=1, init_scale=0.2, dtype=torch.float32)
    draft = tiny_lm(32, seed=2, init_scale=0.2, num_layers=1, dtype=torch.float32)
    for temperature in (float(t) for t in args.temperatures.split(",")):
        rounds = {"target-only": [], "gamma auto in fallback": []}
        for repeat in range(args.repeats):
            order = list(rounds) if repeat % 2 else list(reversed(rounds))
            for name in order:
                rounds[name] += plain_rounds(target, draft if name != "target-only" else None, temperature, args.tokens)
        medians = {name: statistics.median(times) * 1e6 for name, times in rounds.items()}
        print(f"temperature {temperature}: " + ", ".join(f"{n} {m:.1f} us ({len(rounds[n])} rounds)"
                                                         for n, m in medians.items())
              + f"; gamma auto adds {medians['gamma auto in fallback'] - medians['target-only']:.1f} us")


if __name__ == "__main__":
    main()
