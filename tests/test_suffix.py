"""Suffix drafting: the index against its definition (`suffix_reference.py`), the drafts it builds, the drafter's
per-request and shared caches, and the planner letting lookups draft trees."""

from __future__ import annotations

import random
import tracemalloc

import pytest
import torch
from model_factory import draft_request
from planner_driver import batch
from suffix_reference import reference_find

from specsample import Engine, SamplingParams, SpecConfig
from specsample.config import TreeShape
from specsample.drafters.hybrid import HybridDrafter
from specsample.drafters.model import ModelDrafter
from specsample.drafters.suffix import SuffixDrafter
from specsample.drafters.suffix_index import WALK, Draft, SuffixIndex, best_draft, cap, draft_tree
from specsample.planner import FixedGamma, GammaController
from specsample.planner.base import DraftSource, RowState

LEVELS = (1, 2, 4)


def _found(index: SuffixIndex, context: list[int]) -> list[tuple[int, int, int]]:
    return [(o.seq, o.end, o.match) for o in index.find(context)]


def test_index_answers_as_its_definition_while_interleaved_sequences_grow() -> None:
    """Several sequences written a few tokens at a time in turn (as rows commit), over a small vocabulary so n-grams
    of every length repeat: every query, from any context, finds what the definition finds."""
    rng = random.Random(3)
    index = SuffixIndex(LEVELS, occurrences=3, longest=6)
    sequences: dict[int, list[int]] = {}
    order: list[tuple[int, int]] = []
    for step in range(400):
        seq = rng.randrange(5)
        if seq not in sequences:
            sequences[seq] = []
            index.add(seq)
        new = [rng.randrange(3) for _ in range(rng.randrange(4))]
        order += [(seq, len(sequences[seq]) + k - 1) for k in range(len(new)) if len(sequences[seq]) + k > 0]
        sequences[seq] += new
        index.extend(seq, new)
        context = sequences[seq] if step % 2 else [rng.randrange(3) for _ in range(rng.randrange(1, 9))]
        assert _found(index, context) == reference_find(sequences, order, context, LEVELS, 3, WALK, 6)
        assert list(index.tokens(seq)) == sequences[seq]


def test_a_bounded_index_drops_the_oldest_sequences_and_answers_as_if_it_never_held_them() -> None:
    rng = random.Random(5)
    index = SuffixIndex(LEVELS, capacity=60, occurrences=4, longest=5)
    sequences: dict[int, list[int]] = {}
    order: list[tuple[int, int]] = []
    for seq in range(40):
        tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 25))]
        index.add(seq, tokens[:2])
        index.extend(seq, tokens[2:])
        sequences[seq] = tokens
        order += [(seq, e) for e in range(len(tokens) - 1)]
        while sum(len(t) for t in sequences.values()) > 60:  # the oldest go first
            dropped = min(sequences)
            del sequences[dropped]
            order = [(s, e) for s, e in order if s != dropped]
        assert index.held == sum(len(t) for t in sequences.values()) <= 60
        assert all(s in index for s in sequences) and index.sequences == len(sequences)
        for _ in range(3):
            context = [rng.randrange(3) for _ in range(rng.randrange(1, 8))]
            assert _found(index, context) == reference_find(sequences, order, context, LEVELS, 4, WALK, 5)
    assert index.evicted == 40 - len(sequences)
    index.extend(0, [1, 2, 3])  # a dropped sequence takes nothing
    assert 0 not in index


