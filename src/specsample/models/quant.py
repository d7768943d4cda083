"""Weight-only quantized layers of our runtime: int4 group-wise and int8 per output row, multiplied on a CPU by our
kernels (`row_kernels`, on CPUs with AVX512-BF16) or else by torch's (`aten._weight_int4pack_mm_for_cpu`,
`aten._weight_int8pack_mm`).

A weight is stored once, in the layout its kernel reads:
- int4: codes q in [0, 15], packed by `aten._convert_weight_to_int4pack_for_cpu`, and per group of `group_size`
  inputs of a row a scale s and a zero z: w = (q - 8) * s + z (GGUF Q4_0: s = d, z = 0; Q4_1: s = d, z = m + 8d);
- int8: codes q in [-127, 127] (`[out, in]`) and one scale per output row: w = q * s.

The kernels vectorise bfloat16 activations only (torch's run a scalar loop on float32), so a quantized layer computes
in bfloat16 whatever the model's dtype and hands back the caller's dtype; its scales are kept as bfloat16 bits
(int16), so casting the model leaves them as the kernels need them. A layer picks its kernel once, so every call
multiplies the same way, and each row's result does not depend on the other rows in the call (the kernels accumulate
every row alone, in the same order): scoring a block of tokens gives each position the logits one-token decoding
gives it.

Where the kernels do not run (another device), a layer multiplies by its dequantized weight in the activations'
dtype, made once per device and kept (`dequantized`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specsample.models import row_kernels
from specsample.models.layers import Linear

QUANT_MODES = ("auto", "none", "int8", "int4")  # --quantize
INT4_GROUP_SIZES = (32, 64, 128, 256)  # what the int4 kernel accepts
DEFAULT_INT4_GROUP = 32  # GGUF's Q4 block
KERNEL_DTYPE = torch.bfloat16  # the activations' dtype both kernels vectorise


@dataclass(frozen=True)
class Int4Codes:
    """An int4 weight before packing: w = (codes - 8) * scales + zeros, per group of `group_size` inputs."""

    codes: Tensor  # [out, in] uint8 in [0, 15]
    scales: Tensor  # [out, in / group_size] float32
    zeros: Tensor  # [out, in / group_size] float32
    group_size: int

    def dequantize(self) -> Tensor:
        """The float32 weight `[out, in]` these codes stand for."""
        out, width = self.codes.shape
        groups = self.codes.view(out, width // self.group_size, self.group_size).float() - 8
        return (groups * self.scales.unsqueeze(-1) + self.zeros.unsqueeze(-1)).view(out, width)


@dataclass(frozen=True)
class Int8Codes:
    """An int8 weight: w = codes * scales, one scale per output row."""

    codes: Tensor  # [out, in] int8 in [-127, 127]
    scales: Tensor  # [out] float32

    def dequantize(self) -> Tensor:
        """The float32 weight `[out, in]` these codes stand for."""
        return self.codes.float() * self.scales.unsqueeze(-1)


Codes = Int4Codes | Int8Codes


def concat_codes(parts: list[Codes]) -> Codes | None:
    """Codes of the weights `parts` stacked along their output rows (a fused projection), or None where they differ in
    kind or group size (the projection then runs its parts one after the other)."""
    int4 = [p for p in parts if isinstance(p, Int4Codes)]
    if len(int4) == len(parts) and all(p.group_size == int4[0].group_size for p in int4):
        return Int4Codes(
            torch.cat([p.codes for p in int4]),
            torch.cat([p.scales for p in int4]),
            torch.cat([p.zeros for p in int4]),
            int4[0].group_size,
        )
    int8 = [p for p in parts if isinstance(p, Int8Codes)]
    if len(int8) == len(parts):
        return Int8Codes(torch.cat([p.codes for p in int8]), torch.cat([p.scales for p in int8]))
    return None


def _to_kernel_dtype(values: Tensor) -> Tensor:
    """Scales as the kernels read them: bfloat16, zero and subnormal-free magnitudes left as they round."""
    return values.to(KERNEL_DTYPE)


def quantize_int4(weight: Tensor, group_size: int = DEFAULT_INT4_GROUP) -> Int4Codes:
    """Asymmetric min/max int4 codes per group of `group_size` inputs; codes are chosen against the bfloat16-rounded
    scale and zero the kernel will read, so rounding the scales adds no error beyond the codes'."""
    out, width = weight.shape
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    if width % group_size:
        raise ValueError(f"int4 needs the input width ({width}) to be a multiple of the group size ({group_size})")
    groups = weight.detach().float().reshape(out, width // group_size, group_size)
    low, high = groups.amin(-1), groups.amax(-1)
    scales = _to_kernel_dtype(((high - low) / 15).clamp(min=1e-12)).float()
    zeros = _to_kernel_dtype(low + 8 * scales).float()
    codes = ((groups - zeros.unsqueeze(-1)) / scales.unsqueeze(-1) + 8).round().clamp(0, 15)
    return Int4Codes(codes.to(torch.uint8).reshape(out, width), scales, zeros, group_size)


def quantize_int8(weight: Tensor) -> Int8Codes:
    """Symmetric int8 codes with one scale per output row (chosen against its bfloat16 rounding)."""
    rows = weight.detach().float()
    scales = _to_kernel_dtype((rows.abs().amax(-1) / 127).clamp(min=1e-12)).float()
    codes = (rows / scales.unsqueeze(-1)).round().clamp(-127, 127).to(torch.int8)
    return Int8Codes(codes, scales)


def kernels_run_on(device: torch.device) -> bool:
    """Whether the int4/int8 CPU kernels multiply on `device` (else layers use their dequantized weights)."""
    return device.type == "cpu"


class QuantLinear(nn.Module):
    """A linear layer over quantized weights; subclasses say how they are stored and multiplied. Its buffers are not
    in the model's state dict: quantized models are built from a checkpoint, never saved as one."""

    in_features: int
    out_features: int
    bias: Tensor | None

    def __init__(self, in_features: int, out_features: int, bias: Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("bias", None if bias is None else bias.detach().clone(), persistent=False)
        self._dequantized: Tensor | None = None  # non-CPU fallback, made on first use
        self._ours = False  # whether our row kernel multiplies on a CPU (`row_kernels`), set once the weights are held
        self.pool = False  # our kernel splits its work over the fused step's threads (a fused model's output layer)

    def codes(self) -> Codes:
        raise NotImplementedError

    def _kernel(self, x: Tensor) -> Tensor:  # x [m, in] bfloat16 on CPU -> [m, out] bfloat16
        raise NotImplementedError

    def compute(self, x: Tensor) -> Tensor:
        """`x [..., in]` -> `[..., out]` in x's dtype: the kernel on a CPU, else the dequantized weight."""
        if not kernels_run_on(x.device):
            return F.linear(x, self.dequantized(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        flat = x.reshape(-1, self.in_features)
        out = self._kernel(flat if flat.dtype == KERNEL_DTYPE else flat.to(KERNEL_DTYPE))
        out = out.view(*x.shape[:-1], self.out_features)
        if out.dtype != x.dtype:
            out = out.to(x.dtype)
        return out if self.bias is None else out + self.bias.to(x.dtype)

    def forward(self, x: Tensor) -> Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            raise RuntimeError("quantized layers are for inference: load the model with --quantize none to train it")
        return self.compute(x)

    def dequantized(self, dtype: torch.dtype) -> Tensor:
        """The weight `[out, in]` in `dtype`, made once and kept (the fallback where the kernels do not run)."""
        if self._dequantized is None or self._dequantized.dtype != dtype or self._dequantized.device != self.device:
            self._dequantized = self.codes().dequantize().to(device=self.device, dtype=dtype)
        return self._dequantized

    @property
    def weight(self) -> Tensor:
        """The dequantized weight `[out, in]` in float32, computed afresh (for code that reads a layer's weights)."""
        return self.codes().dequantize().to(self.device)

    @property
    def device(self) -> torch.device:
        raise NotImplementedError

    def uses_our_kernel(self) -> bool:
        """Whether this layer multiplies with our row kernel (`row_kernels`) on a CPU, else with torch's."""
        return self._ours

    def _apply(
        self, fn: Callable[[Tensor], Tensor], recurse: bool = True
    ) -> QuantLinear:  # a device move re-packs; the cached dequantized copy is dropped
        self._dequantized = None
        return super()._apply(fn, recurse)

    @property
    def nbytes(self) -> int:
        """Bytes a multiplication reads: codes and scales (and the bias)."""
        return sum(b.numel() * b.element_size() for b in self.buffers())


# our int4 layout (kernels/quant_core.h): nibble t of a row's uint32 holds input NIBBLE_INPUTS[t] of its 8
NIBBLE_INPUTS = (0, 2, 4, 6, 1, 3, 5, 7)


def pack_int4_ours(codes: Int4Codes) -> tuple[Tensor, Tensor]:
    """`codes` in our kernels' layout: codes `[out / 64, in / 8, 64]` int32 and scales and zeros
    `[out / 64, in / group, 64, 2]` bfloat16."""
    out, width = codes.codes.shape
    q = codes.codes.cpu().to(torch.int64).view(out // 64, 64, width // 8, 8)
    lanes = torch.stack([q[..., j] << (4 * t) for t, j in enumerate(NIBBLE_INPUTS)]).sum(0)  # [out / 64, 64, in / 8]
    lanes = torch.where(lanes >= 2**31, lanes - 2**32, lanes).to(torch.int32)  # the uint32's bits
    scales_zeros = torch.stack([codes.scales, codes.zeros], dim=-1).cpu()  # [out, groups, 2]
    scales_zeros = scales_zeros.view(out // 64, 64, -1, 2).transpose(1, 2)
    return lanes.transpose(1, 2).contiguous(), _to_kernel_dtype(scales_zeros).contiguous()


def unpack_int4_ours(packed: Tensor, scales_zeros: Tensor, group_size: int) -> Int4Codes:
    """Invert `pack_int4_ours` (exact: no arithmetic on weights)."""
    blocks, steps, _ = packed.shape
    lanes = packed.cpu().to(torch.int64).transpose(1, 2) & 0xFFFFFFFF  # [out / 64, 64, in / 8]
    q = torch.empty(blocks, 64, steps, 8, dtype=torch.uint8)
    for t, j in enumerate(NIBBLE_INPUTS):
        q[..., j] = (lanes >> (4 * t)) & 15
    pairs = scales_zeros.cpu().float().transpose(1, 2).reshape(blocks * 64, -1, 2)  # [out, groups, 2]
    return Int4Codes(q.view(blocks * 64, steps * 8), pairs[..., 0].contiguous(), pairs[..., 1].contiguous(), group_size)


class Int4Linear(QuantLinear):
    """int4 codes and bfloat16 scales and zeros per group: in our kernels' layout where they multiply (`row_kernels`),
    else in the layout of torch's CPU kernel."""

    packed: Tensor
    scales_zeros: Tensor  # int16, the bfloat16 values' bits

    def __init__(self, codes: Int4Codes, bias: Tensor | None = None) -> None:
        out, width = codes.codes.shape
        super().__init__(width, out, bias)
        self.group_size = codes.group_size
        if out % 16 or width % codes.group_size:
            raise ValueError(
                f"int4 layers need out features divisible by 16 and in features by the group size; "
                f"got [{out}, {width}] with groups of {codes.group_size}"
            )
        self._ours = row_kernels.int4_fits(out, width, self.group_size) and row_kernels.available()
        if self._ours:
            packed, scales_zeros = pack_int4_ours(codes)
        else:  # torch's: codes [out, in / 2] uint8, scales and zeros [in / group, out, 2]
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                codes.codes.to(torch.int32).cpu().contiguous(), 1
            )
            scales_zeros = _to_kernel_dtype(torch.stack([codes.scales.t(), codes.zeros.t()], dim=-1)).contiguous()
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scales_zeros", scales_zeros.view(torch.int16), persistent=False)

    @property
    def device(self) -> torch.device:
        return self.packed.device

    def _kernel(self, x: Tensor) -> Tensor:
        scales_zeros = self.scales_zeros.view(KERNEL_DTYPE)
        if self.uses_our_kernel():
            return torch.ops.specsample_rows.int4_rows_mm(x, self.packed, self.group_size, scales_zeros, self.pool)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, scales_zeros)

    def codes(self) -> Int4Codes:
        """The codes unpacked from the layout they are held in (exact: no arithmetic on weights)."""
        if self.uses_our_kernel():
            return unpack_int4_ours(self.packed, self.scales_zeros.view(KERNEL_DTYPE), self.group_size)
        scales_zeros = self.scales_zeros.view(KERNEL_DTYPE).float().cpu()
        codes = unpack_int4(self.packed.cpu(), self.out_features, self.in_features)
        return Int4Codes(
            codes, scales_zeros[..., 0].t().contiguous(), scales_zeros[..., 1].t().contiguous(), self.group_size
        )

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, int4 groups of {self.group_size}"


def _unpack(packed: Tensor, out: int, width: int, block: int | None) -> Tensor:
    """Codes `[out, width]` from `packed [out, width / 2]`, read as the CPU packer writes them: blocks of `block` rows
    stored k-major, byte d of a k holding rows d and d + block / 2 (low, high nibble); a last, partial block (and
    every block where `block` is None) holds rows n and n + 1 in byte n / 2."""
    full = 0 if block is None else out // block * block
    parts = []
    if block is not None and full:
        blocks = packed[:full].reshape(full // block, width, block // 2)
        rows = torch.cat([blocks & 15, blocks >> 4], dim=-1)  # [blocks, width, block]
        parts.append(rows.transpose(1, 2).reshape(full, width))
    if full < out:
        tail = out - full
        pairs = packed[full:].reshape(width, tail // 2)
        parts.append(torch.stack([pairs & 15, pairs >> 4], dim=-1).reshape(width, tail).t())
    return torch.cat(parts) if len(parts) > 1 else parts[0]


_LAYOUT: list[int | None] = []  # the block size this process's packer uses, found once


def unpack_int4(packed: Tensor, out: int, width: int) -> Tensor:
    """Invert `aten._convert_weight_to_int4pack_for_cpu`: codes `[out, width]` uint8."""
    return _unpack(packed, out, width, packing_block())


def packing_block() -> int | None:
    """Rows per block of `aten._convert_weight_to_int4pack_for_cpu`'s layout, which depends on the CPU's vector width;
    the first call finds it by packing a probe (64 or 32 rows per block, or plain pairs: None)."""
    if not _LAYOUT:
        probe = torch.randint(0, 16, (144, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
        packed_probe = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 1)
        for block in (64, 32, None):
            if torch.equal(_unpack(packed_probe, 144, 64, block), probe.to(torch.uint8)):
                _LAYOUT.append(block)
                break
        else:
            raise NotImplementedError("this CPU's int4 packing layout is not one we can read back")
    return _LAYOUT[0]


class Int8Linear(QuantLinear):
    """int8 codes `[out, in]` and one bfloat16 scale per output row."""

    codes_: Tensor
    scales: Tensor  # int16, the bfloat16 values' bits

    def __init__(self, codes: Int8Codes, bias: Tensor | None = None) -> None:
        out, width = codes.codes.shape
        super().__init__(width, out, bias)
        self.register_buffer("codes_", codes.codes.contiguous(), persistent=False)
        self.register_buffer("scales", _to_kernel_dtype(codes.scales).view(torch.int16), persistent=False)
        self._ours = row_kernels.int8_fits(out, width) and row_kernels.available()

    @property
    def device(self) -> torch.device:
        return self.codes_.device

    def _kernel(self, x: Tensor) -> Tensor:
        if self.uses_our_kernel():
            return torch.ops.specsample_rows.int8_rows_mm(x, self.codes_, self.scales.view(KERNEL_DTYPE), self.pool)
        return torch.ops.aten._weight_int8pack_mm(x, self.codes_, self.scales.view(KERNEL_DTYPE))

    def codes(self) -> Int8Codes:
        return Int8Codes(self.codes_.cpu(), self.scales.view(KERNEL_DTYPE).float().cpu())

    def rows(self, ids: Tensor) -> Int8Linear:
        """A layer of the output rows `ids` only (an output subset)."""
        codes = self.codes()
        ids = ids.cpu()
        return Int8Linear(
            Int8Codes(codes.codes[ids], codes.scales[ids]), None if self.bias is None else self.bias[ids]
        ).to(self.device)

    def lookup(self, ids: Tensor, dtype: torch.dtype) -> Tensor:
        """Rows `ids [...]` of the weight, dequantized: `[..., in]` in `dtype` (an embedding tied to this layer)."""
        return self.codes_[ids].to(dtype) * self.scales.view(KERNEL_DTYPE)[ids].unsqueeze(-1).to(dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, int8 per row"


class SplitLinear(nn.Module):
    """A fused projection whose parts are stored in different layouts: each part multiplies, the outputs are joined."""

    def __init__(self, parts: Sequence[QuantLinear]) -> None:
        super().__init__()
        # registered as a ModuleList, used as the sequence of layers it holds
        self.parts = cast(Sequence[QuantLinear], nn.ModuleList(parts))
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def compute(self, x: Tensor) -> Tensor:
        return torch.cat([part.compute(x) for part in self.parts], dim=-1)

    def forward(self, x: Tensor) -> Tensor:
        return self.compute(x)


class QuantEmbedding(nn.Module):
    """An embedding read from an int8 layer's rows (a tied output layer, or a table of its own)."""

    dtype_marker: Tensor

    def __init__(self, table: Int8Linear, dtype: torch.dtype) -> None:
        super().__init__()
        self.table = table
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features
        # float only to carry the model's dtype through casts; the values live in the table
        self.register_buffer("dtype_marker", torch.zeros((), dtype=dtype), persistent=False)

    def forward(self, ids: Tensor) -> Tensor:
        return self.table.lookup(ids, self.dtype_marker.dtype)

    @property
    def weight(self) -> Tensor:
        """The dequantized table `[vocab, hidden]` in the model's dtype, computed afresh (for code reading it)."""
        return self.table.weight.to(self.dtype_marker.dtype)


def linear_module(codes: Codes, bias: Tensor | None = None) -> QuantLinear:
    """The quantized layer for `codes`."""
    return Int4Linear(codes, bias) if isinstance(codes, Int4Codes) else Int8Linear(codes, bias)


Projection = Linear | QuantLinear | SplitLinear  # a decoder layer's projection, float or quantized
