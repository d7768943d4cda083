"""Quantized weights: the int4/int8 layers, GGUF blocks read as codes, quantized models on every forward path, the
options that ask for them, and exactness of speculation on a quantized target."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from model_factory import make_tokenizer, write_hf_model, write_llama_gguf

from specsample.config import SettingError
from specsample.models import quant, row_kernels
from specsample.models.gguf_blocks import tensor_codes
from specsample.models.loader import load_model
from specsample.models.quant import (
    Int4Codes,
    Int4Linear,
    Int8Linear,
    QuantEmbedding,
    SplitLinear,
    quantize_int4,
    quantize_int8,
    unpack_int4,
)
from specsample.models.quant_model import dequantized_model, quantize_model
from specsample.models.tiny import tiny_lm

BF16_STEP = 2.0**-8  # bfloat16's relative rounding bound


def _layer(kind: str, out: int, width: int, seed: int = 0):
    weight = torch.randn(out, width, generator=torch.Generator().manual_seed(seed))
    codes = quantize_int4(weight, 32) if kind == "int4" else quantize_int8(weight)
    return (Int4Linear if kind == "int4" else Int8Linear)(codes), codes


@pytest.fixture(params=["ours", "torch"])
def kernel(request, monkeypatch) -> str:
    """Layers built under this fixture multiply with our row kernels or with torch's."""
    if request.param == "ours" and not row_kernels.available():
        pytest.skip("our row kernels need a CPU with AVX512-BF16 and a C++ compiler")
    if request.param == "torch":
        monkeypatch.setattr(row_kernels, "available", lambda: False)
    return request.param


@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("group", [32, 64])
def test_layer_multiplies_its_dequantized_weights(kind: str, group: int, kernel: str) -> None:
    weight = torch.randn(128, 256, generator=torch.Generator().manual_seed(0))
    codes = quantize_int4(weight, group) if kind == "int4" else quantize_int8(weight)
    layer = quant.linear_module(codes)
    assert layer.uses_our_kernel() == (kernel == "ours")
    for rows in (1, 5, 17):
        x = torch.randn(rows, 256, dtype=torch.float64)
        expected = x.to(torch.bfloat16).double() @ codes.dequantize().double().t()
        got = layer(x)
        assert got.dtype == torch.float64  # handed back in the caller's dtype
        assert torch.allclose(got, expected, rtol=2 * BF16_STEP, atol=2e-2)


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_each_row_is_computed_alone(kind: str, kernel: str) -> None:
    """A row's output does not depend on the other rows of the call: scoring a block equals decoding one by one."""
    layer, _ = _layer(kind, 192, 64, seed=1)
    assert layer.uses_our_kernel() == (kernel == "ours")
    x = torch.randn(17, 64, dtype=torch.bfloat16)
    block = layer(x)
    for rows in (1, 2, 4, 5, 7, 8, 13):
        assert torch.equal(layer(x[:rows]), block[:rows])
    assert torch.equal(torch.cat([layer(x[i : i + 1]) for i in range(17)]), block)


def test_shapes_our_kernels_cannot_read_use_torchs() -> None:
    int4, _ = _layer("int4", 96, 128)  # int4 needs whole blocks of 64 outputs
    int8 = Int8Linear(quantize_int8(torch.randn(8, 48)))  # int8 needs inputs in multiples of 32
    assert not int4.uses_our_kernel() and not int8.uses_our_kernel()
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    assert torch.equal(
        int4(x), torch.ops.aten._weight_int4pack_mm_for_cpu(x, int4.packed, 32, int4.scales_zeros.view(torch.bfloat16))
    )


@pytest.mark.parametrize("shape", [(128, 64), (80, 96), (48, 32), (960, 64)])
def test_int4_codes_unpack_exactly(shape) -> None:
    codes = torch.randint(0, 16, shape, dtype=torch.int32, generator=torch.Generator().manual_seed(2))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    assert torch.equal(unpack_int4(packed, *shape), codes.to(torch.uint8))


