"""Tree rejection sampling: verifying a token tree by multi-candidate rejection sampling (SpecInfer,
arXiv:2305.09781; Recursive Speculative Decoding, arXiv:2402.14160).

A block per row: index 0 is the pending token, indices 1.. the tree's nodes in an order where parents come first;
`parents[i]` is node i's parent (0 for the root's children). The target's distribution after each block index is
known from one forward over the block. Walking down from the pending token with the residual r (first the target's
distribution there), each child x in turn, drawn from q, is accepted with probability min(1, r(x) / q(x)); on a
rejection r becomes norm(max(0, r - q)) before the next child; an accepted child continues the walk with the
target's distribution after it; when every child is rejected, or a node has none, the next token is drawn from r.

Exact for children drawn i.i.d. from q (SpecInfer's multi-step speculative sampling) and for deterministic children
(q one-hot at the child: accepted with probability r(x), and a rejection removes x from r), in any mix, as long as
each child's q depends only on the past: every child test is one step of rejection sampling from r, and the
residual update is the distribution r conditioned on the rejection. A chain is the tree with one child per node.

Every row walks at once, as tensor operations over rows (a level of the tree and a child rank at a time), on the
target's device: nothing is read back to the host until the caller reads the verdict. Each row draws its uniforms
up front, one per node and one for its next token, from its own generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specsample.sampling import Generators, draw_uniforms, sample_from
from specsample.token_tree import tree_children


@dataclass(frozen=True)
class TreeVerdict:
    """Per row: the accepted path and the token that follows it."""

    # [batch, depth] the accepted nodes, root to leaf, by their index among the tree's nodes (block index - 1); -1
    # past each row's path
    paths: Tensor
    next_token: Tensor  # [batch] long: recovered token, or bonus token after the last accepted node

    @property
    def num_accepted(self) -> Tensor:
        return (self.paths >= 0).sum(dim=1)


def _verdict(walk: Tensor, next_token: Tensor) -> TreeVerdict:
    """The verdict of a walk that accepted block indices `walk [batch, depth]` (-1 past its end)."""
    return TreeVerdict(torch.where(walk > 0, walk - 1, -1), next_token)


def rejected_residual(residual: Tensor, total: Tensor, token: Tensor, q: Tensor | None) -> tuple[Tensor, Tensor]:
    """Each row's residual `[b, V]` (unnormalised, of mass `total [b]`) given a rejected child `token [b]` drawn from
    `q [b, V]` (None: one-hot at the token): max(0, r / total - q), and its mass. A row where that is empty (r == q up
    to rounding, so a rejection could not happen) keeps r."""
    if q is None:
        taken = residual.gather(-1, token.unsqueeze(-1)).squeeze(-1)
        updated = residual.scatter(-1, token.unsqueeze(-1), 0.0)
        left = total - taken
    else:
        updated = (residual / total.unsqueeze(-1) - q).clamp(min=0.0)
        left = updated.sum(dim=-1)
    empty = left <= 0
    return torch.where(empty.unsqueeze(-1), residual, updated), torch.where(empty, total, left)


def verify_tree(
    tokens: Tensor,  # [batch, n] block tokens: the pending token, then the nodes
    parents: Tensor,  # [batch, n] each block index's parent (-1 for the pending token), on the host
    sizes: Tensor,  # [batch] block indices in use per row (1 + nodes), on the host
    draft_probs: Tensor | None,  # [batch, n, vocab] the distribution each node was drawn from; None: all one-hot
    target_probs: Tensor,  # [batch, n, vocab] the target's distribution after each block index
    generators: Generators,  # one per row
) -> TreeVerdict:
    """Accepted path and next token per row; the output is distributed exactly as sampling from the target."""
    batch, n = tokens.shape
    if target_probs.shape[:2] != (batch, n) or parents.shape != (batch, n):
        raise ValueError(
            f"need tokens, parents [batch, n] and target_probs [batch, n, vocab]; got "
            f"{tuple(tokens.shape)}, {tuple(parents.shape)}, {tuple(target_probs.shape)}"
        )
    device, wide = target_probs.device, torch.float64
    table, depth = tree_children(parents, sizes)
    table, tokens = table.to(device), tokens.to(device)
    uniforms = draw_uniforms(generators, batch, n + 1, device, (sizes.cpu() + 1).tolist())  # a node each, then one
    rows = torch.arange(batch, device=device)
    node = torch.zeros(batch, dtype=torch.long, device=device)
    residual = target_probs[:, 0].to(wide)
    total = residual.sum(dim=-1)
    used = torch.zeros(batch, dtype=torch.long, device=device)  # uniforms each row has used
    walking = torch.ones(batch, dtype=torch.bool, device=device)
    walk = torch.full((batch, max(depth, 1)), -1, dtype=torch.long, device=device)  # block indices accepted
    for level in range(depth):
        accepted = torch.full((batch,), -1, dtype=torch.long, device=device)
        for rank in range(table.shape[2]):
            child = table[rows, node, rank]  # [b]
            tested = walking & (accepted < 0) & (child >= 0)
            at = child.clamp(min=0)
            token = tokens[rows, at]
            q = None if draft_probs is None else draft_probs[rows, at].to(device=device, dtype=wide)
            q_token = 1.0 if q is None else q.gather(-1, token.unsqueeze(-1)).squeeze(-1)
            r_token = residual.gather(-1, token.unsqueeze(-1)).squeeze(-1)
            u = uniforms.gather(1, used.unsqueeze(1)).squeeze(1)
            # accept with probability min(1, r(x) / q(x)), r normalised
            passed = tested & (u * q_token * total < r_token)
            accepted = torch.where(passed, child, accepted)
            updated, left = rejected_residual(residual, total, token, q)
            rejected = tested & ~passed
            residual = torch.where(rejected.unsqueeze(-1), updated, residual)
            total = torch.where(rejected, left, total)
            used = used + tested.long()
        moved = accepted >= 0
        walk[:, level] = accepted
        node = torch.where(moved, accepted, node)
        after = target_probs[rows, node].to(wide)
        residual = torch.where(moved.unsqueeze(-1), after, residual)
        total = torch.where(moved, after.sum(dim=-1), total)
        walking = walking & moved
    next_token = sample_from(residual, uniforms.gather(1, used.unsqueeze(1)).squeeze(1))
    return _verdict(walk, next_token)


def verify_tree_greedy(tokens: Tensor, parents: Tensor, sizes: Tensor, target_logits: Tensor) -> TreeVerdict:
    """Greedy: follow the child that is the target's argmax while there is one; the next token is the argmax."""
    return follow_choices(tokens, parents, sizes, target_logits.argmax(dim=-1))


