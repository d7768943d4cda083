"""The repeat suite's stream of requests (`bench/repeat.py` runs it).

The workload is built from the bundled Spec-Bench questions (evaluation only: never train on them), N items of each
of three kinds (N = --num-prompts, default all), interleaved kind by kind:

- two-turn chats: a multi-turn question's first turn, then its second turn after the first reply (the second turn
  asks to rewrite, extend or correct that reply);
- extraction: a math word problem given with a JSON schema to fill (people, quantities, question); the schema is in
  the prompt and decoding is unconstrained, as a peer decodes it;
- reworded questions: a QA question asked as written, then twice more in other words, each wording a full pass over
  the N questions later.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from specsample.datasets import spec_bench_prompts
from specsample.tokenizer import Tokenizer

EXTRACTION_SCHEMA = {
    "type": "object",
    "properties": {
        "people": {"type": "array", "items": {"type": "string"}},
        "quantities": {"type": "array", "items": {"type": "number"}},
        "question": {"type": "string"},
    },
    "required": ["people", "quantities", "question"],
}
EXTRACTION = (
    "Extract the information in the text below as a JSON object that follows this JSON schema:\n"
    + json.dumps(EXTRACTION_SCHEMA)
    + "\nAnswer with the JSON object only.\n\nText: "
)  # + the text
REWORDINGS = (
    "{question}",
    "Can you tell me: {lower}",
    "Someone asked me this and I did not know the answer. {question}",
)
KINDS = ("first turn", "second turn", "extraction", "question", "reworded question")


@dataclass(frozen=True)
class Request:
    """One request of the stream: its kind, an id, its chat messages; a second turn's history is completed at run
    time with the reply to request `after` (its index in the stream)."""

    kind: str
    id: str
    messages: tuple[dict[str, str], ...]
    after: int | None = None


def workload(per_kind: int | None = None) -> list[Request]:
    """The stream (see the module docstring): N two-turn chats, N extractions, N questions each asked three ways."""
    prompts = spec_bench_prompts()
    chats = [p for p in prompts if len(p.turns) >= 2][:per_kind]
    problems = [p for p in prompts if p.category == "math_reasoning"][:per_kind]
    questions = [p for p in prompts if p.category == "qa"][:per_kind]
    lanes: list[list[tuple[str, str, tuple[dict[str, str], ...], int | None]]] = [[], [], []]
    for p in chats:  # the second turn names its first turn by lane position, resolved below
        lanes[0].append(("first turn", f"{p.id}.1", ({"role": "user", "content": p.turns[0]},), None))
        lanes[0].append(("second turn", f"{p.id}.2", ({"role": "user", "content": p.turns[1]},), len(lanes[0]) - 1))
    for p in problems:
        lanes[1].append(("extraction", p.id, ({"role": "user", "content": EXTRACTION + p.turns[0]},), None))
    for w, wording in enumerate(REWORDINGS):
        for p in questions:
            text = wording.format(question=p.turns[0], lower=_lower_first(p.turns[0]))
            lanes[2].append(
                (
                    "question" if w == 0 else "reworded question",
                    f"{p.id}.w{w}",
                    ({"role": "user", "content": text},),
                    None,
                )
            )
    stream: list[Request] = []
    positions: dict[tuple[int, int], int] = {}  # (lane, position in lane) -> index in the stream
    for step in range(max(len(lane) for lane in lanes)):
        for k, lane in enumerate(lanes):
            if step < len(lane):
                kind, rid, messages, after = lane[step]
                positions[(k, step)] = len(stream)
                stream.append(Request(kind, rid, messages, None if after is None else positions[(k, after)]))
    return stream


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:]


def context_needed(tokenizer: Tokenizer, budget: int, stream: list[Request]) -> int:
    """Tokens the longest request of the stream may hold: its prompt, a first reply in its history (with the chat
    template's markers around it) and its own reply of up to `budget` tokens."""
    longest = 0
    for request in stream:
        prompt = len(tokenizer.encode_messages(list(request.messages)))
        history = stream[request.after] if request.after is not None else None
        if history is not None:
            prompt += len(tokenizer.encode_messages(list(history.messages))) + budget + 16
        longest = max(longest, prompt + budget)
    return longest
