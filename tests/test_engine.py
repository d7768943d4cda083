"""The engine loop: greedy equality, caches after rollback, ragged batches, seeds, bad input."""

from __future__ import annotations

import pytest
import torch
from model_factory import draft_request

from specsample import Engine, ModelDrafter, SamplingParams, SpecConfig, generate, tiny_lm
from specsample.models.base import prefill_ragged
from specsample.planner import FixedGamma

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [3], [10, 11, 12, 13, 14, 15, 16, 17, 18]]
GREEDY = SamplingParams(temperature=0, max_new_tokens=24)


def _tokens(result) -> list[list[int]]:
    return [c.token_ids for c in result.completions]


@pytest.fixture(scope="module")
def plain_greedy(tiny_target):
    return _tokens(generate(tiny_target, PROMPTS, GREEDY))


@pytest.mark.parametrize("gamma", range(1, 9))
def test_greedy_speculative_equals_target_only(tiny_target, tiny_draft, plain_greedy, gamma) -> None:
    batched = _tokens(
        generate(tiny_target, PROMPTS, GREEDY, draft=tiny_draft, config=SpecConfig(), planner=FixedGamma(gamma))
    )
    assert batched == plain_greedy
    alone = [
        _tokens(generate(tiny_target, [p], GREEDY, draft=tiny_draft, config=SpecConfig(), planner=FixedGamma(gamma)))[0]
        for p in PROMPTS
    ]
    assert alone == plain_greedy


def test_ragged_rows_equal_rows_run_alone(tiny_target, tiny_draft) -> None:
    # different prompt lengths and budgets: rows finish at different rounds
    params = [SamplingParams(temperature=0, max_new_tokens=n) for n in (5, 17, 9, 30)]
    batched = _tokens(
        generate(tiny_target, PROMPTS, params, draft=tiny_draft, config=SpecConfig(), planner=FixedGamma(4))
    )
    for prompt, p, out in zip(PROMPTS, params, batched):
        assert out == _tokens(generate(tiny_target, [prompt], p))[0]
        assert len(out) == p.max_new_tokens


def test_identical_draft_accepts_every_token(tiny_target) -> None:
    params = SamplingParams(temperature=0.9, max_new_tokens=40, seed=3)
    result = generate(tiny_target, PROMPTS, params, draft=tiny_target, config=SpecConfig(), planner=FixedGamma(5))
    assert result.stats["drafted"] > 0
    assert result.stats["accepted"] == result.stats["drafted"]


def test_same_seed_same_output(tiny_target, tiny_draft) -> None:
    params = SamplingParams(temperature=1.0, max_new_tokens=30, seed=11)
    first = generate(tiny_target, PROMPTS, params, draft=tiny_draft)
    second = generate(tiny_target, PROMPTS, params, draft=tiny_draft)
    assert _tokens(first) == _tokens(second)
    other = generate(
        tiny_target, PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=30, seed=12), draft=tiny_draft
    )
    assert _tokens(first) != _tokens(other)
    # a seeded request gives the same tokens whatever else shares its batch (row 1 got seed 12 + 1)
    alone = generate(
        tiny_target, [PROMPTS[1]], [SamplingParams(temperature=1.0, max_new_tokens=30, seed=13)], draft=tiny_draft
    )
    assert _tokens(alone)[0] == _tokens(other)[1]


def test_eos_stops_a_row(tiny_target, tiny_draft, plain_greedy) -> None:
    eos = plain_greedy[0][5]
    result = generate(tiny_target, PROMPTS[:1], GREEDY, draft=tiny_draft, eos_token_ids=[eos])
    completion = result.completions[0]
    assert completion.token_ids == plain_greedy[0][: plain_greedy[0].index(eos) + 1]
    assert completion.finish_reason == "stop"


def _fresh_cache_matches(model, cache, slot: int, tokens: list[int]) -> None:
    """Cache rows [0, len) equal a fresh prefill of `tokens[:len]`."""
    length = int(cache.lengths[slot])
    fresh = model.new_cache(1, length + 1)
    prefill_ragged(model, fresh, torch.tensor([0]), [tokens[:length]])
    for layer in range(len(cache.keys)):
        assert torch.allclose(cache.keys[layer][slot, :, :length], fresh.keys[layer][0, :, :length], atol=1e-12)
        assert torch.allclose(cache.values[layer][slot, :, :length], fresh.values[layer][0, :, :length], atol=1e-12)


