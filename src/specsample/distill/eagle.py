"""`specsample distill --kind eagle`: train an EAGLE-3 head (`models/eagle_head.py`) for a Llama-family target.

1. Data (`distill/features.py`, chunked and resumable): conversations the target writes itself, its features recorded
   as it writes them (`--data regenerate`, the default: `distill/regenerate.py`), or a dataset's own replies run
   through the target teacher-forced (`--data teacher`). Per token: the fused features of the feature layers, the
   final hidden state and whether it belongs to a reply.
2. Draft vocabulary (FR-Spec, EAGLE-3's d2t): the `draft_vocab` tokens most frequent in the replies.
3. Training with EAGLE-3's training-time test: entry t reads token t + 1's embedding and the fused features of
   position t and predicts token t + 2; each of `unroll` steps drafts once more from the head's own outputs (entry t
   of step s reads the output entry t - 1 made in step s - 1, and attends as the head's cache holds that draft);
   the loss is the cross-entropy from the target's distribution at t + 1 (over the draft vocabulary) to the head's,
   on reply positions, step s weighted `step_decay` ** (s - 1). Resumable: a checkpoint holds the weights, the
   optimiser, the data cursor and the curve, so a resumed run ends with the same weights as an uninterrupted one.
4. Export: the head's folder in the published layout, its evaluation (acceptance by position at T 0 and 0.7 through
   the real engine, the cost ratio) and its model card.
"""

from __future__ import annotations

import functools
import json
import math
import operator
import os
import statistics
import sys
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

from specsample.config import SamplingParams, SpecConfig
from specsample.datasets import Prompt, sharegpt_prompts, spec_bench_prompts, text_file_prompts, training_conversations
from specsample.distill.card import portable_command, portable_spec
from specsample.distill.features import FeatureReader, FeatureSequence, FeatureWriter, collect_features
from specsample.distill.regenerate import Regeneration, regenerate_store
from specsample.drafters.eagle import EagleDrafter
from specsample.engine import Engine
from specsample.metrics import StatsCollector
from specsample.models.cpu import bf16_autocast
from specsample.models.eagle_head import EagleHead, HeadConfig, default_feature_layers, load_head, save_head
from specsample.models.llama import LlamaConfig, LlamaModel
from specsample.models.loader import LoadedModel, load_model
from specsample.models.quant import QUANT_MODES
from specsample.planner import FixedGamma
from specsample.tokenizer import Tokenizer

DATA_SOURCES = ("regenerate", "teacher")
METRICS_EVERY = 10  # training steps between measurements of the head's acceptance on its batch


@dataclass(frozen=True)
class HeadTraining:
    """What `specsample distill --kind eagle` does (a resumed run must pass the same settings, but `tokens`, which
    only bounds data collection)."""

    target: str
    out: Path
    prompts: str = "sharegpt"  # 'sharegpt' (conversations 0..14999; later ones stay held out) or a prompt file
    data: str = "regenerate"  # 'regenerate': the target writes the replies; 'teacher': the prompts' own replies
    regeneration: Regeneration = field(default_factory=Regeneration)
    tokens: int = 12_000_000  # tokens of conversation to collect (prompts and replies)
    max_len: int = 1536  # tokens per conversation (longer ones are cut)
    feature_layers: tuple[int, ...] | None = None  # None: EAGLE-3's low, middle and high layer of the target
    draft_vocab: int = 8192  # draft vocabulary size (tokens most frequent in the replies)
    epochs: float = 1.0
    batch_tokens: int = 16384
    lr: float = 1e-3
    min_lr_ratio: float = 0.05
    warmup: int = 50
    weight_decay: float = 0.0
    clip: float = 0.5
    unroll: int = 3  # drafting steps trained per entry (the training-time test)
    step_decay: float = 0.8  # the loss of drafting step s weighs step_decay ** (s - 1)
    quantize: str = "auto"  # the target's weights while it writes or scores the data (models/quant.py QUANT_MODES)
    seed: int = 0
    checkpoint_minutes: float = 10.0
    eval_every: int = 100  # steps between held-out measurements
    eval_prompts: str = "spec-bench"  # spec-bench (per category), sharegpt-heldout or a prompt file
    eval_per_category: int = 4
    eval_max_new_tokens: int = 64
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.tokens < 1 or self.max_len < 8 or self.batch_tokens < self.max_len:
            raise ValueError("need tokens >= 1, max_len >= 8 and batch_tokens >= max_len")
        if self.data not in DATA_SOURCES:
            raise ValueError(f"data must be one of {', '.join(DATA_SOURCES)}, got {self.data!r}")
        if self.unroll < 1:
            raise ValueError(f"unroll must be >= 1, got {self.unroll}")
        if not 0 < self.step_decay <= 1:
            raise ValueError(f"step_decay must be in (0, 1], got {self.step_decay}")
        if self.epochs <= 0 or self.lr <= 0:
            raise ValueError(f"epochs and lr must be > 0, got {self.epochs}, {self.lr}")
        if self.draft_vocab < 2:
            raise ValueError(f"draft_vocab must be >= 2, got {self.draft_vocab}")
        if self.quantize not in QUANT_MODES:
            raise ValueError(f"quantize must be one of {', '.join(QUANT_MODES)}, got {self.quantize!r}")

    @property
    def work(self) -> Path:
        return self.out / ".work"


