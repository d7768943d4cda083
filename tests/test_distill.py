"""Distillation: the data store, training (loss falls, acceptance rises, exact resume), export."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch
from model_factory import make_tokenizer, write_hf_model

from specsample.cli import build_parser
from specsample.datasets import Prompt
from specsample.distill.card import portable_command
from specsample.distill.collect import CollectConfig, collect_on_policy, collect_teacher_forced
from specsample.distill.data import DataReader, DataWriter, Sequence_
from specsample.distill.train import (
    Batches,
    DraftShape,
    TrainConfig,
    choose_output_subset,
    heldout_metrics,
    init_draft,
    train,
)
from specsample.drafters.model import DraftWindow
from specsample.models.loader import load_model

K = 8


def _random_sequences(count: int, rng: np.random.Generator) -> list[Sequence_]:
    out = []
    for _ in range(count):
        n = int(rng.integers(2, 20))
        out.append(
            Sequence_(
                rng.integers(0, 300, n).astype(np.int32),
                rng.integers(0, 300, (n, K)),
                rng.normal(size=(n, K)).astype(np.float16),
            )
        )
    return out


def test_store_round_trip_and_interrupted_append(tmp_path) -> None:
    rng = np.random.default_rng(0)
    first, second = _random_sequences(5, rng), _random_sequences(3, rng)
    writer = DataWriter(tmp_path, K, 300, "teacher")
    writer.append(first, [{"i": i} for i in range(5)])
    # an append that died after writing data but before committing the index
    for name in ("tokens.bin", "topk_ids.bin", "topk_logp.bin"):
        with (tmp_path / name).open("ab") as handle:
            handle.write(b"\x07" * 13)
    writer = DataWriter(tmp_path, K, 300, "teacher")  # reopen: uncommitted bytes are dropped
    assert writer.num_sequences == 5
    writer.append(second)
    reader = DataReader(tmp_path)
    assert len(reader) == 8
    for got, want in zip([reader[i] for i in range(8)], first + second):
        assert np.array_equal(got.tokens, want.tokens)
        assert np.array_equal(got.topk_ids, want.topk_ids)
        assert np.array_equal(got.topk_logp, want.topk_logp)


def test_truncated_or_corrupt_store_is_a_clear_error(tmp_path) -> None:
    writer = DataWriter(tmp_path, K, 300, "teacher")
    writer.append(_random_sequences(4, np.random.default_rng(1)))
    data = (tmp_path / "topk_logp.bin").read_bytes()
    (tmp_path / "topk_logp.bin").write_bytes(data[:-10])
    with pytest.raises(ValueError, match="truncated"):
        DataReader(tmp_path)
    (tmp_path / "index.json").write_text("{not json")
    with pytest.raises(ValueError, match="corrupt"):
        DataReader(tmp_path)
    with pytest.raises(ValueError, match="not a distillation data store"):
        DataReader(tmp_path / "nowhere")


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    tokenizer = make_tokenizer()
    target = load_model(
        str(write_hf_model(root / "target", "llama", tokenizer=tokenizer, hidden_size=64, num_hidden_layers=2)),
        dtype="float32",
    )
    words = "the quick brown fox jumps over the lazy dog speculative sampling tokens".split()
    rng = np.random.default_rng(0)
    prompts = [
        Prompt(str(i), "t", (" ".join(rng.choice(words, 12)),), (" ".join(rng.choice(words, 30)),)) for i in range(60)
    ]
    config = CollectConfig(top_k=K, max_len=64, batch_tokens=512, onpolicy_batch=8, onpolicy_max_new=16)
    teacher = DataWriter(root / "teacher", K, target.model.vocab_size, "teacher")
    collect_teacher_forced(target.model, target.tokenizer, prompts[:50], teacher, config, progress=False)
    onpolicy = DataWriter(root / "onpolicy", K, target.model.vocab_size, "onpolicy")
    collect_on_policy(target.model, target.tokenizer, prompts[50:], onpolicy, config, progress=False)
    stores = [DataReader(root / "teacher"), DataReader(root / "onpolicy")]
    return root, target, stores


def _draft(target, stores):
    draft = init_draft(target.model, DraftShape(width=32, layers=1, heads=2, kv_heads=1), seed=0)
    draft.set_output_subset(choose_output_subset(stores, target.model.vocab_size, 128))
    return draft


def test_training_improves_acceptance(tiny_setup, tmp_path) -> None:
    _, target, stores = tiny_setup
    config = TrainConfig(steps=80, batch_tokens=512, lr=1e-2, warmup=5, eval_every=40, heldout_every=10)
    draft = _draft(target, stores)
    to_subset = torch.full((draft.vocab_size,), -1, dtype=torch.long)
    to_subset[draft.output_subset] = torch.arange(len(draft.output_subset))
    batches = Batches(stores, config.heldout_every, config.seed)
    before = heldout_metrics(draft, stores, batches, to_subset, 10**6, 512)
    record = train(draft, stores, [1], config, tmp_path, resume=False, progress=False)
    after = record["curve"][-1]
    assert after["heldout_loss"] < before["loss"] - 0.3
    assert after["heldout_alpha"] > 1.3 * before["alpha"]  # a random tiny target is high-entropy: alpha stays small


def test_resume_is_exact(tiny_setup, tmp_path) -> None:
    _, target, stores = tiny_setup
    config = TrainConfig(steps=30, batch_tokens=512, lr=1e-2, warmup=5, eval_every=10, heldout_every=10)
    whole = _draft(target, stores)
    train(whole, stores, [1], config, tmp_path / "whole", resume=False, progress=False)
    parts = _draft(target, stores)
    first = train(parts, stores, [1], config, tmp_path / "parts", resume=False, progress=False, stop_after=12)
    assert first["step"] == 12
    with pytest.raises(ValueError, match="--resume"):
        train(_draft(target, stores), stores, [1], config, tmp_path / "parts", resume=False, progress=False)
    resumed = _draft(target, stores)  # a fresh process: weights come from the checkpoint
    record = train(resumed, stores, [1], config, tmp_path / "parts", resume=True, progress=False)
    assert record["step"] == 30
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.slow
def test_cli_run_exports_a_folder_both_runtimes_load(tmp_path) -> None:
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    target = write_hf_model(tmp_path / "target", "llama", tokenizer=make_tokenizer(), max_position_embeddings=256)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"the quick brown fox number {i} jumps"}) for i in range(40)))
    out = tmp_path / "draft"
    argv = [
        "distill",
        "--kind",
        "model",
        "--target",
        str(target),
        "--out",
        str(out),
        "--prompts",
        str(prompts),
        "--num-prompts",
        "24",
        "--onpolicy-prompts",
        "8",
        "--steps",
        "20",
        "--max-len",
        "64",
        "--onpolicy-max-new",
        "12",
        "--width",
        "32",
        "--layers",
        "1",
        "--heads",
        "2",
        "--kv-heads",
        "1",
        "--draft-vocab",
        "64",
        "--batch-tokens",
        "512",
        "--eval-max-new-tokens",
        "8",
    ]
    done = subprocess.run([sys.executable, "-m", "specsample.cli", *argv], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "draft_vocab.json",
        "README.md",
        "eval.json",
        "training_curve.png",
        "draft_window.json",
    ):
        assert (out / name).exists(), name
    assert DraftWindow.from_folder(out) == DraftWindow(sink=4, recent=32, limit=64)  # trained on --max-len 64
    ours = load_model(str(out), dtype="float32")
    subset = torch.tensor(json.loads((out / "draft_vocab.json").read_text())["token_ids"])
    ids = torch.tensor([[5, 17, 42, 7, 99]])
    theirs = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    with torch.no_grad():
        reference = theirs(ids).logits
    logits = ours.model(ids)
    assert torch.allclose(logits[..., subset], reference[..., subset], atol=1e-4)
    assert torch.isinf(logits).sum() == logits[..., 0].numel() * (ours.model.vocab_size - len(subset))
    card = (out / "README.md").read_text()
    overall = json.loads((out / "eval.json").read_text())["categories"]["overall"]
    assert f"{overall['agree']:.3f}" in card
    # the command that made it, with this machine's folders shown by their names: the same settings
    assert str(tmp_path) not in card
    command = shlex.split(card.split("```bash\n", 1)[1].split("\n", 1)[0])
    assert command[0] == "specsample"
    shown, given = build_parser().parse_args(command[1:]), build_parser().parse_args(argv)
    assert vars(shown) == vars(given) | {"target": target.name, "out": Path(out.name), "prompts": prompts.name}


def test_a_card_shows_a_command_without_the_machines_folders() -> None:
    assert (
        portable_command(
            "specsample distill --out /work/runs/draft --prompts=~/data/p.jsonl --target "
            "smollm2-135m-instruct --eval-prompts 'my prompts.jsonl' --x runs/rel"
        )
        == "specsample distill --out draft --prompts=p.jsonl --target smollm2-135m-instruct --eval-prompts "
        "'my prompts.jsonl' --x runs/rel"
    )
