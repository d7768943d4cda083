"""Batch- and shape-invariant forwards (deterministic mode): every position's hidden states, cache entries and logits
are computed exactly as a one-token forward of that row alone computes them, whatever the number of tokens scored
and whatever else shares the batch.

What makes a block of tokens differ from one-token forwards otherwise (measured on a 2-core AVX512-BF16 CPU, torch
2.13, bfloat16; docs/exactness.md):

- matrix products: oneDNN picks its kernel, and its blocking of the inner dimension, by the number of rows M; a row's
  result can change with M (SmolLM2-135M's down projection, inner size 1536, from M = 7 on). With M fixed, a row's
  result is the same at any place in the block, whatever the other rows hold.
- attention: SDPA's result for one query changes with the number of queries in the call and with the key length,
  masked keys included.
- RMSNorm, RoPE, SiLU, the embedding: computed per row, the same for any number of rows.

So every projection multiplies exactly FIXED_ROWS rows at a time (the rows in blocks of FIXED_ROWS, the last block
padded with zeros), and every query attends in a call of its own, one group of heads over exactly the keys it sees,
unmasked and in cache order: what a one-token decode step does. `check_invariance` verifies the result on the
model's own kernels before a deterministic engine serves.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from specsample.models.base import CausalLM


class CheckedLM(CausalLM[Any], Protocol):
    """What `check_invariance` reads of a model (a LlamaModel)."""

    @property
    def dtype(self) -> torch.dtype: ...


FIXED_ROWS = 8  # rows per matrix product in deterministic mode: a block of up to 7 drafts and the pending token


@dataclass(frozen=True)
class QueryGroups:
    """Which queries of a forward attend together (`exact_attention`): per key count, the (row, position) pairs whose
    visible keys are their row's first `count` (one call each count), and the pairs that see other keys (a tree's, a
    sliding window's), each with its key indices."""

    shape: tuple[int, int]  # [b, n] queries
    prefixes: tuple[tuple[int, Tensor, Tensor], ...]  # (count, rows [m], positions [m])
    others: tuple[tuple[int, int, Tensor], ...]  # (row, position, key indices [count])

    @classmethod
    def of(cls, visible: Tensor) -> QueryGroups:
        """From `visible [b, n, kv_len]` (bool: query (i, j) sees key k)."""
        batch, n, kv_len = visible.shape
        counts = visible.sum(dim=-1)  # [b, n]
        prefix = ((torch.arange(kv_len, device=visible.device) < counts.unsqueeze(-1)) == visible).all(dim=-1)
        by_count: dict[int, list[tuple[int, int]]] = {}
        others = []
        for (row, i), count, is_prefix in zip(
            itertools.product(range(batch), range(n)), counts.flatten().tolist(), prefix.flatten().tolist()
        ):
            if is_prefix:
                by_count.setdefault(count, []).append((row, i))
            else:
                others.append((row, i, visible[row, i].nonzero().flatten()))
        prefixes = tuple(
            (
                count,
                torch.tensor([r for r, _ in pairs], device=visible.device),
                torch.tensor([i for _, i in pairs], device=visible.device),
            )
            for count, pairs in by_count.items()
        )
        return cls((batch, n), prefixes, tuple(others))


def exact_attention(q: Tensor, k: Tensor, v: Tensor, groups: QueryGroups) -> Tensor:
    """Attention output `[b, n, heads * hd]` of queries `q [b, n, kv_heads, groups, hd]` over keys and values
    `[b, kv_heads, kv_len, hd]`, each query seeing the keys `groups` lists for it.

    Each query attends as a one-token decode step does: SDPA of its heads per KV head over exactly its visible keys, in
    cache order, without a mask. Queries seeing the same number of their row's first keys share a call (SDPA gives
    each batch entry the same result at one shape)."""
    batch, n, kv_heads, heads_per_kv, head_dim = q.shape
    out = q.new_empty(batch, n, kv_heads, heads_per_kv, head_dim)
    for count, rows, positions in groups.prefixes:
        out[rows, positions] = F.scaled_dot_product_attention(
            q[rows, positions], k[rows, :, :count], v[rows, :, :count]
        )  # [m, KVH, G, hd]
    for row, i, keys in groups.others:
        out[row, i] = F.scaled_dot_product_attention(
            q[row, i].unsqueeze(0), k[row : row + 1, :, keys], v[row : row + 1, :, keys]
        )[0]
    return out.reshape(batch, n, kv_heads * heads_per_kv * head_dim)


def check_invariance(model: CheckedLM, context: int = 12, block: int = 5) -> None:
    """Raise `RuntimeError` unless `model` (in deterministic mode) scores a block of `block` tokens, beside another
    row, with exactly the logits of one-token forwards of that row alone:
    the guarantee deterministic mode gives, checked on this model's kernels, dtype and device. The next block is
    scored from the cache entries the first one left, so entries that differ show too."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.vocab_size, (2, context + 2 * block), generator=generator).to(model.device)
    alone, beside = model.new_cache(1, context + 2 * block), model.new_cache(2, context + 2 * block)
    slot, both = torch.tensor([0]), torch.tensor([0, 1])
    with torch.inference_mode():
        model.prefill(tokens[:1, :context], alone, slot)
        one = torch.cat(
            [model.forward_cached(tokens[:1, context + i : context + i + 1], alone, slot) for i in range(2 * block)],
            dim=1,
        )  # [1, 2 * block, vocab]
        model.prefill(tokens[:, : context - 3], beside, both)  # the other row ends 3 tokens apart
        model.prefill(tokens[:1, context - 3 : context], beside, slot)
        first = model.forward_cached(tokens[:, context : context + block], beside, both)[:1]  # ragged starts
        second = model.forward_cached(tokens[:1, context + block : context + 2 * block], beside, slot)
    scored = torch.cat([first, second], dim=1)
    if not torch.equal(scored, one):
        worst = float((scored.float() - one.float()).abs().max())
        raise RuntimeError(
            f"deterministic mode: this model's kernels ({model.dtype}, {model.device}) scored a block of {block} "
            f"tokens beside another row differently from one-token forwards (largest logit difference {worst:g}); "
            "bitwise reproducibility cannot be guaranteed here"
        )
