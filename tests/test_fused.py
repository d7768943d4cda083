"""The fused step (models/fused.py) against the torch path: the same function to bfloat16 rounding, and the row
invariance that makes verification exact: a position scored in a block, a tree or a batch gets bitwise what a
one-token step at that position gives."""

from __future__ import annotations

import copy

import pytest
import torch

from specsample.models import row_kernels
from specsample.models.fused import unsupported
from specsample.models.llama import LlamaConfig, LlamaModel
from specsample.models.quant_model import quantize_model
from specsample.models.tiny import tiny_lm

pytestmark = pytest.mark.skipif(not row_kernels.available(), reason="the fused step needs AVX512-BF16 and a compiler")

CONFIG = LlamaConfig(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    max_position_embeddings=512,
)


def _model(kind: str, bias: bool = False) -> LlamaModel:
    """A seeded bfloat16 model whose projections are `kind` (int4, int8 or bfloat16); `bias`: Qwen2's QKV bias."""
    config = LlamaConfig(**{**CONFIG.__dict__, "qkv_bias": bias})
    torch.manual_seed(0)
    model = LlamaModel(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.1 if "norm" in name else 0.08)
    if kind != "bf16":
        quantize_model(model, kind)
    return model.to(torch.bfloat16).eval()


@pytest.fixture(params=["amx", "avx512"])
def kernel_path(request):
    """Each product path the CPU offers (AMX tiles where present, AVX-512 always), restored afterwards."""
    if request.param == "amx" and not row_kernels.set_amx(True):
        pytest.skip("this CPU has no AMX tiles")
    before = row_kernels.uses_amx()
    row_kernels.set_amx(request.param == "amx")
    yield request.param
    row_kernels.set_amx(before)


def _pair(kind: str, bias: bool = False) -> tuple[LlamaModel, LlamaModel]:
    """The same weights twice: on the fused step, and on torch ops."""
    fused = _model(kind, bias)
    plain = copy.deepcopy(fused)
    fused.use_fused_step()
    return fused, plain


def _run(model: LlamaModel, context: list[torch.Tensor], tokens: torch.Tensor, parents=None, slots=None):
    """Prefill each row's context (ragged), then score `tokens [b, n]` (a tree per row with `parents`): logits."""
    batch = tokens.shape[0]
    slots = torch.arange(batch) if slots is None else slots
    cache = model.new_cache(int(slots.max()) + 1, 256)
    for row, prompt in enumerate(context):
        if len(prompt):
            model.prefill(prompt.unsqueeze(0), cache, slots[row : row + 1])
    if parents is None:
        return model.forward_cached(tokens, cache, slots).float(), cache
    return model.forward_cached_tree(tokens, cache, slots, parents)[0].float(), cache


def _close(fused: torch.Tensor, plain: torch.Tensor) -> None:
    """Logits agree to bfloat16 rounding: each within a few bfloat16 steps (2^-8 relative) of the logits' scale."""
    scale = plain.abs().amax().item()
    assert (fused - plain).abs().amax().item() <= 0.04 * scale


@pytest.mark.parametrize("kind", ["int4", "int8", "bf16"])
@pytest.mark.parametrize("contexts", [(0,), (9,), (40, 3, 17)])
@pytest.mark.parametrize("n", [1, 5, 16])
def test_fused_matches_torch_ops(kernel_path, kind: str, contexts: tuple[int, ...], n: int) -> None:
    fused, plain = _pair(kind)
    generator = torch.Generator().manual_seed(len(contexts) * 100 + n)
    context = [torch.randint(0, 256, (c,), generator=generator) for c in contexts]
    tokens = torch.randint(0, 256, (len(contexts), n), generator=generator)
    (got, fused_cache), (want, plain_cache) = _run(fused, context, tokens), _run(plain, context, tokens)
    _close(got, want)
    for row, c in enumerate(contexts):  # the cache holds the same keys and values, to bfloat16 rounding
        keys, plain_keys = fused_cache.keys[1][row, :, : c + n].float(), plain_cache.keys[1][row, :, : c + n].float()
        assert (keys - plain_keys).abs().amax() <= 0.04 * plain_keys.abs().amax()


