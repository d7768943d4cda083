"""The Verifier: one object that picks a round's rule and applies it (vLLM's RejectionSampler shape).

Greedy verification where every row of the round is greedy; otherwise modified rejection sampling (`chain.verify`,
`tree.verify_tree`) or, under coupled sampling, the target's Gumbel-max tokens (`coupled`); a chain or a token tree
as the proposal is. Every rule keeps the output exactly target-distributed (docs/exactness.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from specsample.config import SamplingParams
from specsample.drafters.base import Proposal
from specsample.sampling import usable_rows, warp_rows
from specsample.token_tree import block_parents
from specsample.verification.chain import Verdict, verify, verify_greedy
from specsample.verification.coupled import DraftNoise, verify_coupled, verify_tree_coupled
from specsample.verification.tree import verify_tree, verify_tree_greedy


class Verifier:
    """Verifies a round's proposal against the target's logits at the scored block."""

    def __init__(self, coupled: bool = False) -> None:
        self.coupled = coupled

    def __call__(
        self,
        block: Tensor,  # [b, gamma + 1] what the target scored: each row's pending token, then its drafts
        proposal: Proposal,  # the drafts (a chain, or a tree when `parents` is set)
        target_logits: Tensor,  # [b, gamma + 1, vocab] the target's (processed) logits after each block position
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator],
        noise: Sequence[DraftNoise | None] = (),  # coupled sampling: per row its noise (None: a greedy row)
    ) -> tuple[Verdict, Tensor | None]:
        """The verdict, and the warped target probabilities it sampled from (None: every row greedy)."""
        if proposal.parents is not None:
            return self._tree(block, proposal, target_logits, params, generators, noise)
        num_drafted = proposal.num_drafted  # on the host, as the proposal holds it
        if all(p.greedy for p in params):
            return verify_greedy(proposal.tokens, target_logits, num_drafted), None
        target_probs = warp_rows(target_logits, params)  # [b, gamma + 1, vocab]
        if self.coupled:
            return verify_coupled(proposal.tokens, target_probs, noise, num_drafted), target_probs
        return verify(proposal.tokens, proposal.probs, target_probs, list(generators), num_drafted), target_probs

    def _tree(
        self,
        block: Tensor,
        proposal: Proposal,
        target_logits: Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator],
        noise: Sequence[DraftNoise | None],
    ) -> tuple[Verdict, Tensor | None]:
        """A tree round's verdict (multi-candidate rejection sampling over each row's tree, or its coupled or greedy
        walk), and the warped target probabilities (None: every row greedy)."""
        parents, sizes = block_parents(proposal.parents, proposal.num_drafted), proposal.num_drafted + 1
        if all(p.greedy for p in params):
            found, target_probs = verify_tree_greedy(block, parents, sizes, target_logits), None
        else:
            target_probs = warp_rows(target_logits, params)  # [b, nodes + 1, vocab]
            draft = (
                None
                if proposal.probs is None
                else torch.cat([torch.zeros_like(proposal.probs[:, :1]), proposal.probs], dim=1)
            )
            found = (
                verify_tree_coupled(block, parents, sizes, target_probs, noise)
                if self.coupled
                else verify_tree(block, parents, sizes, draft, target_probs, list(generators))
            )
        paths = found.paths  # [b, depth] indices of the proposal's nodes
        accepted = torch.zeros(
            proposal.tokens.shape[0], proposal.tokens.shape[1] + 1, dtype=torch.bool, device=paths.device
        )
        accepted.scatter_(1, torch.where(paths >= 0, paths, proposal.tokens.shape[1]), True)
        usable = usable_rows(target_logits.float().softmax(-1)) if target_probs is None else usable_rows(target_probs)
        return Verdict(found.num_accepted, found.next_token, accepted[:, :-1], ~usable[:, 0], paths), target_probs
