"""Prefix reuse across requests: a request sharing a finished one's prefix takes its row, prefills only the rest, and
decodes exactly what it would from scratch (greedy with a draft model, a windowed draft and the hybrid; seeded with
the hybrid and without a draft: a windowed draft's view of a reused row differs from a fresh one's, so its seeded
draws may differ, though not their distribution); kept rows are bounded and the least recently finished goes
first."""

from __future__ import annotations

import pytest
import torch

from specsample import Engine, ModelDrafter, SamplingParams, SpecConfig, tiny_lm
from specsample.drafters.hybrid import HybridDrafter
from specsample.drafters.model import DraftWindow
from specsample.drafters.ngram import NgramDrafter
from specsample.planner import FixedGamma
from specsample.scheduler import MIN_REUSED

VOCAB = 32
HISTORY = [(7 * i + 3) % VOCAB for i in range(60)]


@pytest.fixture(scope="module")
def models():
    return (
        tiny_lm(VOCAB, seed=1, init_scale=0.2, dtype=torch.float64),
        tiny_lm(VOCAB, seed=2, init_scale=0.2, num_layers=1, dtype=torch.float64),
    )


def drafter_for(kind: str, draft):
    return {
        "none": lambda: None,
        "model": lambda: ModelDrafter(draft),
        "window": lambda: ModelDrafter(draft, window=DraftWindow(sink=4, recent=16, limit=40)),
        "hybrid": lambda: HybridDrafter(ModelDrafter(draft), NgramDrafter(min_n=1), min_match=2),
    }[kind]()


def serve(engine: Engine, prompt: list[int], params: SamplingParams, scope: str = "") -> tuple[list[int], list]:
    engine.add_request(prompt, params, cache_scope=scope)
    tokens, stats = [], []
    for result in engine.stream():
        stats.append(result.stats)
        for update in result.rows:
            tokens.extend(update.new_tokens)
    return tokens, stats


@pytest.mark.parametrize(
    "kind, temperature", [("model", 0.0), ("window", 0.0), ("hybrid", 0.0), ("none", 0.9), ("hybrid", 0.9)]
)
def test_second_turn_reuses_the_prefix_and_decodes_the_same(models, kind: str, temperature: float) -> None:
    target, draft = models
    params = SamplingParams(temperature=temperature, max_new_tokens=10, seed=11)
    kept = Engine(
        target, drafter_for(kind, draft), SpecConfig(max_batch_size=2, prefix_cache_rows=2), planner=FixedGamma(3)
    )
    first, _ = serve(kept, HISTORY, params)
    follow_up = HISTORY + first + [5, 6, 7]  # the next turn: the history, the reply, a new message
    second, stats = serve(kept, follow_up, params)
    assert stats[0].prefix_hits == 1 and stats[0].reused_tokens == len(HISTORY) + len(first) - 1
    assert stats[0].admitted_tokens == len(follow_up) - 1
    fresh = Engine(target, drafter_for(kind, draft), SpecConfig(max_batch_size=2), planner=FixedGamma(3))
    again, fresh_stats = serve(fresh, follow_up, params)
    assert fresh_stats[0].prefix_hits == 0
    assert second == again


def test_kept_rows_are_bounded_least_recent_first(models) -> None:
    target, draft = models
    params = SamplingParams(temperature=0, max_new_tokens=4)
    engine = Engine(
        target, ModelDrafter(draft), SpecConfig(max_batch_size=1, prefix_cache_rows=2), planner=FixedGamma(3)
    )
    prompts = [[i] * 3 + HISTORY[i : i + 30] for i in range(3)]
    replies = [serve(engine, p, params)[0] for p in prompts]
    assert len(engine.scheduler.kept) == 2  # the first was dropped when the third finished
    _, stats = serve(engine, prompts[0] + replies[0] + [1], params)
    assert stats[0].prefix_hits == 0  # dropped
    _, stats = serve(engine, prompts[2] + replies[2] + [1], params)
    assert stats[0].prefix_hits == 1
    _, stats = serve(engine, prompts[1][: MIN_REUSED - 1] + [0, 0], params)  # too little shared to take a row
    assert stats[0].prefix_hits == 0
    assert engine.cache.num_slots == 3  # one running row and two kept, whatever ran


def test_nothing_is_kept_without_prefix_cache_rows(models) -> None:
    target, draft = models
    engine = Engine(target, ModelDrafter(draft), SpecConfig(max_batch_size=1), planner=FixedGamma(3))
    first, _ = serve(engine, HISTORY, SamplingParams(temperature=0, max_new_tokens=4))
    _, stats = serve(engine, HISTORY + first + [1], SamplingParams(temperature=0, max_new_tokens=4))
    assert stats[0].prefix_hits == 0 and not engine.scheduler.kept


def test_rows_are_reused_only_within_their_cache_scope(models) -> None:
    """B's request sharing A's whole history reuses nothing of A's and leaves A's kept row where it was: A's next turn
    still reuses it."""
    target, draft = models
    params = SamplingParams(temperature=0, max_new_tokens=4)
    engine = Engine(
        target, ModelDrafter(draft), SpecConfig(max_batch_size=1, prefix_cache_rows=2), planner=FixedGamma(3)
    )
    reply, _ = serve(engine, HISTORY, params, scope="A")
    _, stats = serve(engine, HISTORY + reply + [1], params, scope="B")
    assert stats[0].prefix_hits == 0 and stats[0].reused_tokens == 0
    _, stats = serve(engine, HISTORY + reply + [2], params, scope="A")
    assert stats[0].prefix_hits == 1 and stats[0].reused_tokens == len(HISTORY) + len(reply) - 1