def test_biases_and_features(kernel_path) -> None:
    fused, plain = _pair("int4", bias=True)
    for model in (fused, plain):
        model.set_feature_layers((0, 1, 2))
    tokens = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(1))
    results = []
    for model in (fused, plain):
        cache = model.new_cache(2, 64)
        results.append(model.forward_cached_features(tokens, cache, torch.arange(2)))
    _close(results[0][0].float(), results[1][0].float())
    features, plain_features = results[0][1].float(), results[1][1].float()
    assert features.shape == plain_features.shape == (2, 6, 3 * 128)
    assert (features - plain_features).abs().amax() <= 0.04 * plain_features.abs().amax()


@pytest.mark.parametrize("kind, context", [("int4", 21), ("int8", 21), ("bf16", 21), ("int4", 300)])
def test_a_block_scores_as_one_token_steps(kernel_path, kind: str, context: int) -> None:
    """Bitwise: a block of n tokens, the same tokens one at a time, and a row beside other rows (its queries in two
    blocks of tiles; a context of two key chunks too)."""
    fused, _ = _pair(kind)
    generator = torch.Generator().manual_seed(3)
    prompt, tokens = (
        torch.randint(0, 256, (1, context), generator=generator),
        torch.randint(0, 256, (1, 11), generator=generator),
    )
    cache = fused.new_cache(3, context + 43)
    slot = torch.tensor([1])
    fused.prefill(prompt, cache, slot)
    block = fused.forward_cached(tokens, cache, slot)
    cache.truncate(slot, torch.tensor([context]))
    steps = torch.cat([fused.forward_cached(tokens[:, i : i + 1], cache, slot) for i in range(11)], dim=1)
    assert torch.equal(block, steps)
    cache.truncate(slot, torch.tensor([context]))
    other = torch.randint(0, 256, (1, 9), generator=generator)
    cache.lengths[2] = 0
    fused.prefill(other, cache, torch.tensor([2]))
    batch = fused.forward_cached(torch.cat([tokens, tokens.flip(1)]), cache, torch.tensor([1, 2]))
    assert torch.equal(batch[0], block[0])


def test_a_tree_scores_each_path_as_its_chain(kernel_path) -> None:
    """Each token of a tree gets the logits the chain of its ancestors gives it: bitwise on AVX-512, where each query
    attends over its own list of keys; to rounding on tiles, where the path's keys sit at other places in the
    products than the chain's."""
    fused, plain = _pair("int4")
    generator = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, 256, (1, 12), generator=generator)
    tokens = torch.randint(0, 256, (1, 7), generator=generator)
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 5]])
    tree, _ = _run(fused, [prompt[0]], tokens, parents)
    _close(tree, _run(plain, [prompt[0]], tokens, parents)[0])
    for leaf, path in ((3, [0, 1, 3]), (4, [0, 1, 4]), (6, [0, 2, 5, 6])):
        chain, _ = _run(fused, [prompt[0]], tokens[:, path])
        if kernel_path == "avx512":
            assert torch.equal(chain[0, -1], tree[0, leaf]), leaf
        else:
            _close(tree[0, leaf], chain[0, -1])


def test_bad_trees_are_refused() -> None:
    fused, _ = _pair("int4")
    with pytest.raises(RuntimeError, match="parent must come before it"):
        _run(fused, [torch.tensor([1, 2])], torch.tensor([[5, 6, 7]]), torch.tensor([[-1, 2, 0]]))


def test_what_the_fused_step_cannot_run_is_named() -> None:
    assert "bfloat16" in unsupported(tiny_lm(256, hidden_size=128, num_heads=4))  # a float32 model
    windowed = tiny_lm(256, hidden_size=128, num_heads=4, sliding_window=8).to(torch.bfloat16)
    assert "sliding-window" in unsupported(windowed)
    narrow = tiny_lm(256, hidden_size=64, num_heads=4).to(torch.bfloat16)  # head size 16
    assert "multiples of 32" in unsupported(narrow)
    with pytest.raises(ValueError, match="cannot run this model: .*sliding-window"):
        windowed.use_fused_step()
    assert unsupported(_model("int4")) is None
