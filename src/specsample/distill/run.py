"""`specsample distill`: collect data, train, evaluate and export a draft for a target, resumably."""

from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from specsample.datasets import Prompt, sharegpt_prompts, spec_bench_prompts, text_file_prompts
from specsample.distill.card import portable_command, portable_spec
from specsample.distill.collect import CollectConfig, collect_on_policy, collect_teacher_forced
from specsample.distill.data import DataReader, DataWriter
from specsample.distill.evaluate import evaluate
from specsample.distill.train import DraftShape, TrainConfig, choose_output_subset, init_draft, train
from specsample.drafters.model import DraftWindow
from specsample.models.convert import save_hf_folder
from specsample.models.hf_names import export_hf_state_dict
from specsample.models.llama import LlamaModel
from specsample.models.loader import DRAFT_VOCAB_FILE, LoadedModel, load_model


@dataclass(frozen=True)
class DistillPlan:
    """Everything one `specsample distill` run needs (a resumed run must pass the same plan)."""

    target: str
    out: Path
    prompts: str = "sharegpt"  # 'sharegpt' or a prompt file
    num_prompts: int = 2000  # conversations scored teacher-forced
    onpolicy_prompts: int = 500  # prompts the target answers itself
    shape: DraftShape = DraftShape()
    draft_vocab: int | None = 8192
    train: TrainConfig = TrainConfig()
    minutes: float | None = None  # training budget: sizes the schedule when steps were not given
    collect: CollectConfig = CollectConfig()
    seed: int = 0
    eval_prompts: str = "heldout"  # 'heldout' (unused ShareGPT prompts), 'spec-bench', or a file
    eval_max_new_tokens: int = 64
    device: str = "cpu"  # where the target scores and the draft trains ('cuda' on a GPU machine)

    @property
    def work(self) -> Path:
        return self.out / ".work"


def _log(message: str) -> None:
    print(f"specsample distill: {message}", file=sys.stderr, flush=True)


def _training_prompts(plan: DistillPlan) -> tuple[list[Prompt], list[Prompt], list[Prompt]]:
    """Disjoint prompt sets: teacher-forced, on-policy, held-out evaluation."""
    total = plan.num_prompts + plan.onpolicy_prompts + 64
    if plan.prompts == "sharegpt":
        pool = list(sharegpt_prompts(limit=total))
    else:
        pool = text_file_prompts(plan.prompts)
    if len(pool) < plan.num_prompts + plan.onpolicy_prompts:
        raise ValueError(f"only {len(pool)} prompts available; asked for {plan.num_prompts} + {plan.onpolicy_prompts}")
    teacher = pool[: plan.num_prompts]
    onpolicy = pool[plan.num_prompts : plan.num_prompts + plan.onpolicy_prompts]
    heldout = pool[plan.num_prompts + plan.onpolicy_prompts :]
    return teacher, onpolicy, heldout


def collect(plan: DistillPlan, target: LoadedModel, progress: bool) -> list[DataReader]:
    """Fill (or finish filling) the teacher-forced and on-policy stores."""
    teacher, onpolicy, _ = _training_prompts(plan)
    vocab = target.model.vocab_size
    stores = []
    for kind, prompts in (("teacher", teacher), ("onpolicy", onpolicy)):
        if not prompts:
            continue
        writer = DataWriter(plan.work / "data" / kind, plan.collect.top_k, vocab, kind)
        if not writer.index["complete"]:
            started = time.perf_counter()
            if kind == "teacher":
                collect_teacher_forced(target.model, target.text_tokenizer(), prompts, writer, plan.collect, progress)
            else:
                collect_on_policy(
                    target.model, target.text_tokenizer(), prompts, writer, plan.collect, plan.seed, progress
                )
            writer.finish()
            _log(
                f"{kind}: {writer.num_sequences} sequences, {writer.num_tokens} tokens "
                f"({time.perf_counter() - started:.0f} s this run)"
            )
        stores.append(DataReader(plan.work / "data" / kind))
    return stores


def _estimate_steps(draft: LlamaModel, stores: list[DataReader], config: TrainConfig, minutes: float) -> int:
    """Steps that fit in `minutes` on this machine, from three timed steps on a throwaway copy."""
    import copy
    import tempfile

    probe_config = replace(config, steps=3, eval_every=10**9, checkpoint_minutes=10**9)
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        train(copy.deepcopy(draft), stores, [], probe_config, Path(tmp), resume=False, progress=False)
        per_step = (time.perf_counter() - started) / 3
    return max(config.warmup + 10, int(minutes * 60 / (per_step * 1.1)))


