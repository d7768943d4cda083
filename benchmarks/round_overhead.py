"""What a round costs beside the models' forwards: planning, proposing bookkeeping, verification and the commit.

Runs the engine on a tiny target and draft (their forwards take microseconds), times every round, subtracts the time
spent inside the target's and the draft's forwards (measured by wrapping them), and reports the median non-model time
per round for chain rounds (fixed gamma 3, temperature 0.7 and greedy) and tree rounds (16 nodes), at batch 1 and 8.
Run it from two checkouts to compare them on the same machine, interleaved:

    python benchmarks/round_overhead.py --out docs/results/round_overhead.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from specsample import Engine, ModelDrafter, SamplingParams, SpecConfig, tiny_lm
from specsample.config import TreeShape
from specsample.planner import FixedGamma

VOCAB = 512


class Timed:
    """A model whose forwards add their time to `spent` (everything else is passed through)."""

    def __init__(self, model, spent: list[float]) -> None:
        self.model, self.spent = model, spent

    def __getattr__(self, name):
        attribute = getattr(self.model, name)
        if name.startswith(("forward_cached", "prefill")):

            def timed(*args, **kwargs):
                start = time.perf_counter()
                out = attribute(*args, **kwargs)
                self.spent.append(time.perf_counter() - start)
                return out

            return timed
        return attribute


def non_model_ms(batch: int, temperature: float, tree: TreeShape | None, rounds: int, seed: int) -> float:
    """Median milliseconds per round outside the target's and the draft's forwards."""
    spent: list[float] = []
    target = Timed(tiny_lm(VOCAB, seed=1, init_scale=0.1), spent)
    draft = ModelDrafter(Timed(tiny_lm(VOCAB, seed=2, init_scale=0.1, num_layers=1), spent))
    engine = Engine(
        target, draft, SpecConfig(max_batch_size=batch, max_seq_len=rounds * 20 + 40), planner=FixedGamma(3, tree)
    )
    for row in range(batch):
        engine.add_request(
            [1 + row, 2, 3, 4], SamplingParams(temperature=temperature, max_new_tokens=rounds * 17, seed=seed + row)
        )
    engine.step()  # admission and the first round
    times = []
    for _ in range(rounds):
        spent.clear()
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start - sum(spent))
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3, help="passes over every case, interleaved")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cases = [(b, t, tree) for b in (1, 8) for t in (0.0, 0.7) for tree in (None, TreeShape(16, 4, 4))]
    results: dict[str, list[float]] = {}
    for repeat in range(args.repeats):
        for batch, temperature, tree in cases:
            key = f"batch {batch}, T {temperature}, {'tree ' + str(tree) if tree else 'chain of 3'}"
            results.setdefault(key, []).append(non_model_ms(batch, temperature, tree, args.rounds, repeat))
    table = {key: statistics.median(values) for key, values in results.items()}
    for key, value in table.items():
        print(f"{key:40s} {value:7.3f} ms per round outside the models")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {
                    "machine": platform.processor() or platform.machine(),
                    "torch": torch.__version__,
                    "command": " ".join(["python", *sys.argv]),
                    "non_model_ms": table,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
