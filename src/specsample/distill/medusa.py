"""`specsample distill --kind medusa`: train Medusa heads (`models/medusa_head.py`) for a Llama-family target.

1. Data (`distill/features.py`, chunked and resumable): a dataset's conversations with their own replies, run through
   the target teacher-forced; per token the target's final normed hidden state (what the heads read, and what its
   output layer reads: the training target's distribution) and whether it belongs to a reply. No feature layers are
   stored: Medusa reads the last hidden state only.
2. Draft vocabulary (FR-Spec, as vLLM's `token_map`): the `draft_vocab` tokens most frequent in the replies.
3. Training (Medusa-1: the target frozen): head k at position t reads the target's final hidden state there and is
   trained towards the target's distribution at position t + k + 1, i.e. of token t + k + 2 (over the draft
   vocabulary, renormalised there), by cross-entropy on reply positions; every head weighs the same. Resumable: a
   checkpoint holds the weights, the optimiser, the data cursor and the curve.
4. Export: the heads in a published layout (FasterDecoding's or vLLM's), their evaluation through the engine (token
   trees at T 0 and 0.7, tokens per target forward by category, the heads' cost against a target step) and a model
   card.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from tqdm import tqdm

from specsample.config import SamplingParams, SpecConfig, TreeShape
from specsample.datasets import Prompt, training_conversations
from specsample.distill.card import portable_command, portable_spec
from specsample.distill.eagle import Batches, choose_vocab, eval_prompts, vocab_coverage
from specsample.distill.features import FeatureReader, FeatureSequence, FeatureWriter, collect_features
from specsample.drafters.medusa import MedusaDrafter
from specsample.engine import Engine
from specsample.metrics import StatsCollector
from specsample.models.cpu import bf16_autocast
from specsample.models.llama import LlamaModel
from specsample.models.loader import LoadedModel, load_model
from specsample.models.medusa_head import LAYOUTS, MedusaConfig, MedusaHeads, load_medusa, save_medusa
from specsample.models.quant import QUANT_MODES
from specsample.planner import FixedGamma
from specsample.tokenizer import Tokenizer

METRICS_EVERY = 10  # training steps between measurements of the heads' acceptance on their batch


@dataclass(frozen=True)
class MedusaTraining:
    """What `specsample distill --kind medusa` does (a resumed run must pass the same settings, but `tokens`, which
    only bounds data collection)."""

    target: str
    out: Path
    prompts: str = "sharegpt"  # 'sharegpt' (conversations 0..14999; later ones stay held out) or a prompt file
    tokens: int = 4_000_000  # tokens of conversation to collect (prompts and replies)
    max_len: int = 1024  # tokens per conversation (longer ones are cut)
    heads: int = 4  # K: head k drafts the token k + 1 places past the one the target predicts
    layers: int = 1  # residual blocks per head
    draft_vocab: int = 8192  # draft vocabulary size (tokens most frequent in the replies)
    shared_output: bool = True  # one output layer for every head (vLLM's original_lm_head), else one per head
    head_decay: float = 0.8  # head k's loss weighs head_decay ** k (Medusa's lambda_k)
    epochs: float = 1.0
    batch_tokens: int = 8192
    lr: float = 4e-3
    min_lr_ratio: float = 0.05
    warmup: int = 50
    weight_decay: float = 0.0
    clip: float = 1.0
    quantize: str = "auto"  # the target's weights while it scores the data (models/quant.py QUANT_MODES)
    layout: str = "vllm"  # the folder's layout (models/medusa_head.py LAYOUTS)
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
        if self.heads < 1 or self.layers < 0:
            raise ValueError(f"need heads >= 1 and layers >= 0, got {self.heads} and {self.layers}")
        if self.epochs <= 0 or self.lr <= 0:
            raise ValueError(f"epochs and lr must be > 0, got {self.epochs}, {self.lr}")
        if not 0 < self.head_decay <= 1:
            raise ValueError(f"head_decay must be in (0, 1], got {self.head_decay}")
        if self.draft_vocab < 2:
            raise ValueError(f"draft_vocab must be >= 2, got {self.draft_vocab}")
        if self.quantize not in QUANT_MODES:
            raise ValueError(f"quantize must be one of {', '.join(QUANT_MODES)}, got {self.quantize!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")

    @property
    def work(self) -> Path:
        return self.out / ".work"


def _log(message: str) -> None:
    print(f"specsample distill: {message}", file=sys.stderr, flush=True)


# ----- data ----------------------------------------------------------------------------------


def collect(plan: MedusaTraining, target: LoadedModel, progress: bool) -> FeatureReader:
    """Stage 1: the store of final hidden states, filled to `plan.tokens` (unless training has begun: its data is
    then final)."""
    model = target.llama()
    store = plan.work / "features"
    writer = FeatureWriter(
        store / "shard-0", plan.target, model.config.hidden_size, (), model.vocab_size, plan.max_len, "teacher-forced"
    )
    if writer.num_tokens < plan.tokens and not (plan.work / "train" / "checkpoint.pt").exists():
        collect_features(
            model, target.text_tokenizer(), training_conversations(plan.prompts), writer, plan.tokens, progress=progress
        )
    return FeatureReader(store)


def make_batch(sequences: list[FeatureSequence], device: torch.device) -> dict[str, torch.Tensor]:
    """Right-padded tokens `[b, L]` and final hidden states `[b, L, H]` (bfloat16), and the mask `[b, L]` of the
    positions whose distribution counts: reply positions whose hidden state is known."""
    width = max(len(s.tokens) for s in sequences)
    tokens = torch.zeros(len(sequences), width, dtype=torch.long)
    final = torch.zeros(len(sequences), width, sequences[0].final.shape[-1], dtype=torch.bfloat16)
    mask = torch.zeros(len(sequences), width, dtype=torch.bool)
    for row, seq in enumerate(sequences):
        n = len(seq.tokens)
        tokens[row, :n] = seq.tokens
        final[row, :n] = seq.final
        mask[row, : seq.known] = seq.reply[: seq.known]
    lengths = torch.tensor([len(s.tokens) for s in sequences])
    return {"tokens": tokens.to(device), "final": final.to(device), "mask": mask.to(device), "lengths": lengths}


# ----- loss ----------------------------------------------------------------------------------


def medusa_loss(
    heads: MedusaHeads,
    target_out: torch.Tensor,  # [K', H] the target's output layer's rows of the draft vocabulary
    batch: dict[str, torch.Tensor],
    head_decay: float,
    metrics: bool = True,
    branch: int = 4,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Medusa-1's loss: per head k the cross-entropy from the target's distribution at position t + k + 1 (over the
    draft vocabulary, renormalised there) to head k's at position t, over the positions t + k + 1 the mask counts,
    head k weighted head_decay ** k; with `metrics`, per head its KL divergence (the cross-entropy less the target's
    entropy), its acceptance sum(min(p, q)) at temperature 1, its greedy agreement with the target and how often the
    target's most likely token is among its top `branch` (what a tree of that many children a node can hold)."""
    final, mask = batch["final"], batch["mask"]  # [b, L, H], [b, L]
    length = final.shape[1]
    with torch.no_grad():
        log_p = torch.log_softmax((final[mask] @ target_out.T).float(), dim=-1)  # [M, K']
        p = log_p.exp()
        row_of = torch.full(mask.shape, -1, dtype=torch.long, device=mask.device)
        row_of[mask] = torch.arange(int(mask.sum()), device=mask.device)  # position -> its row of p
    total: torch.Tensor | float = 0.0
    weights = 0.0
    out: dict[str, float] = {}
    for k in range(heads.config.num_heads):
        if length <= k + 1:
            break
        valid = mask[:, k + 1 :]  # [b, L - k - 1]: entry t counts where position t + k + 1 does
        if not bool(valid.any()):
            continue
        target = p[row_of[:, k + 1 :][valid]]  # [M_k, K']
        logits = heads.head_logits(k, heads.head_vector(k, final[:, : length - k - 1][valid])).float()
        cross = F.cross_entropy(logits, target)  # soft targets: one fused pass over the logits
        weight = head_decay**k
        total, weights = total + weight * cross, weights + weight
        if metrics:
            with torch.no_grad():
                q = torch.softmax(logits, dim=-1)
                best = target.argmax(-1, keepdim=True)
                top = logits.topk(min(branch, logits.shape[-1]), dim=-1).indices
                out.update(
                    {
                        f"cross_entropy_{k}": cross.item(),
                        f"kl_{k}": (cross + (target * log_p[row_of[:, k + 1 :][valid]]).sum(-1).mean()).item(),
                        f"alpha_{k}": torch.minimum(target, q).sum(-1).mean().item(),
                        f"agree_{k}": (q.argmax(-1, keepdim=True) == best).float().mean().item(),
                        f"top{branch}_{k}": (top == best).any(-1).float().mean().item(),
                    }
                )
    loss = torch.as_tensor(total) / max(weights, 1e-9)
    out["loss"] = loss.item()
    return loss, out


