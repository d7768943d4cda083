"""Verifying a token tree: multi-candidate rejection sampling (SpecInfer, arXiv:2305.09781; Recursive Speculative
Decoding, arXiv:2402.14160).

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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specsample.sampling import Generators, sample_from


@dataclass(frozen=True)
class TreeVerdict:
    """Per row: the accepted path (block indices of the accepted nodes, root to leaf) and the token that follows."""

    paths: tuple[tuple[int, ...], ...]
    next_token: Tensor  # [batch] long: recovered token, or bonus token after the last accepted node

    @property
    def num_accepted(self) -> Tensor:
        return torch.tensor([len(p) for p in self.paths], dtype=torch.long)


def rejected_residual(residual: Tensor, token: int, q: Tensor | None) -> Tensor:
    """The residual given a rejected child `token` drawn from `q` (None: one-hot at the token): norm(max(0, r - q)).
    When that is empty (r == q up to rounding, so a rejection could not happen) r stays."""
    if q is None:
        updated = residual.clone()
        updated[token] = 0.0
    else:
        updated = (residual - q).clamp(min=0.0)
    total = float(updated.sum())
    return updated / total if total > 0 else residual


def _children(parents: list[int], size: int) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for i in range(1, size):
        out.setdefault(parents[i], []).append(i)
    return out


def verify_tree(
    tokens: Tensor,  # [batch, n] block tokens: the pending token, then the nodes
    parents: Tensor,  # [batch, n] each block index's parent (-1 for the pending token)
    sizes: Tensor,  # [batch] block indices in use per row (1 + nodes)
    draft_probs: Tensor | None,  # [batch, n, vocab] the distribution each node was drawn from; None: all one-hot
    target_probs: Tensor,  # [batch, n, vocab] the target's distribution after each block index
    generators: Generators,  # one per row
) -> TreeVerdict:
    """Accepted path and next token per row; the output is distributed exactly as sampling from the target."""
    batch, n = tokens.shape
    if target_probs.shape[:2] != (batch, n) or parents.shape != (batch, n):
        raise ValueError(f"need tokens, parents [batch, n] and target_probs [batch, n, vocab]; got "
                         f"{tuple(tokens.shape)}, {tuple(parents.shape)}, {tuple(target_probs.shape)}")
    wide = torch.float64
    paths, next_tokens = [], []
    for row in range(batch):
        size = int(sizes[row])
        row_tokens = tokens[row].tolist()
        children = _children(parents[row].tolist(), size)
        generator = generators[row] if isinstance(generators, (list, tuple)) else generators
        node, path = 0, []
        residual = target_probs[row, 0].to(wide)
        while True:
            accepted = None
            for child in children.get(node, []):
                x = row_tokens[child]
                q = None if draft_probs is None else draft_probs[row, child].to(device=residual.device, dtype=wide)
                q_x = 1.0 if q is None else float(q[x])
                u = float(torch.rand((), generator=generator, dtype=wide))
                if u * q_x < float(residual[x]):  # accept with probability min(1, r(x) / q(x))
                    accepted = child
                    break
                residual = rejected_residual(residual, x, q)
            if accepted is None:
                break
            path.append(accepted)
            node = accepted
            residual = target_probs[row, node].to(wide)
        u = torch.rand(1, generator=generator, dtype=wide)
        next_tokens.append(sample_from(residual.unsqueeze(0), u)[0])
        paths.append(tuple(path))
    return TreeVerdict(tuple(paths), torch.stack(next_tokens).to(tokens.device))


def verify_tree_greedy(tokens: Tensor, parents: Tensor, sizes: Tensor, target_logits: Tensor) -> TreeVerdict:
    """Greedy: follow the child that is the target's argmax while there is one; the next token is the argmax."""
    return follow_choices(tokens, parents, sizes, target_logits.argmax(dim=-1))


def follow_choices(tokens: Tensor, parents: Tensor, sizes: Tensor, choice: Tensor) -> TreeVerdict:
    """Walk each row's tree from the pending token, following the child equal to the target's chosen token at the
    current node (`choice [batch, n]`: argmax, or a coupled Gumbel-max) while there is one; the next token is the
    choice where the walk stops."""
    choice = choice.tolist()
    paths, next_tokens = [], []
    for row in range(tokens.shape[0]):
        row_tokens = tokens[row].tolist()
        children = _children(parents[row].tolist(), int(sizes[row]))
        node, path = 0, []
        while True:
            match = [c for c in children.get(node, []) if row_tokens[c] == choice[row][node]]
            if not match:
                break
            node = match[0]
            path.append(node)
        paths.append(tuple(path))
        next_tokens.append(choice[row][node])
    return TreeVerdict(tuple(paths), torch.tensor(next_tokens, dtype=torch.long, device=tokens.device))
