"""`specsample distill --kind eagle`: train a feature draft (EAGLE head) for a Llama-family target.

1. Features: ShareGPT conversations rendered with the target's chat template are run through the target once,
   teacher-forced; per token the store keeps its id, the target's final hidden state and whether it belongs to a
   reply (`distill/features.py`, chunked and resumable).
2. Output subset (FR-Spec): the `draft_vocab` tokens most frequent in the replies.
3. Training (EAGLE's loss): entry t reads the token t + 1's embedding and the target's feature f_t (with uniform
   noise), predicts f_{t+1}; loss = smooth L1 to f_{t+1} + `ce_weight` x cross-entropy from the target's
   distribution at t + 1 to the head's, both over the output subset, on reply positions; with `unroll` s > 1 each
   entry also drafts s - 1 steps further from its own predictions, as at inference (EAGLE-3's training-time
   test). Resumable:
   a checkpoint holds the weights, the optimiser, the data cursor and the curve, so a resumed run ends with the
   same weights as an uninterrupted one.
4. Export: the head's folder, its evaluation (acceptance by position at T 0 and 0.7 through the real engine, the
   cost ratio c) and its model card.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from specsample.config import SamplingParams, SpecConfig
from specsample.datasets import Prompt, sharegpt_prompts, spec_bench_prompts, text_file_prompts
from specsample.distill.features import FeatureReader, FeatureWriter, collect_features
from specsample.drafters.eagle import EagleDrafter, EagleHead, HeadConfig
from specsample.engine import Engine
from specsample.metrics import StatsCollector
from specsample.models.cpu import bf16_autocast
from specsample.models.llama import LlamaModel
from specsample.models.loader import load_model
from specsample.models.quant import QUANT_MODES
from specsample.planner import FixedGamma


@dataclass(frozen=True)
class HeadTraining:
    """What `specsample distill --kind eagle` does (a resumed run must pass the same settings)."""

    target: str
    out: Path
    prompts: str = "sharegpt"  # 'sharegpt' (conversations 0..14999; later ones stay held out) or a prompt file
    tokens: int = 7_500_000  # teacher-forced tokens to train on
    max_len: int = 1536  # tokens per conversation (longer ones are cut)
    draft_vocab: int | None = 8192  # output subset size (None: the whole vocabulary)
    epochs: float = 1.0
    batch_tokens: int = 16384
    lr: float = 1e-3
    min_lr_ratio: float = 0.05
    warmup: int = 30
    weight_decay: float = 0.0
    clip: float = 0.5
    noise: float = 0.1  # uniform noise on the input features, +-noise
    ce_weight: float = 0.1
    unroll: int = 2  # drafting steps trained per entry (1: teacher-forced only; more: the training-time test)
    quantize: str = "none"  # the target's weights while features are computed (models/quant.py QUANT_MODES)
    seed: int = 0
    checkpoint_minutes: float = 10.0
    eval_every: int = 50  # steps between held-out measurements
    eval_prompts: str = "spec-bench"  # spec-bench (per category), sharegpt-heldout or a prompt file
    eval_per_category: int = 4
    eval_max_new_tokens: int = 64
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.tokens < 1 or self.max_len < 8 or self.batch_tokens < self.max_len:
            raise ValueError("need tokens >= 1, max_len >= 8 and batch_tokens >= max_len")
        if self.unroll < 1:
            raise ValueError(f"unroll must be >= 1, got {self.unroll}")
        if self.epochs <= 0 or self.lr <= 0:
            raise ValueError(f"epochs and lr must be > 0, got {self.epochs}, {self.lr}")
        if self.quantize not in QUANT_MODES:
            raise ValueError(f"quantize must be one of {', '.join(QUANT_MODES)}, got {self.quantize!r}")

    @property
    def work(self) -> Path:
        return self.out / ".work"


def _log(message: str) -> None:
    print(f"specsample distill: {message}", file=sys.stderr, flush=True)


# ----- data ----------------------------------------------------------------------------------

def training_prompts(plan: HeadTraining):
    """The conversations features are collected from (ShareGPT's first 15,000, or a prompt file's)."""
    if plan.prompts == "sharegpt":
        return sharegpt_prompts(limit=15000)
    return iter(text_file_prompts(plan.prompts))


def choose_subset(reader: FeatureReader, vocab_size: int, size: int | None) -> torch.Tensor | None:
    """The `size` tokens most frequent in the replies (FR-Spec); None for the whole vocabulary."""
    if size is None or size >= vocab_size:
        return None
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for i in range(reader.num_chunks):
        for seq in reader.chunk(i):
            counts += torch.bincount(seq.tokens[seq.reply], minlength=vocab_size)
    return torch.sort(torch.argsort(counts, descending=True, stable=True)[:size]).values


class Batches:
    """Deterministic, resumable batches: per epoch a seeded order of the training chunks, and per chunk a seeded
    order of its sequences grouped into batches of up to `batch_tokens` (similar lengths together)."""

    def __init__(self, reader: FeatureReader, batch_tokens: int, seed: int) -> None:
        self.reader, self.batch_tokens, self.seed = reader, batch_tokens, seed
        self.train_chunks = list(range(max(reader.num_chunks - 1, 1)))  # the last chunk is held out
        self.heldout_chunk = reader.num_chunks - 1 if reader.num_chunks > 1 else None
        self.cursor = [0, 0, 0]  # epoch, chunk position in the epoch's order, batch within the chunk
        self._loaded: tuple[int, list] | None = None

    def _group(self, lengths: list[int], order: list[int]) -> list[list[int]]:
        """Indices in `order`, sorted by length, cut into batches of up to `batch_tokens` padded tokens."""
        batches, current, width = [], [], 0
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
        `batch_tokens`, so this exceeds tokens / batch_tokens); the count does not depend on the epoch's order."""
        total = 0
        for chunk in self.train_chunks:
            lengths = self.reader.lengths(chunk)
            total += len(self._group(lengths, list(range(len(lengths)))))
        return total

    def next(self) -> list:
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


