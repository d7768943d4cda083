"""Integration on the real SmolLM2-135M-Instruct (fetched through its alias; cached between runs)."""

from __future__ import annotations

import pytest
import torch
from devices import DEVICE

from specsample import ModelDrafter, SamplingParams, SpecConfig, generate
from specsample.drafters.eagle import load_head_drafter
from specsample.drafters.medusa import load_medusa_drafter
from specsample.drafters.ngram import NgramDrafter
from specsample.models.hub import SMOLLM2_HEAD, SMOLLM2_MEDUSA, builtin_draft
from specsample.models.loader import load_model
from specsample.planner import FixedGamma

pytestmark = pytest.mark.slow
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Repeat after me: red green blue, red green blue, red green blue.",
]
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
    params = SamplingParams(temperature=0, max_new_tokens=32)
    plain = generate(model, prompts, params, eos_token_ids=tokenizer.eos_token_ids)
    assert "Paris" in tokenizer.decode(plain.completions[0].token_ids)
    bf16_draft = load_model(
        "smollm2-135m-instruct", dtype="bfloat16", device=DEVICE
    ).model  # close to, not equal to, the target
    # a feature draft sets which of the target's states it reads when it loads: each is loaded just before it drafts
    drafters = (
        NgramDrafter,
        lambda: ModelDrafter(bf16_draft),
        lambda: load_head_drafter(builtin_draft(SMOLLM2_HEAD), model),  # reads the target's own features
        lambda: load_medusa_drafter(builtin_draft(SMOLLM2_MEDUSA), model),  # ...its last hidden state: trees
    )
    for make in drafters:
        drafter = make()
        spec = generate(
            model,
            prompts,
            params,
            draft=drafter,
            config=SpecConfig(),
            eos_token_ids=tokenizer.eos_token_ids,
            planner=FixedGamma(5, tree=getattr(drafter, "tree", None)),
        )
        assert spec.stats["accepted"] > 0
        for prompt, a, b in zip(prompts, plain.completions, spec.completions):
            _agree_or_near_tie(model, prompt, a.token_ids, b.token_ids)


def test_default_draft_is_hybrid_with_the_shipped_draft(smollm2) -> None:
    """The alias drafts by suffix drafting and the shipped draft (gamma auto sizes each)."""
    from specsample.drafters.hybrid import HybridDrafter
    from specsample.drafters.suffix import SuffixDrafter
    from specsample.models.hub import SMOLLM2_DRAFT, builtin_draft
    from specsample.options import EngineOptions
    from specsample.pair import load_drafter, resolve_draft

    assert resolve_draft(smollm2, None) == "hybrid"
    drafter = load_drafter("hybrid", smollm2, EngineOptions(device=DEVICE))
    assert isinstance(drafter, HybridDrafter) and drafter.model.folder == builtin_draft(SMOLLM2_DRAFT)
    assert isinstance(drafter.lookup, SuffixDrafter) and drafter.lookup.suffix_cache_scope == "global"
    assert isinstance(drafter.model, ModelDrafter)
