"""Pure sampling math: logits -> warped probabilities, and categorical draws from given uniforms.

No model and no cache here. All arithmetic is float32 or wider whatever the model dtype, so the
draft probability used in the acceptance test is exactly the one the draft token was drawn from.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from specsample.config import SamplingParams

Generators = torch.Generator | Sequence[torch.Generator]


def warp_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """Turn logits `[..., vocab]` into the probabilities sampling draws from under `params`.

    Greedy (temperature 0) gives a one-hot at the argmax (lowest index on ties). A row of logits holding NaN
    gives a row of NaN under any settings, so whoever reads the distribution can tell it is unusable.
    """
    logits = logits.float() if logits.dtype not in (torch.float32, torch.float64) else logits
    if params.greedy:
        top = logits.argmax(dim=-1, keepdim=True)  # a NaN counts as the maximum
        unusable = logits.gather(-1, top).isnan()
        return one_hot_like(top.squeeze(-1), logits).masked_fill(unusable, float("nan"))
    scaled = logits / params.temperature
    if params.top_k is not None and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        probs = _top_p_filter(probs, params.top_p)
    if params.min_p > 0.0:
        floor = params.min_p * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < floor, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _top_p_filter(probs: Tensor, top_p: float) -> Tensor:
    """Keep the smallest most-likely set whose mass reaches `top_p`; the most likely token always stays (a top_p
    too small for the probabilities' dtype, which rounds to 0 there, keeps just that token)."""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop_sorted = mass_before >= top_p  # a token is kept while the mass before it is short of top_p
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    kept = probs.masked_fill(drop, 0.0)
    return kept / kept.sum(dim=-1, keepdim=True)


def one_hot_like(tokens: Tensor, like: Tensor) -> Tensor:
    """One-hot float tensor `[*tokens.shape, vocab]` with the dtype and device of `like`."""
    out = torch.zeros(*tokens.shape, like.shape[-1], dtype=like.dtype, device=like.device)
    return out.scatter_(-1, tokens.unsqueeze(-1), 1.0)


def draw_uniforms(
    generators: Generators, rows: int, count: int, device: torch.device, counts: Sequence[int] | None = None
) -> Tensor:
    """Uniforms `[rows, count]` in [0, 1) as float64: one shared generator or one per row.

    With per-row generators, row i draws only `counts[i]` values (default `count`) and the rest of
    its row is 0: a row's randomness then depends on its own history alone, never on how many
    drafts the other rows of its batch asked for.
    """
    if isinstance(generators, torch.Generator):
        return torch.rand(rows, count, generator=generators, dtype=torch.float64).to(device)
    if len(generators) != rows:
        raise ValueError(f"got {len(generators)} generators for {rows} rows")
    out = torch.zeros(rows, count, dtype=torch.float64)
    for row, g in enumerate(generators):
        n = count if counts is None else counts[row]
        if n:
            out[row, :n] = torch.rand(n, generator=g, dtype=torch.float64)
    return out.to(device)


def sample_from(probs: Tensor, uniforms: Tensor, block: int = 256) -> Tensor:
    """Inverse-CDF draw per row: `probs [rows, vocab]` (unnormalised ok), `uniforms [rows]` -> `[rows]`.

    Two levels, both summed in float64 so rounding biases nothing above 1e-15: find the block of
    `block` tokens holding u * total, then the token inside it. This reads the probabilities once
    instead of materialising a float64 CDF over the whole vocabulary. A token with zero probability
    is never returned.
    """
    rows, vocab = probs.shape
    padded = F.pad(probs, (0, (-vocab) % block)) if vocab % block else probs
    blocks = padded.view(rows, -1, block)  # [rows, num_blocks, block]
    block_mass = blocks.sum(-1, dtype=torch.float64)  # [rows, num_blocks]
    cdf = block_mass.cumsum(-1)
    total = cdf[:, -1:]
    if bool((~torch.isfinite(total) | (total <= 0)).any()):
        raise ValueError("cannot sample from a distribution with zero or non-finite total mass")
    threshold = uniforms.double().unsqueeze(-1) * total  # [rows, 1]
    chosen = torch.searchsorted(cdf, threshold, right=True).clamp(max=cdf.shape[1] - 1)  # [rows, 1]
    within = threshold - (cdf.gather(1, chosen) - block_mass.gather(1, chosen))
    inner = blocks.gather(1, chosen.unsqueeze(-1).expand(rows, 1, block)).squeeze(1).double().cumsum(-1)
    offset = torch.searchsorted(inner, within, right=True).clamp(max=block - 1)
    token = (chosen * block + offset).squeeze(-1).clamp(max=vocab - 1)
    bad = probs.gather(1, token.unsqueeze(-1)).squeeze(-1) <= 0  # only where rounding hit a block edge
    if bool(bad.any()):
        token[bad] = _sample_exact(probs[bad], uniforms[bad])
    return token


def _sample_exact(probs: Tensor, uniforms: Tensor) -> Tensor:
    """One-level float64 inverse CDF (the slow path for rounding at block edges)."""
    cdf = probs.double().cumsum(dim=-1)
    index = torch.searchsorted(cdf, uniforms.double().unsqueeze(-1) * cdf[:, -1:], right=True).squeeze(-1)
    last_positive = probs.shape[-1] - 1 - (probs.flip(-1) > 0).double().argmax(dim=-1)
    return torch.minimum(index, last_positive)


def sample(probs: Tensor, generators: Generators, active: Sequence[bool] | None = None) -> Tensor:
    """Draw one token per row from `probs [rows, vocab]` using the given generator(s).

    Rows marked inactive consume no randomness (per-row generators) and get the first token with
    positive probability. A row that is no distribution (zero or non-finite mass) draws nothing and gets
    token 0: it fails alone, and whoever reads the probabilities it was drawn from must refuse it (the
    verifier does), while the other rows draw exactly as they would without it.
    """
    rows = probs.shape[0]
    usable = usable_rows(probs)
    if bool(usable.all()):
        counts = None if active is None else [int(a) for a in active]
        return sample_from(probs, draw_uniforms(generators, rows, 1, probs.device, counts)[:, 0])
    counts = [int(a and ok) for a, ok in zip(active if active is not None else [True] * rows, usable.tolist())]
    uniforms = draw_uniforms(generators, rows, 1, probs.device, counts)[:, 0]
    tokens = torch.zeros(rows, dtype=torch.long, device=probs.device)
    if bool(usable.any()):
        tokens[usable] = sample_from(probs[usable], uniforms[usable])
    return tokens


def usable_rows(probs: Tensor) -> Tensor:
    """Which rows of `probs [..., vocab]` (probabilities, unnormalised ok) are distributions: finite, with
    positive mass. A NaN or an infinity anywhere in a row makes its sum non-finite, so one sum per row decides."""
    mass = probs.sum(dim=-1)
    return torch.isfinite(mass) & (mass > 0)


def warp_rows(logits: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """Warp `logits [batch, ..., vocab]` with one `SamplingParams` per row (rows sharing params batch)."""
    if len(params) != logits.shape[0]:
        raise ValueError(f"got {len(params)} SamplingParams for {logits.shape[0]} rows")
    # rows group by what warping reads (seeds and budgets differ per row but warp alike)
    groups: dict[tuple, list[int]] = {}
    for row, p in enumerate(params):
        groups.setdefault((p.temperature, p.top_k, p.top_p, p.min_p), []).append(row)
    if len(groups) == 1:
        return warp_probs(logits, params[0])
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    probs = torch.empty(logits.shape, dtype=dtype, device=logits.device)
    for rows in groups.values():
        index = torch.tensor(rows, device=logits.device)
        probs[index] = warp_probs(logits[index], params[rows[0]])
    return probs
