"""Teacher-forced target features on disk: what a feature draft (EAGLE) trains on.

Each conversation is rendered with the target's chat template, cut at `max_len` tokens and run through the
target once; the store keeps, per token, its id, the target's final hidden state there (the vector its output
layer reads) and whether the token belongs to an assistant reply. Chunks of conversations are written as
safetensors files, each committed by rewriting `index.json` atomically, so an interrupted run resumes after
its last committed chunk and memory stays bounded by one chunk:

    index.json              format, target, sizes, committed chunks, conversations consumed
    chunk-00000.safetensors tokens [T] int32, features [T, hidden], reply [T] uint8, offsets [n + 1] int64
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor
from tqdm import tqdm

from specsample.datasets import Prompt
from specsample.tokenizer import Tokenizer

FORMAT = "specsample-features/1"


@dataclass(frozen=True)
class FeatureSequence:
    """One conversation: token ids `[n]`, the target's final hidden states `[n, hidden]`, reply mask `[n]`."""

    tokens: Tensor
    features: Tensor
    reply: Tensor


def rendered_conversation(tokenizer: Tokenizer, prompt: Prompt, max_len: int) -> tuple[list[int], list[bool]]:
    """Chat-rendered token ids of a conversation (its turns and replies, cut at `max_len`) and, per token,
    whether it belongs to an assistant reply (from the reply's first token to its end-of-turn token)."""
    messages: list[dict[str, str]] = []
    spans = []
    for i, turn in enumerate(prompt.turns):
        messages.append({"role": "user", "content": turn})
        if i < len(prompt.replies):
            start = len(_render(tokenizer, messages, generation_prompt=True))
            messages.append({"role": "assistant", "content": prompt.replies[i]})
            ids = _render(tokenizer, messages, generation_prompt=False)
            spans.append((start, len(ids)))
            if len(ids) >= max_len:
                break
    ids = _render(tokenizer, messages, generation_prompt=False)[:max_len]
    reply = [False] * len(ids)
    for start, end in spans:
        for position in range(start, min(end, len(ids))):
            reply[position] = True
    return ids, reply


def _render(tokenizer: Tokenizer, messages: list[dict[str, str]], generation_prompt: bool) -> list[int]:
    text = tokenizer.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    return list(tokenizer.hf(text, add_special_tokens=False)["input_ids"])


@torch.inference_mode()
def target_features(model, sequences: Sequence[Sequence[int]]) -> list[Tensor]:
    """The target's final hidden states `[len, hidden]` of each sequence, teacher-forced in one batch (right
    padding never reaches earlier positions of a causal model)."""
    width = max(len(s) for s in sequences)
    batch = torch.zeros(len(sequences), width, dtype=torch.long)
    for row, seq in enumerate(sequences):
        batch[row, : len(seq)] = torch.tensor(seq)
    hidden = model.uncached_hidden(batch)  # [b, width, hidden]
    return [hidden[row, : len(seq)].cpu() for row, seq in enumerate(sequences)]


class FeatureWriter:
    """Appends chunks of conversations; reopening a store continues after its last committed chunk."""

    def __init__(self, folder: Path, target: str, hidden_size: int, vocab_size: int, max_len: int) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / "index.json"
        asked = {"target": target, "hidden_size": hidden_size, "vocab_size": vocab_size, "max_len": max_len}
        if path.exists():
            self.index = read_index(self.folder)
            held = {k: self.index[k] for k in asked}
            if held != asked:
                raise ValueError(f"{self.folder} holds features of {held}; asked for {asked}")
        else:
            self.index = {"format": FORMAT, **asked, "chunks": [], "consumed": 0, "sequences": 0, "tokens": 0}
        committed = {c["file"] for c in self.index["chunks"]}
        for stray in self.folder.glob("chunk-*.safetensors*"):  # written by a run that stopped before committing
            if stray.name not in committed:
                stray.unlink()

    @property
    def consumed(self) -> int:
        """Source conversations handled so far (written, or skipped as empty)."""
        return self.index["consumed"]

    @property
    def num_tokens(self) -> int:
        return self.index["tokens"]

    def append(self, sequences: Sequence[FeatureSequence], consumed: int) -> None:
        """Write one chunk and commit it together with the count of source conversations it used (none written:
        only the count)."""
        if not sequences:
            self.index["consumed"] += consumed
            _write_json(self.folder / "index.json", self.index)
            return
        name = f"chunk-{len(self.index['chunks']):05d}.safetensors"
        lengths = torch.tensor([0] + [len(s.tokens) for s in sequences], dtype=torch.long)
        tensors = {
            "tokens": torch.cat([s.tokens for s in sequences]).to(torch.int32),
            "features": torch.cat([s.features for s in sequences]).contiguous(),
            "reply": torch.cat([s.reply for s in sequences]).to(torch.uint8),
            "offsets": lengths.cumsum(0),
        }
        tmp = self.folder / (name + ".tmp")
        save_file(tensors, str(tmp))
        os.replace(tmp, self.folder / name)
        self.index["chunks"].append({"file": name, "sequences": len(sequences), "tokens": int(lengths.sum())})
        self.index["consumed"] += consumed
        self.index["sequences"] += len(sequences)
        self.index["tokens"] += int(lengths.sum())
        _write_json(self.folder / "index.json", self.index)