def _log(message: str) -> None:
    print(f"specsample distill: {message}", file=sys.stderr, flush=True)


# ----- data ----------------------------------------------------------------------------------


def collect(plan: HeadTraining, target: LoadedModel, progress: bool) -> FeatureReader:
    """Stage 1: the feature store, filled to `plan.tokens` (unless training has begun: its data is then final)."""
    model = target.llama()
    layers = plan.feature_layers or default_feature_layers(len(model.layers))
    store = plan.work / "features"
    started = (plan.work / "train" / "checkpoint.pt").exists()
    if plan.data == "regenerate":
        if not started:
            regenerate_store(
                store,
                plan.target,
                plan.quantize,
                plan.device,
                plan.prompts,
                plan.regeneration,
                layers,
                plan.max_len,
                plan.tokens,
                loaded=target,
                progress=progress,
            )
        return FeatureReader(store)
    writer = FeatureWriter(
        store / "shard-0",
        plan.target,
        model.config.hidden_size,
        layers,
        model.vocab_size,
        plan.max_len,
        "teacher-forced",
    )
    if writer.num_tokens < plan.tokens and not started:
        collect_features(
            model, target.text_tokenizer(), training_conversations(plan.prompts), writer, plan.tokens, progress=progress
        )
    return FeatureReader(store)


def choose_vocab(reader: FeatureReader, vocab_size: int, size: int) -> torch.Tensor:
    """The `size` tokens most frequent in the replies (in id order): the head's draft vocabulary."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for i in range(reader.num_chunks):
        for seq in reader.chunk(i):
            counts += torch.bincount(seq.tokens[seq.reply], minlength=vocab_size)
    size = min(size, vocab_size)
    return torch.sort(torch.argsort(counts, descending=True, stable=True)[:size]).values


def vocab_coverage(reader: FeatureReader, ids: torch.Tensor, vocab_size: int) -> float:
    """The share of reply tokens in the held-out chunk that the draft vocabulary holds."""
    inside = torch.zeros(vocab_size, dtype=torch.bool)
    inside[ids] = True
    chunk = reader.num_chunks - 1
    tokens = torch.cat([s.tokens[s.reply] for s in reader.chunk(chunk)])
    return float(inside[tokens].float().mean()) if len(tokens) else float("nan")


class Batches:
    """Deterministic, resumable batches: per epoch a seeded order of the training chunks, and per chunk a seeded
    order of its sequences grouped into batches of up to `batch_tokens` (similar lengths together)."""

    def __init__(self, reader: FeatureReader, batch_tokens: int, seed: int) -> None:
        self.reader, self.batch_tokens, self.seed = reader, batch_tokens, seed
        self.train_chunks = list(range(max(reader.num_chunks - 1, 1)))  # the last chunk is held out
        self.heldout_chunk = reader.num_chunks - 1 if reader.num_chunks > 1 else None
        self.cursor = [0, 0, 0]  # epoch, chunk position in the epoch's order, batch within the chunk
        self._loaded: tuple[tuple[int, int], list] | None = None

    def _group(self, lengths: list[int], order: list[int]) -> list[list[int]]:
        """Indices in `order`, sorted by length, cut into batches of up to `batch_tokens` padded tokens."""
        batches: list[list[int]] = []
        current: list[int] = []
        width = 0
        for i in sorted(order, key=lambda i: lengths[i]):
            n = lengths[i]
            if current and (len(current) + 1) * max(width, n) > self.batch_tokens:
                batches.append(current)
                current, width = [], 0
            current.append(i)
            width = max(width, n)
        if current:
            batches.append(current)
        return batches

    def _plan(self, chunk: int, epoch: int) -> list[list]:
        sequences = self.reader.chunk(chunk)
        rng = np.random.default_rng([self.seed, epoch, chunk])
        batches = self._group([len(s.tokens) for s in sequences], rng.permutation(len(sequences)).tolist())
        return [[sequences[i] for i in batches[j]] for j in rng.permutation(len(batches))]

    def batches_per_epoch(self) -> int:
        """How many batches one pass over the training chunks makes (padding leaves fewer tokens in a batch than
        `batch_tokens`); the count does not depend on the epoch's order."""
        total = 0
        for chunk in self.train_chunks:
            lengths = self.reader.lengths(chunk)
            total += len(self._group(lengths, list(range(len(lengths)))))
        return total

    def next(self) -> list[FeatureSequence]:
        """The next batch of sequences (cycling through epochs)."""
        while True:
            epoch, position, index = self.cursor
            order = np.random.default_rng([self.seed, epoch]).permutation(self.train_chunks).tolist()
            chunk = order[position]
            if self._loaded is None or self._loaded[0] != (epoch, chunk):
                self._loaded = ((epoch, chunk), self._plan(chunk, epoch))
            batches = self._loaded[1]
            if index < len(batches):
                self.cursor = [epoch, position, index + 1]
                return batches[index]
            self.cursor = [epoch, position + 1, 0] if position + 1 < len(order) else [epoch + 1, 0, 0]


