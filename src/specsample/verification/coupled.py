"""Coupled sampling: each output position's randomness comes from a counter-based stream keyed by (seed, position),
and the draft and the target share it (Gumbel-max coupling).

A request's token at output position t is argmax_x(log p_t(x) + g_t(x)), where p_t is the target's warped
distribution there and g_t is Gumbel noise over the vocabulary drawn from Philox keyed by the request's seed, with t
in the counter. That is the Gumbel-max trick, so the token has distribution p_t exactly, and g_t is independent of
everything before position t. A draft model draws its token for position t as argmax_x(log q_t(x) + g_t(x)) with the
same noise; the verifier takes the target's token at each position and accepts a draft iff it equals it.

So the output at every position is exactly what plain decoding with that seed gives, whatever drafts were proposed
(how many, from which drafter, chains or trees, gated or extended), whatever else shares the batch: a seeded request
reproduces under any plan. Verification is greedy verification of the noised log-probabilities. The price is acceptance: a draft is accepted with probability
sum_x P(both argmaxes are x) = sum_x 1 / sum_y max(p(y) / p(x), q(y) / q(x)), below modified rejection sampling's
sum_x min(p(x), q(x)) (docs/exactness.md gives both, measured on the shipped pair).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from specsample.token_tree import tree_depths
from specsample.verification.chain import Verdict, verdict_of_choices
from specsample.verification.tree import TreeVerdict, follow_choices

TOKEN_NOISE = 0  # the purpose word of the counter: the noise that picks a position's token
_UNIT = 2.0**-53


def position_gumbels(seed: int, position: int, vocab: int, purpose: int = TOKEN_NOISE) -> Tensor:
    """Gumbel noise `[vocab]` (float64) for output position `position` of a request seeded `seed`: Philox-4x64 keyed
    by the seed, its counter starting at (position, purpose) in its two high words, so every (seed, position,
    purpose) has its own stream, computed directly, never by advancing through the ones before. Raw 64-bit outputs
    (whose stream numpy keeps stable) become uniforms in (0, 1) by their top 53 bits plus half a step."""
    bits = np.random.Philox(key=seed, counter=(position << 128) | (purpose << 192))
    uniforms = ((bits.random_raw(vocab) >> np.uint64(11)).astype(np.float64) + 0.5) * _UNIT
    return torch.from_numpy(-np.log(-np.log(uniforms)))


class NoiseStream:
    """One request's coupled noise: `gumbel(t)` is the same tensor whoever asks (the draft, the verifier, any
    round), kept from its first use until the request moves past position t."""

    def __init__(self, seed: int, vocab: int) -> None:
        self.seed, self.vocab = seed, vocab
        self._kept: dict[int, Tensor] = {}

    def gumbel(self, position: int) -> Tensor:
        """Gumbel noise `[vocab]` float64 for output position `position`."""
        if position not in self._kept:
            self._kept[position] = position_gumbels(self.seed, position, self.vocab)
        return self._kept[position]

    def forget_before(self, position: int) -> None:
        """Drop the noise of positions before `position` (already committed: never read again)."""
        for done in [t for t in self._kept if t < position]:
            del self._kept[done]


@dataclass(frozen=True)
class DraftNoise:
    """A row's noise for one round: its draft j (0-based) and the target's position j are output position
    `start + j`."""

    stream: NoiseStream
    start: int  # output tokens the row has committed: the position its pending token predicts

    def gumbel(self, step: int) -> Tensor:
        return self.stream.gumbel(self.start + step)


def gumbel_argmax(probs: Tensor, gumbels: Tensor) -> Tensor:
    """`argmax(log probs + gumbels)` over the last dim, in float64: `probs [..., K]` (unnormalised ok), `gumbels
    [..., K]`; a token of probability 0 scores -inf and is never chosen while any has mass."""
    return (probs.to(torch.float64).log() + gumbels.to(probs.device)).argmax(dim=-1)


def coupled_choices(
    target_probs: Tensor, noise: Sequence[DraftNoise | None], offsets: Sequence[Sequence[int]]
) -> tuple[Tensor, Tensor]:
    """The target's Gumbel-max token `[b, n]` at each of row i's first `len(offsets[i])` columns of `target_probs
    [b, n, vocab]`, column j with the row's noise at `offsets[i][j]` (a row without noise: its argmax), and whether
    that column is no distribution `[b, n]` (NaN anywhere, or no mass). Columns past a row's offsets: token 0, usable.
    Scores in float64; a tie goes to the lowest token id."""
    batch, n, vocab = target_probs.shape
    gumbels = torch.zeros(batch, n, vocab, dtype=torch.float64)
    for row, (row_noise, row_offsets) in enumerate(zip(noise, offsets)):
        if row_noise is not None and len(row_offsets) > 0:
            gumbels[row, : len(row_offsets)] = torch.stack([row_noise.gumbel(o) for o in row_offsets])
    scores = target_probs.to(torch.float64).log() + gumbels.to(target_probs.device)  # [b, n, vocab]
    top, choice = scores.max(dim=-1)  # [b, n]
    used = (torch.arange(n).unsqueeze(0) < torch.tensor([len(o) for o in offsets]).unsqueeze(1)).to(choice.device)
    unusable = (top.isnan() | (top == float("-inf"))) & used
    return choice.masked_fill(~used, 0), unusable


def verify_coupled(
    draft_tokens: Tensor,  # [batch, gamma] token ids proposed by the drafter
    target_probs: Tensor,  # [batch, gamma + 1, vocab] target distribution at each position
    noise: Sequence[DraftNoise | None],  # per row its noise for the round (None: a greedy row)
    num_drafted: Tensor | None = None,  # [batch] drafts actually proposed per row (<= gamma)
) -> Verdict:
    """Accept each draft while it equals the target's Gumbel-max token at its position; the next token is the target's
    Gumbel-max token after the accepted prefix. The draft's distributions are never read: whatever was proposed, each
    output token is the Gumbel-max sample of the target with the row's noise at its position. A row whose target is
    no distribution at a position it reads is marked in `Verdict.failed`."""
    batch, gamma = draft_tokens.shape
    if target_probs.shape[:2] != (batch, gamma + 1):
        raise ValueError(
            f"target_probs has shape {tuple(target_probs.shape)}, expected [batch={batch}, "
            f"gamma + 1={gamma + 1}, vocab]"
        )
    counts = num_drafted.cpu() if num_drafted is not None else torch.full((batch,), gamma)  # the proposal's: host
    choice, unusable = coupled_choices(target_probs, noise, [range(d + 1) for d in counts.tolist()])
    drafted = counts.to(draft_tokens.device)
    return verdict_of_choices(draft_tokens, choice.to(draft_tokens.device), unusable.to(draft_tokens.device), drafted)


def verify_tree_coupled(
    tokens: Tensor,  # [batch, n] block tokens: the pending token, then the nodes
    parents: Tensor,  # [batch, n] each block index's parent (-1 for the pending token)
    sizes: Tensor,  # [batch] block indices in use per row (1 + nodes)
    target_probs: Tensor,  # [batch, n, vocab] the target's distribution after each block index
    noise: Sequence[DraftNoise | None],  # per row its noise for the round (None: a greedy row)
) -> TreeVerdict:
    """Walk each row's tree from the pending token, following the child equal to the target's Gumbel-max token at the
    current node (a node at depth d predicts output position start + d), until none is; the next token is the
    target's Gumbel-max token there."""
    depths = tree_depths(parents.cpu())  # [batch, n]; the pending token at depth 0
    offsets = [depths[row, : int(sizes[row])].tolist() for row in range(tokens.shape[0])]
    return follow_choices(tokens, parents, sizes, coupled_choices(target_probs, noise, offsets)[0])
