"""Distillation data on disk: token ids plus the target's top-k next-token distribution per position.

A store is a folder of flat memory-mapped arrays and an `index.json` that is rewritten (atomically)
after every appended batch, so an interrupted writer resumes from its last committed batch:

    tokens.bin     int32   [total_tokens]            all sequences back to back
    topk_ids.bin   uint16 / int32 [total_tokens, k]  target's top-k ids for the token after each position
    topk_logp.bin  float16 [total_tokens, k]         their log-probabilities
    index.json     offsets of each sequence, k, vocab, dtypes, committed sizes, per-sequence metadata
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "specsample-distill-data/1"


@dataclass(frozen=True)
class Sequence_:
    """One stored sequence: tokens `[n]`, top-k ids `[n, k]`, top-k log-probs `[n, k]`."""

    tokens: np.ndarray
    topk_ids: np.ndarray
    topk_logp: np.ndarray


class DataWriter:
    """Appends scored sequences; reopening an existing store continues after its last commit."""

    def __init__(self, folder: Path, k: int, vocab_size: int, kind: str) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        index_path = self.folder / "index.json"
        if index_path.exists():
            self.index = _read_index(self.folder)
            if self.index["k"] != k or self.index["vocab_size"] != vocab_size:
                raise ValueError(
                    f"{self.folder} holds k={self.index['k']}, vocab={self.index['vocab_size']}; "
                    f"asked for k={k}, vocab={vocab_size}"
                )
        else:
            self.index = {
                "format": FORMAT,
                "kind": kind,
                "k": k,
                "vocab_size": vocab_size,
                "id_dtype": "uint16" if vocab_size <= 65536 else "int32",
                "offsets": [0],
                "meta": [],
                "complete": False,
            }
        self._truncate_to_committed()

    @property
    def num_sequences(self) -> int:
        return len(self.index["offsets"]) - 1

    @property
    def num_tokens(self) -> int:
        return self.index["offsets"][-1]

    def _truncate_to_committed(self) -> None:
        """Drop bytes written after the last commit (an interrupted append)."""
        total, k = self.num_tokens, self.index["k"]
        id_size = np.dtype(self.index["id_dtype"]).itemsize
        for name, size in (
            ("tokens.bin", total * 4),
            ("topk_ids.bin", total * k * id_size),
            ("topk_logp.bin", total * k * 2),
        ):
            path = self.folder / name
            with path.open("ab") as handle:
                handle.truncate(size)

    def append(self, batch: list[Sequence_], meta: list[dict[str, Any]] | None = None) -> None:
        """Append sequences and commit them (data first, then the index, atomically)."""
        k = self.index["k"]
        id_dtype = np.dtype(self.index["id_dtype"])
        with (
            (self.folder / "tokens.bin").open("ab") as tok,
            (self.folder / "topk_ids.bin").open("ab") as ids,
            (self.folder / "topk_logp.bin").open("ab") as logp,
        ):
            for seq in batch:
                n = len(seq.tokens)
                if seq.topk_ids.shape != (n, k) or seq.topk_logp.shape != (n, k):
                    raise ValueError(f"sequence of {n} tokens needs top-k arrays of shape ({n}, {k})")
                tok.write(np.asarray(seq.tokens, dtype=np.int32).tobytes())
                ids.write(np.asarray(seq.topk_ids).astype(id_dtype).tobytes())
                logp.write(np.asarray(seq.topk_logp).astype(np.float16).tobytes())
                self.index["offsets"].append(self.index["offsets"][-1] + n)
            for handle in (tok, ids, logp):
                handle.flush()
                os.fsync(handle.fileno())
        self.index["meta"].extend(meta or [{} for _ in batch])
        self._write_index()

    def finish(self) -> None:
        """Mark the store complete (readers may require it)."""
        self.index["complete"] = True
        self._write_index()

    def _write_index(self) -> None:
        tmp = self.folder / "index.json.tmp"
        tmp.write_text(json.dumps(self.index))
        os.replace(tmp, self.folder / "index.json")


def _read_index(folder: Path) -> dict[str, Any]:
    path = folder / "index.json"
    if not path.exists():
        raise ValueError(f"{folder} is not a distillation data store (no index.json)")
    try:
        index = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is corrupt: {exc}") from exc
    if index.get("format") != FORMAT:
        raise ValueError(f"{path} has format {index.get('format')!r}, expected {FORMAT!r}")
    return index


class DataReader:
    """Memory-mapped access to a store; sizes are checked against the index up front."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.index = _read_index(self.folder)
        total, k = self.index["offsets"][-1], self.index["k"]
        id_dtype = np.dtype(self.index["id_dtype"])
        expected = {
            "tokens.bin": total * 4,
            "topk_ids.bin": total * k * id_dtype.itemsize,
            "topk_logp.bin": total * k * 2,
        }
        for name, size in expected.items():
            path = self.folder / name
            actual = path.stat().st_size if path.exists() else -1
            if actual < size:
                raise ValueError(f"{path} is truncated: {actual} bytes, the index needs {size}")
        self.offsets = np.asarray(self.index["offsets"], dtype=np.int64)
        self.k = k
        self.vocab_size = self.index["vocab_size"]
        shape = (max(total, 1), k)
        self.tokens = (
            np.memmap(self.folder / "tokens.bin", dtype=np.int32, mode="r", shape=(max(total, 1),))
            if total
            else np.zeros(0, np.int32)
        )
        self.topk_ids = (
            np.memmap(self.folder / "topk_ids.bin", dtype=id_dtype, mode="r", shape=shape)
            if total
            else np.zeros((0, k), id_dtype)
        )
        self.topk_logp = (
            np.memmap(self.folder / "topk_logp.bin", dtype=np.float16, mode="r", shape=shape)
            if total
            else np.zeros((0, k), np.float16)
        )

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, i: int) -> Sequence_:
        begin, end = int(self.offsets[i]), int(self.offsets[i + 1])
        return Sequence_(
            np.asarray(self.tokens[begin:end]),
            np.asarray(self.topk_ids[begin:end]),
            np.asarray(self.topk_logp[begin:end]),
        )