def make_batch(sequences: list, device: torch.device) -> dict[str, torch.Tensor]:
    """Right-padded tokens `[b, L]`, features `[b, L, hidden]` (float32), and the loss mask `[b, L - 1]`: entry t
    counts where t + 1 is a real position of a reply."""
    width = max(len(s.tokens) for s in sequences)
    hidden = sequences[0].features.shape[-1]
    tokens = torch.zeros(len(sequences), width, dtype=torch.long)
    features = torch.zeros(len(sequences), width, hidden)
    mask = torch.zeros(len(sequences), width - 1, dtype=torch.bool)
    for row, seq in enumerate(sequences):
        n = len(seq.tokens)
        tokens[row, :n] = seq.tokens
        features[row, :n] = seq.features.float()
        mask[row, : n - 1] = seq.reply[1:n]
    lengths = torch.tensor([len(s.tokens) for s in sequences])
    return {"tokens": tokens.to(device), "features": features.to(device), "mask": mask.to(device), "lengths": lengths}


# ----- loss ----------------------------------------------------------------------------------

class Frozen:
    """The target's embedding and output layer (over the subset), float32, without gradients."""

    def __init__(self, target: LlamaModel, subset: torch.Tensor | None, device: torch.device) -> None:
        self.embed = target.embed.weight.detach().float().to(device)
        weight = target.lm_head.weight.detach().float()
        self.out = (weight[subset] if subset is not None else weight).to(device)  # [K, hidden]


