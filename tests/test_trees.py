"""Token trees through the engine: greedy output is the target's with every drafter, both caches keep exactly the
accepted path, the tree settings, and how fixed gamma and gamma auto plan tree rounds (gamma auto on a simulated
engine where trees pay and where they do not). Exactness at T > 0 is in test_exactness.py."""

from __future__ import annotations

import random

import pytest
import torch
from model_factory import draft_request
from planner_driver import UNLIMITED, batch, learn
from test_eagle import PROMPTS, _greedy_proposal, random_head

from specsample import Engine, ModelDrafter, SamplingParams, SpecConfig, generate, tiny_lm
from specsample.config import SettingError, TreeShape
from specsample.drafters.eagle import EagleDrafter
from specsample.drafters.hybrid import HybridDrafter
from specsample.drafters.ngram import NgramDrafter, trie
from specsample.planner import FixedGamma, GammaController
from specsample.planner.base import BatchState, RowOutcome, RowState
from specsample.planner.trees import budgets
from specsample.theory import expected_tokens_per_round

VOCAB = 48
TREE = TreeShape(8, 3, 4)


@pytest.fixture(scope="module")
def target():
    return tiny_lm(VOCAB, seed=3, init_scale=0.2, dtype=torch.float64)


def drafters(target) -> dict:
    draft = tiny_lm(VOCAB, seed=5, init_scale=0.2, num_layers=1, dtype=torch.float64)
    return {
        "lookup": lambda: NgramDrafter(min_n=1),
        "model": lambda: ModelDrafter(draft),
        "target_as_draft": lambda: ModelDrafter(target),
        "feature": lambda: EagleDrafter(random_head(target), target),
        "hybrid": lambda: HybridDrafter(EagleDrafter(random_head(target), target), NgramDrafter(min_n=1), min_match=2),
    }


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "auto"])
def test_greedy_trees_give_the_targets_output(target, adaptive: bool) -> None:
    """Every drafter, ragged rows, a fixed tree and gamma auto's trees: the target's greedy tokens."""
    params = SamplingParams(temperature=0, max_new_tokens=20)
    reference = [c.token_ids for c in generate(target, PROMPTS, params).completions]
    for name, make in drafters(target).items():
        config = SpecConfig(max_batch_size=3)
        planner = GammaController(4, TREE) if adaptive else FixedGamma(4, TREE)
        result = generate(target, PROMPTS, params, draft=make(), config=config, planner=planner)
        assert [c.token_ids for c in result.completions] == reference, name
    # the target drafting for itself, every node kept: each tree's spine is the target's greedy path, accepted whole
    engine = Engine(target, ModelDrafter(target), SpecConfig(), planner=FixedGamma(4, TreeShape(12, 3, 4)))
    engine.add_request(PROMPTS[0], params)
    rounds = [(u.num_drafted, u.num_accepted) for result in engine.stream() for u in result.rows]
    assert rounds[:2] == [(12, 4), (12, 4)], rounds


def _cache_matches_a_fresh_prefill(target, engine: Engine) -> None:
    """Each running row's next-token logits from the engine's cache equal those of the target over its whole text."""
    for slot, row in engine.scheduler.by_slot().items():
        text = row.prompt + row.output
        assert int(engine.cache.lengths[slot]) == len(text) - 1  # the last token is pending
        cached = target.forward_cached(torch.tensor([[text[-1]]]), engine.cache, torch.tensor([slot]))[0, -1]
        engine.cache.truncate(torch.tensor([slot]), torch.tensor([len(text) - 1]))
        fresh = target(torch.tensor([text]))[0, -1]
        assert torch.allclose(cached, fresh, atol=1e-9), slot


def test_both_caches_keep_the_accepted_path(target) -> None:
    """Tree rounds at temperature 1 whose accepted paths run through side branches, in a ragged batch: the target's
    cache scores as a fresh prefill of the committed text, and the feature draft proposes as a fresh head on it."""
    head = random_head(target, scale=0.05)
    with torch.no_grad():  # the target's output layer: proposals it accepts now and then
        head.lm_head.weight.copy_(target.lm_head.weight)
    running = EagleDrafter(head, target)
    engine = Engine(target, running, SpecConfig(max_batch_size=3, max_seq_len=64), planner=FixedGamma(4, TREE))
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(prompt, SamplingParams(temperature=1.0, max_new_tokens=40, seed=i))
    side_paths = 0
    for _ in range(10):
        result = engine.step()
        side_paths += sum(u.num_accepted > 0 for u in result.rows)
        _cache_matches_a_fresh_prefill(target, engine)
    assert side_paths > 0
    greedy = SamplingParams(temperature=0)
    for slot in engine.scheduler.by_slot():
        history = running.rows[slot].history
        got = running.propose(draft_request((slot,), (3,), (3,), (greedy,), (torch.Generator(),))).probs
        running.commit([slot], [[]])  # roll the proposal back
        assert torch.allclose(got, _greedy_proposal(EagleDrafter(head, target), target, history), atol=1e-9), slot


