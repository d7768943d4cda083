"""Deliberately broken verifiers, built by wrapping the real one, to prove the tests have teeth."""

from __future__ import annotations

import torch

from specsample.sampling import sample
from specsample.verify import Verdict, verify


def residual_as_target(draft_tokens, draft_probs, target_probs, generators, num_drafted=None) -> Verdict:
    """After a rejection, resample from the target instead of norm(max(0, target - draft))."""
    verdict = verify(draft_tokens, draft_probs, target_probs, generators, num_drafted)
    drafted = torch.full_like(verdict.num_accepted, draft_tokens.shape[1]) if num_drafted is None else num_drafted
    rejected = verdict.num_accepted < drafted
    rows = torch.arange(draft_tokens.shape[0])
    resampled = sample(target_probs[rows, verdict.num_accepted].float(), generators)
    return Verdict(verdict.num_accepted, torch.where(rejected, resampled, verdict.next_token), verdict.accepted)


def bonus_off_by_one(draft_tokens, draft_probs, target_probs, generators, num_drafted=None) -> Verdict:
    """When every draft passes, draw the bonus from the last draft's position instead of the next."""
    verdict = verify(draft_tokens, draft_probs, target_probs, generators, num_drafted)
    drafted = torch.full_like(verdict.num_accepted, draft_tokens.shape[1]) if num_drafted is None else num_drafted
    all_passed = (verdict.num_accepted == drafted) & (drafted > 0)
    rows = torch.arange(draft_tokens.shape[0])
    wrong = sample(target_probs[rows, (verdict.num_accepted - 1).clamp(min=0)].float(), generators)
    return Verdict(verdict.num_accepted, torch.where(all_passed, wrong, verdict.next_token), verdict.accepted)


BROKEN = {"residual_as_target": residual_as_target, "bonus_off_by_one": bonus_off_by_one}