def test_quantizers_stay_within_half_a_step() -> None:
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(3))
    int4 = quantize_int4(weight, 32)
    steps = int4.scales.repeat_interleave(32, dim=1)
    assert ((int4.dequantize() - weight).abs() <= 0.5 * steps + 1e-6).all()
    int8 = quantize_int8(weight)
    assert ((int8.dequantize() - weight).abs() <= 0.5 * int8.scales.unsqueeze(1) + 1e-6).all()
    with pytest.raises(ValueError, match="group size"):
        quantize_int4(weight, 48)


class _Tensor:
    """The fields of a gguf reader's tensor that `tensor_codes` reads."""

    def __init__(self, data: np.ndarray, kind: str, shape: tuple[int, int]) -> None:
        import gguf

        self.data, self.tensor_type, self.name = data, gguf.GGMLQuantizationType[kind], "blk.0.test.weight"
        self.shape = list(reversed(shape))


def _gguf_values(tensor: _Tensor, shape) -> torch.Tensor:
    from gguf.quants import dequantize

    return torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).reshape(shape).astype(np.float32))


def _random_q4_k(rows: int, width: int, seed: int) -> np.ndarray:
    """Valid Q4_K blocks from random bytes (fp16 d and dmin kept small and finite)."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, width // 256, 144), dtype=np.uint8)
    halves = rng.uniform(1e-3, 1e-2, size=(rows, width // 256, 2)).astype(np.float16)
    blocks[..., :4] = halves.view(np.uint8).reshape(rows, width // 256, 4)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K", "Q8_0", "Q5_0"])
def test_gguf_blocks_read_as_codes(kind: str) -> None:
    """int4 types keep their codes (only the scales and zeros round to bfloat16); Q8_0 is rescaled per row, other types
    requantized to int8 per row: each within its stated bound of the values the gguf package decodes."""
    import gguf
    from gguf.quants import quantize

    shape = (32, 512)
    weight = np.random.default_rng(4).normal(0, 0.05, size=shape).astype(np.float32)
    data = _random_q4_k(*shape, seed=5) if kind == "Q4_K" else quantize(weight, gguf.GGMLQuantizationType[kind])
    tensor = _Tensor(data, kind, shape)
    codes, reference = tensor_codes(tensor), _gguf_values(tensor, shape)
    error = (codes.dequantize() - reference).abs()
    if kind.startswith("Q4"):
        assert isinstance(codes, Int4Codes) and codes.group_size == 32
        scales, zeros = (t.repeat_interleave(32, dim=1) for t in (codes.scales, codes.zeros))
        assert (error <= (8 * scales.abs() + zeros.abs()) * BF16_STEP * 1.01 + 1e-7).all()
    else:
        assert (error <= 0.5 * codes.scales.unsqueeze(1) * 1.01 + 1e-7).all()


@pytest.fixture(scope="module")
def gguf_models(tmp_path_factory):
    """A tiny Llama as a GGUF file with int4 and int8 tensors, and the same file's weights dequantized."""
    root = tmp_path_factory.mktemp("quant")
    tokenizer = make_tokenizer()
    folder = write_hf_model(root / "hf", "llama", tokenizer=tokenizer, seed=3)
    path = write_llama_gguf(
        folder,
        root / "tiny.gguf",
        types={
            "attn_q": "Q4_0",
            "attn_k": "Q4_1",
            "attn_v": "Q8_0",
            "attn_output": "Q4_1",
            "ffn_": "Q4_0",
            "token_embd": "Q8_0",
            "output.": "Q8_0",
        },
    )
    native = load_model(str(path))  # dtype auto on a CPU: the codes as stored
    floats = load_model(str(path), dtype="float32")  # an explicit float dtype: dequantized, as before
    return folder, path, native, floats


def test_gguf_loads_natively(gguf_models) -> None:
    _, path, native, floats = gguf_models
    model = native.model
    assert native.quantize == "auto" and native.gguf == path and floats.quantize == "none"
    layer = model.layers[0]
    assert isinstance(layer.qkv, SplitLinear)  # q and k int4, v int8: parts in their own layouts
    assert [type(p) for p in layer.qkv.parts] == [Int4Linear, Int8Linear]
    assert isinstance(layer.gate_up, Int4Linear) and isinstance(layer.down, Int4Linear)
    assert isinstance(model.lm_head, Int8Linear) and not isinstance(model.embed, QuantEmbedding)  # untied
    tokens = torch.tensor([[3, 17, 42, 7, 99, 5]])
    with torch.inference_mode():
        ours, reference = model(tokens).float(), floats.model(tokens).float()
    assert (ours - reference).abs().max() < 0.05 * reference.abs().max()