def test_the_draft_model_drafts_as_a_fresh_one_after_tree_rounds(target) -> None:
    """Tree rounds at temperature 1 in a ragged batch feed the draft model its spine while a side branch may be
    accepted: afterwards its history is the committed text and its next chain equals a fresh drafter's on it."""
    draft = tiny_lm(VOCAB, seed=5, init_scale=0.2, num_layers=1, dtype=torch.float64)
    running = ModelDrafter(draft)
    engine = Engine(target, running, SpecConfig(max_batch_size=3, max_seq_len=64), planner=FixedGamma(4, TREE))
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(prompt, SamplingParams(temperature=1.0, max_new_tokens=30, seed=i))
    for _ in range(6):
        engine.step()
    greedy = SamplingParams(temperature=0)
    assert engine.scheduler.by_slot()
    for slot, row in engine.scheduler.by_slot().items():
        text = row.prompt + row.output
        assert running.history[slot] == text
        got = running.propose(draft_request((slot,), (3,), (3,), (greedy,), (torch.Generator(),)))
        fresh = ModelDrafter(draft)
        fresh.allocate(1, 64)
        fresh.add_rows([0], [text])
        expected = fresh.propose(draft_request((0,), (3,), (3,), (greedy,), (torch.Generator(),)))
        assert torch.equal(got.tokens, expected.tokens) and torch.allclose(got.probs, expected.probs, atol=1e-9), slot


def test_a_feature_tree_keeps_the_best_nodes_of_its_expansions(target) -> None:
    """EAGLE-2's rule: `branch` children per expanded node, the `branch` best new nodes expanded, then the `nodes` of
    highest cumulative probability; ancestors before descendants."""
    drafter = EagleDrafter(random_head(target), target)
    drafter.allocate(1, 64)
    drafter.add_rows([0], [PROMPTS[0]])
    cache = target.new_cache(1, 64)
    from specsample.models.base import prefill_ragged

    drafter.add_features([0], prefill_ragged(target, cache, torch.tensor([0]), [PROMPTS[0][:-1]], features=True))
    greedy = SamplingParams(temperature=0)
    shape = TreeShape(10, 3, 4)
    proposal = drafter.propose(draft_request((0,), (10,), (10,), (greedy,), (torch.Generator(),), tree=shape))
    parents = proposal.parents[0].tolist()
    assert int(proposal.num_drafted[0]) == 10 and proposal.probs is None
    assert all(p < i for i, p in enumerate(parents))  # parents first
    depth = [0] * 10
    for i, p in enumerate(parents):
        depth[i] = 1 if p < 0 else depth[p] + 1
    assert max(depth) <= shape.depth and depth.count(1) <= shape.branch
    children = {}
    for i, p in enumerate(parents):
        children.setdefault(p, []).append(int(proposal.tokens[0, i]))
    assert all(len(set(c)) == len(c) <= shape.branch for c in children.values())  # distinct top-k children
    # cumulative confidence never rises along a path
    confidence = proposal.confidence[0].tolist()
    assert all(confidence[i] <= confidence[p] + 1e-12 for i, p in enumerate(parents) if p >= 0)


def test_lookup_branches_merge_into_a_trie() -> None:
    assert trie([[1, 2, 3], [1, 2, 4], [5]], budget=10) == ([1, 2, 3, 4, 5], [-1, 0, 1, 1, -1])
    assert trie([[1, 2, 3], [1, 4]], budget=3) == ([1, 2, 3], [-1, 0, 1])  # the most recent match first
    drafter = NgramDrafter(min_n=1)
    drafter.allocate(1, 64)
    drafter.add_rows([0], [[7, 1, 2, 7, 3, 4, 7, 5, 6, 7]])  # "7" was followed by 1, 3 and 5
    request = draft_request(
        (0,), (6,), (6,), (SamplingParams(temperature=0),), (torch.Generator(),), tree=TreeShape(6, 3, 2)
    )
    proposal = drafter.propose(request)
    # the most recent continuation first, whole; then the next most recent while the budget lasts
    assert proposal.tokens[0].tolist() == [5, 6, 7, 3, 4, 7] and int(proposal.num_drafted[0]) == 6
    assert proposal.parents[0].tolist() == [-1, 0, 1, -1, 3, 4]
    short = draft_request(
        (0,), (2,), (2,), (SamplingParams(temperature=0),), (torch.Generator(),), tree=TreeShape(2, 3, 2)
    )
    assert drafter.propose(short).tokens[0].tolist() == [5, 6]


