"""Target features on disk: what a feature draft (EAGLE-3 head) trains on.

Each conversation is a sequence of token ids (rendered with the target's chat template, cut at `max_len`) with, per
token, the target's fused features there (the residual stream entering each feature layer, concatenated: what the
head reads), its final normed hidden state (what its output layer reads: the training target's distribution) and
whether the token belongs to an assistant reply. Conversations come either teacher-forced from a dataset's own replies
(`collect_features`) or written by the target itself, the features recorded as it generated
(`distill/regenerate.py`). Chunks of conversations are written as safetensors files, each committed by rewriting
`index.json` atomically, so an interrupted run resumes after its last committed chunk and memory stays bounded:

    index.json              format, target, sizes, feature layers, committed chunks, source conversations handled
    chunk-00000.safetensors tokens [T] int32, features [T, F], final [T, hidden], reply [T] uint8,
                            offsets [n + 1] int64, known [n] int64 (positions whose features were computed)
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor
from tqdm import tqdm

from specsample.datasets import Prompt
from specsample.tokenizer import Tokenizer

if TYPE_CHECKING:
    from specsample.models.llama import LlamaModel

FORMAT = "specsample-features/2"


@dataclass(frozen=True)
class FeatureSequence:
    """One conversation: token ids `[n]`, fused features `[n, F]`, final hidden states `[n, hidden]`, reply mask `[n]`;
    features are known for the first `known` positions (a generated sequence's last token was never scored)."""

    tokens: Tensor
    features: Tensor
    final: Tensor
    reply: Tensor
    known: int


def render_messages(tokenizer: Tokenizer, messages: list[dict[str, str]], generation_prompt: bool) -> list[int]:
    """Token ids of `messages` under the target's chat template."""
    text = tokenizer.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    return list(tokenizer.hf(text, add_special_tokens=False)["input_ids"])


def reply_spans(tokenizer: Tokenizer, turns: Sequence[str], replies: Sequence[str]) -> tuple[list[int], list[bool]]:
    """Chat-rendered token ids of user `turns` each followed by its reply (`replies`, as many or one fewer: then the
    ids end with the generation prompt of the last turn) and, per token, whether it belongs to an assistant reply
    (from the reply's first token to its end-of-turn token)."""
    messages: list[dict[str, str]] = []
    spans = []
    for i, turn in enumerate(turns):
        messages.append({"role": "user", "content": turn})
        if i < len(replies):
            start = len(render_messages(tokenizer, messages, generation_prompt=True))
            messages.append({"role": "assistant", "content": replies[i]})
            spans.append((start, len(render_messages(tokenizer, messages, generation_prompt=False))))
    ids = render_messages(tokenizer, messages, generation_prompt=len(replies) < len(turns))
    reply = [False] * len(ids)
    for start, end in spans:
        for position in range(start, min(end, len(ids))):
            reply[position] = True
    return ids, reply


def rendered_conversation(tokenizer: Tokenizer, prompt: Prompt, max_len: int) -> tuple[list[int], list[bool]]:
    """`reply_spans` of a conversation's turns and replies (as many turns as it has replies), cut at `max_len`."""
    turns = prompt.turns[: len(prompt.replies)]
    for count in range(1, len(turns) + 1):  # the fewest turns that reach max_len: later ones would be cut anyway
        ids, reply = reply_spans(tokenizer, turns[:count], prompt.replies[:count])
        if len(ids) >= max_len:
            break
    else:
        ids, reply = reply_spans(tokenizer, turns, prompt.replies) if turns else ([], [])
    return ids[:max_len], reply[:max_len]


def recording_layers(feature_layers: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """The layers to ask the target for: the feature layers and the last layer's output (for the final hidden state)."""
    return tuple(sorted(set(feature_layers) | {num_layers}))


def split_features(model: LlamaModel, stacked: Tensor, feature_layers: Sequence[int]) -> tuple[Tensor, Tensor]:
    """Features `[.., k * hidden]` taken at a model's `recording_layers` as the fused features of `feature_layers`
    `[.., len(feature_layers) * hidden]` and the final normed hidden states `[.., hidden]`."""
    recorded = recording_layers(feature_layers, len(model.layers))
    blocks = stacked.split(model.config.hidden_size, dim=-1)
    fused = (
        torch.cat([blocks[recorded.index(layer)] for layer in feature_layers], dim=-1)
        if feature_layers
        else stacked[..., :0]  # no feature layers: a store of final hidden states only (Medusa heads read those)
    )
    with torch.no_grad():
        final = model.norm(blocks[recorded.index(len(model.layers))].to(model.dtype))
    return fused, final


@torch.inference_mode()
def target_features(
    model: LlamaModel, sequences: Sequence[Sequence[int]], feature_layers: Sequence[int]
) -> list[tuple[Tensor, Tensor]]:
    """The target's fused features of `feature_layers` and final hidden states of each sequence, teacher-forced in one
    batch (right padding never reaches earlier positions of a causal model)."""
    model.set_feature_layers(recording_layers(feature_layers, len(model.layers)))
    from specsample.models.llama import Attention

    width = max(len(s) for s in sequences)
    batch = torch.zeros(len(sequences), width, dtype=torch.long)
    for row, seq in enumerate(sequences):
        batch[row, : len(seq)] = torch.tensor(seq)
    attend = Attention(
        None, None, torch.zeros(len(sequences), dtype=torch.long), width, model.config, model.groups, model.device
    )
    _, stacked = model.hidden_states(batch.to(model.device), attend)
    if stacked is None:
        raise RuntimeError("the target recorded no feature layers")
    features, final = split_features(model, stacked, feature_layers)
    return [(features[row, : len(seq)].cpu(), final[row, : len(seq)].cpu()) for row, seq in enumerate(sequences)]


class FeatureWriter:
    """Appends chunks of conversations; reopening a store continues after its last committed chunk."""

    def __init__(
        self,
        folder: Path,
        target: str,
        hidden_size: int,
        feature_layers: Sequence[int],
        vocab_size: int,
        max_len: int,
        source: str,
    ) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / "index.json"
        asked = {
            "target": target,
            "hidden_size": hidden_size,
            "feature_layers": list(feature_layers),
            "vocab_size": vocab_size,
            "max_len": max_len,
            "source": source,
        }
        if path.exists():
            self.index = read_index(self.folder)
            held = {k: self.index.get(k) for k in asked}
            if held != asked:
                raise ValueError(f"{self.folder} holds features of {held}; asked for {asked}")
        else:
            self.index = {
                "format": FORMAT,
                **asked,
                "chunks": [],
                "done": [],
                "sequences": 0,
                "tokens": 0,
                "reply_tokens": 0,
            }
        committed = {c["file"] for c in self.index["chunks"]}
        for stray in self.folder.glob("chunk-*.safetensors*"):  # written by a run that stopped before committing
            if stray.name not in committed:
                stray.unlink()

    @property
    def done(self) -> set[int]:
        """Source conversations handled so far (written, or skipped)."""
        return set(self.index["done"])

    @property
    def num_tokens(self) -> int:
        return self.index["tokens"]

    @property
    def num_sequences(self) -> int:
        return self.index["sequences"]

    def append(self, sequences: Sequence[FeatureSequence], done: Iterable[int]) -> None:
        """Write one chunk and commit it together with the source conversations it handled (none written: only
        those)."""
        done = sorted(set(self.index["done"]) | set(done))
        if not sequences:
            self.index["done"] = done
            _write_json(self.folder / "index.json", self.index)
            return
        name = f"chunk-{len(self.index['chunks']):05d}.safetensors"
        lengths = torch.tensor([0] + [len(s.tokens) for s in sequences], dtype=torch.long)
        reply = torch.cat([s.reply for s in sequences]).to(torch.uint8)
        tensors = {
            "tokens": torch.cat([s.tokens for s in sequences]).to(torch.int32),
            "features": torch.cat([s.features for s in sequences]).to(torch.bfloat16).contiguous(),
            "final": torch.cat([s.final for s in sequences]).to(torch.bfloat16).contiguous(),
            "reply": reply,
            "offsets": lengths.cumsum(0),
            "known": torch.tensor([s.known for s in sequences], dtype=torch.long),
        }
        tmp = self.folder / (name + ".tmp")
        save_file(tensors, str(tmp))
        os.replace(tmp, self.folder / name)
        self.index["chunks"].append({"file": name, "sequences": len(sequences), "tokens": int(lengths.sum())})
        self.index["done"] = done
        self.index["sequences"] += len(sequences)
        self.index["tokens"] += int(lengths.sum())
        self.index["reply_tokens"] += int(reply.sum())
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
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def shard_folders(folder: Path) -> list[Path]:
    """The stores a feature store folder holds: itself (a store of one writer), or its `shard-N` folders (a store
    several writers filled at once, each its own shard), in shard order."""
    folder = Path(folder)
    if (folder / "index.json").exists():
        return [folder]
    return sorted(
        (f for f in folder.glob("shard-*") if (f / "index.json").exists()),
        key=lambda f: int(f.name.removeprefix("shard-")),
    )


class FeatureReader:
    """The committed chunks of a store (all its shards, in shard order), one chunk in memory at a time."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        shards = shard_folders(self.folder)
        if not shards:
            raise ValueError(f"{folder} is not a feature store (no index.json, no shard-N/index.json)")
        indices = [read_index(shard) for shard in shards]
        first = indices[0]
        for shard, index in zip(shards[1:], indices[1:]):
            for key in ("target", "hidden_size", "feature_layers", "vocab_size", "max_len", "source"):
                if index[key] != first[key]:
                    raise ValueError(f"{shard} holds features of another {key} ({index[key]}) than {shards[0]}")
        self.index = {**first, "chunks": [], "done": [], "sequences": 0, "tokens": 0, "reply_tokens": 0}
        for shard, index in zip(shards, indices):
            prefix = shard.relative_to(self.folder)
            for chunk in index["chunks"]:
                path = shard / chunk["file"]
                if not path.exists():
                    raise ValueError(f"{path} is missing: the store is incomplete")
                self.index["chunks"].append({**chunk, "file": str(prefix / chunk["file"])})
            self.index["done"] += index["done"]
            for key in ("sequences", "tokens", "reply_tokens"):
                self.index[key] += index[key]

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

    def replies(self) -> int:
        """How many replies (user turns answered) the store's sequences hold: their runs of reply tokens."""
        count = 0
        for i in range(self.num_chunks):
            with safe_open(str(self.folder / self.index["chunks"][i]["file"]), framework="pt") as handle:
                reply = handle.get_tensor("reply").bool()
                offsets = handle.get_tensor("offsets")
            starts = reply.clone()
            starts[1:] &= ~reply[:-1]
            starts[offsets[:-1]] = reply[offsets[:-1]]  # a sequence starting inside a reply starts a run
            count += int(starts.sum())
        return count

    def chunk(self, i: int) -> list[FeatureSequence]:
        """The sequences of chunk `i`."""
        t = load_file(str(self.folder / self.index["chunks"][i]["file"]))
        offsets, known = t["offsets"].tolist(), t["known"].tolist()
        return [
            FeatureSequence(t["tokens"][a:b].long(), t["features"][a:b], t["final"][a:b], t["reply"][a:b].bool(), k)
            for a, b, k in zip(offsets[:-1], offsets[1:], known)
        ]


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


def collect_features(
    model: LlamaModel,
    tokenizer: Tokenizer,
    prompts: Iterable[Prompt],
    writer: FeatureWriter,
    max_tokens: int,
    batch_tokens: int = 8192,
    chunk_conversations: int = 64,
    progress: bool = True,
) -> None:
    """Run the target teacher-forced over conversations with replies (skipping those `writer` handled already) until
    the store holds `max_tokens` tokens or the prompts run out; conversations without a reply token are skipped."""
    bar = tqdm(
        total=max_tokens,
        initial=min(writer.num_tokens, max_tokens),
        desc="target features",
        unit="tok",
        unit_scale=True,
        disable=not progress,
    )
    done = writer.done
    source = ((i, p) for i, p in enumerate(prompts) if i not in done)
    max_len = writer.index["max_len"]
    while writer.num_tokens < max_tokens:
        chunk = [item for _, item in zip(range(chunk_conversations), source)]
        if not chunk:
            break
        items = []
        for _, prompt in chunk:
            ids, reply = rendered_conversation(tokenizer, prompt, max_len)
            if any(reply[1:]):
                items.append((ids, reply))
        sequences: list[FeatureSequence | None] = [None] * len(items)
        for batch in _length_batches(items, batch_tokens):
            for i, (features, final) in zip(
                batch, target_features(model, [items[i][0] for i in batch], writer.index["feature_layers"])
            ):
                ids, reply = items[i]
                sequences[i] = FeatureSequence(torch.tensor(ids), features, final, torch.tensor(reply), len(ids))
        before = writer.num_tokens
        filled = [s for s in sequences if s is not None]
        assert len(filled) == len(sequences)  # every item is in a batch
        writer.append(filled, [i for i, _ in chunk])
        bar.update(min(writer.num_tokens, max_tokens) - min(before, max_tokens))
    bar.close()
