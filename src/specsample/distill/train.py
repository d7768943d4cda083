"""Train a small Llama draft to match the target's next-token distributions (DistillSpec-style).

Loss: forward KL from the target's top-k distribution (renormalised over the tokens the draft can
emit) to the draft's. We use forward KL rather than total variation because its gradient is smooth
and non-zero everywhere, which trains fast from scratch; acceptance (1 - TV) is what we *measure*.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from specsample.distill.data import DataReader
from specsample.models.cpu import bf16_autocast
from specsample.models.llama import LlamaConfig, LlamaModel


@dataclass(frozen=True)
class DraftShape:
    """Architecture of the draft (Llama, tied embeddings, the target's tokenizer)."""

    width: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    mlp_ratio: float = 3.0

    def __post_init__(self) -> None:
        if self.width % self.heads or self.heads % self.kv_heads:
            raise ValueError(
                f"width ({self.width}) must divide by heads ({self.heads}), heads by kv_heads ({self.kv_heads})"
            )
        if (self.width // self.heads) % 2:
            raise ValueError("head dim (width / heads) must be even for RoPE")


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation settings; `steps` fixes the schedule (resumes reuse it)."""

    steps: int = 2000
    batch_tokens: int = 8192
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.01
    clip: float = 1.0
    seed: int = 0
    checkpoint_minutes: float = 5.0
    eval_every: int = 100
    heldout_every: int = 50  # every 50th sequence of each store is held out
    onpolicy_tail: float = 0.3  # the last 30% of steps train on on-policy data only (when there is any)
    max_eval_tokens: int = 20000


def draft_config(target: LlamaConfig, shape: DraftShape) -> LlamaConfig:
    """The draft's Llama config: the target's vocabulary, RoPE and context; a small body."""
    return LlamaConfig(
        vocab_size=target.vocab_size,
        hidden_size=shape.width,
        intermediate_size=int(round(shape.width * shape.mlp_ratio / 32)) * 32,
        num_layers=shape.layers,
        num_heads=shape.heads,
        num_kv_heads=shape.kv_heads,
        head_dim=shape.width // shape.heads,
        max_position_embeddings=target.max_position_embeddings,
        rms_norm_eps=target.rms_norm_eps,
        rope_theta=target.rope_theta,
        rope_scaling=target.rope_scaling,
        tie_word_embeddings=True,
    )


def init_draft(target: LlamaModel, shape: DraftShape, seed: int) -> LlamaModel:
    """A draft whose embedding is the target's projected onto its top singular directions."""
    config = draft_config(target.config, shape)
    generator = torch.Generator().manual_seed(seed)
    draft = LlamaModel(config)
    embed_source = target.embed.weight.detach().float().cpu()  # [vocab, target width]
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if name.endswith("norm.weight"):
                continue
            std = 0.02 / math.sqrt(2 * shape.layers) if name.endswith(("o_proj.weight", "down.weight")) else 0.02
            param.copy_(torch.randn(param.shape, generator=generator) * std)
        _, _, vh = torch.linalg.svd(embed_source, full_matrices=False)
        projected = embed_source @ vh[: shape.width].T  # [vocab, width]
        # small rows: the tied output layer starts with logits of order 1, not a confident wrong guess
        draft.embed.weight.copy_(projected / projected.pow(2).mean().sqrt() * 0.05)
    return draft


def _heldout_ids(count: int, every: int) -> np.ndarray:
    """Every `every`-th sequence; a store too small for that still holds out its last one."""
    ids = np.arange(every - 1, count, every, dtype=np.int64)
    return ids if len(ids) or count < 2 else np.array([count - 1], dtype=np.int64)


class Batches:
    """Deterministic, resumable batches of whole sequences from one or more stores."""

    def __init__(self, stores: list[DataReader], heldout_every: int, seed: int) -> None:
        self.stores = stores
        self.heldout = [_heldout_ids(len(s), heldout_every) for s in stores]
        self.train = [np.setdiff1d(np.arange(len(s), dtype=np.int64), h) for s, h in zip(stores, self.heldout)]
        self.seed = seed
        self.cursor = [[0, 0] for _ in stores]  # per store: epoch, position in its shuffled order

    def _order(self, store: int, epoch: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, store, epoch])
        return self.train[store][rng.permutation(len(self.train[store]))]

    def next(self, store: int, batch_tokens: int) -> list[int]:
        """Sequence ids of the next batch from `store` (whole sequences up to `batch_tokens`)."""
        if len(self.train[store]) == 0:
            raise ValueError(f"store {self.stores[store].folder} has no training sequences")
        picked: list[int] = []
        tokens = 0
        while True:
            epoch, pos = self.cursor[store]
            order = self._order(store, epoch)
            if pos >= len(order):
                self.cursor[store] = [epoch + 1, 0]
                continue
            seq = int(order[pos])
            length = int(self.stores[store].offsets[seq + 1] - self.stores[store].offsets[seq])
            if picked and tokens + length > batch_tokens:
                return picked
            picked.append(seq)
            tokens += length
            self.cursor[store] = [epoch, pos + 1]


def make_batch(store: DataReader, seq_ids: list[int], to_subset: torch.Tensor) -> dict[str, torch.Tensor]:
    """Padded tensors for sequences: tokens, target top-k (mapped to draft outputs), mask of scored positions."""
    seqs = [store[i] for i in seq_ids]
    metas = [store.index["meta"][i] if i < len(store.index["meta"]) else {} for i in seq_ids]
    width, k = max(len(s.tokens) for s in seqs), store.k
    tokens = torch.zeros(len(seqs), width, dtype=torch.long)
    ids = torch.zeros(len(seqs), width, k, dtype=torch.long)
    logp = torch.full((len(seqs), width, k), -1e4, dtype=torch.float32)
    mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    for row, (seq, meta) in enumerate(zip(seqs, metas)):
        n = len(seq.tokens)
        tokens[row, :n] = torch.from_numpy(seq.tokens.astype(np.int64))
        ids[row, :n] = torch.from_numpy(seq.topk_ids.astype(np.int64))
        logp[row, :n] = torch.from_numpy(seq.topk_logp.astype(np.float32))
        mask[row, max(int(meta.get("score_from", 1)) - 1, 0) : n] = True
    return {"tokens": tokens, "topk_ids": ids, "topk_sub": to_subset[ids], "topk_logp": logp, "mask": mask}


def distill_loss(draft: LlamaModel, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
    """Forward KL (as cross-entropy) from the target's top-k to the draft, over scored positions."""
    batch = {k: v.to(draft.device) for k, v in batch.items()}
    hidden = draft.uncached_hidden(batch["tokens"])
    log_q = torch.log_softmax(draft.subset_logits(hidden).float(), dim=-1)  # [b, n, K]
    sub = batch["topk_sub"]  # [b, n, k] index into the draft's outputs, -1 = not emittable
    p = batch["topk_logp"].exp() * (sub >= 0)
    p = p / p.sum(-1, keepdim=True).clamp(min=1e-9)
    log_q_at = log_q.gather(-1, sub.clamp(min=0))
    per_pos = -(p * log_q_at).sum(-1)  # [b, n]
    mask = batch["mask"]
    loss = per_pos[mask].mean()
    with torch.no_grad():
        q_at = log_q_at.exp() * (sub >= 0)
        p_raw = batch["topk_logp"].exp()
        alpha = torch.minimum(p_raw, q_at).sum(-1)[mask].mean()
        agree = (log_q.argmax(-1) == batch["topk_sub"][..., 0])[mask].float().mean()
    return loss, {"loss": loss.item(), "alpha": alpha.item(), "agree": agree.item()}


def _lr(step: int, config: TrainConfig) -> float:
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    progress = (step - config.warmup) / max(1, config.steps - config.warmup)
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return config.lr * (config.min_lr_ratio + (1 - config.min_lr_ratio) * cosine)


@torch.no_grad()
def heldout_metrics(
    draft: LlamaModel,
    stores: list[DataReader],
    batches: Batches,
    to_subset: torch.Tensor,
    max_tokens: int,
    batch_tokens: int,
) -> dict[str, float]:
    """Acceptance (sum of min(p, q) over the target's top-k, at temperature 1) and greedy agreement."""
    draft.eval()
    totals = {"loss": 0.0, "alpha": 0.0, "agree": 0.0}
    count = 0
    for s, store in enumerate(stores):
        ids = batches.heldout[s].tolist()
        used = 0
        while ids and used < max_tokens // max(1, len(stores)):
            chunk, tokens = [], 0
            while ids and tokens < batch_tokens:
                seq = ids.pop(0)
                chunk.append(seq)
                tokens += int(store.offsets[seq + 1] - store.offsets[seq])
            batch = make_batch(store, chunk, to_subset)
            with bf16_autocast(draft.device):
                _, metrics = distill_loss(draft, batch)
            weight = int(batch["mask"].sum())
            for key in totals:
                totals[key] += metrics[key] * weight
            count += weight
            used += tokens
    draft.train()
    return {k: v / count for k, v in totals.items()} if count else {k: float("nan") for k in totals}


def train(
    draft: LlamaModel,
    stores: list[DataReader],
    onpolicy: list[int],
    config: TrainConfig,
    work: Path,
    resume: bool,
    minutes: float | None = None,
    progress: bool = True,
    stop_after: int | None = None,
) -> dict[str, Any]:
    """Train `draft` (its output subset set) on `stores`; checkpoints to `work/checkpoint.pt`.

    `onpolicy` lists the indices of on-policy stores, used alone for the last `onpolicy_tail` of steps.
    Returns the training record (config, curve, step). `minutes` bounds this call's wall time and
    `stop_after` its number of steps; either way it checkpoints, and a resumed call continues exactly.
    """
    work.mkdir(parents=True, exist_ok=True)
    ckpt_path = work / "checkpoint.pt"
    assert draft.output_subset is not None, "set the draft's output subset before training"
    to_subset = torch.full((draft.vocab_size,), -1, dtype=torch.long)
    to_subset[draft.output_subset.cpu()] = torch.arange(len(draft.output_subset))
    optimizer = torch.optim.AdamW(draft.parameters(), lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.95))
    batches = Batches(stores, config.heldout_every, config.seed)
    record: dict[str, Any] = {"config": asdict(config), "curve": [], "step": 0, "tokens_seen": 0}
    if ckpt_path.exists():
        if not resume:
            raise ValueError(f"{work} already has a checkpoint; pass --resume to continue it or use another --out")
        state = torch.load(ckpt_path, weights_only=False)
        draft.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        batches.cursor = state["cursor"]
        record = state["record"]
        if record["config"] != asdict(config):
            raise ValueError(
                "--resume with different training settings than the checkpoint "
                f"({record['config']} vs {asdict(config)})"
            )
    sizes = np.array([len(b) for b in batches.train], dtype=np.float64)
    mix = sizes / sizes.sum()
    started, last_ckpt, first_step = time.monotonic(), time.monotonic(), record["step"]
    draft.train()
    bar = tqdm(total=config.steps, initial=record["step"], desc="distill", unit="step", disable=not progress)
    latest = record["curve"][-1] if record["curve"] else {}
    while record["step"] < config.steps:
        step = record["step"]
        tail = onpolicy and step >= (1 - config.onpolicy_tail) * config.steps
        store = int(onpolicy[step % len(onpolicy)]) if tail else _pick_store(config.seed, step, mix)
        batch = make_batch(stores[store], batches.next(store, config.batch_tokens), to_subset)
        for group in optimizer.param_groups:
            group["lr"] = _lr(step, config)
        with bf16_autocast(draft.device):
            loss, metrics = distill_loss(draft, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), config.clip)
        optimizer.step()
        record["step"] = step + 1
        record["tokens_seen"] += int(batch["mask"].sum())
        if record["step"] % config.eval_every == 0 or record["step"] == config.steps:
            held = heldout_metrics(draft, stores, batches, to_subset, config.max_eval_tokens, config.batch_tokens)
            latest = {
                "step": record["step"],
                "tokens_seen": record["tokens_seen"],
                "train_loss": metrics["loss"],
                "heldout_loss": held["loss"],
                "heldout_alpha": held["alpha"],
                "heldout_agree": held["agree"],
            }
            record["curve"].append(latest)
        bar.update(1)
        bar.set_postfix(
            loss=f"{metrics['loss']:.3f}", heldout_alpha=f"{latest['heldout_alpha']:.3f}" if latest else "pending"
        )
        out_of_time = (minutes is not None and time.monotonic() - started > 60 * minutes) or (
            stop_after is not None and record["step"] - first_step >= stop_after
        )
        if (
            time.monotonic() - last_ckpt > 60 * config.checkpoint_minutes
            or out_of_time
            or record["step"] == config.steps
        ):
            _save(ckpt_path, draft, optimizer, batches, record)
            last_ckpt = time.monotonic()
        if out_of_time:
            break
    bar.close()
    return record


