"""Verifying token trees: exact at any temperature (stochastic and deterministic children alike), greedy follows
the target's argmax, and broken variants of the rule fail the same test."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from stats_util import chi_square

import specsample.verification.tree as tree_module
from specsample.verification.tree import rejected_residual, verify_tree, verify_tree_greedy

VOCAB = 5
SAMPLES = 8_000


def _distributions(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A target p(second | first) and p(first), a draft q likewise: [VOCAB + 1, VOCAB] (row VOCAB: the first)."""
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(VOCAB + 1, VOCAB, generator=g, dtype=torch.float64) * 1.5, -1)
    q = torch.softmax(torch.randn(VOCAB + 1, VOCAB, generator=g, dtype=torch.float64) * 1.5, -1)
    return p, q


def _run(p, q, stochastic: bool, verifier=verify_tree, seed: int = 0) -> np.ndarray:
    """Histogram of the first two output tokens over SAMPLES trees: two children of the pending token, each with
    two children (stochastic: drawn i.i.d. from q; else q's top two, deterministic)."""
    counts = np.zeros(VOCAB * VOCAB, dtype=np.int64)
    draw = torch.Generator().manual_seed(seed)
    batch = 500
    for start in range(0, SAMPLES, batch):
        tokens = torch.zeros(batch, 7, dtype=torch.long)
        probs = torch.zeros(batch, 7, VOCAB, dtype=torch.float64)
        parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 2]]).expand(batch, 7)
        for row in range(batch):
            if stochastic:
                first = torch.multinomial(q[VOCAB], 2, replacement=True, generator=draw)
            else:
                first = q[VOCAB].topk(2).indices
            tokens[row, 1:3] = first
            probs[row, 1:3] = q[VOCAB]
            for j, parent in enumerate((1, 2)):
                dist = q[int(tokens[row, parent])]
                second = (
                    torch.multinomial(dist, 2, replacement=True, generator=draw) if stochastic else dist.topk(2).indices
                )
                tokens[row, 3 + 2 * j : 5 + 2 * j] = second
                probs[row, 3 + 2 * j : 5 + 2 * j] = dist
        target = torch.zeros(batch, 7, VOCAB, dtype=torch.float64)
        target[:, 0] = p[VOCAB]
        for i in range(1, 7):
            target[:, i] = p[tokens[:, i]]
        gens = [torch.Generator().manual_seed(seed * 10**6 + start + r) for r in range(batch)]
        verdict = verifier(tokens, parents, torch.full((batch,), 7), probs if stochastic else None, target, gens)
        for row, path in enumerate(verdict.paths.tolist()):  # the tree's nodes are block indices 1..
            out = [int(tokens[row, 1 + i]) for i in path if i >= 0] + [int(verdict.next_token[row])]
            if len(out) < 2:  # the first token was drawn from the residual: the second from the target after it
                out.append(int(torch.multinomial(p[out[0]], 1, generator=draw)))
            counts[out[0] * VOCAB + out[1]] += 1
    return counts


def _exact(p) -> np.ndarray:
    return np.array([float(p[VOCAB, a] * p[a, b]) for a, b in itertools.product(range(VOCAB), repeat=2)])


@pytest.mark.parametrize("stochastic", [True, False], ids=["iid_children", "top_k_children"])
def test_trees_are_target_distributed(stochastic: bool) -> None:
    p, q = _distributions(1)
    statistic, threshold = chi_square(_run(p, q, stochastic), _exact(p))
    assert statistic < threshold, f"chi2 {statistic:.1f} >= {threshold:.1f}"


def _no_residual_update(residual, total, token, q):
    return residual, total


def _top_k_as_if_drawn(tokens, parents, sizes, draft_probs, target_probs, generators, q=None):
    """Deterministic (top-k) children tested as if drawn from q: min(1, r / q) and max(0, r - q)."""
    return verify_tree(tokens, parents, sizes, q, target_probs, generators)


@pytest.mark.parametrize("broken", ["no_residual_update", "top_k_as_if_drawn"])
def test_broken_tree_verifiers_fail(broken: str, monkeypatch) -> None:
    p, q = _distributions(1)
    if broken == "no_residual_update":
        monkeypatch.setattr(tree_module, "rejected_residual", _no_residual_update)
        counts = _run(p, q, stochastic=True)
    else:

        def verifier(tokens, parents, sizes, draft_probs, target_probs, generators):
            probs = torch.zeros(*tokens.shape, VOCAB, dtype=torch.float64)
            probs[:, 1:3] = q[VOCAB]
            for i in range(3, 7):
                probs[:, i] = q[tokens[:, 1 + (i - 3) // 2]]
            return verify_tree(tokens, parents, sizes, probs, target_probs, generators)

        counts = _run(p, q, stochastic=False, verifier=verifier)
    statistic, threshold = chi_square(counts, _exact(p))
    assert statistic > threshold, f"{broken} was not detected: chi2 {statistic:.1f} < {threshold:.1f}"


def test_greedy_follows_the_targets_argmax() -> None:
    tokens = torch.tensor([[7, 3, 4, 1, 2, 0]])
    parents = torch.tensor([[-1, 0, 0, 2, 2, 3]])
    logits = torch.full((1, 6, 8), -1.0)
    logits[0, 0, 4] = 1.0  # after the pending token: 4 (block index 2; index 1 holds 3)
    logits[0, 2, 1] = 1.0  # after 4: 1 (block index 3)
    logits[0, 3, 6] = 1.0  # after 1: 6, which no child holds
    verdict = verify_tree_greedy(tokens, parents, torch.tensor([6]), logits)
    assert verdict.paths.tolist() == [[1, 2, -1]]  # block indices 2 and 3: the tree's nodes 1 and 2
    assert verdict.next_token.tolist() == [6]
    assert verdict.num_accepted.tolist() == [2]


def test_a_rejected_deterministic_child_leaves_the_target_without_it() -> None:
    residual = torch.tensor([[0.5, 0.3, 0.2], [0.5, 0.3, 0.2]], dtype=torch.float64)
    total = residual.sum(-1)
    updated, left = rejected_residual(residual, total, torch.tensor([0, 2]), None)
    assert torch.allclose(
        updated / left.unsqueeze(-1), torch.tensor([[0.0, 0.6, 0.4], [0.625, 0.375, 0.0]], dtype=torch.float64)
    )
    q = residual.clone()
    updated, left = rejected_residual(residual, total, torch.tensor([1, 1]), q)
    assert torch.equal(updated, residual) and torch.equal(left, total)  # r == q: a rejection cannot happen