def test_a_ragged_prefill_fits_a_row_with_little_room_beside_a_long_one(tiny_target) -> None:
    """A row near the end of its cache with a short rest, prefilled beside a long new prompt, cannot take the long
    one's right-padding: it is prefilled apart, and both rows hold what a prefill alone gives."""
    first, long = [(5 * i + 1) % 32 for i in range(26)], [(3 * i + 2) % 32 for i in range(20)]
    cache = tiny_target.new_cache(2, 30)
    prefill_ragged(tiny_target, cache, torch.tensor([0]), [first[:24]])
    features = prefill_ragged(tiny_target, cache, torch.tensor([0, 1]), [first[24:], long], features=True)
    assert features is not None and [len(f) for f in features] == [2, 20]
    assert cache.lengths.tolist() == [26, 20]
    _fresh_cache_matches(tiny_target, cache, 0, first)
    _fresh_cache_matches(tiny_target, cache, 1, long)


def test_caches_equal_fresh_prefill_after_rejections(tiny_target, tiny_draft) -> None:
    drafter = ModelDrafter(tiny_draft)
    engine = Engine(tiny_target, drafter, SpecConfig(max_batch_size=4, max_seq_len=128), planner=FixedGamma(4))
    ids = [
        engine.add_request(p, SamplingParams(temperature=1.0, max_new_tokens=60, seed=i)) for i, p in enumerate(PROMPTS)
    ]
    outputs = {i: list(p) for i, p in zip(ids, PROMPTS)}
    rejections = 0
    for _ in range(6):
        result = engine.step()
        for update in result.rows:
            outputs[update.request_id].extend(update.new_tokens)
            rejections += update.num_accepted < update.num_drafted
        for slot, row in engine.scheduler.by_slot().items():
            tokens = outputs[row.request_id]
            # the target cache holds every committed token but the last (the next round's input)
            assert int(engine.cache.lengths[slot]) == len(tokens) - 1
            _fresh_cache_matches(tiny_target, engine.cache, slot, tokens)
            # the draft holds a prefix of the same tokens and lacks at most the last draft and the
            # recovered/bonus token, which it is fed at the start of the next round
            assert drafter.history[slot] == tokens
            assert int(drafter.cache.lengths[slot]) >= len(tokens) - 2
            _fresh_cache_matches(tiny_draft, drafter.cache, slot, tokens)
    assert rejections > 0, "the test needs rounds with rejections"


def test_plain_mode_uses_the_same_loop(tiny_target, tiny_draft, plain_greedy) -> None:
    off = generate(tiny_target, PROMPTS, GREEDY, draft=tiny_draft, config=SpecConfig(speculative=False))
    assert _tokens(off) == plain_greedy
    assert off.stats["drafted"] == 0 and off.stats["tokens_per_round"] == 1.0


def test_round_stats(tiny_target, tiny_draft) -> None:
    engine = Engine(tiny_target, ModelDrafter(tiny_draft), SpecConfig(max_batch_size=2), planner=FixedGamma(3))
    engine.add_request([1, 2], SamplingParams(temperature=1.0, max_new_tokens=20, seed=0))
    engine.add_request([3, 4, 5], SamplingParams(temperature=1.0, max_new_tokens=20, seed=1))
    stats = engine.step().stats
    assert stats.batch_size == 2 and stats.gamma == 3 and stats.drafted == 6
    assert stats.drafted_per_position == (2, 2, 2)
    assert sum(stats.accepted_per_position) == stats.accepted
    assert stats.emitted == stats.accepted + 2
    assert stats.draft_seconds > 0 and stats.target_seconds > 0


def test_round_stats_count_what_compiled_models_did(tiny_target, monkeypatch) -> None:
    """A round's recompiles and eager fallbacks are the compile events of its own forwards (models/compile_events.py):
    here every target forward reports one of each; the prefill of admission, which is eager by design, none."""
    from specsample.models import compile_events

    scored = []
    real = type(tiny_target).forward_cached

    def forward_cached(self, tokens, cache, slots):
        scored.append(len(slots))
        compile_events.graph_compiled()
        compile_events.fell_back()
        return real(self, tokens, cache, slots)

    monkeypatch.setattr(type(tiny_target), "forward_cached", forward_cached)
    engine = Engine(tiny_target, None, SpecConfig(max_batch_size=2, speculative=False))
    engine.add_request([1, 2, 3], SamplingParams(temperature=0, max_new_tokens=3))
    stats = [engine.step().stats for _ in range(3)]
    assert len(scored) == 3 and [(s.recompiles, s.eager_fallbacks) for s in stats] == [(1, 1)] * 3
    compile_events.graph_compiled()  # outside a round: no round's
    assert engine.step().stats.recompiles == 0  # the request finished: a round without rows


