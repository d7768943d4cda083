"""The draft window: a draft model attends to the first `sink` and the latest `recent` tokens of a long
context, and re-windows a row before its cache passes `limit` positions; the output stays exact."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from model_factory import draft_request

from specsample import Engine, SamplingParams, SpecConfig, generate
from specsample.drafters.hybrid import HybridDrafter
from specsample.drafters.model import DraftWindow, ModelDrafter
from specsample.drafters.ngram import NgramDrafter
from specsample.models.hub import SMOLLM2_DRAFT, builtin_draft
from specsample.planner import FixedGamma


def _propose(drafter, slots, reach, params, generators):
    """Each row drafts up to its reach, the round as wide as the widest."""
    return drafter.propose(draft_request(tuple(slots), tuple(reach), tuple(reach), tuple(params), tuple(generators)))


def test_view_keeps_the_sink_and_the_latest_tokens() -> None:
    window = DraftWindow(sink=2, recent=3, limit=9)
    assert window.view(list(range(10))) == ([0, 1, 7, 8, 9], 5)
    assert window.view([4, 5, 6]) == ([4, 5, 6], 0)  # short: all of it
    assert window.view(list(range(5))) == ([0, 1, 2, 3, 4], 0)
    assert DraftWindow(sink=0, recent=2, limit=6).view([1, 2, 3]) == ([2, 3], 1)


@pytest.mark.parametrize("fields", [dict(sink=-1), dict(recent=0), dict(sink=4, recent=4, limit=11)])
def test_bad_windows_are_errors(fields) -> None:
    with pytest.raises(ValueError):
        DraftWindow(**{"sink": 2, "recent": 4, "limit": 64, **fields})


def test_window_file(tmp_path) -> None:
    assert DraftWindow.from_folder(builtin_draft(SMOLLM2_DRAFT)) == DraftWindow(sink=32, recent=256, limit=512)
    assert DraftWindow.from_folder(tmp_path) is None and DraftWindow.from_folder(None) is None
    (tmp_path / "draft_window.json").write_text(json.dumps({"sink": 4, "recent": "many", "limit": 64}))
    with pytest.raises(ValueError, match="draft_window.json"):
        DraftWindow.from_folder(tmp_path)


def test_window_for_a_training_length(tmp_path) -> None:
    assert DraftWindow.trained_on(512) == DraftWindow(sink=32, recent=256, limit=512)  # the shipped draft's
    assert DraftWindow.trained_on(64) == DraftWindow(sink=4, recent=32, limit=64)
    assert DraftWindow.trained_on(4) is None  # too short to leave room to draft
    DraftWindow.trained_on(128).save(tmp_path, "a test")
    assert DraftWindow.from_folder(tmp_path) == DraftWindow(sink=8, recent=64, limit=128)


def _reference(tiny_draft, context: list[int]) -> ModelDrafter:
    """A whole-context drafter on exactly `context` (the windowed drafter's view plus its pending tokens)."""
    fresh = ModelDrafter(tiny_draft)
    fresh.allocate(1, 128)
    fresh.add_rows([0], [context])
    return fresh


@pytest.mark.parametrize("gamma", [1, 3])
def test_windowed_drafts_are_a_fresh_drafts_on_the_view(tiny_draft, gamma: int) -> None:
    """Round after round, through re-windowings: the same tokens and probabilities as a whole-context draft
    prefilled with only the sink and the kept tokens, and the cache never holds more than `limit`."""
    window = DraftWindow(sink=2, recent=5, limit=14)
    drafter = ModelDrafter(tiny_draft, window=window)
    drafter.allocate(1, 256)
    assert drafter.cache.max_len == window.limit  # the window bounds the cache, not the request
    prompt = [(5 * t + 1) % 32 for t in range(20)]
    drafter.add_rows([0], [prompt])
    params = [SamplingParams(temperature=1.0)]
    rewindows, skipped = 0, drafter._skipped[0]
    for round_ in range(24):
        proposal = _propose(drafter, [0], [gamma], params, [torch.Generator().manual_seed(round_)])
        history, skipped_now = drafter.history[0], drafter._skipped[0]
        rewindows += skipped_now != skipped
        skipped = skipped_now
        assert int(drafter.cache.lengths[0]) <= window.limit
        seen = history[: window.sink] + history[window.sink + skipped :]
        ref = _propose(_reference(tiny_draft, seen), [0], [gamma], params, [torch.Generator().manual_seed(round_)])
        assert proposal.tokens.tolist() == ref.tokens.tolist()
        assert torch.allclose(proposal.probs, ref.probs, atol=1e-10)
        drafts = proposal.tokens[0, : int(proposal.num_drafted[0])].tolist()
        accepted = round_ % (gamma + 1)  # a mix of rejections and full acceptance
        drafter.commit([0], [drafts[:accepted] + [(round_ * 7) % 32]])
    assert rewindows >= 3


def test_plain_rounds_then_a_probe_past_the_limit(tiny_draft) -> None:
    """A backlog from plain rounds that would pass the limit re-windows instead of overflowing."""
    window = DraftWindow(sink=2, recent=5, limit=14)
    drafter = ModelDrafter(tiny_draft, window=window)
    drafter.allocate(2, 256)
    drafter.add_rows([0, 1], [[1, 2, 3], [4, 5, 6, 7]])
    drafter.commit([0], [[(3 * t) % 32 for t in range(30)]])  # 30 tokens of plain rounds
    proposal = _propose(
        drafter,
        [0, 1],
        [2, 2],
        [SamplingParams(temperature=0)] * 2,
        [torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)],
    )
    assert proposal.num_drafted.tolist() == [2, 2]
    assert drafter._skipped[0] > 0 and int(drafter.cache.lengths[0]) <= window.limit


