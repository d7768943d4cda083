"""Theorem 1, sequences: the engine's first 3 tokens follow the target's exact joint distribution.

The exact distribution is enumerated from the target (vocabulary 8: 512 sequences); the engine
draws SAMPLES independent rows in one batch. A deliberately broken verifier must fail the same test.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import specsample.engine as engine_module
from broken import BROKEN
from specsample import SamplingParams, SpecConfig, generate, tiny_lm
from specsample.sampling import warp_probs
from stats_util import chi_square

VOCAB = 8
LENGTH = 3
SAMPLES = 12_000
PROMPT = [1, 2]
WARPS = {
    "temperature_1": SamplingParams(temperature=1.0, max_new_tokens=LENGTH),
    "temperature_0.7_top_k_5": SamplingParams(temperature=0.7, top_k=5, max_new_tokens=LENGTH),
    "top_p_0.8": SamplingParams(temperature=1.0, top_p=0.8, max_new_tokens=LENGTH),
}


@pytest.fixture(scope="module")
def pair():
    # large init scale: peaky, clearly different distributions so broken variants stand out
    target = tiny_lm(VOCAB, seed=10, init_scale=0.2, dtype=torch.float64)
    draft = tiny_lm(VOCAB, seed=20, init_scale=0.2, num_layers=1, dtype=torch.float64)
    return target, draft


def exact_joint(target, params: SamplingParams) -> np.ndarray:
    """P(x1, x2, x3 | prompt) for all VOCAB**3 sequences, indexed x1 * V^2 + x2 * V + x3."""
    seqs = torch.tensor(list(itertools.product(range(VOCAB), repeat=LENGTH)))  # [V^3, 3]
    inputs = torch.cat([torch.tensor(PROMPT).expand(len(seqs), -1), seqs], dim=1)
    with torch.no_grad():
        probs = warp_probs(target(inputs)[:, len(PROMPT) - 1:-1], params)  # [V^3, 3, V]
    per_step = probs.gather(-1, seqs.unsqueeze(-1)).squeeze(-1)  # [V^3, 3]
    return per_step.prod(dim=1).numpy()


def engine_counts(target, draft, params: SamplingParams, gamma: int) -> np.ndarray:
    result = generate(target, [PROMPT] * SAMPLES, params.__class__(**{**params.__dict__, "seed": 1000}),
                      draft=draft, config=SpecConfig(gamma=gamma, max_batch_size=SAMPLES))
    index = [sum(t * VOCAB ** (LENGTH - 1 - i) for i, t in enumerate(c.token_ids)) for c in result.completions]
    return np.bincount(index, minlength=VOCAB**LENGTH)


@pytest.mark.parametrize("warp", list(WARPS))
def test_engine_matches_exact_distribution(pair, warp: str) -> None:
    target, draft = pair
    params = WARPS[warp]
    statistic, threshold = chi_square(engine_counts(target, draft, params, gamma=2), exact_joint(target, params))
    assert statistic < threshold, f"{warp}: chi2 {statistic:.1f} >= threshold {threshold:.1f}"


@pytest.mark.parametrize("broken", list(BROKEN))
def test_broken_verifier_fails(pair, monkeypatch, broken: str) -> None:
    target, draft = pair
    monkeypatch.setattr(engine_module, "verify", BROKEN[broken])
    params = WARPS["temperature_1"]
    statistic, threshold = chi_square(engine_counts(target, draft, params, gamma=2), exact_joint(target, params))
    assert statistic > threshold, f"{broken} was not detected: chi2 {statistic:.1f} < {threshold:.1f}"