def test_cancel_frees_the_slot(tiny_target, tiny_draft) -> None:
    engine = Engine(tiny_target, ModelDrafter(tiny_draft), SpecConfig(max_batch_size=1), planner=FixedGamma(3))
    first = engine.add_request([1, 2], SamplingParams(max_new_tokens=50, seed=0))
    second = engine.add_request([3, 4], SamplingParams(max_new_tokens=5, seed=0))
    engine.step()
    assert engine.num_running == 1 and engine.num_waiting == 1
    engine.cancel(first)
    result = engine.step()
    assert any(u.request_id == first and u.finish_reason == "cancelled" for u in result.rows)
    assert any(u.request_id == second for u in result.rows)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda t, d: generate(t, [[]], SamplingParams()), "prompt is empty"),
        (
            lambda t, d: generate(t, [[1]], SamplingParams(), draft=d, config=SpecConfig(), planner=FixedGamma(0)),
            "gamma",
        ),
        (lambda t, d: generate(t, [[1]], SamplingParams(temperature=-1)), "temperature"),
        (lambda t, d: generate(t, [[1]], SamplingParams(top_p=0)), "top_p"),
        (lambda t, d: generate(t, [[1]], SamplingParams(top_k=0)), "top_k"),
        (lambda t, d: generate(t, [[1]], SamplingParams(), draft=tiny_lm(33)), "vocabulary"),
        (lambda t, d: generate(t, [[99]], SamplingParams()), "outside the vocabulary"),
        (lambda t, d: generate(t, [[1] * 500], SamplingParams(max_new_tokens=100)), "context window"),
        (lambda t, d: generate(t, [], SamplingParams()), "no prompts"),
    ],
)
def test_bad_input_raises_value_error(tiny_target, tiny_draft, make, message) -> None:
    with pytest.raises(ValueError, match=message):
        make(tiny_target, tiny_draft)


class _BrokenAdmission(ModelDrafter):
    def add_rows(self, slots, prompts):
        raise RuntimeError("out of memory (simulated)")


def test_failed_admission_returns_its_slots(tiny_target, tiny_draft) -> None:
    engine = Engine(tiny_target, _BrokenAdmission(tiny_draft), SpecConfig(max_batch_size=2), planner=FixedGamma(3))
    engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=4))
    with pytest.raises(RuntimeError, match="out of memory"):
        engine.step()
    assert list(engine.scheduler.free) == [0, 1] and engine.num_running == 0
    assert int(engine.cache.lengths.sum()) == 0


def test_decoding_accepts_any_attention_output_layout(tiny_target, monkeypatch) -> None:
    """CUDA's SDPA returns its output in a transposed memory layout; decoding must not assume contiguity."""
    import torch.nn.functional as F

    reference = _tokens(generate(tiny_target, PROMPTS, GREEDY))
    original = F.scaled_dot_product_attention

    def cuda_layout(*args, **kwargs):
        out = original(*args, **kwargs)
        return out.transpose(1, 2).contiguous().transpose(1, 2)  # same values, dims 1 and 2 swapped in memory

    monkeypatch.setattr(F, "scaled_dot_product_attention", cuda_layout)
    assert _tokens(generate(tiny_target, PROMPTS, GREEDY)) == reference


def test_a_draft_row_that_stopped_early_keeps_its_last_committed_token_unfed(tiny_target) -> None:
    """In a batch where one row drafts further than another, the short row's cache is fed filler past its drafts;
    when that filler equals what the verifier commits, the row must still lack its last token (the next round's
    first forward feeds it), or the next proposal has nothing to score."""
    drafter = ModelDrafter(tiny_target)
    drafter.allocate(2, 64)
    drafter.add_rows([0, 1], [[1, 2, 3], [4, 5, 6]])
    greedy = SamplingParams(temperature=0.0)
    generators = [torch.Generator().manual_seed(i) for i in range(2)]
    proposal = drafter.propose(draft_request((0, 1), (1, 3), (1, 3), (greedy, greedy), tuple(generators)))
    assert proposal.num_drafted.tolist() == [1, 3]
    filler = drafter._drafted[0][1]  # what row 0's cache was fed after its only draft
    drafter.commit([0, 1], [[int(proposal.tokens[0, 0]), filler], [int(proposal.tokens[1, 0])]])
    for slot in (0, 1):
        assert drafter._fed(slot) < len(drafter.history[slot])
    again = drafter.propose(draft_request((0, 1), (2, 2), (2, 2), (greedy, greedy), tuple(generators)))
    assert again.num_drafted.tolist() == [2, 2]