# ----- training ------------------------------------------------------------------------------


def _lr(step: int, steps: int, plan: MedusaTraining) -> float:
    if step < plan.warmup:
        return plan.lr * (step + 1) / plan.warmup
    progress = (step - plan.warmup) / max(1, steps - plan.warmup)
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return plan.lr * (plan.min_lr_ratio + (1 - plan.min_lr_ratio) * cosine)


def init_heads(target: LlamaModel, draft_ids: torch.Tensor, plan: MedusaTraining) -> MedusaHeads:
    """New heads as Medusa starts them: residual blocks at zero (each head passes the target's state through), every
    output layer the target's own (its rows of the draft vocabulary): so each head starts as the target's guess of
    the next token and learns the shift."""
    config = MedusaConfig(
        target.config.hidden_size,
        target.vocab_size,
        plan.heads,
        plan.layers,
        len(draft_ids),
        shared_output=plan.shared_output,
    )
    heads = MedusaHeads(config)
    weight = target.lm_head.weight.detach()[draft_ids.to(target.device)].float().cpu()  # quantized: float32 rows
    with torch.no_grad():
        for name, param in heads.named_parameters():
            param.copy_(weight if name.startswith("outputs.") else torch.zeros_like(param))
        heads.token_map.copy_(draft_ids.cpu())
    return heads


