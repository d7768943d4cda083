"""A token tree, per row, given as parent indices: `parents [b, n]` holds node i's parent (-1 for a root), and every
parent comes before its children. What the target's tree attention, the verifiers, the drafters and the round's
counters read of a tree is computed here, one way each: a node's depth, its ancestors, its children, and the parents
of a scored block (the pending token first, then a proposal's nodes).
"""

from __future__ import annotations

import torch
from torch import Tensor


def tree_depths(parents: Tensor) -> Tensor:
    """`[b, n]` each node's depth: 0 for a root, one more than its parent's below it (counted a level at a time: as
    many steps as the trees are deep)."""
    n = parents.shape[1]
    late = (parents >= torch.arange(n, device=parents.device)) | (parents < -1)  # [b, n]
    if bool(late.any()):
        i = int(late.any(dim=0).nonzero()[0])
        raise ValueError(f"token {i}'s parent must come before it (or be -1), got {parents[:, i].tolist()}")
    depths = torch.zeros_like(parents)
    above = parents  # [b, n] each node's ancestor `depths + 1` levels up, -1 past its root
    while bool((reached := above >= 0).any()):
        depths += reached.long()
        above = torch.where(reached, parents.gather(1, above.clamp(min=0)), -1)
    return depths


def tree_ancestors(parents: Tensor) -> tuple[Tensor, Tensor]:
    """From `parents [b, n]` (host tensors), each node's ancestors and itself `[b, n, n]` (bool) and its depth `[b, n]`
    (`tree_depths`)."""
    depths = tree_depths(parents)
    batch, n = parents.shape
    ancestors = torch.zeros(batch, n, n, dtype=torch.bool)
    for i in range(n):
        parent = parents[:, i]
        rows = torch.nonzero(parent >= 0).flatten()
        if len(rows):
            ancestors[rows, i] = ancestors[rows, parent[rows]]
        ancestors[:, i, i] = True
    return ancestors, depths


def tree_children(parents: Tensor, sizes: Tensor) -> tuple[Tensor, int]:
    """`[b, n, k]` each node's children (node indices, in order; -1 past its last), and the trees' greatest depth, of
    the first `sizes[i]` nodes of row i (the rest ignored). Built on the host from `parents [b, n]` and `sizes [b]`."""
    parents, sizes = parents.cpu(), sizes.cpu()
    batch, n = parents.shape
    real = torch.arange(n).unsqueeze(0) < sizes.unsqueeze(1)  # [b, n]
    is_child = real & (parents >= 0)
    rank = torch.zeros(batch, n, dtype=torch.long)  # each node's place among its parent's children
    count = torch.zeros(batch, n + 1, dtype=torch.long)
    for i in range(1, n):  # parents come first: one pass in order
        parent = parents[:, i].clamp(min=0)
        rank[:, i] = count.gather(1, parent.unsqueeze(1)).squeeze(1)
        count.scatter_add_(1, parent.unsqueeze(1), is_child[:, i].long().unsqueeze(1))
    width = max(int(count.max()), 1)
    table = torch.full((batch, n, width), -1, dtype=torch.long)
    rows, nodes = torch.nonzero(is_child, as_tuple=True)
    table[rows, parents[rows, nodes], rank[rows, nodes]] = nodes
    depths = torch.where(real, tree_depths(parents), 0)
    return table, int(depths.max()) if n else 0


def block_parents(parents: Tensor, num_drafted: Tensor) -> Tensor:
    """`[b, nodes + 1]` the parents in a scored block of a proposal's tree (`parents [b, nodes]`, `num_drafted [b]`,
    host tensors): the pending token first (-1), then the nodes (their parents shifted by one, the pending token at
    0); nodes past a row's count hang from the pending token."""
    shifted = parents + 1
    real = torch.arange(shifted.shape[1]).unsqueeze(0) < num_drafted.unsqueeze(1)
    shifted = torch.where(real, shifted, torch.zeros_like(shifted))
    return torch.cat([torch.full((shifted.shape[0], 1), -1, dtype=torch.long), shifted], dim=1)
