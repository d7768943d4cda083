"""Theorem 1, single step: the verifier's first output token is distributed exactly as the target."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from broken import residual_as_target
from stats_util import chi_square

from specsample.sampling import sample
from specsample.verification.chain import verify, verify_greedy

VOCAB = 10
SAMPLES = 200_000


def _dist(values: list[float]) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float64)
    return t / t.sum()


def _cases() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    rand = lambda: torch.rand(VOCAB, generator=g, dtype=torch.float64) ** 3  # noqa: E731 - peaky
    target, draft = rand(), rand()
    draft_zero = draft.clone()
    draft_zero[:3] = 0.0  # draft can never propose tokens the target likes
    target_zero = target.clone()
    target_zero[5:8] = 0.0  # draft proposes tokens the target never emits
    disjoint_t = _dist([1, 2, 3, 4, 5, 0, 0, 0, 0, 0])
    disjoint_d = _dist([0, 0, 0, 0, 0, 5, 4, 3, 2, 1])
    return {
        "random": (target / target.sum(), draft / draft.sum()),
        "draft_zero_where_target_positive": (target / target.sum(), draft_zero / draft_zero.sum()),
        "target_zero_where_draft_positive": (target_zero / target_zero.sum(), draft / draft.sum()),
        "identical": (target / target.sum(), target / target.sum()),
        "disjoint": (disjoint_t, disjoint_d),
    }


def _first_tokens(target: torch.Tensor, draft: torch.Tensor, verifier=verify, seed: int = 0) -> np.ndarray:
    """Run one verification step on SAMPLES rows with gamma = 1; return the first emitted token."""
    g = torch.Generator().manual_seed(seed)
    draft_probs = draft.expand(SAMPLES, 1, VOCAB)
    target_probs = torch.stack([target, _dist([1] * VOCAB)]).expand(SAMPLES, 2, VOCAB)  # bonus: anything
    draft_tokens = sample(draft_probs[:, 0], g).unsqueeze(1)  # [SAMPLES, 1] drawn from the draft
    verdict = verifier(draft_tokens, draft_probs, target_probs, g)
    first = torch.where(verdict.num_accepted >= 1, draft_tokens[:, 0], verdict.next_token)
    return np.bincount(first.numpy(), minlength=VOCAB)


@pytest.mark.parametrize("case", list(_cases()))
def test_first_token_follows_target(case: str) -> None:
    target, draft = _cases()[case]
    counts = _first_tokens(target, draft)
    statistic, threshold = chi_square(counts, target.numpy())
    assert statistic < threshold, f"{case}: chi2 {statistic:.1f} >= {threshold:.1f}"


def test_broken_residual_fails_single_step() -> None:
    target, draft = _cases()["random"]
    counts = _first_tokens(target, draft, verifier=residual_as_target)
    statistic, threshold = chi_square(counts, target.numpy())
    assert statistic > threshold, "the goodness-of-fit test did not catch a broken residual"


def test_deterministic_drafter_one_hot() -> None:
    target, _ = _cases()["random"]
    g = torch.Generator().manual_seed(3)
    draft_tokens = torch.full((SAMPLES, 1), 4)  # an n-gram drafter always proposing token 4
    target_probs = target.expand(SAMPLES, 2, VOCAB)
    verdict = verify(draft_tokens, None, target_probs, g)
    first = torch.where(verdict.num_accepted >= 1, draft_tokens[:, 0], verdict.next_token)
    statistic, threshold = chi_square(np.bincount(first.numpy(), minlength=VOCAB), target.numpy())
    assert statistic < threshold


def test_identical_draft_accepts_everything() -> None:
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(64, 6, VOCAB, generator=g), -1)
    tokens = sample(probs[:, :5].reshape(-1, VOCAB), g).view(64, 5)
    verdict = verify(tokens, probs[:, :5], probs, g)
    assert bool((verdict.num_accepted == 5).all())


def test_zero_residual_falls_back_to_target() -> None:
    # target == draft but the draw rejected through rounding: residual is all zero
    target = _dist([0, 1, 0, 0, 0, 0, 0, 0, 0, 0])
    draft_probs = target.expand(4, 1, VOCAB).clone()
    draft_probs[:, 0, 2] = 1e-30  # tiny mass so the draft token 2 has q > p = 0 -> rejection
    verdict = verify(torch.full((4, 1), 2), draft_probs, target.expand(4, 2, VOCAB), torch.Generator().manual_seed(0))
    assert verdict.num_accepted.tolist() == [0] * 4
    assert verdict.next_token.tolist() == [1] * 4


def test_low_precision_inputs_are_verified_in_float32() -> None:
    g = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(8, 3, VOCAB, generator=g), -1)
    tokens = sample(probs[:, :2].reshape(-1, VOCAB), g).view(8, 2)
    verdict = verify(tokens, probs[:, :2].bfloat16(), probs.bfloat16(), torch.Generator().manual_seed(2))
    assert verdict.next_token.dtype == torch.long and bool((verdict.num_accepted <= 2).all())


def test_num_drafted_limits_rows() -> None:
    probs = torch.softmax(torch.randn(2, 4, VOCAB, generator=torch.Generator().manual_seed(0)), -1)
    tokens = probs[:, :3].argmax(-1)
    # identical distributions accept everything offered; row 1 offered only one draft
    verdict = verify(tokens, probs[:, :3], probs, torch.Generator().manual_seed(0), torch.tensor([3, 1]))
    assert verdict.num_accepted.tolist() == [3, 1]
    assert verdict.accepted.tolist() == [[True, True, True], [True, False, False]]


def test_verify_greedy() -> None:
    logits = torch.zeros(2, 4, VOCAB)
    for pos, tok in enumerate([3, 5, 7, 9]):
        logits[:, pos, tok] = 1.0
    drafts = torch.tensor([[3, 5, 7], [3, 6, 7]])
    verdict = verify_greedy(drafts, logits)
    assert verdict.num_accepted.tolist() == [3, 1]
    assert verdict.next_token.tolist() == [9, 5]  # bonus after all accepted; target's choice at first miss


def test_shape_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="target_probs has shape"):
        verify(torch.zeros(2, 3, dtype=torch.long), None, torch.zeros(2, 3, VOCAB), torch.Generator())
    with pytest.raises(ValueError, match="vocabularies must match"):
        verify(
            torch.zeros(2, 3, dtype=torch.long),
            torch.zeros(2, 3, VOCAB + 1),
            torch.zeros(2, 4, VOCAB),
            torch.Generator(),
        )


def _acceptance_rate_check(target: torch.Tensor, draft: torch.Tensor, beta: float, samples: int) -> tuple[float, float]:
    """|observed - beta| of verify's acceptance over `samples` drafts drawn from `draft`, and the bound a
    correct beta stays within (a normal quantile at FALSE_ALARM for this sample size)."""
    from scipy import stats
    from stats_util import FALSE_ALARM

    g = torch.Generator().manual_seed(3)
    tokens = torch.multinomial(draft, samples, replacement=True, generator=g).unsqueeze(1)  # [samples, 1]
    verdict = verify(tokens, draft.expand(samples, 1, -1), target.expand(samples, 2, -1), g)
    observed = verdict.num_accepted.double().mean().item()
    bound = stats.norm.ppf(1 - FALSE_ALARM / 2) * (max(beta * (1 - beta), 1e-12) / samples) ** 0.5
    return abs(observed - beta), bound


@pytest.mark.parametrize(
    "case", ["random", "draft_zero_where_target_positive", "target_zero_where_draft_positive", "identical", "disjoint"]
)
def test_acceptance_probabilities_are_verify_acceptance_rates(case: str) -> None:
    """beta = sum min(target, draft) is the rate at which verify accepts a draft drawn from the draft; a beta
    computed from the wrong pair (the draft against itself: always 1) must fail the same check."""
    from specsample.verification.chain import acceptance_probabilities

    target, draft = _cases()[case]
    beta = acceptance_probabilities(torch.zeros(1, 1, dtype=torch.long), draft.view(1, 1, -1), target.view(1, 1, -1))[
        0, 0
    ].item()
    assert 0.0 <= beta <= 1.0
    gap, bound = _acceptance_rate_check(target, draft, beta, 40_000)
    assert gap <= bound, (case, beta, gap, bound)
    if case not in ("identical",):  # the broken beta: what a draft agreeing with itself would be accepted with
        broken = acceptance_probabilities(
            torch.zeros(1, 1, dtype=torch.long), draft.view(1, 1, -1), draft.view(1, 1, -1)
        )[0, 0].item()
        gap, bound = _acceptance_rate_check(target, draft, broken, 40_000)
        assert gap > bound, (case, broken, gap, bound)


def test_acceptance_probability_of_a_deterministic_draft_is_the_targets_probability_of_it() -> None:
    from specsample.verification.chain import acceptance_probabilities

    target = _dist([1, 2, 3, 4]).view(1, 1, -1).expand(2, 3, -1)  # [2, gamma + 1 = 3, 4]
    tokens = torch.tensor([[3, 0], [1, 2]])
    beta = acceptance_probabilities(tokens, None, target)
    assert torch.allclose(beta, torch.tensor([[0.4, 0.1], [0.2, 0.3]], dtype=beta.dtype))


def test_acceptance_probabilities_take_cpu_draft_tokens_with_target_probs_on_the_test_device() -> None:
    """Drafters build their tokens on the CPU while the target scores on its device: on a GPU the one-hot
    (n-gram) path gathered with a CPU index and raised (`SPECSAMPLE_TEST_DEVICE=cuda` exercises that)."""
    from devices import DEVICE

    from specsample.verification.chain import acceptance_probabilities

    target = _dist([1, 2, 3, 4]).view(1, 1, -1).expand(1, 2, -1).to(DEVICE)  # [1, gamma + 1 = 2, 4]
    tokens = torch.tensor([[3]])  # [1, gamma = 1], on the CPU as a drafter makes it
    beta = acceptance_probabilities(tokens, None, target)
    assert beta.device == target.device and abs(beta.item() - 0.4) < 1e-6
    draft = _dist([4, 3, 2, 1]).view(1, 1, -1)  # on the CPU too
    beta = acceptance_probabilities(tokens, draft, target)
    assert beta.device == target.device and abs(beta.item() - (0.1 + 0.2 + 0.2 + 0.1)) < 1e-6