class UnrolledAttention:
    """The head's attention over whole sequences for `unroll` drafting steps at once (EAGLE-3's training-time test).

    Step 1 is teacher-forced: entry t sees entries 0..t, all with the target's features. At step s > 1, entry t
    stands for the (s - 1)-th draft past a last true entry e = t - s + 1: it sees the true entries 0..e, the entry
    step j made at position e + j - 1 for each j in 2..s - 1, and itself, as the head's cache holds them while it
    drafts. Call `__call__` once per step, in order."""

    def __init__(self, config, batch: int, n: int, device: torch.device) -> None:
        self.groups = config.num_heads // config.num_kv_heads
        self.scale = config.head_dim ** -0.5
        self.rope_positions = torch.arange(n, device=device).unsqueeze(0).expand(batch, n)
        self.positions = self.rope_positions
        self.keys: list[torch.Tensor] = []  # per step [b, KVH, n, hd]
        self.values: list[torch.Tensor] = []
        self.layer = 0

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        batch, n, heads, head_dim = q.shape
        q = q.transpose(1, 2)  # [b, H, n, hd]
        k = k.transpose(1, 2).repeat_interleave(self.groups, dim=1)  # [b, H, n, hd]
        v = v.transpose(1, 2).repeat_interleave(self.groups, dim=1)
        step = len(self.keys) + 1
        self.keys.append(k)
        self.values.append(v)
        if step == 1:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return out.transpose(1, 2).reshape(batch, n, heads * head_dim)
        true_keys, true_values = self.keys[0], self.values[0]
        scores = (q @ true_keys.transpose(-1, -2)).float() * self.scale  # [b, H, n, n]
        query, key = torch.arange(n, device=q.device).view(-1, 1), torch.arange(n, device=q.device).view(1, -1)
        scores = scores.masked_fill(key > query - step + 1, float("-inf"))  # true entries 0..t - s + 1
        diagonals = []  # the speculative entries of steps 2..s, each one per query
        for j in range(2, step + 1):
            shift = step - j  # entry t sees step j's entry at t - shift
            keys_j = F.pad(self.keys[j - 1], (0, 0, shift, 0))[:, :, :n]
            diagonals.append(((q * keys_j).sum(-1).float() * self.scale).masked_fill(query.view(-1) < shift,
                                                                                      float("-inf")))
        weights = torch.softmax(torch.cat([scores, torch.stack(diagonals, dim=-1)], dim=-1), dim=-1)
        weights = torch.nan_to_num(weights).to(q.dtype)  # entries before step s exists see nothing
        out = weights[..., :n] @ true_values
        for i, j in enumerate(range(2, step + 1)):
            shift = step - j
            values_j = F.pad(self.values[j - 1], (0, 0, shift, 0))[:, :, :n]
            out = out + weights[..., n + i].unsqueeze(-1) * values_j
        return out.transpose(1, 2).reshape(batch, n, heads * head_dim)


def head_loss(head: EagleHead, frozen: Frozen, batch: dict[str, torch.Tensor], noise: float, ce_weight: float,
              generator: torch.Generator | None, unroll: int = 1) -> tuple[torch.Tensor, dict[str, float]]:
    """EAGLE's loss over the masked entries: smooth L1 from the predicted to the target's next feature, plus
    `ce_weight` x cross-entropy from the target's next-token distribution to the head's (over the output subset),
    averaged over `unroll` drafting steps (step s: entry t reads the head's own prediction made at entry t - 1 in
    step s - 1, as the s-th draft does); with, per step, the head's acceptance sum(min(p, q)) at temperature 1 and
    its greedy agreement with the target."""
    tokens, features, mask = batch["tokens"], batch["features"], batch["mask"]
    embeddings = F.embedding(tokens[:, 1:], frozen.embed)  # [b, L - 1, hidden]: token t + 1 at entry t
    target = features[:, 1:]  # f_{t+1}
    inputs = features[:, :-1]
    if noise and head.training:
        inputs = inputs + (torch.rand(inputs.shape, generator=generator, device=inputs.device) * 2 - 1) * noise
    p = torch.softmax((target @ frozen.out.T).float(), dim=-1)  # [b, L - 1, K]
    attend = UnrolledAttention(head.layer_config, *embeddings.shape[:2], embeddings.device)
    total, metrics = 0.0, {}
    for step in range(1, unroll + 1):
        valid = mask.clone()
        valid[:, : step - 1] = False  # no (step - 1)-th draft before position step - 1
        count = valid.sum().clamp(min=1)
        predicted = head(embeddings, inputs, attend).float()  # [b, L - 1, hidden]
        regression = (F.smooth_l1_loss(predicted, target, reduction="none").mean(-1) * valid).sum() / count
        log_q = torch.log_softmax((predicted @ frozen.out.T).float(), dim=-1)
        cross = (-(p * log_q).sum(-1) * valid).sum() / count
        total = total + regression + ce_weight * cross
        with torch.no_grad():
            alpha = (torch.minimum(p, log_q.exp()).sum(-1) * valid).sum() / count
            agree = ((p.argmax(-1) == log_q.argmax(-1)) * valid).sum() / count
        suffix = "" if step == 1 else f"_{step}"
        metrics.update({f"regression{suffix}": regression.item(), f"cross_entropy{suffix}": cross.item(),
                        f"alpha{suffix}": alpha.item(), f"agree{suffix}": agree.item()})
        inputs = torch.cat([inputs[:, :1], predicted[:, :-1].to(inputs.dtype)], dim=1)  # entry t: prediction at t - 1
    loss = total / unroll
    metrics["loss"] = loss.item()
    return loss, metrics


