"""What llama.cpp's batched decode costs: one `Llama.eval` of n = 1, 2, 4, 5, 8, 16 new tokens after a prefill of
`--context` tokens (a Spec-Bench prompt), through llama-cpp-python, on a GGUF file (default: the alias's, the file
`specsample bench --compare llama.cpp` runs). Verifying n - 1 drafted tokens is such a call.

Two settings: logits of the last position only (`logits_all=False`, plain decoding's call) and of every position
(`logits_all=True`, what verifying a draft needs: llama-cpp-python's own prompt-lookup decoding turns it on). Each
call is rolled back after it (the cache truncated to the prefill), the widths run in an order rotating repeat by
repeat, the first repeat is a warm-up; medians and minimums in ms, and each median over n = 1's. llama.cpp's threads
meet at a barrier after every operation, so where other work shares the cores its times grow far more than the load:
time on a quiet machine.

Needs llama-cpp-python (docs/benchmarks.md says how to build it for the machine).

    python benchmarks/llama_cpp_widths.py --out docs/results/llama_cpp/widths.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

from specsample.bench.context import cpu_name

WIDTHS = (1, 2, 4, 5, 8, 16)


def prompt_tokens(llm, count: int) -> list[int]:
    """The first `count` tokens of the bundled Spec-Bench questions, joined."""
    from specsample.datasets import spec_bench_prompts

    text = "\n\n".join(turn for prompt in spec_bench_prompts() for turn in prompt.turns)
    tokens = llm.tokenize(text.encode(), add_bos=True)
    if len(tokens) < count:
        raise ValueError(f"the bundled prompts hold {len(tokens)} tokens, fewer than {count}")
    return tokens[:count]


def time_widths(llm, tokens: list[int], context: int, repeats: int) -> dict[int, list[float]]:
    """Seconds of `llm.eval` of each width's next tokens after `context` cached, `repeats` times each."""
    llm.reset()
    llm.eval(tokens[:context])
    times: dict[int, list[float]] = {n: [] for n in WIDTHS}
    for rep in range(repeats + 1):  # the first repeat warms up
        turn = rep % len(WIDTHS)
        for n in WIDTHS[turn:] + WIDTHS[:turn]:
            llm.n_tokens = context  # eval drops the cache past n_tokens first: every call starts after the prefill
            start = time.perf_counter()
            llm.eval(tokens[context : context + n])
            if rep:
                times[n].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", help="a GGUF file (default: the alias's)")
    parser.add_argument("--alias", default="smollm2-135m-instruct", help="the model alias whose GGUF file to time")
    parser.add_argument("--context", type=int, default=100, help="tokens cached before each call")
    parser.add_argument("--repeats", type=int, default=30, help="timed calls per width and setting")
    parser.add_argument("--threads", type=int, help="llama.cpp's threads (default: as many as torch uses, as in bench)")
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    args = parser.parse_args()

    import llama_cpp
    import torch
    from llama_cpp import Llama

    args.threads = args.threads or torch.get_num_threads()

    if args.gguf:
        gguf = Path(args.gguf)
    else:
        from specsample.models.hub import alias_gguf

        gguf = alias_gguf(args.alias)
    results: dict = {
        "command": "python " + shlex.join(sys.argv),
        "machine": {
            "cpu": cpu_name(),
            "cores": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "llama_cpp_python": llama_cpp.__version__,
            "llama_cpp_system_info": llama_cpp.llama_print_system_info().decode().strip(),
        },
        "gguf": gguf.name,
        "threads": args.threads,
        "context": args.context,
        "repeats": args.repeats,
        "widths": {},
    }
    for setting, logits_all in (("last position's logits", False), ("every position's logits", True)):
        llm = Llama(
            model_path=str(gguf),
            n_ctx=512,
            n_batch=512,
            n_threads=args.threads,
            n_threads_batch=args.threads,
            logits_all=logits_all,
            verbose=False,
        )
        tokens = prompt_tokens(llm, args.context + max(WIDTHS))
        times = time_widths(llm, tokens, args.context, args.repeats)
        one = statistics.median(times[1])
        results["widths"][setting] = {
            str(n): {
                "median_ms": 1e3 * statistics.median(t),
                "min_ms": 1e3 * min(t),
                "over_one": statistics.median(t) / one,
            }
            for n, t in times.items()
        }
        del llm
    print(f"{gguf.name}, {args.context} tokens cached, threads: {args.threads}, {cpu_name()}")
    print("| n | " + " | ".join(f"{s}: median ms (x n=1)" for s in results["widths"]) + " |")
    print("|---" * (1 + len(results["widths"])) + "|")
    for n in WIDTHS:
        cells = [results["widths"][s][str(n)] for s in results["widths"]]
        print(f"| {n} | " + " | ".join(f"{c['median_ms']:.2f} ({c['over_one']:.2f}x)" for c in cells) + " |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
