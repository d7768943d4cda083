"""The feature draft (EAGLE head) shipped inside the package: size, shape, output subset, model-card numbers."""

from __future__ import annotations

import json

import pytest

from specsample.drafters.eagle import EagleDrafter, EagleHead
from specsample.models.hub import DRAFTS_DIR, SMOLLM2_HEAD, builtin_draft
from specsample.pair import load_drafter

pytestmark = pytest.mark.slow
FOLDER = DRAFTS_DIR / SMOLLM2_HEAD
MAX_BYTES = 20 * 1024 * 1024
MIN_TRAINING_TOKENS = 7_200_000  # three times the 2.4 M distinct tokens the draft model saw


def test_shipped_head_fits_the_budget_and_records_its_training() -> None:
    files = {p.name: p for p in FOLDER.iterdir() if p.is_file()}
    assert {"eagle.json", "model.safetensors", "draft_vocab.json", "README.md", "eval.json",
            "training_curve.json", "training_curve.png"} <= set(files)
    assert sum(p.stat().st_size for p in files.values()) <= MAX_BYTES
    about = json.loads(files["eagle.json"].read_text())
    assert about["target"] == "smollm2-135m-instruct"
    assert about["trained"]["tokens"] >= MIN_TRAINING_TOKENS
    curve = json.loads(files["training_curve.json"].read_text())
    assert curve[-1]["tokens_seen"] >= MIN_TRAINING_TOKENS
    assert curve[-1]["heldout_loss"] < curve[0]["heldout_loss"]


def test_model_card_shows_the_recorded_evaluation() -> None:
    card = (FOLDER / "README.md").read_text()
    report = json.loads((FOLDER / "eval.json").read_text())
    for temperature, categories in report["temperatures"].items():
        assert f"Temperature {temperature}:" in card
        for name, row in categories.items():
            assert f"| {name} | {row['acceptance_rate']:.3f} | {row['alpha']:.3f} | {row['tokens_per_round']:.2f} |" in card
    assert f"c = {report['cost']['c']:.3f}" in card
    assert "specsample distill" in card


def test_loads_for_the_real_target_with_its_output_subset(smollm2) -> None:
    assert builtin_draft(SMOLLM2_HEAD) == FOLDER
    drafter = load_drafter(SMOLLM2_HEAD, smollm2)
    assert isinstance(drafter, EagleDrafter)
    head, subset, _ = EagleHead.load(FOLDER)
    assert head.config.hidden_size == smollm2.model.config.hidden_size
    ids = subset.tolist()
    assert len(ids) == len(set(ids)) and all(0 <= t < smollm2.model.vocab_size for t in ids)
    assert drafter.output_subset.tolist() == ids