# ----- training ------------------------------------------------------------------------------

def _lr(step: int, steps: int, plan: HeadTraining) -> float:
    if step < plan.warmup:
        return plan.lr * (step + 1) / plan.warmup
    progress = (step - plan.warmup) / max(1, steps - plan.warmup)
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return plan.lr * (plan.min_lr_ratio + (1 - plan.min_lr_ratio) * cosine)


def init_head(target: LlamaModel, seed: int) -> EagleHead:
    """A head that starts as the identity on the feature: fc passes the feature through (the embedding half small)
    and the decoder layer's residual branches start at zero (their output projections), so training starts from
    "the next feature is this one" rather than from noise."""
    head = EagleHead(HeadConfig.of(target.config))
    generator = torch.Generator().manual_seed(seed)
    hidden = target.config.hidden_size
    with torch.no_grad():
        for name, param in head.named_parameters():
            if name.endswith("norm.weight"):
                continue
            param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
        head.layer.o_proj.weight.zero_()
        head.layer.down.weight.zero_()
        head.fc.weight[:, hidden:] += torch.eye(hidden)
        head.fc.bias.zero_()
    return head


@torch.no_grad()
def heldout(head: EagleHead, frozen: Frozen, batches: Batches, plan: HeadTraining, device: torch.device,
            limit_tokens: int = 60_000) -> dict[str, float]:
    """The loss and acceptance over (up to `limit_tokens` of) the held-out chunk."""
    if batches.heldout_chunk is None:
        return {}
    head.eval()
    sequences = batches.reader.chunk(batches.heldout_chunk)
    sums: dict[str, float] = defaultdict(float)
    weight, used = 0, 0
    for start in range(0, len(sequences), 8):
        group = sequences[start:start + 8]
        batch = make_batch(group, device)
        with bf16_autocast(device):
            _, metrics = head_loss(head, frozen, batch, 0.0, plan.ce_weight, None, plan.unroll)
        n = int(batch["mask"].sum())
        for key, value in metrics.items():
            sums[key] += value * n
        weight += n
        used += sum(len(s.tokens) for s in group)
        if used >= limit_tokens:
            break
    head.train()
    return {k: v / max(weight, 1) for k, v in sums.items()}


def train_head(head: EagleHead, frozen: Frozen, reader: FeatureReader, plan: HeadTraining, work: Path,
               progress: bool = True, minutes: float | None = None, stop_after: int | None = None) -> dict[str, Any]:
    """Train `head`; checkpoints to `work/checkpoint.pt` (a later call resumes it exactly). `minutes` and
    `stop_after` bound this call (it checkpoints, and a resumed call continues). Returns the training record."""
    device = torch.device(plan.device)
    work.mkdir(parents=True, exist_ok=True)
    path = work / "checkpoint.pt"
    head.to(device).train()
    optimizer = torch.optim.AdamW(head.parameters(), lr=plan.lr, weight_decay=plan.weight_decay, betas=(0.9, 0.95))
    batches = Batches(reader, plan.batch_tokens, plan.seed)
    steps = max(1, round(plan.epochs * batches.batches_per_epoch()))
    record: dict[str, Any] = {"steps": steps, "step": 0, "tokens_seen": 0, "curve": []}
    generator = torch.Generator(device=device).manual_seed(plan.seed)
    if path.exists():
        state = torch.load(path, weights_only=False)
        head.load_state_dict(state["head"])
        optimizer.load_state_dict(state["optimizer"])
        batches.cursor, record = state["cursor"], state["record"]
        record["steps"] = steps  # the schedule's length follows from the data and the settings
        generator.set_state(state["generator"])
    started = last_save = time.monotonic()
    first = record["step"]
    bar = tqdm(total=record["steps"], initial=record["step"], desc="train head", unit="step", disable=not progress)
    window: list[dict[str, float]] = []
    while record["step"] < record["steps"]:
        step = record["step"]
        batch = make_batch(batches.next(), device)
        for group in optimizer.param_groups:
            group["lr"] = _lr(step, record["steps"], plan)
        with bf16_autocast(device):
            loss, metrics = head_loss(head, frozen, batch, plan.noise, plan.ce_weight, generator, plan.unroll)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), plan.clip)
        optimizer.step()
        record["step"] = step + 1
        record["tokens_seen"] += int(batch["lengths"].sum())
        window.append(metrics)
        if record["step"] % plan.eval_every == 0 or record["step"] == record["steps"]:
            point = {"step": record["step"], "tokens_seen": record["tokens_seen"],
                     **{f"train_{k}": statistics.fmean(w[k] for w in window) for k in window[0]},
                     **{f"heldout_{k}": v for k, v in heldout(head, frozen, batches, plan, device).items()}}
            record["curve"].append(point)
            window = []
        bar.update(1)
        bar.set_postfix(loss=f"{metrics['loss']:.3f}", alpha=f"{metrics['alpha']:.3f}")
        out_of_time = (minutes is not None and time.monotonic() - started > 60 * minutes) or (
            stop_after is not None and record["step"] - first >= stop_after)
        if out_of_time or record["step"] == record["steps"] or time.monotonic() - last_save > 60 * plan.checkpoint_minutes:
            _save(path, head, optimizer, batches, record, generator)
            last_save = time.monotonic()
        if out_of_time:
            break
    bar.close()
    return record