def make_batch(sequences: list[FeatureSequence], device: torch.device) -> dict[str, torch.Tensor]:
    """Right-padded tokens `[b, L]`, fused features `[b, L, F]` and final hidden states `[b, L, H]` (bfloat16), and
    the loss mask `[b, L - 1]`: entry t counts where t + 1 is a reply position whose features are known."""
    width = max(len(s.tokens) for s in sequences)
    tokens = torch.zeros(len(sequences), width, dtype=torch.long)
    features = torch.zeros(len(sequences), width, sequences[0].features.shape[-1], dtype=torch.bfloat16)
    final = torch.zeros(len(sequences), width, sequences[0].final.shape[-1], dtype=torch.bfloat16)
    mask = torch.zeros(len(sequences), width - 1, dtype=torch.bool)
    for row, seq in enumerate(sequences):
        n = len(seq.tokens)
        tokens[row, :n] = seq.tokens
        features[row, :n] = seq.features
        final[row, :n] = seq.final
        mask[row, : seq.known - 1] = seq.reply[1 : seq.known]
    lengths = torch.tensor([len(s.tokens) for s in sequences])
    return {
        "tokens": tokens.to(device),
        "features": features.to(device),
        "final": final.to(device),
        "mask": mask.to(device),
        "lengths": lengths,
    }


# ----- loss ----------------------------------------------------------------------------------


class Frozen:
    """What training reads of the target without training it: its embedding, and its output layer's rows of the
    draft vocabulary (for the target's distribution over it)."""

    def __init__(self, target: LlamaModel, draft_ids: torch.Tensor, device: torch.device) -> None:
        self.embed = target.embed.weight.detach().to(device, torch.bfloat16)
        weight = target.lm_head.weight.detach()  # a quantized output layer hands out float32
        self.out = weight[draft_ids.to(weight.device)].to(device, torch.bfloat16).contiguous()  # [K, hidden]