def test_a_window_too_small_for_gamma_shrinks_or_errs(tiny_draft) -> None:
    """A round of more drafts than a re-windowed row has room for keeps fewer recent tokens; none at all is an error."""
    drafter = ModelDrafter(tiny_draft, window=DraftWindow(sink=2, recent=4, limit=10))
    drafter.allocate(1, 64)
    drafter.add_rows([0], [list(range(1, 20))])
    params, gens = [SamplingParams(temperature=0)], [torch.Generator().manual_seed(0)]
    assert int(_propose(drafter, [0], [3], params, gens).num_drafted[0]) == 3  # room for 2 recent tokens
    assert int(drafter.cache.lengths[0]) <= 10 and drafter._skipped[0] == 19 - 2 - 2 - 2
    with pytest.raises(ValueError, match="does not fit the draft window"):
        _propose(drafter, [0], [6], params, gens)


PROMPTS = [[(3 * t + 1) % 32 for t in range(40)], [(5 * t) % 32 for t in range(9)], [1, 2, 3]]


@pytest.mark.parametrize("drafter", ["model", "hybrid"])
def test_windowed_greedy_equals_target_greedy(tiny_target, tiny_draft, drafter: str) -> None:
    window = DraftWindow(sink=2, recent=6, limit=16)
    model = ModelDrafter(tiny_draft, window=window)
    chosen = model if drafter == "model" else HybridDrafter(model, NgramDrafter(min_n=1), min_match=2)
    params = SamplingParams(temperature=0, max_new_tokens=40)
    plain = generate(tiny_target, PROMPTS, params, config=SpecConfig(speculative=False))
    spec = generate(tiny_target, PROMPTS, params, chosen, SpecConfig(max_batch_size=3), planner=FixedGamma(3))
    assert [c.token_ids for c in spec.completions] == [c.token_ids for c in plain.completions]
    assert spec.stats["drafted"] > 0


def test_engine_runs_long_requests_with_a_small_window(tiny_target, tiny_draft) -> None:
    """Batches, ragged acceptance, requests joining and leaving: the draft cache stays within its limit."""
    window = DraftWindow(sink=2, recent=6, limit=16)
    drafter = ModelDrafter(tiny_draft, window=window)
    engine = Engine(tiny_target, drafter, SpecConfig(max_batch_size=2, max_seq_len=128), planner=FixedGamma(4))
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, SamplingParams(temperature=1.0, max_new_tokens=50 + 10 * i, seed=i))
    tokens = 0
    while engine.has_work():
        result = engine.step()
        tokens += sum(len(u.new_tokens) for u in result.rows)
        assert int(drafter.cache.lengths.max()) <= window.limit
    assert tokens == 50 + 60 + 70


def test_load_drafter_reads_the_window_beside_the_weights(tmp_path) -> None:
    from model_factory import make_tokenizer, write_hf_model

    from specsample.models.loader import load_model
    from specsample.options import EngineOptions
    from specsample.pair import load_drafter

    tokenizer = make_tokenizer()
    target = load_model(str(write_hf_model(tmp_path / "t", "llama", tokenizer=tokenizer)), dtype="float32")
    folder = write_hf_model(tmp_path / "d", "llama", tokenizer=tokenizer, seed=3, num_hidden_layers=1)
    assert load_drafter(str(folder), target).window is None  # no file: the whole context
    (folder / "draft_window.json").write_text(json.dumps({"sink": 4, "recent": 16, "limit": 64}))
    saved = DraftWindow(sink=4, recent=16, limit=64)
    assert load_drafter(str(folder), target).window == saved
    assert load_drafter(str(folder), target, EngineOptions(draft_window="off")).window is None
    assert load_drafter(f"hybrid:{folder}", target).model.window == saved
    with pytest.raises(ValueError, match="draft_window must be one of"):
        EngineOptions(draft_window="on")


def test_a_swapped_draft_loads_like_the_first(tmp_path) -> None:
    """The server's /admin/draft loads the new draft with the pair's dtype, device and window mode."""
    from model_factory import make_tokenizer, write_hf_model

    from specsample.options import EngineOptions
    from specsample.pair import load_pair

    tokenizer = make_tokenizer()
    target = write_hf_model(tmp_path / "t", "llama", tokenizer=tokenizer)
    folder = write_hf_model(tmp_path / "d", "llama", tokenizer=tokenizer, seed=3, num_hidden_layers=1)
    DraftWindow(sink=4, recent=16, limit=64).save(folder, "a test")
    options = EngineOptions(target=str(target), draft=str(folder), dtype="float32")
    pair = load_pair(replace(options, draft_window="off"))
    assert pair.drafter.window is None
    swapped = pair.load_draft(str(folder))
    assert swapped.window is None and swapped.model.dtype == torch.float32
    assert load_pair(options).load_draft(str(folder)).window is not None
