"""Integration on the real SmolLM2-135M-Instruct (fetched through its alias; cached between runs)."""

from __future__ import annotations

import pytest
import torch
from devices import DEVICE

from specsample import ModelDrafter, SamplingParams, SpecConfig, generate
from specsample.drafters.ngram import NgramDrafter
from specsample.models.loader import load_model

pytestmark = pytest.mark.slow
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "Repeat after me: red green blue, red green blue, red green blue."]
NEAR_TIE = 1e-3  # logit gap below which fp rounding of a multi-token forward may flip the argmax


def _agree_or_near_tie(model, prompt: list[int], expected: list[int], got: list[int]) -> None:
    """Equal token for token, or diverging only where the target's top two logits tie to rounding."""
    if got == expected:
        return
    first = next(i for i, (a, b) in enumerate(zip(expected, got)) if a != b)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + expected[:first]]))[0, -1]
    top2 = logits.topk(2).values
    assert float(top2[0] - top2[1]) < NEAR_TIE, f"diverged at token {first} without a near tie"


def test_greedy_speculative_equals_target_only(smollm2) -> None:
    model, tokenizer = smollm2.model, smollm2.tokenizer
    assert model.vocab_size == 49152 and smollm2.runtime == "ours"
    prompts = [tokenizer.encode(p, chat=True) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_new_tokens=48)
    plain = generate(model, prompts, params, eos_token_ids=tokenizer.eos_token_ids)
    assert "Paris" in tokenizer.decode(plain.completions[0].token_ids)
    bf16_draft = load_model("smollm2-135m-instruct", dtype="bfloat16", device=DEVICE).model  # close to, not equal to, the target
    for drafter in (NgramDrafter(), ModelDrafter(bf16_draft)):
        spec = generate(model, prompts, params, draft=drafter, config=SpecConfig(gamma=5),
                        eos_token_ids=tokenizer.eos_token_ids)
        assert spec.stats["accepted"] > 0
        for prompt, a, b in zip(prompts, plain.completions, spec.completions):
            _agree_or_near_tie(model, prompt, a.token_ids, b.token_ids)


def test_default_draft_is_hybrid_with_the_shipped_draft(smollm2) -> None:
    """The alias drafts by prompt lookup and the shipped draft (gamma auto sizes each); benchmarks of a draft
    model get the hybrid's model, under the model's own spec."""
    from specsample.bench.run import load_model_draft_pair
    from specsample.drafters.hybrid import HybridDrafter
    from specsample.models.hub import SMOLLM2_DRAFT, builtin_draft
    from specsample.pair import load_drafter, resolve_draft_spec

    assert resolve_draft_spec(smollm2, None) == "hybrid"
    drafter = load_drafter("hybrid", smollm2, device=DEVICE)
    assert isinstance(drafter, HybridDrafter) and drafter.model.folder == builtin_draft(SMOLLM2_DRAFT)
    pair = load_model_draft_pair("smollm2-135m-instruct", None)
    assert isinstance(pair.drafter, ModelDrafter) and pair.draft_spec == SMOLLM2_DRAFT


def test_round_phases_and_round_ops_run_on_the_shipped_pair(tmp_path) -> None:
    """benchmarks/round_phases.py and round_ops.py end to end (their shared lockstep set-up, the step they wrap),
    on the test device: a plain round and one-draft rounds in each table."""
    import subprocess
    import sys
    from pathlib import Path

    scripts = Path(__file__).resolve().parents[1] / "benchmarks"
    common = ["--device", DEVICE, "--prompts", "1", "--tokens", "6", "--auto"]
    subprocess.run([sys.executable, str(scripts / "round_phases.py"), *common, "--temperatures", "0",
                    "--out", str(tmp_path / "phases.json")], check=True, capture_output=True)
    subprocess.run([sys.executable, str(scripts / "round_ops.py"), *common, "--gammas", "1",
                    "--out", str(tmp_path / "ops.json")], check=True, capture_output=True)
    phases, ops = (tmp_path / "phases.md").read_text(), (tmp_path / "ops.md").read_text()
    assert "| 0 |" in phases and "| 1 |" in phases and f"on {DEVICE}" in phases
    assert "| 0 |" in ops and "| 1 |" in ops and "| 1.00 |" in ops


def test_forward_shapes_runs_on_the_shipped_pair(tmp_path) -> None:
    """benchmarks/forward_shapes.py end to end on the test device: each model's forward by tokens scored, at a
    held and at a growing context, under each attention backend set asked for."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "forward_shapes.py"
    subprocess.run([sys.executable, str(script), "--device", DEVICE, "--widths", "1,3", "--draft-widths", "2",
                    "--calls", "2", "--context", "16", "--backends", "torch,math", "--out", str(tmp_path / "f.json")],
                   check=True, capture_output=True)
    result = json.loads((tmp_path / "f.json").read_text())["results"]
    assert set(result) == {"torch", "math"} and set(result["math"]) == {"target", "draft"}
    assert set(result["torch"]["target"]["growing"]) == {"1", "3"} and set(result["math"]["draft"]["runs"]) == {"2"}
    assert all(row["median_ms"] > 0 for row in result["torch"]["target"]["turns"].values())
    assert "| 3 |" in (tmp_path / "f.md").read_text()
    bad = subprocess.run([sys.executable, str(script), "--backends", "cudnn-only"], capture_output=True, text=True)
    assert bad.returncode != 0 and "unknown ['cudnn-only']" in bad.stderr