class UnrolledAttention:
    """The head's attention over whole sequences for `unroll` drafting steps at once (EAGLE-3's training-time test).

    Step 1 is teacher-forced: entry t sees entries 0..t, all read with the target's features. At step s > 1, entry t
    stands for the (s - 1)-th draft past a last true entry e = t - s + 1: it sees the true entries 0..e, the entry
    step j made at position e + j - 1 for each j in 2..s - 1, and itself, as the head's cache holds them while it
    drafts. Call `__call__` once per step, in order: step s attends over the keys of every step so far at once
    (fused attention with that mask; grouped-query heads read their shared keys without copies)."""

    def __init__(self, config: LlamaConfig, batch: int, n: int, device: torch.device) -> None:
        self.rope_positions = torch.arange(n, device=device).unsqueeze(0).expand(batch, n)
        self.positions = self.rope_positions
        self.keys: list[torch.Tensor] = []  # per step [b, KVH, n, hd]
        self.values: list[torch.Tensor] = []
        self.layer = 0

    @staticmethod
    def mask(n: int, step: int, device: torch.device) -> torch.Tensor:
        """`[n, step * n]` which keys (the true entries', then each later step's) query t of drafting step `step`
        sees."""
        query = torch.arange(n, device=device).view(-1, 1)
        key = torch.arange(n, device=device).view(1, -1)
        parts = [key <= query - step + 1] + [key == query - (step - j) for j in range(2, step + 1)]
        return torch.cat(parts, dim=1)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        batch, n, heads, head_dim = q.shape
        q = q.transpose(1, 2)  # [b, H, n, hd]
        self.keys.append(k.transpose(1, 2))  # [b, KVH, n, hd]
        self.values.append(v.transpose(1, 2))
        step = len(self.keys)
        if step == 1:
            out = F.scaled_dot_product_attention(q, self.keys[0], self.values[0], is_causal=True, enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(
                q,
                torch.cat(self.keys, dim=2),
                torch.cat(self.values, dim=2),
                attn_mask=self.mask(n, step, q.device),
                enable_gqa=True,
            )
        return out.transpose(1, 2).reshape(batch, n, heads * head_dim)


def head_loss(
    head: EagleHead,
    frozen: Frozen,
    batch: dict[str, torch.Tensor],
    unroll: int,
    step_decay: float,
    metrics: bool = True,
) -> tuple[torch.Tensor, dict[str, float]]:
    """EAGLE-3's loss over the masked entries: per drafting step s, the cross-entropy from the target's next-token
    distribution (over the draft vocabulary, renormalised there) to the head's, weighted step_decay ** (s - 1); with
    `metrics`, per step the KL divergence (the cross-entropy less the target's entropy), the head's acceptance
    sum(min(p, q)) at temperature 1 and its greedy agreement with the target (else only the loss)."""
    tokens, mask = batch["tokens"], batch["mask"]
    embeddings = F.embedding(tokens[:, 1:], frozen.embed)  # [b, L - 1, H]: token t + 1 at entry t
    hidden = head.fc(batch["features"][:, :-1])  # [b, L - 1, H]: the fused features, projected
    with torch.no_grad():
        log_p = torch.log_softmax((batch["final"][:, 1:][mask] @ frozen.out.T).float(), dim=-1)  # [M, K]
        p = log_p.exp()
    batch_size, length = embeddings.shape[:2]
    attend = UnrolledAttention(head.layer_config, batch_size, length, embeddings.device)
    terms: list[Tensor] = []  # each step's weighted loss
    weights, out = 0.0, {}
    for step in range(1, unroll + 1):
        valid = mask.clone()
        valid[:, : step - 1] = False  # no (step - 1)-th draft before position step - 1
        rows = valid[mask]  # the masked entries this step counts
        outputs = head(embeddings, hidden, attend)  # [b, L - 1, H]
        logits = head.logits(outputs[valid]).float()  # [M_s, K]
        target = p[rows]
        cross = F.cross_entropy(logits, target)  # soft targets: one fused pass over the logits
        weight = step_decay ** (step - 1)
        terms.append(weight * cross)
        weights += weight
        if metrics:
            with torch.no_grad():
                log_q = torch.log_softmax(logits, dim=-1)
                suffix = "" if step == 1 else f"_{step}"
                out.update(
                    {
                        f"cross_entropy{suffix}": cross.item(),
                        f"kl{suffix}": (cross + (target * log_p[rows]).sum(-1).mean()).item(),
                        f"alpha{suffix}": torch.minimum(target, log_q.exp()).sum(-1).mean().item(),
                        f"agree{suffix}": (target.argmax(-1) == log_q.argmax(-1)).float().mean().item(),
                    }
                )
        hidden = torch.cat([hidden[:, :1], outputs[:, :-1].to(hidden.dtype)], dim=1)  # entry t: output at t - 1
    loss = functools.reduce(operator.add, terms) / weights
    out["loss"] = loss.item()
    return loss, out


# ----- training ------------------------------------------------------------------------------


def _lr(step: int, steps: int, plan: HeadTraining) -> float:
    if step < plan.warmup:
        return plan.lr * (step + 1) / plan.warmup
    progress = (step - plan.warmup) / max(1, steps - plan.warmup)
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return plan.lr * (plan.min_lr_ratio + (1 - plan.min_lr_ratio) * cosine)


def init_head(target: LlamaModel, draft_ids: torch.Tensor, feature_layers: tuple[int, ...], seed: int) -> EagleHead:
    """A new head at the target's shape: the projection passes the highest feature layer through, the decoder layer's
    residual branches start at zero (their output projections), the output layer and final norm as the target's
    (its rows of the draft vocabulary), the rest small and random; so training starts from the target's own early
    exit at that layer rather than from noise."""
    config = HeadConfig.for_target(target.config, len(draft_ids), feature_layers)
    head = EagleHead(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in head.named_parameters():
            if name.endswith("norm.weight"):
                continue
            param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
        head.o_proj.weight.zero_()
        head.down.weight.zero_()
        hidden = config.target_hidden_size
        if config.hidden_size == hidden:
            head.fc.weight[:, -hidden:] += torch.eye(hidden)
        head.lm_head.weight.copy_(target.lm_head.weight.detach()[draft_ids.to(target.device)].float().cpu())
        head.norm.weight.copy_(target.norm.weight.detach().float().cpu())
        head.d2t.copy_(draft_ids.cpu() - torch.arange(len(draft_ids)))
    return head


@torch.no_grad()
def heldout(
    head: EagleHead,
    frozen: Frozen,
    batches: Batches,
    plan: HeadTraining,
    device: torch.device,
    limit_tokens: int = 60_000,
) -> dict[str, float]:
    """The loss and acceptance over (up to `limit_tokens` of) the held-out chunk."""
    if batches.heldout_chunk is None:
        return {}
    head.eval()
    sequences = batches.reader.chunk(batches.heldout_chunk)
    sums: dict[str, float] = defaultdict(float)
    weight, used = 0, 0
    for start in range(0, len(sequences), 8):
        group = sequences[start : start + 8]
        batch = make_batch(group, device)
        with bf16_autocast(device):
            _, metrics = head_loss(head, frozen, batch, plan.unroll, plan.step_decay)
        n = int(batch["mask"].sum())
        for key, value in metrics.items():
            sums[key] += value * n
        weight += n
        used += sum(len(s.tokens) for s in group)
        if used >= limit_tokens:
            break
    head.train()
    return {k: v / max(weight, 1) for k, v in sums.items()}


def train_head(
    head: EagleHead,
    frozen: Frozen,
    reader: FeatureReader,
    plan: HeadTraining,
    work: Path,
    progress: bool = True,
    minutes: float | None = None,
    stop_after: int | None = None,
) -> dict[str, Any]:
    """Train `head`; checkpoints to `work/checkpoint.pt` (a later call resumes it exactly). `minutes` and
    `stop_after` bound this call (it checkpoints, and a resumed call continues). Returns the training record:
    steps, tokens seen, token-steps (reply entries trained, summed over the drafting steps) and the curve."""
    device = torch.device(plan.device)
    work.mkdir(parents=True, exist_ok=True)
    path = work / "checkpoint.pt"
    head.to(device).train()
    optimizer = torch.optim.AdamW(head.parameters(), lr=plan.lr, weight_decay=plan.weight_decay, betas=(0.9, 0.95))
    batches = Batches(reader, plan.batch_tokens, plan.seed)
    steps = max(1, round(plan.epochs * batches.batches_per_epoch()))
    record: dict[str, Any] = {
        "steps": steps,
        "step": 0,
        "tokens_seen": 0,
        "token_steps": 0,
        "seconds": 0.0,
        "curve": [],
    }
    if path.exists():
        state = torch.load(path, weights_only=False)
        head.load_state_dict(state["head"])
        optimizer.load_state_dict(state["optimizer"])
        batches.cursor, record = state["cursor"], state["record"]
        record["steps"] = steps  # the schedule's length follows from the data and the settings
    started = last_save = time.monotonic()
    first = record["step"]
    bar = tqdm(total=record["steps"], initial=record["step"], desc="train head", unit="step", disable=not progress)
    window: list[dict[str, float]] = []
    while record["step"] < record["steps"]:
        step = record["step"]
        tick = time.monotonic()
        batch = make_batch(batches.next(), device)
        for group in optimizer.param_groups:
            group["lr"] = _lr(step, record["steps"], plan)
        with bf16_autocast(device):  # the train metrics every METRICS_EVERY steps: they cost a pass over the logits
            loss, metrics = head_loss(head, frozen, batch, plan.unroll, plan.step_decay, step % METRICS_EVERY == 0)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), plan.clip)
        optimizer.step()
        record["step"] = step + 1
        record["tokens_seen"] += int(batch["lengths"].sum())
        mask = batch["mask"]
        record["token_steps"] += sum(int(mask[:, s:].sum()) for s in range(plan.unroll))
        record["seconds"] += time.monotonic() - tick
        window.append(metrics)
        if record["step"] % plan.eval_every == 0 or record["step"] == record["steps"]:
            point = {
                "step": record["step"],
                "tokens_seen": record["tokens_seen"],
                "token_steps": record["token_steps"],
                **{
                    f"train_{k}": statistics.fmean(w[k] for w in window if k in w)
                    for k in sorted({k for w in window for k in w})
                },
                **{f"heldout_{k}": v for k, v in heldout(head, frozen, batches, plan, device).items()},
            }
            record["curve"].append(point)
            window = []
        bar.update(1)
        bar.set_postfix(loss=f"{metrics['loss']:.3f}")
        out_of_time = (minutes is not None and time.monotonic() - started > 60 * minutes) or (
            stop_after is not None and record["step"] - first >= stop_after
        )
        if (
            out_of_time
            or record["step"] == record["steps"]
            or time.monotonic() - last_save > 60 * plan.checkpoint_minutes
        ):
            _save(path, head, optimizer, batches, record)
            last_save = time.monotonic()
        if out_of_time:
            break
    bar.close()
    return record