def _pick_store(seed: int, step: int, mix: np.ndarray) -> int:
    """Which store a step draws from: a function of (seed, step) alone, so resumes replay it."""
    return int(np.random.default_rng([seed, 7, step]).choice(len(mix), p=mix))


def _save(
    path: Path, draft: LlamaModel, optimizer: torch.optim.Optimizer, batches: Batches, record: dict[str, Any]
) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(
        {"model": draft.state_dict(), "optimizer": optimizer.state_dict(), "cursor": batches.cursor, "record": record},
        tmp,
    )
    os.replace(tmp, path)
    (path.parent / "curve.json").write_text(json.dumps(record["curve"], indent=1))


def choose_output_subset(stores: list[DataReader], vocab_size: int, size: int | None) -> torch.Tensor:
    """The `size` tokens the target ranks first most often (FR-Spec); all tokens when size is None."""
    if size is None or size >= vocab_size:
        return torch.arange(vocab_size)
    counts = np.zeros(vocab_size, dtype=np.int64)
    for store in stores:
        top1 = np.asarray(store.topk_ids[: store.num_tokens, 0], dtype=np.int64)
        counts += np.bincount(top1, minlength=vocab_size)
    return torch.from_numpy(np.sort(np.argsort(-counts, kind="stable")[:size]))