def _save(path: Path, head: EagleHead, optimizer, batches: Batches, record: dict[str, Any],
          generator: torch.Generator) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"head": head.state_dict(), "optimizer": optimizer.state_dict(), "cursor": batches.cursor,
                "record": record, "generator": generator.get_state()}, tmp)
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
def evaluate_head(target, drafter: EagleDrafter, tokenizer, prompts: list[Prompt], max_new_tokens: int,
                  gamma: int = 4, progress: bool = True) -> dict[str, Any]:
    """Through the real engine, a chain of `gamma` drafts per round at temperature 0 and 0.7: per category the
    acceptance rate, acceptance by draft position and tokens per target forward; and the cost ratio c."""
    report: dict[str, Any] = {"prompts": len(prompts), "gamma": gamma, "max_new_tokens": max_new_tokens,
                              "temperatures": {}}
    bar = tqdm(total=2 * len(prompts), desc="evaluate head", unit="prompt", disable=not progress)
    for temperature in (0.0, 0.7):
        per_cat: dict[str, StatsCollector] = defaultdict(StatsCollector)
        for i, prompt in enumerate(prompts):
            ids = tokenizer.encode(prompt.turns[0], chat=tokenizer.has_chat_template)
            if len(ids) + max_new_tokens > target.max_seq_len:
                continue
            engine = Engine(target, drafter, SpecConfig(gamma=gamma, max_seq_len=len(ids) + max_new_tokens),
                            tokenizer.eos_token_ids, planner=FixedGamma(gamma))
            engine.add_request(ids, SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=i))
            for result in engine.stream():
                per_cat[prompt.category].observe(result)
                per_cat["overall"].observe(result)
            bar.update(1)
        report["temperatures"][str(temperature)] = {cat: _summary(c) for cat, c in per_cat.items()}
    bar.close()
    report["cost"] = cost_ratio(target, drafter)
    return report


def _summary(collector: StatsCollector) -> dict[str, Any]:
    s = collector.summary()
    return {"acceptance_rate": s["acceptance_rate"], "alpha": s["alpha_mle"],
            "tokens_per_round": s["tokens_per_round"], "acceptance_per_position": s["acceptance_per_position"],
            "rounds": s["rounds"], "new_tokens": s["new_tokens"]}


@torch.inference_mode()
def cost_ratio(target, drafter: EagleDrafter, repeats: int = 30, context: int = 128) -> dict[str, float]:
    """Median seconds of a target decode step and of one draft step (the head's forward, its logits and a draw),
    batch 1, interleaved; c = draft step / target step."""
    head = drafter.head
    params, generator = [SamplingParams(temperature=0.7)], [torch.Generator().manual_seed(0)]
    target_times, draft_times = [], []
    for _ in range(3):
        cache = target.new_cache(1, context + repeats + 2)
        slot = torch.tensor([0])
        target.prefill(torch.randint(0, min(1000, target.vocab_size), (1, context)), cache, slot)
        head_cache = head.new_cache(1, context + repeats + 2)
        feature = torch.zeros(1, 1, head.config.hidden_size, dtype=head.dtype, device=target.device)
        for _ in range(repeats):
            start = time.perf_counter()
            target.forward_cached(torch.tensor([[5]]), cache, slot)
            target_times.append(time.perf_counter() - start)
            start = time.perf_counter()
            predicted = head.forward_cached(target.embed(torch.tensor([[5]], device=target.device)), feature,
                                            head_cache, slot)[:, 0]
            sample_probs = torch.softmax(drafter._logits(predicted).float() / 0.7, dim=-1)
            torch.multinomial(sample_probs, 1, generator=generator[0])
            draft_times.append(time.perf_counter() - start)
    t, d = statistics.median(target_times), statistics.median(draft_times)
    return {"target_step_ms": 1000 * t, "draft_step_ms": 1000 * d, "c": d / t}