def _save(
    path: Path, head: EagleHead, optimizer: torch.optim.Optimizer, batches: Batches, record: dict[str, Any]
) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(
        {"head": head.state_dict(), "optimizer": optimizer.state_dict(), "cursor": batches.cursor, "record": record},
        tmp,
    )
    os.replace(tmp, path)
    (path.parent / "curve.json").write_text(json.dumps(record["curve"], indent=1))


# ----- evaluation ----------------------------------------------------------------------------


def eval_prompts(name: str, per_category: int) -> list[Prompt]:
    """Spec-Bench (`per_category` of each category), ShareGPT conversations past the training range, or a file."""
    if name == "spec-bench":
        seen: Counter = Counter()
        picked = []
        for p in spec_bench_prompts():
            if seen[p.category] < per_category:
                picked.append(p)
                seen[p.category] += 1
        return picked
    if name == "sharegpt-heldout":
        return list(sharegpt_prompts(skip=16000, limit=13 * per_category))
    return text_file_prompts(name)


@torch.inference_mode()
def evaluate_head(
    target: LlamaModel,
    drafter: EagleDrafter,
    tokenizer: Tokenizer,
    prompts: list[Prompt],
    max_new_tokens: int,
    gamma: int = 3,
    progress: bool = True,
    measure_cost: bool = True,
) -> dict[str, Any]:
    """Through the real engine, a chain of `gamma` drafts per round at temperature 0 and 0.7: per category the
    acceptance rate, acceptance by draft position and tokens per target forward; and the cost ratio c."""
    report: dict[str, Any] = {
        "prompts": len(prompts),
        "gamma": gamma,
        "max_new_tokens": max_new_tokens,
        "temperatures": {},
    }
    bar = tqdm(total=2 * len(prompts), desc="evaluate head", unit="prompt", disable=not progress)
    for temperature in (0.0, 0.7):
        per_cat: dict[str, StatsCollector] = defaultdict(StatsCollector)
        for i, prompt in enumerate(prompts):
            ids = tokenizer.encode(prompt.turns[0], chat=tokenizer.has_chat_template)
            if len(ids) + max_new_tokens > target.max_seq_len:
                continue
            engine = Engine(
                target,
                drafter,
                SpecConfig(max_seq_len=len(ids) + max_new_tokens),
                tokenizer.eos_token_ids,
                planner=FixedGamma(gamma),
            )
            engine.add_request(ids, SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=i))
            for result in engine.stream():
                per_cat[prompt.category].observe(result)
                per_cat["overall"].observe(result)
            bar.update(1)
        report["temperatures"][str(temperature)] = {cat: _summary(c) for cat, c in per_cat.items()}
    bar.close()
    if measure_cost:
        report["cost"] = cost_ratio(target, drafter)
    return report


