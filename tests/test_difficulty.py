"""Text difficulty for the draft and benchmark times adjusted for it (specsample.bench.difficulty)."""

from __future__ import annotations

import math
import random
import statistics

import pytest
import torch

from specsample.bench.difficulty import adjust_for_difficulty, text_acceptance, within_prompt_spread
from specsample.config import SamplingParams
from specsample.models.tiny import tiny_lm
from specsample.sampling import warp_probs

WARM = SamplingParams(temperature=0.7)


def test_text_acceptance_is_the_mean_overlap_of_the_two_distributions_on_the_reply() -> None:
    target, draft = tiny_lm(vocab_size=32, seed=1, init_scale=0.3), tiny_lm(vocab_size=32, seed=2, init_scale=0.3)
    prompt, reply = [3, 5, 7], [9, 11, 2, 4]
    assert text_acceptance(target, target, prompt, reply, WARM) == pytest.approx(1.0, abs=1e-5)  # a draft = target
    got = text_acceptance(target, draft, prompt, reply, WARM)
    tokens = torch.tensor([prompt + reply])
    with torch.inference_mode():  # by hand: the positions predicting reply tokens 1..4 are 2..5
        p = warp_probs(target.forward(tokens)[0, 2:6], WARM)
        q = warp_probs(draft.forward(tokens)[0, 2:6], WARM)
    assert got == pytest.approx(float(torch.minimum(p, q).sum(-1).mean()), rel=1e-5)
    assert 0.0 < got < 1.0
    # a reply's own tokens only: a different prompt or reply moves it
    assert text_acceptance(target, draft, prompt, reply[:2], WARM) != pytest.approx(got)
    assert math.isnan(text_acceptance(target, draft, prompt, [], WARM))
    with pytest.raises(ValueError, match="needs the prompt"):
        text_acceptance(target, draft, [], reply, WARM)


def test_a_draft_with_an_output_subset_is_scored_on_its_subset_only() -> None:
    target = tiny_lm(vocab_size=32, seed=1, init_scale=0.3)
    draft = tiny_lm(vocab_size=32, seed=1, init_scale=0.3)  # the target's own weights...
    draft.set_output_subset(torch.arange(16))  # ...proposing only tokens 0..15
    restricted = text_acceptance(target, draft, [3, 5, 7], [9, 11, 2, 4], WARM)
    assert restricted < 0.999  # the target's mass on tokens 16..31 can never be matched


def _runs(rng: random.Random, prompts: int = 30, samples: int = 4, easier: float = 0.0):
    """Target-only (one round per token) and four drafting systems (rounds per token 1 / (1 + gain x), x the
    text's acceptance) on one fixed set of prompts, every text drawn afresh from the prompt's distribution
    (gamma=2's `easier` than that: no lossless system's can be); each reply's rounds cost its prompt's price
    times its system's, with 2% timing noise per reply. Returns replies, acceptances, prompts, rounds."""
    layout = random.Random(99)  # the prompt set stays: only the texts are drawn anew
    prompt_set = [(layout.uniform(0.2, 0.4), layout.uniform(0.025, 0.035)) for _ in range(prompts)]  # ease, s/round
    systems = {"target-only": (0.0, 1.0), "gamma=1": (0.8, 1.25), "gamma=2": (1.2, 1.3), "gamma=3": (1.4, 1.45),
               "gamma=auto": (1.1, 1.3)}  # (gain, round price over a plain round's)
    replies: dict[str, list] = {name: [] for name in systems}
    difficulty: dict[str, dict[int, float]] = {name: {} for name in systems}
    rounds: dict[str, dict[int, tuple[int, float]]] = {name: {} for name in systems}
    for p, (ease, base) in enumerate(prompt_set):
        for k in range(samples):
            key = p + k * prompts
            for name, (gain, price) in systems.items():
                shift = easier if name == "gamma=2" else 0.0
                x = min(max(rng.gauss(ease + shift, 0.08), 0.0), 1.0)  # this system's own text
                count = 64 / (1 + gain * x)  # fractional: the expectation of the rounds such a text takes
                spent = count * base * price * rng.lognormvariate(0, 0.02)
                replies[name].append((key, "c", 64, spent + 0.05))  # with 50 ms of prefill
                difficulty[name][key] = x
                rounds[name][key] = (count, spent)
    return replies, difficulty, prompts, rounds


def _ratio(replies: dict[str, list]) -> float:
    """The drafting system's time over target-only's, all replies pooled."""
    return sum(r[3] for r in replies["gamma=2"]) / sum(r[3] for r in replies["target-only"])


def test_the_adjustment_keeps_each_system_where_it_was_and_narrows_the_spread() -> None:
    """Over many simulated runs the adjusted ratio is centred where the raw one is (the texts' luck has mean
    zero) and strays much less far; one reply's spread on its prompt drops to the box's timing noise."""
    rng = random.Random(0)
    raw, adjusted = [], []
    for _ in range(60):
        replies, difficulty, prompts, rounds = _runs(rng)
        fixed, betas = adjust_for_difficulty(replies, difficulty, prompts, rounds)
        raw.append(_ratio(replies))
        adjusted.append(_ratio(fixed))
        assert betas["target-only"] == 0.0  # a round per token, whatever the text
        assert betas["gamma=2"] < -0.4  # rounds per token per unit of acceptance: easier texts take fewer rounds
    assert statistics.fmean(adjusted) == pytest.approx(statistics.fmean(raw), abs=0.004)
    assert statistics.stdev(adjusted) < 0.6 * statistics.stdev(raw)
    # one reply's speed on its prompt: the text's luck (~7%) is gone, the 2% timing noise stays
    replies, difficulty, prompts, rounds = _runs(rng)
    before = within_prompt_spread(replies, prompts)
    after = within_prompt_spread(adjust_for_difficulty(replies, difficulty, prompts, rounds)[0], prompts)
    assert before["gamma=2"] > 0.05 and after["gamma=2"] < 0.03
    assert after["target-only"] == pytest.approx(before["target-only"], rel=1e-9)
    with pytest.raises(ValueError, match="prompts must be"):
        within_prompt_spread(replies, 0)
    # no texts scored, NaN scores or no rounds: replies stay as they were
    assert adjust_for_difficulty(replies, {}, prompts, rounds)[0] == replies
    nan = {name: {key: float("nan") for key in d} for name, d in difficulty.items()}
    assert adjust_for_difficulty(replies, nan, prompts, rounds)[0] == replies
    assert adjust_for_difficulty(replies, difficulty, prompts, {})[0] == replies
    with pytest.raises(ValueError, match="prompts must be"):
        adjust_for_difficulty(replies, difficulty, 0, rounds)


def test_the_centre_is_the_prompts_mean_over_every_systems_texts() -> None:
    """Were gamma=2's texts easier by 0.1 (lossless systems' cannot be: a check of where the centre sits), and
    faster for it, the prompt's centre moves by a fifth of that (one system in five) and four fifths of its gain
    are charged back; centred on its own texts' mean (or not adjusted) it would keep all of it."""
    replies, difficulty, prompts, rounds = _runs(random.Random(1))
    shifted = _runs(random.Random(1), easier=0.1)  # the same draws, gamma=2's texts 0.1 easier
    gained = _ratio(replies) - _ratio(shifted[0])
    kept = _ratio(adjust_for_difficulty(replies, difficulty, prompts, rounds)[0]) - _ratio(
        adjust_for_difficulty(*shifted)[0])
    assert gained > 0.05
    assert kept == pytest.approx(0.2 * gained, rel=0.15)
