"""The EAGLE-3 head shipped inside the package: its size, its published layout, its record of data and training, and
that it loads and drafts for the real target."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from specsample.drafters.eagle import EagleDrafter
from specsample.models.hub import DRAFTS_DIR, SMOLLM2_HEAD, builtin_draft
from specsample.pair import load_drafter

pytestmark = pytest.mark.slow
FOLDER = DRAFTS_DIR / SMOLLM2_HEAD
MAX_BYTES = 20_000_000


def test_shipped_head_is_in_the_published_layout_within_its_budget() -> None:
    files = {p.name: p for p in FOLDER.iterdir() if p.is_file()}
    assert {"config.json", "model.safetensors", "README.md", "eval.json", "training_curve.json"} <= set(files)
    assert sum(p.stat().st_size for p in files.values()) <= MAX_BYTES
    config = json.loads(files["config.json"].read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert len(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]) == 3
    with safe_open(str(files["model.safetensors"]), framework="pt") as handle:
        names = set(handle.keys())
    assert {"fc.weight", "d2t", "t2d", "lm_head.weight", "midlayer.self_attn.q_proj.weight"} <= names


def test_shipped_head_records_target_written_data_and_unrolled_training() -> None:
    record = json.loads((FOLDER / "eval.json").read_text())
    data = record["data"]
    assert data["source"] == "regenerated" and data["prompts"] >= data["conversations"] > 0
    assert 0 < data["reply_tokens"] < data["tokens"]
    assert record["training"]["unroll"] >= 3
    curve = json.loads((FOLDER / "training_curve.json").read_text())
    assert curve[-1]["token_steps"] == record["training"]["token_steps"]
    assert curve[-1]["heldout_alpha"] > curve[0]["heldout_alpha"]


def test_loads_and_drafts_for_the_real_target(smollm2) -> None:
    assert builtin_draft(SMOLLM2_HEAD) == FOLDER
    drafter = load_drafter(SMOLLM2_HEAD, smollm2)
    assert isinstance(drafter, EagleDrafter)
    ids = drafter.output_subset.tolist()
    assert len(ids) == len(set(ids)) and all(0 <= t < smollm2.model.vocab_size for t in ids)