def _summary(collector: StatsCollector) -> dict[str, Any]:
    s = collector.summary()
    return {
        "acceptance_rate": s["acceptance_rate"],
        "alpha": s["alpha_mle"],
        "tokens_per_round": s["tokens_per_round"],
        "acceptance_per_position": s["acceptance_per_position"],
        "rounds": s["rounds"],
        "new_tokens": s["new_tokens"],
    }


@torch.inference_mode()
def cost_ratio(target: LlamaModel, drafter: EagleDrafter, repeats: int = 30, context: int = 128) -> dict[str, Any]:
    """Median seconds of the target's one-token step and of one draft step (the head's forward on one entry, its
    logits and a draw), batch 1, interleaved, each as the engine runs it (compiled where the target is); c = draft
    step / target step."""
    head = drafter.head
    generator = torch.Generator().manual_seed(0)
    target_times, draft_times = [], []
    slot = torch.tensor([0])
    token = torch.tensor([[5]], device=target.device)
    for _ in range(3):
        cache = target.new_cache(1, context + repeats + 2)
        target.prefill(torch.randint(0, min(1000, target.vocab_size), (1, context)), cache, slot)
        head_cache = head.new_cache(1, context + repeats + 2)
        head.forward_cached(
            drafter.embed(token.expand(1, context)),
            torch.zeros(1, context, head.config.hidden_size, dtype=head.dtype),
            head_cache,
            slot,
        )
        hidden = torch.zeros(1, 1, head.config.hidden_size, dtype=head.dtype, device=target.device)
        for _ in range(repeats):
            start = time.perf_counter()
            target.forward_cached(token, cache, slot)
            target_times.append(time.perf_counter() - start)
            start = time.perf_counter()
            hidden, logits = drafter.step(token, hidden, head_cache, slot)
            probs = torch.softmax(logits.float() / 0.7, dim=-1)
            torch.multinomial(probs, 1, generator=generator)
            draft_times.append(time.perf_counter() - start)
    t, d = statistics.median(target_times), statistics.median(draft_times)
    return {"target_step_ms": 1000 * t, "draft_step_ms": 1000 * d, "c": d / t, "compiled": target.compiled is not None}


# ----- the whole run -------------------------------------------------------------------------


def _settings(plan: HeadTraining) -> dict[str, Any]:
    out = asdict(plan)
    out["out"] = str(plan.out)
    for key in ("device", "checkpoint_minutes", "eval_prompts", "eval_per_category", "eval_max_new_tokens", "tokens"):
        out.pop(key)  # these may differ between resumed runs
    out["regeneration"].pop("workers")
    return out