def follow_choices(tokens: Tensor, parents: Tensor, sizes: Tensor, choice: Tensor) -> TreeVerdict:
    """Walk each row's tree from the pending token, following the child equal to the target's chosen token at the
    current node (`choice [batch, n]`: argmax, or a coupled Gumbel-max) while there is one; the next token is the
    choice where the walk stops."""
    batch = tokens.shape[0]
    device = choice.device
    table, depth = tree_children(parents, sizes)
    table, tokens = table.to(device), tokens.to(device)
    rows = torch.arange(batch, device=device)
    node = torch.zeros(batch, dtype=torch.long, device=device)
    walking = torch.ones(batch, dtype=torch.bool, device=device)
    walk = torch.full((batch, max(depth, 1)), -1, dtype=torch.long, device=device)  # block indices accepted
    for level in range(depth):
        kids = table[rows, node]  # [b, k]
        wanted = choice[rows, node]  # [b]
        match = (kids >= 0) & (tokens.gather(1, kids.clamp(min=0)) == wanted.unsqueeze(1)) & walking.unsqueeze(1)
        found = match.any(dim=1)
        child = kids.gather(1, match.long().argmax(dim=1, keepdim=True)).squeeze(1)  # the first match
        walk[:, level] = torch.where(found, child, -1)
        node = torch.where(found, child, node)
        walking = walking & found
    return _verdict(walk, choice[rows, node])