def target_rows(target: LlamaModel, draft_ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`[K', H]` the target's output layer's rows of the draft vocabulary (bfloat16): the training target."""
    weight = target.lm_head.weight.detach()  # a quantized output layer hands out float32
    return weight[draft_ids.to(weight.device)].to(device, torch.bfloat16).contiguous()


@torch.no_grad()
def heldout(
    heads: MedusaHeads,
    target_out: torch.Tensor,
    batches: Batches,
    plan: MedusaTraining,
    device: torch.device,
    limit_tokens: int = 60_000,
) -> dict[str, float]:
    """The loss and per-head acceptance over (up to `limit_tokens` of) the held-out chunk."""
    if batches.heldout_chunk is None:
        return {}
    heads.eval()
    sequences = batches.reader.chunk(batches.heldout_chunk)
    sums: dict[str, float] = defaultdict(float)
    weight, used = 0, 0
    for start in range(0, len(sequences), 8):
        group = sequences[start : start + 8]
        batch = make_batch(group, device)
        with bf16_autocast(device):
            _, metrics = medusa_loss(heads, target_out, batch, plan.head_decay)
        n = int(batch["mask"].sum())
        for key, value in metrics.items():
            sums[key] += value * n
        weight += n
        used += sum(len(s.tokens) for s in group)
        if used >= limit_tokens:
            break
    heads.train()
    return {k: v / max(weight, 1) for k, v in sums.items()}


def train_heads(
    heads: MedusaHeads,
    target_out: torch.Tensor,
    reader: FeatureReader,
    plan: MedusaTraining,
    work: Path,
    progress: bool = True,
    minutes: float | None = None,
    stop_after: int | None = None,
) -> dict[str, Any]:
    """Train `heads`; checkpoints to `work/checkpoint.pt` (a later call resumes it exactly). `minutes` and
    `stop_after` bound this call (it checkpoints, and a resumed call continues). Returns the training record: steps,
    tokens seen, token-steps (counted positions summed over the heads) and the curve."""
    device = torch.device(plan.device)
    work.mkdir(parents=True, exist_ok=True)
    path = work / "checkpoint.pt"
    heads.to(device).train()
    optimizer = torch.optim.AdamW(heads.parameters(), lr=plan.lr, weight_decay=plan.weight_decay, betas=(0.9, 0.95))
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
        heads.load_state_dict(state["heads"])
        optimizer.load_state_dict(state["optimizer"])
        batches.cursor, record = state["cursor"], state["record"]
        record["steps"] = steps  # the schedule's length follows from the data and the settings
    started = last_save = time.monotonic()
    first = record["step"]
    bar = tqdm(total=record["steps"], initial=record["step"], desc="train heads", unit="step", disable=not progress)
    window: list[dict[str, float]] = []
    while record["step"] < record["steps"]:
        step = record["step"]
        tick = time.monotonic()
        batch = make_batch(batches.next(), device)
        for group in optimizer.param_groups:
            group["lr"] = _lr(step, record["steps"], plan)
        with bf16_autocast(device):  # the train metrics every METRICS_EVERY steps: they cost a pass over the logits
            loss, metrics = medusa_loss(heads, target_out, batch, plan.head_decay, step % METRICS_EVERY == 0)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(heads.parameters(), plan.clip)
        optimizer.step()
        record["step"] = step + 1
        record["tokens_seen"] += int(batch["lengths"].sum())
        mask = batch["mask"]
        record["token_steps"] += sum(int(mask[:, k + 1 :].sum()) for k in range(plan.heads))
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
                **{f"heldout_{k}": v for k, v in heldout(heads, target_out, batches, plan, device).items()},
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
            _save(path, heads, optimizer, batches, record)
            last_save = time.monotonic()
        if out_of_time:
            break
    bar.close()
    return record


def _save(
    path: Path, heads: MedusaHeads, optimizer: torch.optim.Optimizer, batches: Batches, record: dict[str, Any]
) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(
        {"heads": heads.state_dict(), "optimizer": optimizer.state_dict(), "cursor": batches.cursor, "record": record},
        tmp,
    )
    os.replace(tmp, path)
    (path.parent / "curve.json").write_text(json.dumps(record["curve"], indent=1))


# ----- evaluation ----------------------------------------------------------------------------


@torch.inference_mode()
def evaluate_medusa(
    target: LlamaModel,
    drafter: MedusaDrafter,
    tokenizer: Tokenizer,
    prompts: list[Prompt],
    max_new_tokens: int,
    tree: TreeShape | None = None,
    progress: bool = True,
    measure_cost: bool = True,
) -> dict[str, Any]:
    """Through the real engine, Medusa's candidate tree of `tree` (default: the heads' own, `MedusaDrafter.tree`)
    every round at temperature 0 and 0.7: per category the tokens per target forward; and the heads' cost against a
    target step."""
    tree = tree or drafter.tree
    report: dict[str, Any] = {
        "prompts": len(prompts),
        "tree": {"nodes": tree.nodes, "branch": tree.branch, "depth": tree.depth},
        "max_new_tokens": max_new_tokens,
        "temperatures": {},
    }
    bar = tqdm(total=2 * len(prompts), desc="evaluate heads", unit="prompt", disable=not progress)
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
                planner=FixedGamma(tree.depth, tree=tree),
            )
            engine.add_request(ids, SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=i))
            for result in engine.stream():
                per_cat[prompt.category].observe(result)
                per_cat["overall"].observe(result)
            bar.update(1)
        report["temperatures"][str(temperature)] = {cat: _summary(c) for cat, c in per_cat.items()}
    bar.close()
    if measure_cost:
        report["cost"] = cost_ratio(target, drafter, tree)
    return report


def _summary(collector: StatsCollector) -> dict[str, Any]:
    s = collector.summary()
    return {
        "tokens_per_round": s["tokens_per_round"],
        "accepted_per_round": s["accepted_per_round"],
        "rounds": s["rounds"],
        "new_tokens": s["new_tokens"],
    }


@torch.inference_mode()
def cost_ratio(
    target: LlamaModel, drafter: MedusaDrafter, tree: TreeShape, repeats: int = 30, context: int = 128
) -> dict[str, Any]:
    """Median seconds of the target's one-token step and of the heads' whole proposal (their forward, the top-k and
    the tree), batch 1, interleaved, each as the engine runs it; c = proposal / target step."""
    from specsample.drafters.base import DraftRequest, DraftRow

    generator = torch.Generator().manual_seed(0)
    target_times, draft_times = [], []
    slot = torch.tensor([0])
    token = torch.tensor([[5]], device=target.device)
    drafter.allocate(1, context + 4)
    request = DraftRequest((DraftRow(0, tree.depth, tree.nodes, SamplingParams(temperature=0), generator),), tree=tree)
    for _ in range(3):
        cache = target.new_cache(1, context + repeats + 2)
        target.prefill(torch.randint(0, min(1000, target.vocab_size), (1, context)), cache, slot)
        drafter.add_rows([0], [[5] * (context + 1)])
        drafter.add_features([0], [torch.randn(1, target.config.hidden_size, dtype=target.dtype)])
        for _ in range(repeats):
            start = time.perf_counter()
            target.forward_cached(token, cache, slot)
            target_times.append(time.perf_counter() - start)
            start = time.perf_counter()
            drafter.propose(request)
            draft_times.append(time.perf_counter() - start)
            cache.truncate(slot, torch.tensor([context]))
        drafter.release_rows([0])
    t, d = statistics.median(target_times), statistics.median(draft_times)
    return {
        "target_step_ms": 1000 * t,
        "draft_step_ms": 1000 * d,
        "c": d / t,
        "compiled": target.compiled is not None,
        "step_path": getattr(target, "step_path", None),  # which code ran the target's step (the fused step, ...)
    }


# ----- the whole run -------------------------------------------------------------------------


def _settings(plan: MedusaTraining) -> dict[str, Any]:
    out = asdict(plan)
    out["out"] = str(plan.out)
    for key in ("device", "checkpoint_minutes", "eval_prompts", "eval_per_category", "eval_max_new_tokens", "tokens"):
        out.pop(key)  # these may differ between resumed runs
    return out


def run_medusa(
    plan: MedusaTraining, resume: bool, progress: bool = True, minutes: float | None = None, command: str | None = None
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
    if not isinstance(target.model, LlamaModel) or target.tokenizer is None:
        raise ValueError("Medusa heads need a Llama-family target (our runtime) with a tokenizer")
    model = target.model
    if plan.layout == "medusa" and (plan.draft_vocab < model.vocab_size or plan.shared_output):
        raise ValueError(
            "FasterDecoding's Medusa layout holds an output layer over the whole vocabulary per head: pass "
            "--draft-vocab 0 and --separate-outputs, or --layout vllm"
        )
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
    target_out = target_rows(model, draft_ids, device)
    heads = init_heads(model, draft_ids, plan)
    record = train_heads(heads, target_out, reader, plan, plan.work / "train", progress, minutes)
    if record["step"] < record["steps"]:
        _log(f"stopped at step {record['step']}/{record['steps']}; rerun with --resume to continue")
        return {"finished": False, "step": record["step"], "steps": record["steps"]}
    save_medusa(heads.cpu(), plan.out, plan.layout)
    (plan.out / "training_curve.json").write_text(json.dumps(record["curve"], indent=1))
    _plot_curve(record["curve"], plan.out / "training_curve.png", plan.heads)
    # the heads are evaluated beside the target as it serves
    served = target if plan.quantize == "auto" else load_model(plan.target, device=plan.device)
    served_model = cast(LlamaModel, served.model)
    drafter = MedusaDrafter(load_medusa(plan.out, model.config.hidden_size, model.vocab_size), served_model, plan.out)
    report = evaluate_medusa(
        served_model,
        drafter,
        target.tokenizer,
        eval_prompts(plan.eval_prompts, plan.eval_per_category),
        plan.eval_max_new_tokens,
        progress=progress,
    )
    report["target_weights"] = "auto"
    report["draft_vocab_coverage"] = vocab_coverage(reader, draft_ids, model.vocab_size)
    index = reader.index
    report["data"] = {
        "source": index["source"],
        "conversations": index["sequences"],
        "tokens": index["tokens"],
        "reply_tokens": index["reply_tokens"],
        "target_weights": plan.quantize,
    }
    report["training"] = {
        "epochs": plan.epochs,
        "steps": record["step"],
        "token_steps": record["token_steps"],
        "hours": record["seconds"] / 3600,
        "device": _device_name(plan.device),
    }
    (plan.out / "eval.json").write_text(json.dumps(report, indent=2))
    write_card(plan, reader, record, report, command)
    return {"finished": True, "step": record["step"], "eval": report}


def _device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return f"one {torch.cuda.get_device_name(torch.device(device))}"
    return f"{os.cpu_count()} CPU cores" if device == "cpu" else device


def _plot_curve(curve: list[dict[str, Any]], path: Path, heads: int) -> None:
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
    for k in range(heads):
        if f"heldout_top4_{k}" in curve[0]:
            right.plot(tokens, [c[f"heldout_top4_{k}"] for c in curve], label=f"head {k}: target's token in top 4")
        if f"heldout_agree_{k}" in curve[0]:
            right.plot(tokens, [c[f"heldout_agree_{k}"] for c in curve], linestyle="--", label=f"head {k}: top 1")
    right.set_xlabel("training tokens (M)")
    if right.lines:
        right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def evaluation_table(report: dict[str, Any]) -> list[str]:
    """Markdown of an `evaluate_medusa` report: per temperature and category, and the cost ratio."""
    tree = report["tree"]
    weights = f", the target's weights --quantize {report['target_weights']}" if "target_weights" in report else ""
    lines = [
        f"{report['prompts']} prompts, up to {report['max_new_tokens']} new tokens, Medusa's candidate tree of "
        f"{tree['nodes']} nodes ({tree['branch']} children a node at most, {tree['depth']} deep) every round through "
        f"the engine (batch 1{weights}).",
        "",
        "| category | tokens per target forward, T 0 | T 0.7 |",
        "|---|---|---|",
    ]
    cold, warm = report["temperatures"]["0.0"], report["temperatures"]["0.7"]
    for name in sorted(cold, key=lambda n: (n == "overall", n)):
        lines.append(
            f"| {name} | {cold[name]['tokens_per_round']:.2f} | {warm.get(name, {}).get('tokens_per_round', 0):.2f} |"
        )
    cost = report.get("cost")
    if cost is not None:
        mode = "compiled" if cost.get("compiled") else "eager"
        if cost.get("step_path"):
            mode = f"the target on {cost['step_path']}" + (", compiled" if cost.get("compiled") else "")
        lines += [
            "",
            f"Cost ratio c = {cost['c']:.3f} (the heads' proposal {cost['draft_step_ms']:.2f} ms: their forward, top-k "
            f"and tree; the target's one-token step {cost['target_step_ms']:.2f} ms; batch 1, {mode}).",
        ]
    return lines


def write_card(
    plan: MedusaTraining, reader: FeatureReader, record: dict[str, Any], report: dict[str, Any], command: str | None
) -> None:
    """README.md beside the heads: data, compute, curve and evaluation, all from this run's files."""
    index = reader.index
    target = portable_spec(plan.target)
    output = "one output layer shared by every head" if plan.shared_output else "an output layer per head"
    lines = [
        f"# Medusa heads for {target}",
        "",
        f"{plan.heads} Medusa heads (Medusa-1: the target frozen) on `{target}`'s last hidden state "
        f"({index['hidden_size']} wide), each {plan.layers} residual block(s), with {output} over a "
        f"{min(plan.draft_vocab, index['vocab_size'])}-token draft vocabulary. Head k guesses the token k + 2 places "
        f"past the position it reads. The folder is in {'vLLM' if plan.layout == 'vllm' else 'FasterDecoding'}'s "
        "Medusa layout. Trained with `specsample distill --kind medusa`.",
        "",
    ]
    if command:
        lines += ["## Command", "", "```bash", portable_command(command), "```", ""]
    hours = record["seconds"] / 3600
    lines += [
        "## Data",
        "",
        f"{index['sequences']:,} conversations from `{portable_spec(plan.prompts)}` with their own replies, run "
        f"through the target teacher-forced (weights `--quantize {plan.quantize}`): {index['tokens']:,} tokens, "
        f"{index['reply_tokens']:,} of them in replies (the loss counts reply positions); conversations cut at "
        f"{plan.max_len} tokens. The last chunk is held out. The draft vocabulary covers "
        f"{report.get('draft_vocab_coverage', float('nan')):.1%} of held-out reply tokens.",
        "",
        "## Training",
        "",
        f"{record['step']} steps of up to {plan.batch_tokens} tokens with padding ({record['tokens_seen']:,} tokens "
        f"seen, {plan.epochs} pass(es)), head k's loss weighted {plan.head_decay}^k: {record['token_steps']:,} "
        f"token-steps (positions summed over the heads). AdamW lr {plan.lr}, cosine to {plan.min_lr_ratio} x. "
        f"Compute: {hours:.1f} h of training on {_device_name(plan.device)}.",
        "",
        "![training curve](training_curve.png)",
        "",
        "Held-out, per head: the target's most likely token among the head's top 4 / the head's top 1.",
        "",
        "| step | tokens | train loss | held-out loss | " + " | ".join(f"head {k}" for k in range(plan.heads)) + " |",
        "|---|---|---|---|" + "---|" * plan.heads,
    ]
    curve = record["curve"]
    shown = curve[:: max(1, len(curve) // 12)]
    for c in shown + [c for c in curve[-1:] if c not in shown]:
        per_head = " | ".join(
            f"{c.get(f'heldout_top4_{k}', float('nan')):.3f} / {c.get(f'heldout_agree_{k}', float('nan')):.3f}"
            for k in range(plan.heads)
        )
        lines.append(
            f"| {c['step']} | {c['tokens_seen']:,} | {c['train_loss']:.4f} | "
            f"{c.get('heldout_loss', float('nan')):.4f} | {per_head} |"
        )
    lines += ["", "## Evaluation", "", *evaluation_table(report)]
    (plan.out / "README.md").write_text("\n".join(lines) + "\n")
