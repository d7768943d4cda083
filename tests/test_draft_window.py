"""The draft window: a draft model attends to the first `sink` and the latest `recent` tokens of a long
context, and re-windows a row before its cache passes `limit` positions; the output stays exact."""

from __future__ import annotations

import json

import pytest
import torch

from specsample import Engine, SamplingParams, SpecConfig, generate
from specsample.bench.replay import reply_logits
from specsample.drafters.hybrid import HybridDrafter
from specsample.drafters.model import DraftWindow, ModelDrafter
from specsample.drafters.ngram import NgramDrafter
from specsample.models.hub import SMOLLM2_DRAFT, builtin_draft


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
        proposal = drafter.propose([0], gamma, [gamma], params, [torch.Generator().manual_seed(round_)])
        history, skipped_now = drafter.history[0], drafter._skipped[0]
        rewindows += skipped_now != skipped
        skipped = skipped_now
        assert int(drafter.cache.lengths[0]) <= window.limit
        seen = history[: window.sink] + history[window.sink + skipped:]
        ref = _reference(tiny_draft, seen).propose([0], gamma, [gamma], params, [torch.Generator().manual_seed(round_)])
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
    proposal = drafter.propose([0, 1], 2, [2, 2], [SamplingParams(temperature=0)] * 2,
                               [torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)])
    assert proposal.num_drafted.tolist() == [2, 2]
    assert drafter._skipped[0] > 0 and int(drafter.cache.lengths[0]) <= window.limit


def test_a_window_too_small_for_gamma_shrinks_or_errs(tiny_draft) -> None:
    """A round of more drafts than a re-windowed row has room for keeps fewer recent tokens; none at all is an error."""
    drafter = ModelDrafter(tiny_draft, window=DraftWindow(sink=2, recent=4, limit=10))
    drafter.allocate(1, 64)
    drafter.add_rows([0], [list(range(1, 20))])
    params, gens = [SamplingParams(temperature=0)], [torch.Generator().manual_seed(0)]
    assert int(drafter.propose([0], 3, [3], params, gens).num_drafted[0]) == 3  # room for 2 recent tokens
    assert int(drafter.cache.lengths[0]) <= 10 and drafter._skipped[0] == 19 - 2 - 2 - 2
    with pytest.raises(ValueError, match="does not fit the draft window"):
        drafter.propose([0], 6, [6], params, gens)


PROMPTS = [[(3 * t + 1) % 32 for t in range(40)], [(5 * t) % 32 for t in range(9)], [1, 2, 3]]


@pytest.mark.parametrize("drafter", ["model", "hybrid"])
def test_windowed_greedy_equals_target_greedy(tiny_target, tiny_draft, drafter: str) -> None:
    window = DraftWindow(sink=2, recent=6, limit=16)
    model = ModelDrafter(tiny_draft, window=window)
    chosen = model if drafter == "model" else HybridDrafter(model, NgramDrafter(min_n=1), min_match=2)
    params = SamplingParams(temperature=0, max_new_tokens=40)
    plain = generate(tiny_target, PROMPTS, params, config=SpecConfig(speculative=False))
    spec = generate(tiny_target, PROMPTS, params, chosen, SpecConfig(gamma=3, max_batch_size=3))
    assert [c.token_ids for c in spec.completions] == [c.token_ids for c in plain.completions]
    assert spec.stats["drafted"] > 0


def test_engine_runs_long_requests_with_a_small_window(tiny_target, tiny_draft) -> None:
    """Batches, ragged acceptance, requests joining and leaving: the draft cache stays within its limit."""
    window = DraftWindow(sink=2, recent=6, limit=16)
    drafter = ModelDrafter(tiny_draft, window=window)
    engine = Engine(tiny_target, drafter, SpecConfig(gamma=4, max_batch_size=2, max_seq_len=128))
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, SamplingParams(temperature=1.0, max_new_tokens=50 + 10 * i, seed=i))
    tokens = 0
    while engine.has_work():
        result = engine.step()
        tokens += sum(len(u.new_tokens) for u in result.rows)
        assert int(drafter.cache.lengths.max()) <= window.limit
    assert tokens == 50 + 60 + 70


def test_reply_logits_sees_what_the_windowed_drafter_sees(tiny_draft) -> None:
    """The replay's teacher-forced draft logits: the window's view of the prompt, re-windowed at the limit."""
    window = DraftWindow(sink=2, recent=5, limit=14)
    prompt, reply = [(5 * t + 1) % 32 for t in range(20)], [(3 * t) % 32 for t in range(12)]
    logits = reply_logits(tiny_draft, prompt, reply, window)
    assert logits.shape == (12, 32)
    first = reply_logits(tiny_draft, window.view(prompt[:-1])[0] + prompt[-1:], reply[:7])
    assert torch.allclose(logits[:7], first, atol=1e-10)  # 7 kept + 7 fed = the limit
    context = prompt + reply[:7]
    second = reply_logits(tiny_draft, window.view(context[:-1])[0] + context[-1:], reply[7:])
    assert torch.allclose(logits[7:], second, atol=1e-10)
    assert torch.allclose(reply_logits(tiny_draft, prompt, reply), reply_logits(tiny_draft, prompt, reply, None))