# ----- the whole run -------------------------------------------------------------------------

def _settings(plan: HeadTraining) -> dict[str, Any]:
    out = asdict(plan)
    out["out"] = str(plan.out)
    for key in ("device", "checkpoint_minutes", "eval_prompts", "eval_per_category", "eval_max_new_tokens"):
        out.pop(key)  # these may differ between resumed runs
    return out


def run_head(plan: HeadTraining, resume: bool, progress: bool = True, minutes: float | None = None,
             command: str | None = None) -> dict[str, Any]:
    """Collect features, choose the output subset, train, export, evaluate; each stage resumes where an
    interrupted run stopped."""
    settings_path = plan.work / "settings.json"
    if plan.work.exists() and not resume:
        raise ValueError(f"{plan.out} already holds a training run; pass --resume to continue it")
    if resume and settings_path.exists() and json.loads(settings_path.read_text()) != _settings(plan):
        raise ValueError(f"--resume needs the same settings as the run in {plan.out} (see {settings_path})")
    plan.work.mkdir(parents=True, exist_ok=True)
    settings_path.write_text(json.dumps(_settings(plan), indent=2, sort_keys=True))
    torch.manual_seed(plan.seed)
    target = load_model(plan.target, device=plan.device, quantize=plan.quantize)
    if not isinstance(target.model, LlamaModel) or target.tokenizer is None:
        raise ValueError("a feature draft needs a Llama-family target (our runtime) with a tokenizer")
    model = target.model
    writer = FeatureWriter(plan.work / "features", plan.target, model.config.hidden_size, model.vocab_size,
                           plan.max_len)
    if writer.num_tokens < plan.tokens:
        collect_features(model, target.tokenizer, training_prompts(plan), writer, plan.tokens, progress=progress)
    reader = FeatureReader(plan.work / "features")
    _log(f"features: {reader.index['sequences']} conversations, {reader.num_tokens} tokens")
    subset_path = plan.work / "subset.json"
    if not subset_path.exists():
        subset = choose_subset(reader, model.vocab_size, plan.draft_vocab)
        subset_path.write_text(json.dumps({"token_ids": None if subset is None else subset.tolist()}))
    ids = json.loads(subset_path.read_text())["token_ids"]
    subset = None if ids is None else torch.tensor(ids)
    device = torch.device(plan.device)
    frozen = Frozen(model, subset, device)
    head = init_head(model, plan.seed)
    record = train_head(head, frozen, reader, plan, plan.work / "train", progress, minutes)
    if record["step"] < record["steps"]:
        _log(f"stopped at step {record['step']}/{record['steps']}; rerun with --resume to continue")
        return {"finished": False, "step": record["step"], "steps": record["steps"]}
    head.save(plan.out, plan.target, subset, {"trained": {"tokens": reader.num_tokens, "steps": record["step"],
                                                          "settings": _settings(plan)}})
    (plan.out / "training_curve.json").write_text(json.dumps(record["curve"], indent=1))
    _plot_curve(record["curve"], plan.out / "training_curve.png")
    loaded, loaded_subset, _ = EagleHead.load(plan.out)
    drafter = EagleDrafter(loaded, model, loaded_subset, plan.out)
    report = evaluate_head(model, drafter, target.tokenizer, eval_prompts(plan.eval_prompts, plan.eval_per_category),
                           plan.eval_max_new_tokens, progress=progress)
    report["target_weights"] = plan.quantize
    (plan.out / "eval.json").write_text(json.dumps(report, indent=2))
    write_card(plan, reader, record, report, command)
    return {"finished": True, "step": record["step"], "eval": report}