def test_float_checkpoint_quantizes_on_load(gguf_models) -> None:
    """Quantized on load, a model computes its float copy's function (`dequantized_model`) up to bfloat16 rounding,
    and int4 strays further from the float checkpoint than int8."""
    folder = gguf_models[0]
    original = load_model(str(folder), dtype="float32").model
    tokens = torch.tensor([[3, 17, 42, 7, 99, 5]])
    strays = {}
    for mode, layer_type in (("int4", Int4Linear), ("int8", Int8Linear)):
        loaded = load_model(str(folder), dtype="float32", quantize=mode)
        assert loaded.quantize == mode and isinstance(loaded.model.layers[1].gate_up, layer_type)
        assert isinstance(loaded.model.lm_head, Int8Linear)  # the output layer is never int4
        with torch.inference_mode():
            ours, same_weights = loaded.model(tokens), dequantized_model(loaded.model)(tokens)
            strays[mode] = (ours - original(tokens)).abs().max()
        assert (ours - same_weights).abs().max() < 4 * BF16_STEP * same_weights.abs().max()
    assert strays["int4"] > strays["int8"]
    with pytest.raises(ValueError, match="quantize"):
        load_model(str(folder), quantize="int3")


def _quantized_tiny(mode: str, dtype=torch.float32):
    return quantize_model(tiny_lm(48, seed=7, init_scale=0.2, dtype=dtype), mode)


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_every_path_scores_alike(mode: str) -> None:
    """Prefill + one-token steps, a scored block, a chain-shaped token tree and the uncached forward agree."""
    model = _quantized_tiny(mode)
    tokens = torch.randint(0, 48, (2, 9), generator=torch.Generator().manual_seed(8))
    slots = torch.arange(2)
    with torch.inference_mode():
        full = model(tokens)
        cache = model.new_cache(2, 16)
        model.prefill(tokens[:, :4], cache, slots)
        block = model.forward_cached(tokens[:, 4:], cache, slots)
        cache.truncate(slots, torch.tensor([4, 4]))
        steps = torch.cat([model.forward_cached(tokens[:, i : i + 1], cache, slots) for i in range(4, 9)], dim=1)
        cache.truncate(slots, torch.tensor([4, 4]))
        chain = torch.arange(-1, 4).expand(2, -1)
        tree, _ = model.forward_cached_tree(tokens[:, 4:], cache, slots, chain)
    for other in (block, steps, tree):
        assert torch.allclose(other, full[:, 4:], atol=1e-4, rtol=1e-4)


def test_output_subset_of_a_quantized_layer() -> None:
    model = _quantized_tiny("int8")
    subset = torch.tensor([5, 0, 33, 12])
    tokens = torch.tensor([[1, 2, 3]])
    with torch.inference_mode():
        full = model(tokens)
        model.set_output_subset(subset)
        cache = model.new_cache(1, 8)
        last = model.forward_cached_last(tokens, cache, torch.tensor([0]), torch.tensor([2]))
    assert torch.allclose(last[0], full[0, 2, subset], atol=1e-5)


def test_fallback_off_the_cpu_kernels(monkeypatch) -> None:
    """Where the kernels do not run, a layer multiplies by its dequantized weights: the same function."""
    model = _quantized_tiny("int4")
    tokens = torch.tensor([[4, 8, 15, 16, 23, 42]])
    with torch.inference_mode():
        kernel = model(tokens)
        monkeypatch.setattr(quant, "kernels_run_on", lambda device: False)
        fallback = model(tokens)
    assert (kernel - fallback).abs().max() < 4 * BF16_STEP * fallback.abs().max()  # the kernel rounds to bfloat16


def test_quantized_layers_refuse_training() -> None:
    model = _quantized_tiny("int4")
    with pytest.raises(RuntimeError, match="inference"):
        model.layers[0].qkv(torch.randn(1, 64, requires_grad=True))