def run_head(
    plan: HeadTraining, resume: bool, progress: bool = True, minutes: float | None = None, command: str | None = None
) -> dict[str, Any]:
    """Collect data, choose the draft vocabulary, train, export, evaluate; each stage resumes where an interrupted
    run stopped."""
    settings_path = plan.work / "settings.json"
    if plan.work.exists() and not resume:
        raise ValueError(f"{plan.out} already holds a training run; pass --resume to continue it")
    if (
        resume
        and settings_path.exists()
        and json.loads(settings_path.read_text()) != json.loads(json.dumps(_settings(plan)))
    ):
        raise ValueError(f"--resume needs the same settings as the run in {plan.out} (see {settings_path})")
    plan.work.mkdir(parents=True, exist_ok=True)
    settings_path.write_text(json.dumps(_settings(plan), indent=2, sort_keys=True))
    torch.manual_seed(plan.seed)
    target = load_model(plan.target, device=plan.device, quantize=plan.quantize)
    model, tokenizer = target.llama(), target.text_tokenizer()  # a feature draft reads a Llama target's features
    reader = collect(plan, target, progress)
    _log(
        f"data: {reader.index['sequences']} conversations, {reader.num_tokens} tokens "
        f"({reader.index['reply_tokens']} in replies)"
    )
    vocab_path = plan.work / "draft_vocab.json"
    if not vocab_path.exists():
        vocab_path.write_text(
            json.dumps({"token_ids": choose_vocab(reader, model.vocab_size, plan.draft_vocab).tolist()})
        )
    draft_ids = torch.tensor(json.loads(vocab_path.read_text())["token_ids"])
    device = torch.device(plan.device)
    layers = tuple(reader.index["feature_layers"])
    frozen = Frozen(model, draft_ids, device)
    head = init_head(model, draft_ids, layers, plan.seed)
    record = train_head(head, frozen, reader, plan, plan.work / "train", progress, minutes)
    if record["step"] < record["steps"]:
        _log(f"stopped at step {record['step']}/{record['steps']}; rerun with --resume to continue")
        return {"finished": False, "step": record["step"], "steps": record["steps"]}
    save_head(head.cpu(), plan.out)
    (plan.out / "training_curve.json").write_text(json.dumps(record["curve"], indent=1))
    _plot_curve(record["curve"], plan.out / "training_curve.png")
    drafter = EagleDrafter(load_head(plan.out, model.config), model, plan.out)
    report = evaluate_head(
        model,
        drafter,
        tokenizer,
        eval_prompts(plan.eval_prompts, plan.eval_per_category),
        plan.eval_max_new_tokens,
        progress=progress,
    )
    report["target_weights"] = plan.quantize
    report["draft_vocab_coverage"] = vocab_coverage(reader, draft_ids, model.vocab_size)
    index = reader.index
    report["data"] = {
        "source": index["source"],
        "conversations": index["sequences"],
        "prompts": reader.replies(),
        "tokens": index["tokens"],
        "reply_tokens": index["reply_tokens"],
    }
    report["training"] = {
        "unroll": plan.unroll,
        "epochs": plan.epochs,
        "steps": record["step"],
        "token_steps": record["token_steps"],
        "hours": record["seconds"] / 3600,
        "device": _device_name(plan.device),
    }
    (plan.out / "eval.json").write_text(json.dumps(report, indent=2))
    write_card(plan, reader, record, report, command)
    return {"finished": True, "step": record["step"], "eval": report}


