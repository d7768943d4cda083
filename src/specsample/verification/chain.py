"""Chain rejection sampling: modified rejection sampling of a chain of drafts (Chen et al. 2023, Leviathan et al.
2022).

Pure tensor functions. Given draft tokens, the distributions they were drawn from and the target's
distributions at the same positions, decide per row how many drafts to accept and which token
follows them: the *recovered* token, drawn from norm(max(0, target - draft)) at the first rejection,
or the *bonus* token, drawn from the target right after the last draft when every draft passes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specsample.sampling import Generators, draw_uniforms, one_hot_like, sample_from, usable_rows


@dataclass(frozen=True)
class Verdict:
    """Per row: how many drafts were accepted and the token that follows them."""

    num_accepted: Tensor  # [batch] long, in 0..num_drafted
    next_token: Tensor  # [batch] long: recovered token, or bonus token when all drafts passed
    accepted: Tensor  # [batch, gamma] bool: draft position i was accepted (a prefix per row)
    # [batch] bool: rows whose target or draft distribution at a position they use is no distribution (NaN,
    # infinite, zero mass); such a row's tokens mean nothing and it must end. None: every row was usable
    failed: Tensor | None = None
    # a tree round: per row its path `[batch, depth]`, the accepted nodes root to leaf by their index among the
    # proposal's drafts (-1 past its end); None: a chain, whose accepted drafts are its first num_accepted
    paths: Tensor | None = None


def _num_drafted_or_full(num_drafted: Tensor | None, draft_tokens: Tensor) -> Tensor:
    batch, gamma = draft_tokens.shape
    if num_drafted is None:
        return torch.full((batch,), gamma, dtype=torch.long, device=draft_tokens.device)
    return num_drafted.to(device=draft_tokens.device, dtype=torch.long)


def _failed(bad_read: Tensor, in_range: Tensor, bad_next: Tensor) -> Tensor:
    """Rows `[batch]` that read an unusable value: at an offered draft (`bad_read [batch, gamma]`, where `in_range`)
    or in the distribution their next token comes from (`bad_next [batch]`)."""
    return (bad_read & in_range).any(dim=-1) | bad_next


def _first_false(mask: Tensor) -> Tensor:
    """Length of the all-true prefix of each row of `mask [batch, gamma]`."""
    return mask.long().cumprod(dim=-1).sum(dim=-1)


def verify(
    draft_tokens: Tensor,  # [batch, gamma] token ids proposed by the drafter
    draft_probs: Tensor | None,  # [batch, gamma, vocab]; None = deterministic drafter (one-hot)
    target_probs: Tensor,  # [batch, gamma + 1, vocab] target distribution at each position
    generators: Generators,  # one generator, or one per row
    num_drafted: Tensor | None = None,  # [batch] drafts actually proposed per row (<= gamma)
) -> Verdict:
    """Accept each draft with probability min(1, target/draft); resample at the first rejection.

    The returned tokens are distributed exactly as sampling from `target_probs` one token at a time.
    Rows may carry fewer than gamma drafts (`num_drafted`): their bonus comes from the target at the
    position after their last draft. A row whose distributions are unusable where it reads them is marked
    in `Verdict.failed` and draws no token; the other rows are verified exactly as without it.
    """
    batch, gamma = draft_tokens.shape
    _check_shapes(draft_tokens, draft_probs, target_probs)
    device = target_probs.device
    counts = num_drafted.cpu() if num_drafted is not None else torch.full((batch,), gamma)  # the proposal's: host
    drafted = counts.to(device)
    # float32 or wider whatever the model dtype; float64 if either side is (never round a float64 draft)
    wide = target_probs.dtype == torch.float64 or (draft_probs is not None and draft_probs.dtype == torch.float64)
    target = target_probs.to(torch.float64 if wide else torch.float32)
    draft_tokens = draft_tokens.to(device)
    if draft_probs is not None:
        draft_probs = draft_probs.to(device=device, dtype=target.dtype)  # drafters may return CPU tensors
    # per row: one uniform per offered draft, then one for the next token
    uniforms = draw_uniforms(generators, batch, gamma + 1, device, (counts + 1).tolist())
    next_uniform = uniforms.gather(1, drafted.unsqueeze(1)).squeeze(1)  # [batch]

    target_at_draft = target[:, :gamma].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
    if draft_probs is None:
        draft_at_draft = torch.ones_like(target_at_draft)
    else:
        draft_at_draft = draft_probs.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
    # accept iff u < target/draft, written without division so a draft probability of 0 is safe
    passes = uniforms[:, :gamma] * draft_at_draft.double() < target_at_draft.double()  # [batch, gamma]
    in_range = torch.arange(gamma, device=device).unsqueeze(0) < drafted.unsqueeze(1)
    accepted_prefix = _first_false(passes & in_range)  # [batch]

    rows = torch.arange(batch, device=device)
    target_next = target[rows, accepted_prefix]  # [batch, vocab] target at the first unaccepted slot
    rejected = accepted_prefix < drafted
    clamped = accepted_prefix.clamp(max=max(gamma - 1, 0))
    if gamma == 0:
        draft_next = torch.zeros_like(target_next)
    elif draft_probs is None:
        draft_next = one_hot_like(draft_tokens[rows, clamped], target)
    else:
        draft_next = draft_probs[rows, clamped]
    # sample from max(0, target - draft): this is what keeps the output exactly target-distributed
    residual = (target_next - draft_next).clamp(min=0.0)
    # a residual that sums to 0 means target == draft up to rounding: fall back to the target
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, target_next, residual)
    next_dist = torch.where(rejected.unsqueeze(-1), residual, target_next)
    # what the verifier reads: each offered draft's two probabilities and the distribution the next token comes from
    # (NaN or an infinity in logits spreads over a whole warped row, so these show any row the model broke)
    bad_read = ~torch.isfinite(target_at_draft) | ~torch.isfinite(draft_at_draft)
    usable = usable_rows(next_dist)
    failed = _failed(bad_read, in_range, ~usable)
    # a failed row draws from a stand-in (its token means nothing); the others exactly as without it
    safe = torch.where(usable.unsqueeze(-1), next_dist, torch.ones_like(next_dist))
    next_token = sample_from(safe, next_uniform).masked_fill(failed, 0)
    accepted_prefix = accepted_prefix.masked_fill(failed, 0)
    accepted = torch.arange(gamma, device=device).unsqueeze(0) < accepted_prefix.unsqueeze(1)
    return Verdict(num_accepted=accepted_prefix, next_token=next_token, accepted=accepted, failed=failed)


def verify_greedy(
    draft_tokens: Tensor,  # [batch, gamma]
    target_logits: Tensor,  # [batch, gamma + 1, vocab] (logits or probabilities: only argmax is used)
    num_drafted: Tensor | None = None,  # [batch]
) -> Verdict:
    """Greedy verification: accept while the draft token equals the target's argmax. A row whose target holds NaN
    (or only -inf) at a position it reads is marked in `Verdict.failed`, its tokens meaningless."""
    batch, gamma = draft_tokens.shape
    if target_logits.shape[:2] != (batch, gamma + 1):
        raise ValueError(
            f"target_logits has shape {tuple(target_logits.shape)}, expected [batch={batch}, "
            f"gamma + 1={gamma + 1}, vocab]"
        )
    target_choice = target_logits.argmax(dim=-1)  # [batch, gamma + 1]
    top = target_logits.gather(-1, target_choice.unsqueeze(-1)).squeeze(-1)  # argmax takes a NaN as the maximum
    unusable = top.isnan() | (top == float("-inf"))  # [batch, gamma + 1]
    return verdict_of_choices(draft_tokens, target_choice, unusable, _num_drafted_or_full(num_drafted, draft_tokens))


def verdict_of_choices(
    draft_tokens: Tensor,  # [batch, gamma]
    choice: Tensor,  # [batch, gamma + 1] the target's token at each position (argmax, or a coupled Gumbel-max)
    unusable: Tensor,  # [batch, gamma + 1] bool: the target is no distribution there
    drafted: Tensor,  # [batch] drafts proposed per row
) -> Verdict:
    """Accept while the draft token equals the target's chosen token; the next token is the choice after the accepted
    prefix. A row reading an unusable position is marked in `Verdict.failed`."""
    gamma = draft_tokens.shape[1]
    in_range = torch.arange(gamma, device=draft_tokens.device).unsqueeze(0) < drafted.unsqueeze(1)
    num_accepted = _first_false((draft_tokens == choice[:, :gamma]) & in_range)
    next_token = choice.gather(-1, num_accepted.unsqueeze(-1)).squeeze(-1)
    failed = _failed(unusable[:, :gamma], in_range, unusable.gather(1, num_accepted.unsqueeze(1)).squeeze(1))
    num_accepted = num_accepted.masked_fill(failed, 0)
    accepted = torch.arange(gamma, device=draft_tokens.device).unsqueeze(0) < num_accepted.unsqueeze(1)
    return Verdict(num_accepted=num_accepted, next_token=next_token, accepted=accepted, failed=failed)


def acceptance_probabilities(
    draft_tokens: Tensor,  # [batch, gamma] token ids proposed by the drafter
    draft_probs: Tensor | None,  # [batch, gamma, vocab]; None = deterministic drafter (one-hot)
    target_probs: Tensor,  # [batch, gamma + 1, vocab] (or [batch, gamma, vocab])
) -> Tensor:
    """Per draft position, the probability that a draft there is accepted given what precedes it: the sum over
    tokens of min(target, draft) (Leviathan et al.'s beta); for a deterministic draft, the target's probability
    of its token. `[batch, gamma]`: the expectation of `verify`'s accept-or-not at each position it reaches."""
    gamma = draft_tokens.shape[1]
    target = target_probs[:, :gamma].float()
    if draft_probs is None:  # drafters build their tokens on the CPU; the target's probs may be on a GPU
        return target.gather(-1, draft_tokens.to(target.device).unsqueeze(-1)).squeeze(-1)
    return torch.minimum(target, draft_probs.to(device=target.device, dtype=target.dtype)).sum(-1).clamp(max=1.0)


def _check_shapes(draft_tokens: Tensor, draft_probs: Tensor | None, target_probs: Tensor) -> None:
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must be [batch, gamma], got shape {tuple(draft_tokens.shape)}")
    batch, gamma = draft_tokens.shape
    if target_probs.dim() != 3 or target_probs.shape[:2] != (batch, gamma + 1):
        raise ValueError(
            f"target_probs has shape {tuple(target_probs.shape)}, expected [batch={batch}, "
            f"gamma + 1={gamma + 1}, vocab]"
        )
    if draft_probs is not None and draft_probs.shape != (batch, gamma, target_probs.shape[-1]):
        raise ValueError(
            f"draft_probs has shape {tuple(draft_probs.shape)}, expected "
            f"[{batch}, {gamma}, {target_probs.shape[-1]}] (vocabularies must match)"
        )
