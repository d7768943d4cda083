"""GGUF quantized tensors as our int4/int8 codes, read from the blocks' bits: the weights never pass through float.

- Q4_0 (w = d (q - 8)), Q4_1 (w = d q + m) and Q4_K (super-blocks of 8 groups, w = d sc q - dmin mn) are int4 codes
  in groups of 32: the same codes, and their scales and zeros rounded to bfloat16 (the kernel's).
- Q8_0 (w = d q, a scale per block of 32) becomes int8 with one scale per row, as our int8 kernel reads it:
  each code is rescaled to the row's scale, q' = round(d q / s_row) (at most half a step of the row's scale).
- Every other quantized type (Q5_0, Q5_1, Q2_K, Q3_K, Q5_K, Q6_K, IQ*) has no kernel of its width here: the gguf
  package dequantizes it and it is quantized again to int8 per row, the nearest layout we run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from specsample.models.quant import Codes, Int4Codes, Int8Codes, quantize_int8

QK = 32  # weights per Q4_0 / Q4_1 / Q8_0 block and per Q4_K group
FLOAT_TYPES = ("F32", "F16", "BF16", "F64")
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")  # the types read as int4 codes


def _blocks(tensor: Any, block_bytes: int) -> np.ndarray:
    """The tensor's blocks `[rows, blocks, block_bytes]` (uint8)."""
    data = np.asarray(tensor.data, dtype=np.uint8)
    return data.reshape(data.shape[0], -1, block_bytes)


def _half(raw: np.ndarray) -> np.ndarray:
    """float16 fields `[..., 2]` (bytes) as float32 `[...]`."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """`[rows, blocks, 16]` bytes -> codes `[rows, blocks * 32]`: a block's low nibbles are its first 16 weights."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(qs.shape[0], -1)


def q4_0_codes(tensor: Any) -> Int4Codes:
    blocks = _blocks(tensor, 18)
    scales = _half(blocks[..., 0:2])
    return _int4(_nibbles(blocks[..., 2:]), scales, np.zeros_like(scales))


def q4_1_codes(tensor: Any) -> Int4Codes:
    blocks = _blocks(tensor, 20)
    scales, mins = _half(blocks[..., 0:2]), _half(blocks[..., 2:4])
    return _int4(_nibbles(blocks[..., 4:]), scales, mins + 8 * scales)


def q4_k_codes(tensor: Any) -> Int4Codes:
    from gguf.quants import Q4_K

    blocks = _blocks(tensor, 144)  # [rows, super-blocks, 144]: d, dmin, 12 bytes of 6-bit scales and mins, 128 qs
    rows, supers = blocks.shape[:2]
    d, dmin = _half(blocks[..., 0:2])[..., None], _half(blocks[..., 2:4])[..., None]
    sc, mn = (
        part.reshape(rows, supers, 8).astype(np.float32)
        for part in Q4_K.get_scale_min(np.ascontiguousarray(blocks[..., 4:16]).reshape(-1, 12))
    )
    qs = blocks[..., 16:].reshape(rows, supers, 4, 1, 32)  # group 2j: low nibbles of chunk j; 2j + 1: high ones
    codes = np.concatenate([qs & 15, qs >> 4], axis=3).reshape(rows, -1)
    scales = (d * sc).reshape(rows, -1)
    return _int4(codes, scales, (8 * d * sc - dmin * mn).reshape(rows, -1))


def _int4(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray) -> Int4Codes:
    # scales and zeros as the kernel reads them (bfloat16)
    return Int4Codes(
        torch.from_numpy(np.ascontiguousarray(codes)),
        torch.from_numpy(scales).to(torch.bfloat16).float(),
        torch.from_numpy(zeros).to(torch.bfloat16).float(),
        QK,
    )


def q8_0_codes(tensor: Any) -> Int8Codes:
    blocks = _blocks(tensor, 34)
    scales = torch.from_numpy(_half(blocks[..., 0:2]))  # [rows, blocks]
    codes = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:]).view(np.int8))  # [rows, blocks, 32]
    row_scales = (scales.abs() * codes.abs().amax(-1).float()).amax(-1) / 127  # [rows]
    row_scales = row_scales.clamp(min=1e-12).to(torch.bfloat16).float()
    ratio = (scales / row_scales.unsqueeze(-1)).unsqueeze(-1)  # [rows, blocks, 1]
    requantized = (codes.float() * ratio).round().clamp(-127, 127).to(torch.int8)
    return Int8Codes(requantized.reshape(codes.shape[0], -1), row_scales)


_READERS: dict[str, Callable[[Any], Codes]] = {
    "Q4_0": q4_0_codes,
    "Q4_1": q4_1_codes,
    "Q4_K": q4_k_codes,
    "Q8_0": q8_0_codes,
}


def tensor_codes(tensor: Any) -> Int4Codes | Int8Codes:
    """A quantized GGUF weight matrix as codes `[out, in]` (see the module's rules per type)."""
    kind = tensor.tensor_type.name
    if kind in FLOAT_TYPES:
        raise ValueError(f"{tensor.name} is a {kind} tensor, not a quantized one")
    shape = [int(d) for d in reversed(tensor.shape)]
    if len(shape) != 2:
        raise ValueError(f"{tensor.name}: quantized tensors must be matrices, got shape {shape}")
    if kind in _READERS:
        return _READERS[kind](tensor)
    from gguf.quants import dequantize

    values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False).reshape(shape)
    return quantize_int8(torch.from_numpy(np.ascontiguousarray(values)))
