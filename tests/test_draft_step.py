"""A draft step's cheaper paths: last-position logits over the output subset, float32 for narrow drafts on a
CPU, small float32 matrices left unpacked. Each must compute what the plain path computes."""

from __future__ import annotations

import torch
from model_factory import draft_request

from specsample import ModelDrafter, SamplingParams, tiny_lm
from specsample.models import loader, row_kernels
from specsample.models.convert import save_hf_folder
from specsample.models.hf_names import export_hf_state_dict
from specsample.models.layers import PACK_MIN_FLOAT32_ELEMENTS, prepack
from specsample.models.loader import LoadedModel, resolve_dtype
from specsample.options import EngineOptions
from specsample.pair import SMALL_DRAFT_HIDDEN, load_drafter

SUBSET = [0, 3, 4, 9, 10, 17, 21, 30]  # sorted: sampling over it draws what sampling over the vocabulary draws


def test_small_float32_matrices_stay_unpacked() -> None:
    side = int(PACK_MIN_FLOAT32_ELEMENTS**0.5)
    assert prepack(torch.randn(side // 2, side // 2)) is None  # F.linear is faster there
    large = prepack(torch.randn(side, side))
    small_bf16 = prepack(torch.randn(side // 2, side // 2, dtype=torch.bfloat16))
    if large is not None:  # oneDNN can pack on this CPU: the rule leaves large float32 and any bfloat16 packed
        assert small_bf16 is not None
    model = tiny_lm(32, seed=1)
    assert not model.pack_for_cpu() and all(layer.qkv.packed is None for layer in model.layers)


def test_last_position_logits_are_the_full_forwards_columns() -> None:
    model = tiny_lm(32, seed=3, init_scale=0.2)
    tokens = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]])  # row 1 padded: its last real position is 1
    last = torch.tensor([3, 1])
    for subset in (None, torch.tensor([30, 2, 7, 11])):  # any order: columns follow the subset
        model.set_output_subset(subset)
        cache_a, cache_b = model.new_cache(2, 16), model.new_cache(2, 16)
        slots = torch.tensor([0, 1])
        full = model.forward_cached(tokens, cache_a, slots)[torch.arange(2), last]  # [2, vocab]
        got = model.forward_cached_last(tokens, cache_b, slots, last)
        want = full if subset is None else full[:, subset]
        assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5)
        assert cache_a.lengths.tolist() == cache_b.lengths.tolist()


def test_subset_drafting_draws_what_full_vocabulary_drafting_draws() -> None:
    """Same seeds, same tokens, same probabilities (at vocabulary ids) and confidences, over several rounds."""
    model = tiny_lm(32, seed=4, init_scale=0.2)
    model.set_output_subset(torch.tensor(SUBSET))
    fast, plain = ModelDrafter(model), ModelDrafter(model)
    plain._last_only = None  # the path for models without last-position logits: full vocabulary, every position
    assert fast._last_only is not None
    settings = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.9, top_k=3),
        SamplingParams(temperature=1.0, top_p=0.8),
    ]
    for params in settings:
        gens = {d: [torch.Generator().manual_seed(11), torch.Generator().manual_seed(12)] for d in (fast, plain)}
        for drafter in (fast, plain):
            drafter.allocate(2, 64)
            drafter.add_rows([0, 1], [[1, 2, 3, 4], [5, 6]])
        for _ in range(4):
            got = {
                d: d.propose(draft_request((0, 1), (3, 2), (3, 2), (params,) * 2, tuple(gens[d]), width=3))
                for d in (fast, plain)
            }
            a, b = got[fast], got[plain]
            assert a.tokens.tolist() == b.tokens.tolist() and a.num_drafted.tolist() == b.num_drafted.tolist()
            assert torch.allclose(a.probs, b.probs, atol=1e-6) and torch.allclose(a.confidence, b.confidence, atol=1e-6)
            assert set(a.tokens[0].tolist()) <= set(SUBSET)
            outside = [t for t in range(32) if t not in SUBSET]
            assert float(a.probs[..., outside].abs().max()) == 0.0
            for drafter in (fast, plain):  # keep the first draft and add a token of our own
                drafter.commit([0, 1], [[int(a.tokens[0, 0]), 7], [int(a.tokens[1, 0]), 8]])


def _target() -> LoadedModel:
    return LoadedModel(tiny_lm(32, seed=1), None, "tiny-target", "ours")


def _draft_folder(tmp_path, hidden: int):
    draft = tiny_lm(32, seed=2, hidden_size=hidden, num_heads=4, num_kv_heads=2)
    folder = tmp_path / f"draft{hidden}"
    save_hf_folder(folder, draft.config.to_hf(), export_hf_state_dict(draft), dtype=torch.bfloat16)
    return folder


def test_a_narrow_draft_runs_in_float32_on_a_cpu_under_auto(tmp_path, monkeypatch) -> None:
    """On torch ops a narrow draft steps faster in float32; on the fused step it stays in bfloat16."""
    narrow = _draft_folder(tmp_path, SMALL_DRAFT_HIDDEN // 2)
    if row_kernels.available():
        on_fused = load_drafter(str(narrow), _target(), EngineOptions(dtype="auto")).model
        assert on_fused.dtype == torch.bfloat16 and on_fused.fused is not None
    monkeypatch.setattr(loader, "unsupported_fused", lambda model: "a CPU without the fused step")
    assert load_drafter(str(narrow), _target(), EngineOptions(dtype="auto")).model.dtype == torch.float32
    bfloat16 = EngineOptions(dtype="bfloat16")
    assert load_drafter(str(narrow), _target(), bfloat16).model.dtype == torch.bfloat16  # asked for: kept
    wide = _draft_folder(tmp_path, SMALL_DRAFT_HIDDEN + 64)
    auto = resolve_dtype("auto", torch.device("cpu"))
    assert load_drafter(str(wide), _target(), EngineOptions(dtype="auto")).model.dtype == auto


def test_a_model_built_under_inference_mode_packs_and_decodes() -> None:
    """Weights made under torch.inference_mode keep no version counter: packing and the output subset must not
    read one (loading a pair inside `with torch.inference_mode():` raised before)."""
    with torch.inference_mode():
        model = tiny_lm(32, seed=5, dtype=torch.bfloat16)
        model.pack_for_cpu()
        model.set_output_subset(torch.tensor(SUBSET))
        cache = model.new_cache(1, 16)
        logits = model.forward_cached_last(torch.tensor([[1, 2, 3]]), cache, torch.tensor([0]), torch.tensor([2]))
    assert logits.shape == (1, len(SUBSET)) and bool(torch.isfinite(logits).all())
