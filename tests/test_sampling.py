"""The warping filters on hand-made distributions, and the categorical sampler."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from stats_util import chi_square

from specsample.config import SamplingParams
from specsample.sampling import sample, sample_from, warp_probs, warp_rows

PROBS = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05], dtype=torch.float64)
LOGITS = PROBS.log()


def test_temperature_one_is_softmax() -> None:
    assert torch.allclose(warp_probs(LOGITS, SamplingParams()), PROBS)


def test_temperature_sharpens() -> None:
    warped = warp_probs(LOGITS, SamplingParams(temperature=0.5))
    expected = PROBS**2 / (PROBS**2).sum()
    assert torch.allclose(warped, expected)


def test_greedy_is_one_hot_at_argmax() -> None:
    warped = warp_probs(torch.tensor([[0.1, 2.0, 2.0, -1.0]]), SamplingParams(temperature=0))
    assert warped.tolist() == [[0.0, 1.0, 0.0, 0.0]]  # lowest index on ties


def test_top_k() -> None:
    warped = warp_probs(LOGITS, SamplingParams(top_k=2))
    assert torch.allclose(warped, torch.tensor([0.4, 0.3, 0, 0, 0], dtype=torch.float64) / 0.7)


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    # 0.4 + 0.3 = 0.7 < 0.75, so the third token is needed; the fourth is not
    warped = warp_probs(LOGITS, SamplingParams(top_p=0.75))
    assert torch.allclose(warped, torch.tensor([0.4, 0.3, 0.15, 0, 0], dtype=torch.float64) / 0.85)
    # a tiny top_p still keeps the most likely token
    assert warp_probs(LOGITS, SamplingParams(top_p=0.01)).tolist() == [1.0, 0, 0, 0, 0]


def test_min_p() -> None:
    warped = warp_probs(LOGITS, SamplingParams(min_p=0.3))  # floor 0.12
    assert torch.allclose(warped, torch.tensor([0.4, 0.3, 0.15, 0, 0], dtype=torch.float64) / 0.85)


def test_filters_compose_in_order() -> None:
    # temperature first, then top-k, then top-p on the renormalised top-k distribution
    warped = warp_probs(LOGITS, SamplingParams(temperature=2.0, top_k=3, top_p=0.5))
    assert warped.nonzero().flatten().tolist() == [0, 1]


def test_low_precision_logits_warp_in_float32() -> None:
    assert warp_probs(LOGITS.bfloat16(), SamplingParams()).dtype == torch.float32


def test_warp_rows_per_row_params() -> None:
    logits = LOGITS.expand(3, 5)
    params = [SamplingParams(), SamplingParams(temperature=0), SamplingParams(top_k=2)]
    warped = warp_rows(logits, params)
    for row, p in enumerate(params):
        assert torch.allclose(warped[row], warp_probs(LOGITS, p))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"min_p": 1.0}, "min_p"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": math.nan}, "temperature"),
    ],
)
def test_bad_params_name_the_problem(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampler_matches_distribution() -> None:
    n = 100_000
    g = torch.Generator().manual_seed(0)
    draws = sample(PROBS.expand(n, 5), g)
    statistic, threshold = chi_square(np.bincount(draws.numpy(), minlength=5), PROBS.numpy())
    assert statistic < threshold


def test_sampler_never_returns_zero_mass_tokens() -> None:
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).expand(4, 5)
    edges = torch.tensor([0.0, 0.4999999, 0.5, 1.0 - 1e-16])
    assert set(sample_from(probs, edges).tolist()) <= {1, 3}
    with pytest.raises(ValueError, match="zero or non-finite total mass"):
        sample_from(torch.zeros(1, 5), torch.tensor([0.3]))


def test_two_level_sampler_matches_one_level_cdf() -> None:
    from specsample.sampling import _sample_exact

    g = torch.Generator().manual_seed(5)
    for vocab in (7, 256, 1000, 49152):  # below, at and across block boundaries, padded tails
        probs = torch.softmax(torch.randn(64, vocab, generator=g) * 3, -1)
        probs[:, ::3] = 0.0  # many zero-mass tokens
        probs[0] = 0.0
        probs[0, vocab - 1] = 1.0  # all mass on the very last (padded-block) token
        uniforms = torch.rand(64, generator=g, dtype=torch.float64)
        uniforms[1] = 0.0
        uniforms[2] = 1.0 - 1e-16
        assert torch.equal(sample_from(probs, uniforms), _sample_exact(probs, uniforms))
    with pytest.raises(ValueError, match="non-finite"):
        sample_from(torch.tensor([[float("nan"), 1.0]]), torch.tensor([0.3]))
