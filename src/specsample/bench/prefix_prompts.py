"""The prompts of the prefix workloads, shared by the prefix suite (suites.py) and the replicas suite (replicas.py):
one long system prompt made of Spec-Bench questions, and different questions after it."""

from __future__ import annotations

from specsample.bench.context import Bench
from specsample.datasets import spec_bench_prompts
from specsample.tokenizer import Tokenizer

CLIENTS = 8  # the shared-system-prompt workload's concurrent clients


def history_message(tokenizer: Tokenizer, tokens: int) -> str:
    """Spec-Bench questions joined until the chat-rendered message holds at least `tokens` tokens."""
    parts: list[str] = []
    for prompt in spec_bench_prompts():
        parts.extend(prompt.turns)
        if len(tokenizer.encode("\n\n".join(parts), chat=tokenizer.has_chat_template)) >= tokens:
            break
    return "\n\n".join(parts)


def distinct_questions(bench: Bench, count: int) -> list[str]:
    """`count` different questions: the first turns of the run's prompts in turn (numbered where they repeat)."""
    turns = [p.turns[0] for p in bench.prompts]
    return [turns[i % len(turns)] + ("" if i < len(turns) else f" ({i + 1})") for i in range(count)]
