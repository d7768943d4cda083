"""`compile_decode`: the compiled decode step (packages on a CPU, torch.compile with CUDA graphs on a GPU) computes what
the eager runtime computes."""

from __future__ import annotations

import pytest
import torch
from devices import DEVICE

import specsample.models.compiled as compiled_module
from specsample import SamplingParams, SpecConfig, generate
from specsample.models import compile_events
from specsample.models.base import prefill_ragged
from specsample.models.compiled import CompiledDecode
from specsample.models.llama import LlamaModel
from specsample.models.tiny import tiny_lm
from specsample.planner import FixedGamma

VOCAB = 64
SHIPPED = dict(compiled_module.CPU_INDUCTOR_CONFIG)
AUTOTUNING = (
    "max_autotune",
    "max_autotune_gemm_backends",
    "autotune_num_choices_displayed",
    "max_autotune_report_choices_stats",
)
QUICK = {k: v for k, v in SHIPPED.items() if k not in AUTOTUNING} | {"cpp_wrapper": False}


@pytest.fixture(scope="module", autouse=True)
def quick_compiles():
    """Inductor without kernel autotuning and with its Python wrapper: the same generated kernels and frozen weights,
    compiled in a fraction of the time."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compiled_module, "CPU_INDUCTOR_CONFIG", QUICK)
        yield


def twin(seed: int = 1, sliding_window: int | None = None) -> tuple[LlamaModel, LlamaModel]:
    """Two copies of the same random model: one eager, one with compile_decode."""
    eager, compiled = (
        tiny_lm(VOCAB, seed, init_scale=0.2, sliding_window=sliding_window, device=DEVICE) for _ in range(2)
    )
    compiled.compile_decode()
    return eager, compiled


@pytest.fixture(scope="module")
def pair() -> tuple[LlamaModel, LlamaModel]:
    return twin()


def count_compiled_calls(model: LlamaModel, monkeypatch) -> list[int]:
    calls = [0]
    original = type(model.compiled).__call__

    def counted(self, *args):
        calls[0] += 1
        return original(self, *args)

    monkeypatch.setattr(type(model.compiled), "__call__", counted)
    return calls


def decode_both(
    eager: LlamaModel, compiled: LlamaModel, prompts: list[list[int]], steps: int, max_len: int = 40
) -> float:
    """Greedy-decode ragged rows with both models; return the largest logit difference seen."""
    batch = len(prompts)
    caches = [eager.new_cache(batch, max_len), compiled.new_cache(batch, max_len)]
    slots = torch.arange(batch)
    for model, cache in zip((eager, compiled), caches):
        prefill_ragged(model, cache, slots, [p[:-1] for p in prompts])
    token = torch.tensor([[p[-1]] for p in prompts])
    worst = 0.0
    for _ in range(steps):
        eager_logits = eager.forward_cached(token, caches[0], slots)  # [b, 1, vocab]
        compiled_logits = compiled.forward_cached(token, caches[1], slots)
        worst = max(worst, float((eager_logits - compiled_logits).abs().max()))
        token = eager_logits[:, -1:].argmax(-1)
    assert torch.equal(caches[0].lengths, caches[1].lengths)
    return worst


@pytest.mark.parametrize(
    "prompts", [[[3, 4, 5]], [[3, 4, 5], [7, 8, 9, 10, 11, 12], [1]]], ids=["batch1", "ragged-batch3"]
)
@pytest.mark.slow
def test_logits_match_eager(pair, prompts, monkeypatch) -> None:
    eager, compiled = pair
    calls = count_compiled_calls(compiled, monkeypatch)
    worst = decode_both(eager, compiled, prompts, steps=6)
    assert calls[0] == 6  # the compiled step really ran
    assert worst < 1e-4


@pytest.mark.slow
@pytest.mark.packages  # a sliding-window architecture's packages are a build of their own
def test_sliding_window_matches_eager(monkeypatch) -> None:
    eager, compiled = twin(sliding_window=4)
    calls = count_compiled_calls(compiled, monkeypatch)
    assert decode_both(eager, compiled, [[1, 2, 3, 4, 5, 6, 7]], steps=8) < 1e-4
    assert calls[0] == 8


@pytest.mark.slow
def test_any_rows_of_the_cache_run_compiled(pair, monkeypatch) -> None:
    """One request alone in a bigger engine, rows with a gap between them (a batch after a row finished), rows out of
    slot order and rows in consecutive slots (read as views) all run the compiled step, with the eager step's
    logits; once each kind ran, other slots, batch sizes and longer contexts compile nothing more."""
    eager, compiled = pair
    calls = count_compiled_calls(compiled, monkeypatch)
    caches = [eager.new_cache(4, 24), compiled.new_cache(4, 24)]
    for model, cache in zip((eager, compiled), caches):
        prefill_ragged(model, cache, torch.arange(4), [[1, 2], [3, 4, 5], [6], [7, 8]])
    before = calls[0]
    kinds = ([0, 2], [2, 1], [1], [0, 1, 2])
    again = ([1, 3], [3, 0, 2], [0], [2], [1, 2], [0, 1, 2, 3])  # other slots and sizes of the same kinds
    for step, rows in enumerate(kinds + again):
        if step == len(kinds):
            graphs = compile_events.counts()[0]
        slots = torch.tensor(rows)
        tokens = torch.tensor([[7]] * len(rows))
        out = [m.forward_cached(tokens, c, slots) for m, c in zip((eager, compiled), caches)]
        assert calls[0] == before + step + 1, rows
        assert torch.allclose(out[0], out[1], atol=1e-5)
    assert compile_events.counts()[0] == graphs  # no recompile
    assert torch.equal(caches[0].lengths, caches[1].lengths)


@pytest.mark.slow
def test_forwards_the_step_cannot_take_are_counted(pair) -> None:
    """Token trees and blocks past MAX_BLOCK run eagerly on a compiled model, each counted as a fallback; prefill is
    eager by design and not counted."""
    eager, compiled = pair
    caches = [eager.new_cache(1, 40), compiled.new_cache(1, 40)]
    slots = torch.tensor([0])
    fallbacks = compile_events.counts()[1]
    for model, cache in zip((eager, compiled), caches):
        model.prefill(torch.tensor([[1, 2, 3]]), cache, slots)
    assert compile_events.counts()[1] == fallbacks
    long_block = torch.arange(compiled_module.MAX_BLOCK + 1).view(1, -1) % VOCAB
    out = [m.forward_cached(long_block, c, slots) for m, c in zip((eager, compiled), caches)]
    assert torch.allclose(out[0], out[1], atol=1e-5)
    tree = [
        m.forward_cached_tree(torch.tensor([[4, 5, 6]]), c, slots, torch.tensor([[-1, 0, 0]]))[0]
        for m, c in zip((eager, compiled), caches)
    ]
    assert torch.allclose(tree[0], tree[1], atol=1e-5)
    assert compile_events.counts()[1] == fallbacks + 2


@pytest.mark.slow
def test_in_place_weight_update_is_followed(pair) -> None:
    """An in-place weight update reaches the compiled step: read as it is (packages), or recompiled (torch.compile).
    (The module's pair: both copies get the update, so later tests still compare equal weights.)"""
    eager, compiled = pair
    decode_both(eager, compiled, [[1, 2, 3]], steps=1)  # compiled with the current weights
    with torch.no_grad():
        for model in (eager, compiled):
            model.layers[0].down.weight.mul_(3.0)
    assert compiled.compiled.stale() is isinstance(compiled.compiled, CompiledDecode)
    assert decode_both(eager, compiled, [[1, 2, 3]], steps=2) < 1e-4


@pytest.mark.slow
def test_greedy_generation_is_unchanged(pair) -> None:
    eager, compiled = pair
    draft_eager, draft_compiled = twin(seed=9)
    params = SamplingParams(temperature=0, max_new_tokens=12)
    prompts = [[5, 6, 7, 8]]
    reference = generate(eager, prompts, params, config=SpecConfig(speculative=False)).completions
    assert generate(compiled, prompts, params, config=SpecConfig(speculative=False)).completions == reference
    speculative = generate(compiled, prompts, params, draft=draft_compiled, config=SpecConfig(), planner=FixedGamma(3))
    assert speculative.completions == reference


def test_compile_needs_our_runtime(tmp_path) -> None:
    from model_factory import write_hf_model

    from specsample.models.loader import load_model

    folder = write_hf_model(tmp_path / "gemma", "gemma3")
    with pytest.raises(ValueError, match="compile needs our Llama-family runtime"):
        load_model(str(folder), compile=True)


def test_tiny_lm_unaffected() -> None:
    assert tiny_lm(VOCAB).compiled is None  # opt-in: nothing compiles unless asked


@pytest.mark.slow
def test_two_compiled_models_keep_their_own_weights(pair) -> None:
    """Same architecture, different weights (a target and its draft): neither may run the other's code."""
    first_eager, first = pair
    second_eager, second = twin(seed=12)
    assert decode_both(first_eager, first, [[1, 2, 3]], steps=2) < 1e-4
    assert decode_both(second_eager, second, [[1, 2, 3]], steps=2) < 1e-4
    assert decode_both(first_eager, first, [[4, 5]], steps=2) < 1e-4


@pytest.mark.slow
def test_output_subset_goes_through_the_compiled_head() -> None:
    """FR-Spec drafts: the compiled output layer honours the subset, and a new subset rebuilds it."""
    eager, compiled = twin(seed=13)
    for subset in ([0, 5, 9, 33, 63, 2], None):
        for model in (eager, compiled):
            model.set_output_subset(None if subset is None else torch.tensor(subset))
        caches = [eager.new_cache(1, 12), compiled.new_cache(1, 12)]
        slots = torch.arange(1)
        for model, cache in zip((eager, compiled), caches):
            model.prefill(torch.tensor([[1, 2]]), cache, slots)
        token = torch.tensor([[3]])
        for _ in range(3):
            expected, got = (m.forward_cached(token, c, slots) for m, c in zip((eager, compiled), caches))
            assert torch.equal(torch.isinf(expected), torch.isinf(got))  # the same tokens are excluded
            finite = torch.isfinite(expected)
            assert float((expected[finite] - got[finite]).abs().max()) < 1e-4
            token = expected[:, -1:].argmax(-1)
        if isinstance(compiled.compiled, CompiledDecode):
            assert compiled.compiled.head[0] is compiled.output_subset  # built for this subset
    with torch.no_grad():  # an in-place update of the output layer: the head's frozen copy must go
        for model in (eager, compiled):
            model.set_output_subset(torch.tensor([1, 4, 9, 60]))
            model.lm_head.weight.mul_(-1.5)
    caches = [eager.new_cache(1, 4), compiled.new_cache(1, 4)]
    expected, got = (
        m.forward_cached(torch.tensor([[3]]), c, torch.arange(1)) for m, c in zip((eager, compiled), caches)
    )
    assert torch.equal(torch.isinf(expected), torch.isinf(got))
    assert float((expected[torch.isfinite(expected)] - got[torch.isfinite(got)]).abs().max()) < 1e-4


@pytest.mark.slow
def test_warm_up_covers_what_generation_calls() -> None:
    """After the warm-up, generating compiles nothing more (a recompile costs ~70 s on SmolLM2),
    whether the token tensors come from the engine (inference mode) or from a caller outside it. (Recompiles follow
    dynamo's guards, which inductor's wrapper and autotuning do not change: the module's quick configuration.)"""
    model = tiny_lm(VOCAB, 21, init_scale=0.2, device=DEVICE)
    start = compile_events.counts()[0]
    model.compile_decode(warm_up=True, blocks=True)  # what a speculative setup warms
    graphs = compile_events.counts()[0]
    if isinstance(model.compiled, CompiledDecode):
        assert graphs - start == 4  # the step and the output layer, each for one token and for blocks
    else:
        assert graphs - start <= 2  # the packages' two graphs, unless an earlier test of the session built them
    generate(model, [[1, 2, 3]], SamplingParams(temperature=0, max_new_tokens=4), config=SpecConfig(speculative=False))
    cache, slots = model.new_cache(1, 10), torch.tensor([0])
    model.forward_cached(torch.tensor([[1, 2]]), cache, slots)
    model.forward_cached(torch.tensor([[3]]), cache, slots)  # a token tensor made outside inference mode
    model.forward_cached(torch.tensor([[4, 5]])[:, 1:], cache, slots)  # a slice of a longer one
    wide = model.new_cache(3, 12)  # one request in an engine with room for three
    with torch.inference_mode():
        model.forward_cached(torch.tensor([[1, 2]]), wide, torch.tensor([1]))
        model.forward_cached(torch.tensor([[3]]), wide, torch.tensor([1]))
    assert compile_events.counts()[0] == graphs


@pytest.mark.slow
def test_the_step_reads_the_cache_only_up_to_the_context(pair, monkeypatch) -> None:
    """Entries past the furthest row's position are never read (a server allocates the whole context window, and
    the step's cost must follow the context): NaN there leaves the logits those of a clean cache."""
    eager, compiled = pair
    calls = count_compiled_calls(compiled, monkeypatch)
    clean, poisoned = eager.new_cache(1, 64), compiled.new_cache(1, 64)
    poisoned.key_store.fill_(float("nan"))
    poisoned.value_store.fill_(float("nan"))
    slots = torch.tensor([0])
    for model, cache in ((eager, clean), (compiled, poisoned)):
        model.prefill(torch.tensor([[1, 2, 3]]), cache, slots)
    for tokens in ([[4]], [[5, 6, 7]]):  # a step and a block
        expected = eager.forward_cached(torch.tensor(tokens), clean, slots)
        got = compiled.forward_cached(torch.tensor(tokens), poisoned, slots)
        assert torch.allclose(got, expected, atol=1e-4)
    assert calls[0] == 2


@pytest.mark.slow
def test_blocks_of_tokens_match_eager(pair, monkeypatch) -> None:
    """A verification's block of tokens per row (ragged rows, any block length up to MAX_BLOCK) runs compiled,
    with the eager forward's logits and cache."""
    eager, compiled = pair
    calls = count_compiled_calls(compiled, monkeypatch)
    caches = [eager.new_cache(3, 48), compiled.new_cache(3, 48)]
    slots = torch.tensor([2, 0])
    for model, cache in zip((eager, compiled), caches):
        prefill_ragged(model, cache, slots, [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [6]])
    before = calls[0]
    for width in (2, 5, compiled_module.MAX_BLOCK):
        tokens = torch.randint(0, VOCAB, (2, width), generator=torch.Generator().manual_seed(width))
        out = [m.forward_cached(tokens, c, slots) for m, c in zip((eager, compiled), caches)]
        assert torch.allclose(out[0], out[1], atol=1e-4)
    assert calls[0] == before + 3
    assert torch.equal(caches[0].lengths, caches[1].lengths)
    assert torch.allclose(caches[0].key_store, caches[1].key_store, atol=1e-5)


@pytest.mark.slow
def test_a_feature_drafts_compiled_step_computes_the_eager_one(pair) -> None:
    """An EAGLE-3 head's drafting step through its compiled graph (`--compile`): the outputs and logits of the eager
    step, for ragged rows of its cache, and the cache grows alike."""
    from specsample.drafters.eagle import EagleDrafter
    from specsample.models.eagle_head import EagleHead, HeadConfig

    eager_target, _ = pair
    head = EagleHead(HeadConfig.for_target(eager_target.config, 16, (0, 1, 2)))
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in head.named_parameters():
            if not name.endswith("norm.weight"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    compiled = EagleDrafter(head, eager_target, compile=True)
    eager = EagleDrafter(head, eager_target)
    results = []
    for drafter in (eager, compiled):
        cache = head.new_cache(3, 16)
        slots = torch.tensor([2, 0])
        cache.lengths[slots] = torch.tensor([5, 3])
        hidden = torch.randn(2, 1, head.config.hidden_size, generator=torch.Generator().manual_seed(1))
        with torch.inference_mode():
            out, logits = drafter.step(torch.tensor([[4], [9]]), hidden, cache, slots)
            out2, logits2 = drafter.step(torch.tensor([[1], [2]]), out, cache, slots)
        results.append((out2, logits2, cache.lengths.clone()))
    (a, la, lengths_a), (b, lb, lengths_b) = results
    assert torch.equal(lengths_a, lengths_b) and lengths_a.tolist() == [5, 0, 7]
    assert torch.allclose(a, b, atol=1e-4) and torch.allclose(la, lb, atol=1e-4)


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_graphs_replay_the_eager_step() -> None:
    """On CUDA the compiled step and output layer run as CUDA graphs (none skipped), with the eager forward's logits,
    for one row and a batch, across the edge of a read bucket, the graphs' outputs copied out before the next
    replay overwrites them."""
    from torch._dynamo.utils import counters

    bucket = compiled_module.READ_BUCKET
    eager, compiled = (tiny_lm(VOCAB, 5, init_scale=0.2, device="cuda", max_seq_len=2 * bucket) for _ in range(2))
    compiled.compile_decode()
    caches = [m.new_cache(2, bucket + 8) for m in (eager, compiled)]
    for model, cache in zip((eager, compiled), caches):
        prefill_ragged(model, cache, torch.arange(2), [[1] * (bucket - 3), [2, 3]])
    skips = counters["inductor"]["cudagraph_skips"]
    kept = []
    for step in range(6):  # the first row's context crosses the bucket's edge
        for rows in ([0], [0, 1]):
            slots = torch.tensor(rows)
            tokens = torch.tensor([[step + 4]] * len(rows))
            out = [m.forward_cached(tokens, c, slots) for m, c in zip((eager, compiled), caches)]
            assert torch.allclose(out[0], out[1], atol=1e-4), (step, rows)
            kept.append((out[0], out[1].clone(), out[1]))
    assert all(torch.equal(copy, held) for _, copy, held in kept)  # no output overwritten by a later replay
    assert counters["inductor"]["cudagraph_skips"] == skips


def test_compiled_artefacts_go_to_the_specsample_cache(monkeypatch, tmp_path) -> None:
    """A compiled model keeps inductor's artefacts in the specsample cache, unless TORCHINDUCTOR_CACHE_DIR names
    another folder."""
    from specsample.models.hub import CACHE_ENV

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv(compiled_module.INDUCTOR_CACHE_ENV, "")  # so that the test's end restores the process's own
    monkeypatch.delenv(compiled_module.INDUCTOR_CACHE_ENV)
    CompiledDecode(tiny_lm(VOCAB, 3, device=DEVICE))  # nothing compiles before the first call
    assert compiled_module.keep_artefacts_in_cache() == tmp_path / "cache" / "compiled"
    monkeypatch.setenv(compiled_module.INDUCTOR_CACHE_ENV, str(tmp_path / "mine"))
    assert compiled_module.keep_artefacts_in_cache() == tmp_path / "mine"


def test_compiled_steps_hold_no_copy_of_a_layer() -> None:
    """The compiled steps run the models' own layers (`Block.forward`, `EagleHead.forward`): the module that builds
    them reaches no layer's projections or norms itself."""
    import inspect

    source = inspect.getsource(compiled_module)
    for part in ("qkv", "o_proj", "gate_up", ".down", "post_norm", "input_norm", "apply_rope"):
        assert part not in source, part