def test_tree_settings_are_checked_and_parsed() -> None:
    assert TreeShape.parse("16x4x6") == TreeShape(16, 4, 6)
    assert TreeShape.parse("12") == TreeShape(12, 4, 6) and TreeShape.parse("3") == TreeShape(3, 4, 3)
    for bad in ("", "x", "16x4", "0", "4x2x8", "ax2x3"):
        with pytest.raises(SettingError, match="tree"):
            TreeShape.parse(bad)
    assert FixedGamma(5, TreeShape(16, 4, 6)).most_drafts == 24  # four children at six depths
    assert [s.nodes for s in budgets(TreeShape(32, 4, 6))] == [8, 12, 16, 24, 32]


def test_fixed_gamma_drafts_its_tree_only_where_the_target_scores_trees() -> None:
    planner = FixedGamma(4, tree=TREE)
    rows = (
        RowState("a", UNLIMITED),
        RowState("own", UNLIMITED, gamma=3),
        RowState("short", 4),
        RowState("plain", UNLIMITED, speculative=False),
    )
    plan = planner.plan(BatchState(rows, can_tree=True))
    # nodes: the tree's, a request's own gamma bounding them; depth: the tree's, never past what a budget can use
    assert plan.tree == TREE and [r.reach for r in plan.rows] == [8, 3, 8, 0]
    assert [r.drafts for r in plan.rows] == [4, 3, 3, 0]
    chain = planner.plan(BatchState(rows))
    assert chain.tree is None and [r.reach for r in chain.rows] == [4, 3, 3, 0]


def _simulate(
    controller: GammaController,
    alpha: float,
    tree_yield: dict[int, float],
    rounds: int,
    rng: random.Random,
    plain: float = 0.020,
    per_node: float = 0.01,
) -> list[int]:
    """One request on a simulated engine: chains as `planner_driver.timed` (c 0.15, overhead 0.1), a tree round of n
    nodes costs a chain of its depth plus `per_node` plain rounds per further node and commits about
    `tree_yield[n]` tokens. The node budget of each round (0: a chain)."""
    chosen = []
    for _ in range(rounds):
        state = batch("r", can_tree=True)
        plan = controller.plan(state)
        gamma = plan.rows[0].drafts
        depth = plan.tree.depth if plan.tree else gamma
        target = plain * (1.0 + (gamma - depth) * per_node / 0.9 if plan.tree else 1.0)
        seconds = (depth * 0.15 * plain, target * 0.9 + 0.1 * plain, 0.1 * plain)
        if plan.tree is not None:
            tokens = tree_yield[plan.tree.nodes]
            accepted = int(tokens) - 1 + (rng.random() < tokens % 1)
            chosen.append(plan.tree.nodes)
        else:
            accepted = 0
            while accepted < gamma and rng.random() < alpha:
                accepted += 1
            chosen.append(0)
        learn(controller, plan, state, RowOutcome("r", gamma, accepted), seconds=seconds)
    return chosen


def test_gamma_auto_drafts_trees_where_they_pay_and_chains_where_they_do_not() -> None:
    alpha = 0.6
    chain_best = expected_tokens_per_round(alpha, 4)
    shape = TreeShape(24, 4, 6)
    paying = {8: chain_best + 0.3, 12: chain_best + 0.5, 16: chain_best + 1.4, 24: chain_best + 1.3}
    chosen = _simulate(GammaController(8, shape), alpha, paying, 400, random.Random(0))
    late = chosen[200:]
    assert late.count(16) > 0.8 * len(late)  # the best priced budget: 24 nodes add too little for their cost
    assert 0 < late.count(0) < 0.1 * len(late)  # chains are still tried now and then
    useless = {n: expected_tokens_per_round(alpha, 3) for n in paying}
    chosen = _simulate(GammaController(8, shape), alpha, useless, 400, random.Random(0))
    late = chosen[200:]
    assert late.count(0) > 0.85 * len(late)  # chains, trees tried now and then
    assert set(late) - {0}
    assert set(_simulate(GammaController(8), alpha, paying, 100, random.Random(0))) == {0}  # no tree configured


def test_gamma_auto_drafts_no_tree_where_the_target_cannot_score_one() -> None:
    controller = GammaController(8, TREE)
    for _ in range(40):
        state = batch("r")  # can_tree False
        plan = controller.plan(state)
        assert plan.tree is None
        learn(controller, plan, state, RowOutcome("r", plan.rows[0].drafts, 1), seconds=(0.001, 0.01, 0.001))