def run(
    plan: DistillPlan,
    resume: bool,
    progress: bool = True,
    train_minutes: float | None = None,
    command: str | None = None,
) -> dict[str, Any]:
    """Collect, train, export and evaluate; every stage resumes where an interrupted run stopped."""
    plan_file = plan.work / "plan.json"
    plan_json = json.dumps(_plan_dict(plan), indent=2, sort_keys=True)
    if plan.work.exists() and not resume:
        raise ValueError(f"{plan.out} already holds a distillation run; pass --resume to continue it")
    if resume and plan_file.exists() and json.loads(plan_file.read_text()) != json.loads(plan_json):
        raise ValueError(f"--resume needs the same settings as the run in {plan.out} (see {plan_file})")
    plan.work.mkdir(parents=True, exist_ok=True)
    plan_file.write_text(plan_json)
    torch.manual_seed(plan.seed)
    target = load_model(plan.target, device=plan.device)
    if not isinstance(target.model, LlamaModel) or target.tokenizer is None:
        raise ValueError("distill needs a Llama-family target (our runtime) with a tokenizer")
    stores = collect(plan, target, progress)
    subset_path = plan.work / "subset.json"
    if not subset_path.exists():
        subset = choose_output_subset(stores, target.model.vocab_size, plan.draft_vocab)
        subset_path.write_text(json.dumps({"token_ids": subset.tolist()}))
    subset = torch.tensor(json.loads(subset_path.read_text())["token_ids"])
    fp32_target = target.model.float() if target.model.dtype != torch.float32 else target.model
    draft = init_draft(fp32_target, plan.shape, plan.seed).to(plan.device)
    draft.set_output_subset(subset)
    config = plan.train
    schedule_path = plan.work / "schedule.json"
    if plan.minutes is not None:
        if not schedule_path.exists():
            schedule_path.write_text(json.dumps({"steps": _estimate_steps(draft, stores, config, plan.minutes)}))
        config = replace(config, steps=json.loads(schedule_path.read_text())["steps"])
    onpolicy = [i for i, s in enumerate(stores) if s.index["kind"] == "onpolicy"]
    record = train(
        draft, stores, onpolicy, config, plan.work / "train", resume=True, minutes=train_minutes, progress=progress
    )
    if record["step"] < config.steps:
        _log(f"stopped at step {record['step']}/{config.steps}; rerun with --resume to continue")
        return {"finished": False, "step": record["step"]}
    export(draft, target, plan.out, stores, record, plan.collect.max_len)
    exported = load_model(str(plan.out), dtype="float32", device=plan.device)
    report = evaluate(
        fp32_target,
        exported.model,
        target.text_tokenizer(),
        _eval_prompts(plan),
        plan.eval_max_new_tokens,
        progress=progress,
    )
    (plan.out / "eval.json").write_text(json.dumps(report, indent=2))
    write_model_card(plan, stores, record, report, command)
    return {"finished": True, "step": record["step"], "eval": report}


def _eval_prompts(plan: DistillPlan) -> list[Prompt]:
    if plan.eval_prompts == "spec-bench":
        return spec_bench_prompts()
    if plan.eval_prompts == "heldout":
        return _training_prompts(plan)[2]
    return text_file_prompts(plan.eval_prompts)


def _plan_dict(plan: DistillPlan) -> dict[str, Any]:
    out = asdict(plan)
    out["out"] = str(plan.out)
    out.pop("minutes", None)  # a time budget may differ between resumed chunks
    out.pop("device", None)  # ...and so may the machine
    return out


def export(
    draft: LlamaModel,
    target: LoadedModel,
    out: Path,
    stores: list[DataReader],
    record: dict[str, Any],
    trained_len: int,
) -> None:
    """Write the draft as a standard HF Llama folder (bf16), its output subset, its tokenizer and the
    context window it drafts from (it saw sequences of at most `trained_len` tokens)."""
    config = draft.config.to_hf()
    config["torch_dtype"] = "bfloat16"
    tensors = export_hf_state_dict(draft)
    tokenizer = target.text_tokenizer()
    save_hf_folder(out, config, tensors, tokenizer.hf, tokenizer.eos_token_ids, dtype=torch.bfloat16)
    if draft.output_subset is not None and len(draft.output_subset) < draft.vocab_size:
        (out / DRAFT_VOCAB_FILE).write_text(
            json.dumps(
                {
                    "token_ids": draft.output_subset.tolist(),
                    "note": "specsample restricts this draft's output to these token ids (FR-Spec); other tokens get "
                    "probability 0. transformers ignores this file and uses the full tied vocabulary, so its "
                    "logits equal ours on these ids.",
                }
            )
        )
    window = DraftWindow.trained_on(trained_len)
    if window is not None:
        window.save(
            out,
            f"trained on sequences of at most {trained_len} tokens: specsample drafts from the first "
            f"{window.sink} and latest {window.recent}, re-windowed at {window.limit} positions",
        )
    (out / "training_curve.json").write_text(json.dumps(record["curve"], indent=1))
    _plot_curve(record["curve"], out / "training_curve.png")


