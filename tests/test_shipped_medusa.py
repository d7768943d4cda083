"""The Medusa heads shipped inside the package: their size, their published layout, their record of data and training,
and that they load and draft for the real target (alone and in the hybrid)."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from specsample.drafters.hybrid import HybridDrafter
from specsample.drafters.medusa import MedusaDrafter
from specsample.models.hub import DRAFTS_DIR, SMOLLM2_MEDUSA, builtin_draft
from specsample.pair import load_drafter

pytestmark = pytest.mark.slow
FOLDER = DRAFTS_DIR / SMOLLM2_MEDUSA
MAX_BYTES = 12_000_000


def test_shipped_heads_are_in_vllms_layout_within_their_budget() -> None:
    files = {p.name: p for p in FOLDER.iterdir() if p.is_file()}
    assert {"config.json", "model.safetensors", "README.md", "eval.json", "training_curve.json"} <= set(files)
    assert sum(p.stat().st_size for p in files.values()) <= MAX_BYTES
    config = json.loads(files["config.json"].read_text())
    assert config["architectures"] == ["MedusaModel"] and config["truncated_vocab_size"] < config["vocab_size"]
    with safe_open(str(files["model.safetensors"]), framework="pt") as handle:
        names = set(handle.keys())
    assert {"token_map", "lm_heads.0.weight", "blocks.0.layers.0.weight"} <= names


def test_shipped_heads_record_their_data_training_and_evaluation() -> None:
    record = json.loads((FOLDER / "eval.json").read_text())
    data = record["data"]
    assert data["source"] == "teacher-forced" and 0 < data["reply_tokens"] < data["tokens"]
    curve = json.loads((FOLDER / "training_curve.json").read_text())
    assert curve[-1]["token_steps"] == record["training"]["token_steps"]
    assert curve[-1]["heldout_top4_0"] > curve[0]["heldout_top4_0"]
    assert record["tree"]["nodes"] <= 16 and record["prompts"] >= 13
    assert "0.0" in record["temperatures"] and "cost" in record
    card = (FOLDER / "README.md").read_text()
    assert f"{record['temperatures']['0.0']['overall']['tokens_per_round']:.2f}" in card


def test_loads_and_drafts_for_the_real_target(smollm2) -> None:
    assert builtin_draft(SMOLLM2_MEDUSA) == FOLDER
    drafter = load_drafter(SMOLLM2_MEDUSA, smollm2)
    assert isinstance(drafter, MedusaDrafter) and drafter.tree.nodes == 16
    ids = drafter.output_subset.tolist()
    assert len(ids) == len(set(ids)) and all(0 <= t < smollm2.model.vocab_size for t in ids)
    hybrid = load_drafter(f"hybrid:{SMOLLM2_MEDUSA}", smollm2)
    assert isinstance(hybrid, HybridDrafter) and hybrid.tree == drafter.tree
