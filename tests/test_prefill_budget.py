"""The per-round prefill budget: in tokens, and in time beside the decoding, each model's work priced as measured."""

from __future__ import annotations

import pytest

from specsample.prefill_budget import PROBE, PrefillPacer


def _rounds(pacer: PrefillPacer, cost, wanted: int, rounds: int) -> list[int]:
    """The target tokens granted per round, each round's chunk costing `cost(n)` seconds."""
    granted = []
    for _ in range(rounds):
        budget = pacer.round()
        n = budget.grant("target", wanted)
        budget.spend("target", n, cost(n))
        granted.append(n)
    return granted


def test_a_chunk_grows_to_what_the_time_allows() -> None:
    """A chunk costs 4 ms plus 0.5 ms a token and decoding 10 ms a round: at a ratio of 1.5 the chunks settle at 21
    tokens (14.5 ms; 22 would take the whole 15 ms), from a first probe of PROBE tokens."""
    pacer = PrefillPacer(time_ratio=1.5)
    pacer.learn_decoding(0.010)
    granted = _rounds(pacer, lambda n: 0.004 + 0.0005 * n, 10_000, 12)
    assert granted[0] == PROBE
    assert granted[-3:] == [21, 21, 21]


def test_every_round_prefills_a_token_however_dear() -> None:
    """A single token costing more than the budget is still granted, one per round once the cost is known (the prompt
    progresses)."""
    pacer = PrefillPacer(time_ratio=1.0)
    pacer.learn_decoding(0.010)
    assert _rounds(pacer, lambda n: 0.030 + 0.001 * n, 10_000, 8)[2:] == [1] * 6


def test_tokens_bound_the_target_only_and_the_time_bounds_both() -> None:
    pacer = PrefillPacer(max_tokens=8, time_ratio=1.0)
    pacer.learn_decoding(0.010)
    pacer.learn("target", 100, 0.010)  # 0.1 ms a token: the time would allow 100
    pacer.learn("draft", 100, 0.001)  # 10 us a unit
    budget = pacer.round()
    assert budget.grant("draft", 500) == 500
    budget.spend("draft", 500, 0.005)
    assert budget.grant("target", 100) == 8  # the tokens bound it
    budget.spend("target", 8, 0.004)
    assert budget.grant("draft", 1000) == 100  # 1 ms left at 10 us a unit
    assert budget.grant("target", 100) == 0  # spent: and the round already progressed


def test_without_a_decoding_time_only_tokens_bound() -> None:
    budget = PrefillPacer(max_tokens=32, time_ratio=1.0).round()
    assert budget.grant("target", 1000) == 32
    assert budget.grant("draft", 1000) == 1000


@pytest.mark.parametrize("max_tokens, time_ratio", [(0, None), (None, 0.0), (None, -1.0)])
def test_bad_budgets_are_refused(max_tokens, time_ratio) -> None:
    with pytest.raises(ValueError):
        PrefillPacer(max_tokens, time_ratio)