def _plot_curve(curve: list[dict[str, Any]], path: Path) -> None:
    if not curve:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [c["token_steps"] / 1e6 for c in curve]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    left.plot(steps, [c["train_loss"] for c in curve], label="train")
    if "heldout_loss" in curve[0]:
        left.plot(steps, [c["heldout_loss"] for c in curve], label="held-out")
    left.set_xlabel("token-steps (M)")
    left.set_ylabel("loss")
    left.legend()
    for key, label in (("alpha", "alpha, step 1"), ("alpha_2", "alpha, step 2"), ("agree", "greedy agreement")):
        if f"heldout_{key}" in curve[0]:
            right.plot(steps, [c[f"heldout_{key}"] for c in curve], label=f"held-out {label}")
    right.set_xlabel("token-steps (M)")
    if right.lines:
        right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_card(
    plan: HeadTraining, reader: FeatureReader, record: dict[str, Any], report: dict[str, Any], command: str | None
) -> None:
    """README.md beside the head: data, compute, curve and evaluation, all from this run's files."""
    index = reader.index
    target = portable_spec(plan.target)
    layers = ", ".join(map(str, index["feature_layers"]))
    regen = plan.regeneration
    data = (
        f"{index['sequences']} conversations the target wrote itself (`--data regenerate`): the user turns of "
        f"ShareGPT conversations 0..14,999 (up to {regen.turns} per conversation, {report['data']['prompts']:,} "
        f"answered in all), each reply sampled by `{target}` (weights `--quantize {plan.quantize}`) through "
        f"our engine at temperature {' or '.join(map(str, regen.temperatures))} (alternating by conversation), "
        f"up to {regen.max_new_tokens} tokens, under its chat template; the features recorded as it wrote them"
        if plan.data == "regenerate"
        else f"{index['sequences']} conversations from `{portable_spec(plan.prompts)}` with their own replies, run "
        "through the target "
        f"teacher-forced (weights `--quantize {plan.quantize}`)"
    )
    lines = [
        f"# EAGLE-3 head for {target}",
        "",
        f"One decoder layer at the target's width ({index['hidden_size']}) that drafts from `{target}`'s "
        f"hidden states entering layers {layers} (fused), with its own output layer over a {plan.draft_vocab}-token "
        "draft vocabulary. The folder is in the EAGLE-3 layout vLLM and SGLang load "
        "(`LlamaForCausalLMEagle3`: config.json, model.safetensors with d2t/t2d). Trained with "
        "`specsample distill --kind eagle`.",
        "",
    ]
    if command:
        lines += ["## Command", "", "```bash", portable_command(command), "```", ""]
    hours = record["seconds"] / 3600
    lines += [
        "## Data",
        "",
        f"{data}. {index['tokens']:,} tokens, {index['reply_tokens']:,} of them in replies (the loss counts "
        f"reply positions); conversations cut at {plan.max_len} tokens. The last chunk is held out. The draft "
        f"vocabulary covers {report.get('draft_vocab_coverage', float('nan')):.1%} of held-out reply tokens.",
        "",
        "## Training",
        "",
        f"{record['step']} steps of up to {plan.batch_tokens} tokens with padding ({record['tokens_seen']:,} "
        f"tokens seen, {plan.epochs} pass(es)), {plan.unroll} drafting steps per entry (the training-time test, "
        f"step s weighted {plan.step_decay}^(s-1)): {record['token_steps']:,} token-steps. AdamW lr {plan.lr}, "
        f"cosine to {plan.min_lr_ratio} x. Compute: {hours:.1f} h of training on {_device_name(plan.device)}.",
        "",
        "![training curve](training_curve.png)",
        "",
        "| step | token-steps | train loss | held-out loss | held-out alpha (T=1), steps 1 / 2 / 3 | "
        "held-out greedy agreement |",
        "|---|---|---|---|---|---|",
    ]
    curve = record["curve"]
    shown = curve[:: max(1, len(curve) // 12)]
    for c in shown + [c for c in curve[-1:] if c not in shown]:
        alphas = " / ".join(f"{c.get(f'heldout_alpha{s}', float('nan')):.3f}" for s in ("", "_2", "_3"))
        lines.append(
            f"| {c['step']} | {c['token_steps']:,} | {c['train_loss']:.4f} | "
            f"{c.get('heldout_loss', float('nan')):.4f} | {alphas} | {c.get('heldout_agree', float('nan')):.3f} |"
        )
    lines += ["", "## Evaluation", "", *evaluation_table(report)]
    (plan.out / "README.md").write_text("\n".join(lines) + "\n")


def _device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return f"one {torch.cuda.get_device_name(torch.device(device))}"
    return f"{os.cpu_count()} CPU cores" if device == "cpu" else device


def evaluation_table(report: dict[str, Any]) -> list[str]:
    """Markdown of an `evaluate_head` report: per temperature and category, and the cost ratio."""
    weights = f", the target's weights --quantize {report['target_weights']}" if "target_weights" in report else ""
    lines = [
        f"{report['prompts']} prompts, up to {report['max_new_tokens']} new tokens, a chain of "
        f"{report['gamma']} drafts per round through the engine (batch 1{weights}).",
        "",
    ]
    for temperature, cats in report["temperatures"].items():
        lines += [
            f"Temperature {temperature}:",
            "",
            "| category | acceptance | alpha | tokens per target forward | acceptance by position |",
            "|---|---|---|---|---|",
        ]
        for name in sorted(cats, key=lambda n: (n == "overall", n)):
            c = cats[name]
            positions = ", ".join(f"{a:.2f}" for a in c["acceptance_per_position"])
            lines.append(
                f"| {name} | {c['acceptance_rate']:.3f} | {c['alpha']:.3f} | {c['tokens_per_round']:.2f} | "
                f"{positions} |"
            )
        lines.append("")
    cost = report.get("cost")
    if cost is not None:
        mode = "compiled" if cost.get("compiled") else "eager"
        lines.append(
            f"Cost ratio c = {cost['c']:.3f} (draft step {cost['draft_step_ms']:.2f} ms, target one-token "
            f"step {cost['target_step_ms']:.2f} ms, batch 1, both {mode})."
        )
    return lines
