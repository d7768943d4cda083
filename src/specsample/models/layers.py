"""The building blocks of our runtime's layers: prepacked CPU linear layers, RMS norm, rotary embeddings."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specsample.models.invariant import FIXED_ROWS

# float32 weights smaller than this stay unpacked: a packed oneDNN call costs 13-17 us however small the
# matrix, while F.linear multiplies a 128-wide draft's matrices in 3-7 us (2-core AVX512-BF16 CPU)
PACK_MIN_FLOAT32_ELEMENTS = 1 << 18


def prepack(weight: Tensor) -> Tensor | None:
    """oneDNN-prepacked copy of a `[out, in]` weight for CPU inference; None where oneDNN cannot, or where
    it would be slower (a small float32 matrix, see PACK_MIN_FLOAT32_ELEMENTS).

    Measured on a 2-core AVX512-BF16 machine: a prepacked matrix-vector product reads weights about twice as
    fast as `F.linear`, in float32 and bfloat16 alike.
    """
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    if weight.dtype == torch.float32 and weight.numel() < PACK_MIN_FLOAT32_ELEMENTS:
        return None
    try:
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
            probe = torch.ones(1, weight.shape[1], dtype=weight.dtype)
            torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
    except (AttributeError, RuntimeError):
        return None
    return packed


def linear(x: Tensor, weight: Tensor, bias: Tensor | None, packed: Tensor | None) -> Tensor:
    """`F.linear`, through the prepacked weight when there is one and no gradient is needed."""
    if packed is None or torch.is_grad_enabled():
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def weight_version(weight: Tensor) -> int:
    """The tensor's in-place version counter; -2 for a tensor made under `torch.inference_mode` (a model loaded
    there), which keeps none: its copies (packed, gathered, compiled) are then never refreshed."""
    return -2 if weight.is_inference() else weight._version


def fixed_rows_linear(
    x: Tensor, weight: Tensor, bias: Tensor | None, packed: Tensor | None, rows: int = FIXED_ROWS
) -> Tensor:
    """`linear(x, weight, bias)` for `x [..., in]` as products of exactly `rows` rows each: the same result for a row
    wherever it sits and whatever the other rows are."""
    flat = x.reshape(-1, x.shape[-1])  # [m, in]
    m = flat.shape[0]
    if m % rows:
        flat = torch.cat([flat, flat.new_zeros(rows - m % rows, flat.shape[1])])
    out = torch.cat([linear(block, weight, bias, packed) for block in flat.split(rows)])  # [m + pad, out]
    return out[:m].reshape(*x.shape[:-1], out.shape[-1])


class Linear(nn.Linear):
    """`nn.Linear` that can prepack its weight for oneDNN on CPU."""

    packed: Tensor | None = None
    packed_version: int = -1  # the weight's version counter when packed: training invalidates the copy
    fixed_rows: int | None = None  # deterministic mode: multiply this many rows at a time (models/invariant.py)

    def pack(self) -> bool:
        """Prepack for CPU inference; returns False (and stays unpacked) where oneDNN cannot."""
        self.packed = prepack(self.weight)
        self.packed_version = weight_version(self.weight)
        return self.packed is not None

    def forward(self, x: Tensor) -> Tensor:
        if torch.compiler.is_compiling():  # traced for a compiled step: plain weights, which inductor packs itself
            return F.linear(x, self.weight, self.bias)
        if self.packed is not None and weight_version(self.weight) != self.packed_version:
            self.pack()  # the weights were updated in place since they were packed
        if self.fixed_rows is not None and not torch.is_grad_enabled():
            return fixed_rows_linear(x, self.weight, self.bias, self.packed, self.fixed_rows)
        return linear(x, self.weight, self.bias, self.packed)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # one fused op; for bf16 it accumulates in float32 and rounds once (HF rounds twice). Under autocast a
        # bfloat16 input meets float32 weights: it is normed in float32, where the op stays fused
        if x.dtype != self.weight.dtype:
            x = x.to(self.weight.dtype)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate `x [b, n, heads, hd]` by position; cos/sin are `[b, n, 1, hd]` (halves duplicated)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