def _plot_curve(curve: list[dict[str, Any]], path: Path) -> None:
    if not curve:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = [c["tokens_seen"] / 1e6 for c in curve]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    left.plot(tokens, [c["train_loss"] for c in curve], label="train")
    if "heldout_loss" in curve[0]:
        left.plot(tokens, [c["heldout_loss"] for c in curve], label="held-out")
    left.set_xlabel("training tokens (M)")
    left.set_ylabel("loss")
    left.legend()
    for key, label in (("alpha", "alpha (T=1)"), ("agree", "greedy agreement")):
        if f"heldout_{key}" in curve[0]:
            right.plot(tokens, [c[f"heldout_{key}"] for c in curve], label=f"held-out {label}")
    right.set_xlabel("training tokens (M)")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_card(plan: HeadTraining, reader: FeatureReader, record: dict[str, Any], report: dict[str, Any],
               command: str | None) -> None:
    """README.md beside the head: data, training, curve and evaluation, all from this run's files."""
    lines = [f"# Feature draft (EAGLE head) for {plan.target}", "",
             f"One decoder layer at the target's width ({reader.index['hidden_size']}) that drafts from "
             f"`{plan.target}`'s own final hidden states, with its embedding and output layer (frozen, shared; "
             f"output restricted to {plan.draft_vocab or 'all'} tokens). Trained with `specsample distill --kind "
             "eagle`.", ""]
    if command:
        lines += ["## Command", "", "```bash", command, "```", ""]
    lines += ["## Data", "",
              f"{reader.index['sequences']} ShareGPT conversations rendered with the target's chat template (cut at "
              f"{plan.max_len} tokens), {reader.num_tokens} tokens, the target's features computed teacher-forced "
              f"(weights: --quantize {plan.quantize}); "
              "the loss counts reply positions. The last chunk is held out.", "",
              "## Training", "",
              f"{record['step']} steps of up to {plan.batch_tokens} tokens with padding ({record['tokens_seen']} tokens "
              f"seen, {plan.epochs} pass(es) over the training chunks); "
              f"AdamW lr {plan.lr}, cosine to {plan.min_lr_ratio} x, feature noise +-{plan.noise}, cross-entropy "
              f"weight {plan.ce_weight}, {plan.unroll} drafting step(s) trained per entry.", "",
              "![training curve](training_curve.png)", "",
              "| step | tokens | train loss | held-out loss | held-out alpha (T=1) | held-out greedy agreement |",
              "|---|---|---|---|---|---|"]
    curve = record["curve"]
    shown = curve[:: max(1, len(curve) // 12)]
    for c in shown + [c for c in curve[-1:] if c not in shown]:
        lines.append(f"| {c['step']} | {c['tokens_seen']} | {c['train_loss']:.4f} | {c.get('heldout_loss', float('nan')):.4f} | "
                     f"{c.get('heldout_alpha', float('nan')):.3f} | {c.get('heldout_agree', float('nan')):.3f} |")
    lines += ["", "## Evaluation", "", *evaluation_table(report)]
    (plan.out / "README.md").write_text("\n".join(lines) + "\n")


def evaluation_table(report: dict[str, Any]) -> list[str]:
    """Markdown of an `evaluate_head` report: per temperature and category, and the cost ratio."""
    weights = f", the target's weights --quantize {report['target_weights']}" if "target_weights" in report else ""
    lines = [f"{report['prompts']} prompts, up to {report['max_new_tokens']} new tokens, a chain of "
             f"{report['gamma']} drafts per round through the engine (batch 1{weights}).", ""]
    for temperature, cats in report["temperatures"].items():
        lines += [f"Temperature {temperature}:", "",
                  "| category | acceptance | alpha | tokens per target forward | acceptance by position |",
                  "|---|---|---|---|---|"]
        for name in sorted(cats, key=lambda n: (n == "overall", n)):
            c = cats[name]
            positions = ", ".join(f"{a:.2f}" for a in c["acceptance_per_position"])
            lines.append(f"| {name} | {c['acceptance_rate']:.3f} | {c['alpha']:.3f} | {c['tokens_per_round']:.2f} | "
                         f"{positions} |")
        lines.append("")
    cost = report["cost"]
    lines.append(f"Cost ratio c = {cost['c']:.3f} (draft step {cost['draft_step_ms']:.2f} ms, target step "
                 f"{cost['target_step_ms']:.2f} ms, batch 1).")
    return lines
