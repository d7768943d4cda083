"""Prompt lookup: the rule (`ngram_reference.py`), `NgramIndex` against it, and `NgramDrafter`'s rows."""

from __future__ import annotations

import random

import pytest
import torch
from model_factory import draft_request
from ngram_reference import reference_continuation

from specsample import SamplingParams
from specsample.drafters.ngram import NgramDrafter, NgramIndex
from specsample.planner.base import DraftSource


def _indexed(history: list[int], max_tokens: int, min_n: int = 1, max_n: int = 4) -> tuple[list[int], int]:
    return NgramIndex(history, min_n, max_n).find(max_tokens)


FINDERS = pytest.mark.parametrize("find", [reference_continuation, _indexed], ids=["definition", "index"])


@FINDERS
def test_longest_match_wins(find) -> None:
    # suffix [7, 8, 9] occurs once (-> 1); suffix [8, 9] also occurs later (-> 5): the longer match wins
    history = [7, 8, 9, 1, 2, 3, 8, 9, 5, 6, 0, 7, 8, 9]
    assert find(history, 3, min_n=1, max_n=3) == ([1, 2, 3], 3)


@FINDERS
def test_most_recent_occurrence_wins_ties(find) -> None:
    history = [4, 5, 1, 1, 4, 5, 2, 2, 4, 5]
    assert find(history, 2, min_n=1, max_n=2) == ([2, 2], 2)


@FINDERS
def test_no_match_no_draft_and_limits(find) -> None:
    assert find([1, 2, 3, 4], 5, min_n=1, max_n=3) == ([], 0)
    assert find([1, 2, 3, 1, 2], 5, min_n=3, max_n=4) == ([], 0)  # only a 2-gram repeats
    assert find([1, 2, 3, 1, 2], 5, min_n=2, max_n=4) == ([3, 1, 2], 2)  # runs to the end
    assert find([1, 2, 3, 1, 2], 1, min_n=1, max_n=4) == ([3], 2)
    assert find([5], 3) == ([], 0)
    assert find([2, 2, 2, 2], 3, min_n=1, max_n=4) == ([2], 3)  # a match may overlap the suffix it matches


def test_ngram_drafter_needs_min_n_at_most_max_n() -> None:
    with pytest.raises(ValueError, match="min_n"):
        NgramDrafter(min_n=3, max_n=2)


def test_ngram_index_matches_its_definition_on_random_histories() -> None:
    rng = random.Random(7)
    for _ in range(3000):
        history = [rng.randrange(rng.randrange(1, 5)) for _ in range(rng.randrange(0, 25))]
        min_n = rng.randrange(1, 4)
        max_n, max_tokens = rng.randrange(min_n, 6), rng.randrange(0, 6)
        assert NgramIndex(history, min_n, max_n).find(max_tokens) == reference_continuation(
            history, max_tokens, min_n, max_n
        ), (history, max_tokens, min_n, max_n)


@pytest.mark.parametrize("min_n, max_n", [(1, 1), (1, 4), (2, 4), (3, 4), (3, 3)])
def test_ngram_index_answers_as_the_definition_while_tokens_arrive(min_n: int, max_n: int) -> None:
    # a small vocabulary repeats n-grams of every length; tokens arrive 0-3 at a time, as committed per round
    rng = random.Random(min_n * 10 + max_n)
    history = [rng.randrange(4) for _ in range(rng.randrange(1, 6))]
    index = NgramIndex(history, min_n, max_n)
    for _ in range(300):
        new = [rng.randrange(4) for _ in range(rng.randrange(4))]
        history += new
        index.extend(new)
        max_tokens = rng.randrange(1, 9)
        assert index.find(max_tokens) == reference_continuation(history, max_tokens, min_n, max_n)
        assert index.tokens == history


def test_ngram_drafter_rows_and_commit() -> None:
    drafter = NgramDrafter(min_n=1, max_n=3)
    drafter.add_rows([0, 3], [[1, 2, 3, 1, 2], [9, 8, 7]])
    gens = (torch.Generator(), torch.Generator())
    proposal = drafter.propose(draft_request((0, 3), (4, 4), (4, 4), (SamplingParams(),) * 2, gens))
    assert proposal.probs is None and proposal.num_drafted.tolist() == [3, 0]
    assert proposal.tokens[0, :3].tolist() == [3, 1, 2]
    drafter.commit([0, 3], [[3, 1], [9]])
    assert drafter.rows[3].tokens == [9, 8, 7, 9]
    # a row proposes up to its reach, in a proposal as wide as the round
    narrow = drafter.propose(draft_request((3,), (2,), (2,), (SamplingParams(),), gens[:1], width=4))
    assert narrow.tokens[0].tolist() == [8, 7, 0, 0] and narrow.num_drafted.tolist() == [2]


def test_rows_sent_away_from_their_lookup_propose_nothing() -> None:
    drafter = NgramDrafter(min_n=1, max_n=3)
    drafter.add_rows([0, 1], [[1, 2, 3, 1, 2], [4, 5, 4, 5]])
    gens = (torch.Generator(), torch.Generator())
    proposal = drafter.propose(
        draft_request(
            (0, 1), (3, 3), (3, 3), (SamplingParams(),) * 2, gens, source=(DraftSource.MODEL, DraftSource.LOOKUP)
        )
    )
    assert proposal.num_drafted.tolist() == [0, 2] and proposal.tokens[1, :2].tolist() == [4, 5]


def test_a_rows_lookup_follows_its_commits() -> None:
    ngram = NgramDrafter(min_n=1, max_n=2)
    ngram.add_rows([0], [[1, 2, 3, 1]])
    assert ngram.continuation(0, 3) == ([2, 3, 1], 1)
    assert ngram.continuation(0, 1) == ([2], 1)  # the same lookup, fewer tokens
    ngram.commit([0], [[2]])
    assert ngram.continuation(0, 3) == ([3, 1, 2], 2)
    ngram.add_rows([0], [[5, 6, 7, 8, 9]])  # a new row in the slot, history as long as the last one
    assert ngram.continuation(0, 3) == ([], 0)