def _plot_curve(curve: list[dict[str, Any]], path: Path) -> None:
    if not curve:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = [c["tokens_seen"] / 1e6 for c in curve]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    left.plot(tokens, [c["train_loss"] for c in curve], label="train")
    left.plot(tokens, [c["heldout_loss"] for c in curve], label="held-out")
    left.set_xlabel("training tokens (M)")
    left.set_ylabel("cross-entropy to target top-k")
    left.legend()
    right.plot(tokens, [c["heldout_alpha"] for c in curve], label="alpha (T=1, top-k)")
    right.plot(tokens, [c["heldout_agree"] for c in curve], label="greedy agreement")
    right.set_xlabel("training tokens (M)")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_model_card(
    plan: DistillPlan,
    stores: list[DataReader],
    record: dict[str, Any],
    report: dict[str, Any],
    command: str | None = None,
) -> None:
    """README.md beside the weights: data, command, curve and evaluation, all from this run's files (paths of this
    machine shown by their names)."""
    target = portable_spec(plan.target)
    lines = [
        f"# Draft for {target}",
        "",
        f"A {plan.shape.layers}-layer, {plan.shape.width}-wide Llama draft distilled from `{target}` with "
        "`specsample distill` (DistillSpec-style: forward KL to the target's top-k distributions).",
        "",
    ]
    if command:
        lines += ["## Command", "", "```bash", portable_command(command), "```", ""]
    lines += ["## Data", ""]
    for store in stores:
        lines.append(f"- {store.index['kind']}: {len(store)} sequences, {store.num_tokens} tokens, top-{store.k}")
    window = DraftWindow.trained_on(plan.collect.max_len)
    if window is not None:
        lines += [
            "",
            "## Context window",
            "",
            f"Trained on sequences of at most {plan.collect.max_len} tokens, so specsample drafts from the first "
            f"{window.sink} and the latest {window.recent} tokens of a longer context, re-windowed at "
            f"{window.limit} positions (`draft_window.json`; `--draft-window off` gives it the whole context). "
            "The evaluation below scores the whole context.",
        ]
    lines += [
        "",
        "## Training",
        "",
        f"{record['step']} steps, {record['tokens_seen']} scored tokens seen; "
        f"settings: `{json.dumps(record['config'])}`",
        "",
        "![training curve](training_curve.png)",
        "",
        "| step | tokens | train loss | held-out loss | held-out alpha | agreement |",
        "|---|---|---|---|---|---|",
    ]
    curve = record["curve"]
    shown = curve[:: max(1, len(curve) // 12)]
    for c in shown + [c for c in curve[-1:] if c not in shown]:
        lines.append(
            f"| {c['step']} | {c['tokens_seen']} | {c['train_loss']:.3f} | {c['heldout_loss']:.3f} | "
            f"{c['heldout_alpha']:.3f} | {c['heldout_agree']:.3f} |"
        )
    lines += ["", "## Evaluation", "", *evaluation_table(report)]
    (plan.out / "README.md").write_text("\n".join(lines) + "\n")


def evaluation_table(report: dict[str, Any]) -> list[str]:
    """Markdown rows for an `evaluate()` report: per category, then cost and predicted speedup."""
    lines = [
        f"{report['prompts']} prompts, greedy target continuations of up to {report['max_new_tokens']} tokens.",
        "",
        "| category | positions | greedy agreement | alpha T=0.7 | alpha T=1.0 |",
        "|---|---|---|---|---|",
    ]
    cats = report["categories"]
    for name in sorted(cats, key=lambda n: (n == "overall", n)):
        c = cats[name]
        lines.append(f"| {name} | {c['positions']} | {c['agree']:.3f} | {c['alpha_0.7']:.3f} | {c['alpha_1.0']:.3f} |")
    if "cost" in report:
        cost = report["cost"]
        lines += [
            "",
            f"Cost ratio c = {cost['c']:.3f} (draft step {cost['draft_step_ms']:.2f} ms, target step "
            f"{cost['target_step_ms']:.2f} ms, batch 1).",
            "",
            "| decoding | alpha | best gamma | predicted speedup |",
            "|---|---|---|---|",
        ]
        for name, p in report["predicted"].items():
            lines.append(f"| {name} | {p['alpha']:.3f} | {p['best_gamma']} | {p['speedup']:.2f}x |")
    return lines


def copy_shipped(out: Path, dest: Path) -> None:
    """Copy only the files a shipped draft needs (no work data, no checkpoints)."""
    dest.mkdir(parents=True, exist_ok=True)
    for item in out.iterdir():
        if item.name.startswith("."):
            continue
        shutil.copy2(item, dest / item.name)
