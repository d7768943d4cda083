"""The distilled draft shipped inside the package: size, vocabulary, default wiring, model-card numbers."""

from __future__ import annotations

import json

import pytest
from devices import DEVICE

from specsample.cli import eval_prompt_set
from specsample.distill.card import portable_command
from specsample.distill.evaluate import evaluate
from specsample.models.hub import ALIASES, DRAFTS_DIR, SMOLLM2_DRAFT, builtin_draft
from specsample.models.loader import load_model

pytestmark = pytest.mark.slow
FOLDER = DRAFTS_DIR / SMOLLM2_DRAFT
MAX_BYTES = 16 * 1024 * 1024
# the quick re-run repeats the recorded evaluation on the same machine class; float32 sums may differ
# in the last bits across CPUs, which can move a handful of near-tie positions
TOLERANCE = 0.02


@pytest.fixture(scope="module")
def quick_record() -> dict:
    return json.loads((FOLDER / "eval_quick.json").read_text())


@pytest.fixture(scope="module")
def shipped_draft():
    return load_model(SMOLLM2_DRAFT, dtype="float32", device=DEVICE)


def test_shipped_folder_fits_the_budget() -> None:
    files = [p for p in FOLDER.iterdir() if p.is_file()]
    assert {"config.json", "model.safetensors", "draft_vocab.json", "README.md", "eval.json"} <= {p.name for p in files}
    assert sum(p.stat().st_size for p in files) <= MAX_BYTES


def test_alias_defaults_to_hybrid_with_the_shipped_draft() -> None:
    alias = ALIASES["smollm2-135m-instruct"]
    assert alias.default_draft == "hybrid" and alias.draft_model == SMOLLM2_DRAFT
    assert builtin_draft(SMOLLM2_DRAFT) == FOLDER


def test_loads_with_the_target_vocabulary_and_output_subset(shipped_draft) -> None:
    draft = shipped_draft
    target_vocab = 49152
    assert draft.model.vocab_size == target_vocab
    subset = json.loads((FOLDER / "draft_vocab.json").read_text())["token_ids"]
    assert draft.model.output_subset is not None and draft.model.output_subset.tolist() == subset
    assert all(0 <= t < target_vocab for t in subset) and len(set(subset)) == len(subset)


def test_model_card_shows_the_recorded_evaluation() -> None:
    card = (FOLDER / "README.md").read_text()
    full = json.loads((FOLDER / "eval.json").read_text())
    overall = full["categories"]["overall"]
    for key in ("agree", "alpha_0.7", "alpha_1.0"):
        assert f"{overall[key]:.3f}" in card
    assert f"{full['cost']['c']:.3f}" in card
    for name in full["categories"]:
        assert f"| {name} |" in card


def test_model_card_command_names_no_folder_of_the_training_machine() -> None:
    card = (FOLDER / "README.md").read_text()
    command = card.split("```bash\n", 1)[1].split("\n", 1)[0]
    assert command.startswith("specsample distill ") and portable_command(command) == command


RERUN_CATEGORIES = ("coding", "extraction", "qa")  # the record's categories re-evaluated (each prompt on its own)


def test_quick_evaluation_rerun_matches_the_record(quick_record: dict, smollm2, shipped_draft) -> None:
    """The recorded quick evaluation reproduces, category by category (three of its 13, for time), and the card
    shows its overall figures."""
    prompts = eval_prompt_set("spec-bench", 1)
    assert len(prompts) == quick_record["prompts"]
    chosen = [p for p in prompts if p.category in RERUN_CATEGORIES]
    report = evaluate(
        smollm2.model,
        shipped_draft.model,
        smollm2.tokenizer,
        chosen,
        quick_record["max_new_tokens"],
        progress=False,
        measure_cost=False,
    )
    for category in RERUN_CATEGORIES:
        recorded, got = quick_record["categories"][category], report["categories"][category]
        assert got["positions"] == recorded["positions"], category
        for key in ("agree", "alpha_0.7", "alpha_1.0"):
            assert abs(got[key] - recorded[key]) <= TOLERANCE, (category, key, got[key], recorded[key])
    card = (FOLDER / "README.md").read_text()
    assert f"{quick_record['categories']['overall']['agree']:.3f}" in card
