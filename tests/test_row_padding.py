"""Scoring a round's tokens as a wider block where the target runs that faster: same output, clean caches."""

from __future__ import annotations

import pytest
import torch
from test_engine import PROMPTS, _fresh_cache_matches

import specsample.engine as engine_module
from specsample import Engine, ModelDrafter, SamplingParams, SpecConfig
from specsample.models.row_padding import fastest_widths, measure_target_widths
from specsample.planner import FixedGamma


def test_fastest_widths_pads_to_a_cheaper_wider_block() -> None:
    # 2 tokens dearer than 3 (the dev box's bfloat16 kernels); 4 a little dearer than 3
    assert fastest_widths([1.00, 1.10, 1.00, 1.02]) == (1, 3, 3, 4)
    # a gain under 3% is noise: no padding
    assert fastest_widths([1.00, 1.02, 1.00]) == (1, 2, 3)
    # ties go to the narrower block; monotone costs pad nothing
    assert fastest_widths([1.0, 1.2, 1.1, 1.1]) == (1, 3, 3, 4)
    assert fastest_widths([1.0, 1.1, 1.2]) == (1, 2, 3)
    # one token is never padded (plain decoding is the baseline)
    assert fastest_widths([1.1, 1.0, 1.0]) == (1, 2, 3)


class _Watched:
    """A model that records the widths it is asked to score and advances a fake clock by a cost per width
    (the real forward still runs)."""

    def __init__(self, model, cost: dict[int, float] | None = None) -> None:
        self.model, self.cost, self.now, self.widths = model, cost or {}, 0.0, []
        self.vocab_size, self.max_seq_len, self.device = model.vocab_size, model.max_seq_len, model.device
        self.new_cache, self.prefill = model.new_cache, model.prefill

    def forward_cached(self, tokens, cache, slots):
        self.widths.append(tokens.shape[1])
        self.now += self.cost.get(tokens.shape[1], 0.0)
        return self.model.forward_cached(tokens, cache, slots)


def test_measure_picks_the_cheapest_width(tiny_target) -> None:
    timed = _Watched(tiny_target, {1: 1.0, 2: 1.3, 3: 1.1, 4: 1.2, 5: 1.25})
    assert measure_target_widths(timed, 5, context=16, repeats=3, clock=lambda: timed.now) == (1, 3, 3, 4, 5)
    with pytest.raises(ValueError, match="max_tokens"):
        measure_target_widths(timed, 0)
    with pytest.raises(ValueError, match="repeats must be >= 2"):
        measure_target_widths(timed, 3, repeats=1)


def test_measure_pads_only_where_both_halves_agree(tiny_target) -> None:
    """A gain seen in one half of the repeats only (a noisy pass) pads nothing."""
    timed = _Watched(tiny_target, {1: 1.0, 2: 1.3, 3: 1.1})
    calls = {"n": 0}

    def forward(tokens, cache, slots, inner=timed.forward_cached):
        calls["n"] += 1
        if calls["n"] > 3 * 3:  # from the second half of the 4 repeats on (after a warm-up pass), 2 tokens are cheap
            timed.cost[2] = 1.0
        return inner(tokens, cache, slots)

    timed.forward_cached = forward
    assert measure_target_widths(timed, 3, context=16, repeats=4, clock=lambda: timed.now) == (1, 2, 3)


def test_measured_widths_fit_the_config(tiny_target) -> None:
    widths = measure_target_widths(tiny_target, 4, context=8, repeats=2)  # real timings: any valid table
    assert SpecConfig(target_widths=widths).target_widths == widths


@pytest.mark.parametrize("widths", [(1, 1), (1, 2, 2), (0,), (1, 2.5)])
def test_bad_widths_are_refused(widths) -> None:
    with pytest.raises(ValueError, match=r"target_widths\[\d\] \(the width to score"):
        SpecConfig(target_widths=widths)


def _decode(target, draft, gamma: int, widths: tuple[int, ...], params: SamplingParams) -> list[list[int]]:
    """Each prompt alone (padding applies at batch 1), checking the caches after every round. The cache is
    sized to the request exactly, as `generate` sizes it, so padding in the last rounds runs into its slack."""
    outputs = []
    for prompt in PROMPTS:
        drafter = ModelDrafter(draft)
        config = SpecConfig(max_batch_size=1, max_seq_len=len(prompt) + params.max_new_tokens, target_widths=widths)
        engine = Engine(target, drafter, config, planner=FixedGamma(gamma))
        rid = engine.add_request(prompt, params)
        tokens = list(prompt)
        while engine.has_work():
            for update in engine.step().rows:
                tokens.extend(update.new_tokens)
            for (
                slot
            ) in engine.scheduler.by_slot():  # the padding was rolled back: the cache is every token but the last
                assert int(engine.cache.lengths[slot]) == len(tokens) - 1
                _fresh_cache_matches(
                    target.model if isinstance(target, _Watched) else target, engine.cache, slot, tokens
                )
        outputs.append(tokens[len(prompt) :])
        assert rid not in engine.scheduler.by_slot().values()
    return outputs


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("gamma", [1, 2, 3])
def test_padding_changes_no_token(tiny_target, tiny_draft, gamma: int, temperature: float) -> None:
    params = SamplingParams(temperature=temperature, max_new_tokens=20, seed=5)
    plain = _decode(tiny_target, tiny_draft, gamma, (), params)
    spy = _Watched(tiny_target)
    widest = gamma + 6  # wider than any round of this gamma: more than the gamma + 2 positions of slack
    padded = _decode(spy, tiny_draft, gamma, (widest,) * widest, params)
    assert padded == plain
    assert spy.widths and set(spy.widths) == {widest}  # every round was padded (prompts prefill without logits)


def test_reading_the_padding_is_caught(tiny_target, tiny_draft, monkeypatch) -> None:
    """The test above has teeth: an engine that reads the logits of the padded positions changes the output."""
    params = SamplingParams(temperature=1.0, max_new_tokens=20, seed=5)
    plain = _decode(tiny_target, tiny_draft, 2, (), params)

    def wrong_positions(model, tokens, cache, slots, width, features=False):
        scored = tokens.shape[1]
        tokens = torch.cat([tokens, tokens[:, -1:].expand(-1, width - scored)], dim=1)
        return model.forward_cached(tokens, cache, slots)[:, -scored:], None

    monkeypatch.setattr(engine_module, "score_padded", wrong_positions)
    assert _decode(tiny_target, tiny_draft, 2, (8,) * 8, params) != plain


def test_batches_are_not_padded(tiny_target, tiny_draft) -> None:
    """The widths were measured at batch 1: a batch of rows scores what it asks."""
    spy = _Watched(tiny_target)
    engine = Engine(
        spy, ModelDrafter(tiny_draft), SpecConfig(max_batch_size=2, target_widths=(1, 8, 8)), planner=FixedGamma(2)
    )
    for prompt in PROMPTS[:2]:
        engine.add_request(prompt, SamplingParams(temperature=0, max_new_tokens=8))
    engine.step()
    assert spy.widths and max(spy.widths) <= 3