def test_load_drafter_reads_the_window_beside_the_weights(tmp_path) -> None:
    from model_factory import make_tokenizer, write_hf_model
    from specsample.models.loader import load_model
    from specsample.pair import load_drafter

    tokenizer = make_tokenizer()
    target = load_model(str(write_hf_model(tmp_path / "t", "llama", tokenizer=tokenizer)), dtype="float32")
    folder = write_hf_model(tmp_path / "d", "llama", tokenizer=tokenizer, seed=3, num_hidden_layers=1)
    assert load_drafter(str(folder), target).window is None  # no file: the whole context
    (folder / "draft_window.json").write_text(json.dumps({"sink": 4, "recent": 16, "limit": 64}))
    saved = DraftWindow(sink=4, recent=16, limit=64)
    assert load_drafter(str(folder), target).window == saved
    assert load_drafter(str(folder), target, window="off").window is None
    assert load_drafter(f"hybrid:{folder}", target).model.window == saved
    assert load_drafter(str(folder), target, window=DraftWindow(sink=0, recent=8, limit=32)).window.recent == 8
    with pytest.raises(ValueError, match="draft window must be one of"):
        load_drafter(str(folder), target, window="on")


def test_a_swapped_draft_loads_like_the_first(tmp_path) -> None:
    """The server's /admin/draft loads the new draft with the pair's dtype, device and window mode."""
    from model_factory import make_tokenizer, write_hf_model
    from specsample.pair import load_pair

    tokenizer = make_tokenizer()
    target = write_hf_model(tmp_path / "t", "llama", tokenizer=tokenizer)
    folder = write_hf_model(tmp_path / "d", "llama", tokenizer=tokenizer, seed=3, num_hidden_layers=1)
    DraftWindow(sink=4, recent=16, limit=64).save(folder, "a test")
    pair = load_pair(str(target), str(folder), dtype="float32", draft_window="off")
    assert pair.drafter.window is None
    swapped = pair.load_draft(str(folder))
    assert swapped.window is None and swapped.model.dtype == torch.float32
    assert load_pair(str(target), str(folder), dtype="float32").load_draft(str(folder)).window is not None


def test_the_adaptive_benchmark_drafts_with_the_loaded_window(tiny_target, tiny_draft) -> None:
    """Every model drafter of benchmarks/adaptive.py carries the loaded draft's window (its first full run
    in session 19 built them from the model alone and drafted from the whole context), each its own."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from adaptive import SYSTEMS, make_systems

    window = DraftWindow(sink=2, recent=6, limit=16)
    systems = make_systems(list(SYSTEMS), tiny_target, ModelDrafter(tiny_draft, window=window), frozenset(), 64, ())
    assert [s.name for s in systems] == list(SYSTEMS)
    drafters = [s.drafter.model if isinstance(s.drafter, HybridDrafter) else s.drafter for s in systems]
    models = [d for d in drafters if isinstance(d, ModelDrafter)]
    # fixed gammas 1-8, their placebo copies, gamma auto kept and fresh, hybrid fixed, auto and auto offer3
    assert len(models) == 8 + 8 + 2 + 3 and all(d.window == window for d in models)
    offers = {s.name: s.drafter.offer_match for s in systems if isinstance(s.drafter, HybridDrafter)}
    assert offers == {"hybrid": 2, "hybrid auto": 2, "hybrid auto offer3": 3}  # the previous default, for comparison
    copies = [s for s in systems if s.name.endswith(" again") and s.drafter is not None]
    assert len(copies) == 8 and all(s.seed_offset for s in copies)  # the copies sample texts of their own
    assert not any(s.seed_offset for s in systems if s not in copies)
    assert len({id(d) for d in models}) == len(models)  # each system keeps its own cache and history
    assert [s.name for s in make_systems(["gamma=auto", "target-only", "gamma=1"], tiny_target, models[0],
                                         frozenset(), 64, ())] == ["target-only", "gamma=1", "gamma=auto"]


def test_the_adaptive_benchmark_passes_controller_knobs_to_gamma_auto(tiny_target, tiny_draft) -> None:
    """benchmarks/adaptive.py --controller: both gamma auto systems (the kept controller and the fresh one
    each run starts) get the knobs, with max_gamma the system's gamma; fixed gammas have no controller."""
    import sys
    from pathlib import Path

    from specsample.bench.run import controller_config

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from adaptive import make_systems

    knobs = controller_config("scored_fallback_margin=0.5,score_backlog=false")
    systems = {s.name: s for s in make_systems(["gamma=1", "gamma=auto", "gamma=auto fresh"], tiny_target,
                                               ModelDrafter(tiny_draft), frozenset(), 64, (), knobs)}
    kept = systems["gamma=auto"].controller
    assert kept.config.scored_fallback_margin == 0.5 and not kept.config.score_backlog and kept.config.max_gamma == 8
    assert systems["gamma=auto fresh"].controller is None and systems["gamma=1"].controller is None
    assert systems["gamma=auto fresh"].controller_config == kept.config
    record = systems["gamma=auto fresh"].run([[1, 2, 3]], SamplingParams(temperature=0, max_new_tokens=4))[0]
    assert len(record.tokens) == 4
    with pytest.raises(ValueError, match="ControllerConfig field"):
        controller_config("no_such_knob=1")