def read_index(folder: Path) -> dict[str, Any]:
    path = Path(folder) / "index.json"
    if not path.exists():
        raise ValueError(f"{folder} is not a feature store (no index.json)")
    try:
        index = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is corrupt: {exc}") from exc
    if index.get("format") != FORMAT:
        raise ValueError(f"{path} has format {index.get('format')!r}, expected {FORMAT!r}")
    return index


def _write_json(path: Path, value: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value, indent=1))
    os.replace(tmp, path)


class FeatureReader:
    """The committed chunks of a store, one chunk in memory at a time."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.index = read_index(self.folder)
        for chunk in self.index["chunks"]:
            if not (self.folder / chunk["file"]).exists():
                raise ValueError(f"{self.folder / chunk['file']} is missing: the store is incomplete")

    @property
    def num_chunks(self) -> int:
        return len(self.index["chunks"])

    @property
    def num_tokens(self) -> int:
        return self.index["tokens"]

    def lengths(self, i: int) -> list[int]:
        """The token count of each sequence of chunk `i` (read without loading its features)."""
        with safe_open(str(self.folder / self.index["chunks"][i]["file"]), framework="pt") as handle:
            offsets = handle.get_tensor("offsets").tolist()
        return [b - a for a, b in zip(offsets[:-1], offsets[1:])]

    def chunk(self, i: int) -> list[FeatureSequence]:
        """The sequences of chunk `i`."""
        tensors = load_file(str(self.folder / self.index["chunks"][i]["file"]))
        offsets = tensors["offsets"].tolist()
        return [FeatureSequence(tensors["tokens"][a:b].long(), tensors["features"][a:b], tensors["reply"][a:b].bool())
                for a, b in zip(offsets[:-1], offsets[1:])]


def _length_batches(items: list[tuple[list[int], list[bool]]], batch_tokens: int) -> Iterator[list[int]]:
    """Indices of `items` grouped by similar length so padding stays small."""
    order = sorted(range(len(items)), key=lambda i: len(items[i][0]))
    batch: list[int] = []
    for i in order:
        if batch and (len(batch) + 1) * len(items[i][0]) > batch_tokens:
            yield batch
            batch = []
        batch.append(i)
    if batch:
        yield batch


def answered(model, tokenizer: Tokenizer, prompts: Sequence[Prompt], max_new_tokens: int, seed: int) -> list[Prompt]:
    """The prompts with their first turn answered by the target itself (sampled at temperature 0.7, seeded)."""
    from specsample.config import SamplingParams, SpecConfig
    from specsample.engine import Engine

    ids = [tokenizer.encode(p.turns[0], chat=True) for p in prompts]
    engine = Engine(model, None, SpecConfig(speculative=False, max_batch_size=min(16, len(prompts)),
                                            max_seq_len=max(len(i) for i in ids) + max_new_tokens),
                    tokenizer.eos_token_ids)
    rids = [engine.add_request(i, SamplingParams(temperature=0.7, max_new_tokens=max_new_tokens, seed=seed + n))
            for n, i in enumerate(ids)]
    replies: dict[str, list[int]] = {r: [] for r in rids}
    for result in engine.stream():
        for update in result.rows:
            replies[update.request_id].extend(update.new_tokens)
    return [Prompt(p.id, p.category, p.turns[:1], (tokenizer.decode(replies[r]),)) for p, r in zip(prompts, rids)]


def collect_features(model, tokenizer: Tokenizer, prompts: Iterable[Prompt], writer: FeatureWriter,
                     max_tokens: int, batch_tokens: int = 8192, chunk_conversations: int = 64,
                     progress: bool = True) -> None:
    """Run the target over conversations (skipping the `writer.consumed` already handled) until the store holds
    `max_tokens` tokens or the prompts run out. A prompt without replies is answered by the target itself first
    (up to a quarter of `max_len` tokens); conversations left without a reply token are skipped."""
    bar = tqdm(total=max_tokens, initial=min(writer.num_tokens, max_tokens), desc="target features", unit="tok",
               unit_scale=True, disable=not progress)
    source = iter(prompts)
    for _ in range(writer.consumed):
        next(source, None)
    max_len = writer.index["max_len"]
    while writer.num_tokens < max_tokens:
        items, consumed, chunk = [], 0, []
        for prompt in source:
            consumed += 1
            chunk.append(prompt)
            if len(chunk) >= chunk_conversations:
                break
        unanswered = [p for p in chunk if not p.replies]
        if unanswered:
            own = dict(zip((id(p) for p in unanswered),
                           answered(model, tokenizer, unanswered, max(8, max_len // 4), seed=writer.consumed)))
            chunk = [own.get(id(p), p) for p in chunk]
        for prompt in chunk:
            ids, reply = rendered_conversation(tokenizer, prompt, max_len)
            if any(reply[1:]):
                items.append((ids, reply))
        if not chunk:
            break
        sequences: list[FeatureSequence | None] = [None] * len(items)
        for batch in _length_batches(items, batch_tokens):
            for i, features in zip(batch, target_features(model, [items[i][0] for i in batch])):
                ids, reply = items[i]
                sequences[i] = FeatureSequence(torch.tensor(ids), features, torch.tensor(reply))
        before = writer.num_tokens
        writer.append(sequences, consumed)
        bar.update(min(writer.num_tokens, max_tokens) - min(before, max_tokens))
    bar.close()