def test_settings_are_checked() -> None:
    from specsample.options import EngineOptions

    for name, value in (("quantize", "int3"), ("draft_quantize", "fp8"), ("quant_group", 48)):
        with pytest.raises(SettingError) as raised:
            EngineOptions(**{name: value})
        assert raised.value.name == name
    with pytest.raises(SettingError, match="runtime"):
        EngineOptions(quantize="int4", runtime="hf")


def test_self_draft_is_the_target_quantized(gguf_models) -> None:
    from specsample.drafters.model import ModelDrafter
    from specsample.options import EngineOptions
    from specsample.pair import load_drafter

    folder = gguf_models[0]
    target = load_model(str(folder), dtype="float32")
    drafter = load_drafter("self:int4", target, EngineOptions(dtype="float32"))
    assert isinstance(drafter, ModelDrafter) and isinstance(drafter.model.layers[0].qkv, Int4Linear)
    assert drafter.model is not target.model
    with pytest.raises(ValueError, match="self-draft"):
        load_drafter("self:int2", target)


def test_llama_cpp_missing_is_a_message(monkeypatch, tmp_path) -> None:
    import sys

    from specsample.bench.llama_cpp import peer_or_reason

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails as if not installed
    peer, reason = peer_or_reason(tmp_path / "model.gguf", 64, frozenset())
    assert peer is None and "not installed" in reason and "specsample[llama]" in reason
    peer, reason = peer_or_reason(None, 64, frozenset())
    assert peer is None and "GGUF" in reason
    peer, reason = peer_or_reason(tmp_path / "model.gguf", 64, frozenset(), lookup=True)
    assert peer is None and reason.startswith("llama.cpp-lookup skipped") and "not installed" in reason


@pytest.fixture(scope="module")
def quantized_pair():
    from test_exactness import VOCAB

    target = quantize_model(tiny_lm(VOCAB, seed=10, init_scale=0.2, dtype=torch.float64), "int4")
    unquantized = tiny_lm(VOCAB, seed=10, init_scale=0.2, dtype=torch.float64)  # the weights before quantization
    draft = tiny_lm(VOCAB, seed=20, init_scale=0.2, num_layers=1, dtype=torch.float64)
    return target, unquantized, draft


def test_speculation_is_exact_for_the_quantized_target(quantized_pair) -> None:
    """Speculative output is distributed as the quantized target's own sampling (int4 layers, int8 output)."""
    from stats_util import chi_square
    from test_exactness import WARPS, engine_counts, exact_joint

    target, _, draft = quantized_pair
    params = WARPS["temperature_1"]
    statistic, threshold = chi_square(engine_counts(target, draft, params, gamma=2), exact_joint(target, params))
    assert statistic < threshold, f"chi2 {statistic:.1f} >= threshold {threshold:.1f}"


def test_verifying_against_the_float_weights_fails(quantized_pair) -> None:
    """Broken twin: rounds verified by the weights before quantization are not the quantized target's sampling."""
    from stats_util import chi_square
    from test_exactness import WARPS, engine_counts, exact_joint

    target, unquantized, draft = quantized_pair
    params = WARPS["temperature_1"]
    statistic, threshold = chi_square(engine_counts(unquantized, draft, params, gamma=2), exact_joint(target, params))
    assert statistic > threshold, f"float verification was not detected: chi2 {statistic:.1f} < {threshold:.1f}"


def test_a_build_lock_left_by_a_killed_build_is_removed(tmp_path, monkeypatch) -> None:
    import os
    import time

    lock = tmp_path / "lock"
    lock.touch()
    waited = []

    def another_build_finishes(seconds: float) -> None:  # a fresh lock is waited on until its build removes it
        waited.append(seconds)
        lock.unlink()

    monkeypatch.setattr(row_kernels.time, "sleep", another_build_finishes)
    row_kernels._clear_stale_lock(lock)
    assert waited and not lock.exists()
    lock.touch()
    old = time.time() - row_kernels.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    row_kernels._clear_stale_lock(lock)  # a lock older than any build is removed at once
    assert not lock.exists() and len(waited) == 1
    row_kernels._clear_stale_lock(lock)  # no lock: nothing to do