def test_index_memory_estimate_follows_what_python_allocates() -> None:
    """The bytes /metrics reports are within 25% of what tracemalloc sees the index allocate."""
    rng = random.Random(0)
    vocabulary = [rng.randrange(49152) for _ in range(3000)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = SuffixIndex(capacity=2_000)
    for seq in range(12):
        index.add(seq, [rng.choice(vocabulary) for _ in range(250)])
    allocated = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert 0.75 < index.nbytes() / allocated < 1.25, (index.nbytes(), allocated)


CONTINUATIONS = [(5, 6, 7), (5, 6, 8), (5, 6, 7), (9,)]  # most recent first


@pytest.mark.parametrize(
    "nodes, depth, min_prob, chain, tokens, parents",
    [
        (8, 3, 0.1, False, (5, 6, 7, 9, 8), (-1, 0, 1, -1, 1)),  # 9 and 8 tie at 1/4: 9 came first (from the root)
        (8, 3, 0.3, False, (5, 6, 7), (-1, 0, 1)),  # nodes below 0.3 are left out
        (2, 3, 0.1, False, (5, 6), (-1, 0)),
        (8, 1, 0.1, False, (5, 9), (-1, -1)),
        (8, 3, 0.1, True, (5, 6, 7), (-1, 0, 1)),  # the path of most frequent children
        (8, 3, 0.6, True, (5, 6), (-1, 0)),
    ],
)
def test_draft_tree_takes_the_most_probable_continuations(nodes, depth, min_prob, chain, tokens, parents) -> None:
    draft = draft_tree(CONTINUATIONS, 4, nodes, depth, min_prob, chain)
    assert (draft.tokens, draft.parents, draft.match) == (tokens, parents, 4)
    probabilities = {5: 0.75, 6: 0.75, 7: 0.5, 9: 0.25, 8: 0.25}  # count over its parent's, times its parent's
    assert draft.probs == pytest.approx([probabilities[t] for t in tokens])
    assert draft.score == pytest.approx(sum(draft.probs))


def test_ties_go_to_the_more_recent_continuation_and_nothing_drafts_nothing() -> None:
    assert draft_tree([(1,), (2,)], 2, 8, 8, 0.1, chain=True).tokens == (1,)
    assert draft_tree([(2,), (1,)], 2, 8, 8, 0.1).tokens == (2, 1)
    assert draft_tree([], 2, 8, 8, 0.1) == Draft(match=2) and draft_tree([(1,)], 2, 0, 8, 0.1).tokens == ()


def test_the_longer_match_drafts_more_and_wins_where_it_scores_higher() -> None:
    """Tokens allowed grow with the match (factor x match + offset); of a query's occurrences, the ones matching
    furthest back are weighed against all of them."""
    assert [cap(m, 1.0, 2.0, 6) for m in (1, 2, 3, 4, 5)] == [3, 4, 5, 6, 6]
    assert cap(3, 0.5, 0.0, 8) == 1
    index = SuffixIndex((2,))
    # [1, 2] ended at 3 places; the context's [9, 1, 2] only at the first, then 7 7 7 7; elsewhere 3 then 4s
    index.add(0, [9, 1, 2, 7, 7, 7, 7, 0, 1, 2, 3, 4, 4, 4, 5, 1, 2, 3, 4, 4, 4])
    context = [8, 9, 1, 2]
    found = index.find(context)
    assert [(o.end, o.match) for o in found] == [(16, 2), (9, 2), (2, 3)]
    draft = best_draft(index, found, nodes=8, depth=8, factor=1.0, offset=2.0, min_prob=0.1)
    assert (draft.tokens, draft.match) == ((7, 7, 7, 7, 0), 3)  # one occurrence, five tokens at probability 1
    index = SuffixIndex((2,))
    index.add(0, [0, 1, 2, 3, 4, 4, 0, 1, 2, 3, 4, 4])
    index.add(1, [9, 1, 2, 7])  # the furthest match, but the text ends after one token
    found = index.find(context)
    assert [(o.seq, o.end, o.match) for o in found] == [(1, 2, 3), (0, 8, 2), (0, 2, 2)]
    draft = best_draft(index, found, nodes=8, depth=8, factor=1.0, offset=2.0, min_prob=0.1)
    # (7,) scores 1 at match 3; at match 2, 3 4 4 at 2/3 each and 7 (1/3, before 0 at 1/3: it came first)
    assert (draft.tokens, draft.parents, draft.match) == ((3, 4, 4, 7), (-1, 0, 1, -1), 2)


def _request(slots, reach, tree=None, lookup_trees=False, source=()):
    rows = len(slots)
    drafts = tuple(min(r, tree.depth) for r in reach) if tree is not None else tuple(reach)
    return draft_request(
        tuple(slots),
        drafts,
        tuple(reach),
        (SamplingParams(),) * rows,
        (torch.Generator(),) * rows,
        source=tuple(source),
        tree=tree,
        lookup_trees=lookup_trees,
    )


def test_a_row_drafts_from_its_own_text_and_from_what_other_requests_wrote() -> None:
    template = [90, 91, 92]  # the chat template's tail every prompt ends with
    for scope in ("global", "request"):
        drafter = SuffixDrafter(scope)
        drafter.allocate(4, 256)
        drafter.add_rows([0], [[1, 2, 3, 4, 1, 2]])  # its own text repeats: [1, 2] was followed by 3, 4, 1, 2
        assert drafter.lookup_lengths([0], [8]) == [4]  # a match of 2 drafts 2 x 1 + 2 tokens
        assert drafter.propose(_request([0], [3])).tokens[0].tolist() == [3, 4, 1]
        drafter.add_rows([1], [[7, 7] + template])
        drafter.commit([1], [[10, 11, 12, 13, 14, 15]])
        drafter.release_rows([1])  # a finished request: its output stays in the shared cache
        drafter.add_rows([2], [[8] + template])  # another client, the same template: its reply may repeat
        offered = drafter.lookup_lengths([2], [8])
        if scope == "global":
            assert offered == [5] and drafter.propose(_request([2], [5])).tokens[0].tolist() == [10, 11, 12, 13, 14]
            stats = drafter.suffix_cache()
            assert (stats.tokens, stats.sequences) == (6 + (5 + 6) + 4, 3) and stats.bytes > 0  # prompts < LEAD_IN
        else:
            assert offered == [0] and drafter.suffix_cache() is None
    drafter.allocate(4, 256)  # a new engine starts with an empty shared cache
    assert drafter.rows == {} and (drafter.shared is None or drafter.shared.held == 0)


def test_the_shared_cache_is_bounded_and_drops_the_oldest_outputs() -> None:
    drafter = SuffixDrafter(capacity=40)
    drafter.allocate(2, 256)
    for request in range(6):
        drafter.add_rows([0], [[request, 50, 51]])
        drafter.commit([0], [[60 + request] * 12])
        drafter.release_rows([0])
    stats = drafter.suffix_cache()
    assert stats.tokens <= 40 and stats.sequences == 2 and stats.evicted == 4 and stats.capacity == 40
    with pytest.raises(ValueError, match="scope"):
        SuffixDrafter("everyone")
    with pytest.raises(ValueError, match="capacity"):
        SuffixDrafter(capacity=0)


def test_proposals_are_chains_unless_the_round_lets_lookups_branch() -> None:
    drafter = SuffixDrafter("request")
    drafter.allocate(2, 256)
    # [1, 2, 3] was followed by 4 twice, by 5 once (each occurrence matching 3 tokens back)
    drafter.add_rows([0], [[7, 1, 2, 3, 4, 8, 1, 2, 3, 5, 6, 1, 2, 3, 4, 0, 1, 2, 3]])
    chain = drafter.propose(_request([0], [4]))
    assert chain.parents is None and chain.probs is None and chain.tokens[0].tolist() == [4, 0, 1, 2]
    tree = drafter.propose(_request([0], [6], lookup_trees=True, source=(DraftSource.LOOKUP,)))
    assert tree.num_drafted.tolist() == [5]  # a match of 3 drafts up to 3 + 2 tokens
    # best first: 4 (2/3), then at 1/3 the root's other child 5, 4's children 0 and 8 (0 more recent), 5's child 6
    assert tree.tokens[0, :5].tolist() == [4, 5, 0, 8, 6] and tree.parents[0, :5].tolist() == [-1, -1, 0, 0, 1]
    shaped = drafter.propose(_request([0], [4], tree=TreeShape(4, 2, 2)))
    assert shaped.parents is not None and max(_depth(shaped.parents[0].tolist()[:4])) <= 2
    assert drafter.propose(_request([0], [4], source=(DraftSource.MODEL,))).num_drafted.tolist() == [0]
    with pytest.raises(ValueError, match="no confidence"):
        drafter.propose(draft_request((0,), (1,), (3,), (SamplingParams(),), (torch.Generator(),)))


def _depth(parents: list[int]) -> list[int]:
    depths: list[int] = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    return depths


def test_hybrid_offers_gamma_auto_shorter_suffix_matches_than_it_takes_alone(tiny_draft) -> None:
    hybrid = HybridDrafter(ModelDrafter(tiny_draft), SuffixDrafter("request"))
    hybrid.allocate(2, 64)
    hybrid.add_rows([0], [[5, 6, 9, 1, 2, 3, 5, 6]])  # [5, 6] occurred before: a match of 2
    assert hybrid.lookup_lengths([0], [3]) == [3]
    proposal = hybrid.propose(_request([0], [3], source=(DraftSource.LOOKUP,)))
    assert proposal.probs is None and proposal.tokens[0].tolist() == [9, 1, 2]
    assert (
        hybrid.propose(_request([0], [3], source=(DraftSource.EITHER,))).probs is not None
    )  # alone it takes matches of 3
    hybrid.commit([0], [[9]])
    assert hybrid.propose(_request([0], [2], source=(DraftSource.EITHER,))).probs is None


def test_gamma_auto_lets_lookups_branch_only_where_every_drafting_row_is_a_lookup() -> None:
    controller = GammaController(4)
    lookups = batch(
        RowState("a", 100, lookup=4, drafts_otherwise=False),
        RowState("b", 100, lookup=3, drafts_otherwise=False),
        offers_lookups=True,
        can_tree=True,
    )
    assert controller.plan(lookups).lookup_trees
    assert not controller.plan(batch(*lookups.rows, offers_lookups=True)).lookup_trees  # the target scores no trees
    mixed = batch(
        RowState("a", 100, lookup=4, drafts_otherwise=False), RowState("c", 100), offers_lookups=True, can_tree=True
    )
    plan = controller.plan(mixed)
    assert plan.rows[1].drafts > 0 and plan.rows[1].source is DraftSource.MODEL and not plan.lookup_trees


def _decode(engine: Engine, prompt: list[int], params: SamplingParams) -> tuple[list[int], int]:
    """A request's tokens and the rounds it took."""
    engine.add_request(prompt, params)
    results = list(engine.stream())
    return [t for r in results for u in r.rows for t in u.new_tokens], len(results)


def test_a_repeated_request_drafts_from_the_shared_cache_and_decodes_as_plain(tiny_target) -> None:
    """A request repeating an earlier one drafts its reply from the shared cache, in far fewer rounds, and its greedy
    output is plain decoding's."""
    prompt, params = [5, 17, 3, 29, 11, 8, 2, 23, 14], SamplingParams(temperature=0, max_new_tokens=16)
    plain, _ = _decode(
        Engine(tiny_target, None, SpecConfig(speculative=False, max_batch_size=1, max_seq_len=32)), prompt, params
    )
    engine = Engine(tiny_target, SuffixDrafter(), SpecConfig(max_batch_size=1, max_seq_len=32), planner=FixedGamma(6))
    (first, first_rounds), (again, again_rounds) = _decode(engine, prompt, params), _decode(engine, prompt, params)
    assert first == again == plain
    assert again_rounds < 0.5 * first_rounds


def test_the_scope_is_a_checked_setting() -> None:
    """(Ray replicas get it too: tests/test_ray.py.)"""
    from specsample.cli import build_parser
    from specsample.config import SettingError
    from specsample.options import EngineOptions

    parser = build_parser()
    assert parser.parse_args(["serve"]).suffix_cache_scope == "global"
    assert parser.parse_args(["serve", "--suffix-cache-scope", "request"]).suffix_cache_scope == "request"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--suffix-cache-scope", "everyone"])
    with pytest.raises(SettingError, match="suffix_cache_scope must be one of request, global"):
        EngineOptions(suffix_cache_scope="everyone")


def test_metrics_read_the_shared_caches_of_every_drafter_serving_rows(tiny_draft) -> None:
    """The suffix cache gauges follow what the caches hold, summed over a routed drafter's generations (a draft
    replaced while rows of the old one run); zeros where no drafter holds one."""
    from prometheus_client.parser import text_string_to_metric_families

    from specsample.drafters.routed import RoutedDrafter
    from specsample.server.metrics import ServerMetrics

    def gauges(metrics: ServerMetrics) -> dict[str, float]:
        return {
            s.name.removeprefix("specsample_suffix_cache_"): s.value
            for f in text_string_to_metric_families(metrics.render().decode())
            for s in f.samples
            if s.name.startswith("specsample_suffix_cache_")
        }

    old = HybridDrafter(ModelDrafter(tiny_draft), SuffixDrafter(capacity=100))
    routed = RoutedDrafter(old)
    routed.allocate(4, 64)
    metrics = ServerMetrics()
    metrics.watch_suffix_cache(routed.suffix_cache)
    assert gauges(metrics) == {
        "tokens": 0,
        "sequences": 0,
        "bytes": gauges(metrics)["bytes"],
        "capacity_tokens": 100,
        "evicted_sequences": 0,
    }
    routed.add_rows([0], [[1, 2, 3]])
    routed.commit([0], [[4, 5]])
    routed.replace(SuffixDrafter(capacity=50))  # row 0 stays with the old drafter
    routed.add_rows([1], [[6, 7]])
    values = gauges(metrics)
    assert (values["tokens"], values["sequences"], values["capacity_tokens"]) == (5 + 2, 2, 150) and values["bytes"] > 0
    empty = ServerMetrics()
    empty.watch_suffix_cache(lambda: None)
    assert set(gauges(empty).values()) == {0.0}
