"""The prefix cache: a request starts from the longest prefix it shares with a running, prefilling or kept row of its
scope, copied into its own row (the target's cache and the drafter's state: a draft model's, a feature head's), the
source left usable; requests arriving together prefill their shared prefix once; kept rows are bounded in tokens,
least recently used out first; long prompts are prefilled in chunks while others decode. Each decodes exactly what it
would from scratch (greedy with every drafter; seeded without a draft and with the hybrid)."""

from __future__ import annotations

import random

import pytest
import torch
from broken import PrefillATokenLate
from model_factory import draft_request
from test_eagle import _greedy_proposal, random_head
from test_medusa import random_heads
from virtual_clock import ClockedLM, VirtualClock

from specsample import Engine, ModelDrafter, SamplingParams, SpecConfig, tiny_lm
from specsample.drafters.base import common_prefix
from specsample.drafters.eagle import EagleDrafter
from specsample.drafters.hybrid import HybridDrafter
from specsample.drafters.medusa import MedusaDrafter
from specsample.drafters.model import DraftWindow
from specsample.drafters.ngram import NgramDrafter
from specsample.drafters.routed import RoutedDrafter
from specsample.drafters.suffix import SuffixDrafter
from specsample.planner import FixedGamma
from specsample.prefix_index import PrefixIndex

VOCAB = 48
SYSTEM = [(7 * i + 3) % VOCAB for i in range(40)]  # a system prompt many requests share
QUESTIONS = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12], [13, 14]]
GREEDY = SamplingParams(temperature=0, max_new_tokens=8)


@pytest.fixture(scope="module")
def models():
    return (
        tiny_lm(VOCAB, seed=3, init_scale=0.2, dtype=torch.float64),
        tiny_lm(VOCAB, seed=2, init_scale=0.2, num_layers=1, dtype=torch.float64),
    )


def drafter_for(kind: str, target, draft):
    return {
        "none": lambda: None,
        "model": lambda: ModelDrafter(draft),
        "window": lambda: ModelDrafter(draft, window=DraftWindow(sink=4, recent=16, limit=40)),
        "hybrid": lambda: HybridDrafter(ModelDrafter(draft), NgramDrafter(min_n=1), min_match=2),
        "suffix": lambda: SuffixDrafter(),
        "eagle": lambda: EagleDrafter(random_head(target), target),
        "medusa": lambda: MedusaDrafter(random_heads(target), target),
        "routed": lambda: RoutedDrafter(ModelDrafter(draft)),
    }[kind]()


def run(engine: Engine, prompts, params=GREEDY, scope: str = "") -> tuple[list[list[int]], list]:
    """Add every prompt at once, then step until all finish: each one's tokens, and every round's stats."""
    ids = [engine.add_request(p, params, cache_scope=scope) for p in prompts]
    out: dict[str, list[int]] = {i: [] for i in ids}
    stats = []
    for result in engine.stream():
        stats.append(result.stats)
        for update in result.rows:
            out[update.request_id].extend(update.new_tokens)
    return [out[i] for i in ids], stats


def fresh(models, kind: str, prompt, params=GREEDY) -> list[int]:
    target, draft = models
    engine = Engine(target, drafter_for(kind, target, draft), SpecConfig(max_batch_size=1), planner=FixedGamma(3))
    return run(engine, [prompt], params)[0][0]


CASES = [("model", 0.0), ("window", 0.0), ("hybrid", 0.0), ("suffix", 0.0), ("eagle", 0.0), ("none", 0.9)]
CASES += [("hybrid", 0.9), ("medusa", 0.0)]


@pytest.mark.parametrize("kind, temperature", CASES)
def test_a_kept_rows_prefix_is_copied_and_the_row_stays(models, kind: str, temperature: float) -> None:
    """Two users share a system prompt: the second copies the first's kept row (only its question is prefilled) and
    decodes what it would afresh; the kept row stays, and the first user's next turn takes it over."""
    target, draft = models
    params = SamplingParams(temperature=temperature, max_new_tokens=8, seed=5)
    engine = Engine(
        target,
        drafter_for(kind, target, draft),
        SpecConfig(max_batch_size=2, prefix_cache_rows=2),
        planner=FixedGamma(3),
    )
    (first,), _ = run(engine, [SYSTEM + QUESTIONS[0]], params)
    (second,), stats = run(engine, [SYSTEM + QUESTIONS[1]], params)
    assert stats[0].prefix_hits == 1 and stats[0].reused_tokens >= len(SYSTEM) - 1
    assert sum(s.prefilled_tokens for s in stats) == len(SYSTEM) + len(QUESTIONS[1]) - 1 - stats[0].reused_tokens
    assert second == fresh(models, kind, SYSTEM + QUESTIONS[1], params)
    turn = SYSTEM + QUESTIONS[0] + first + [20, 21]
    (third,), stats = run(engine, [turn], params)
    assert stats[0].reused_tokens >= len(SYSTEM + QUESTIONS[0] + first) - 2
    assert third == fresh(models, kind, turn, params)


@pytest.mark.parametrize("kind", ["model", "window", "hybrid", "eagle", "medusa", "routed"])
def test_a_running_rows_prefix_is_copied(models, kind: str) -> None:
    """A request arriving while another with the same system prompt runs copies the running row's prefix; both
    decode what they would alone."""
    target, draft = models
    engine = Engine(target, drafter_for(kind, target, draft), SpecConfig(max_batch_size=2), planner=FixedGamma(3))
    long = SamplingParams(temperature=0, max_new_tokens=20)
    a = engine.add_request(SYSTEM + QUESTIONS[0], long)
    out = {a: []}
    for _ in range(3):
        out[a].extend(t for u in engine.step().rows for t in u.new_tokens)
    b = engine.add_request(SYSTEM + QUESTIONS[2], GREEDY)
    out[b] = []
    hits = 0
    for result in engine.stream():
        hits += result.stats.prefix_hits
        for update in result.rows:
            out[update.request_id].extend(update.new_tokens)
    assert hits == 1
    assert out[a] == fresh(models, kind, SYSTEM + QUESTIONS[0], long)
    assert out[b] == fresh(models, kind, SYSTEM + QUESTIONS[2])


@pytest.mark.parametrize("chunk", [None, 8])
@pytest.mark.parametrize("kind", ["model", "eagle"])
def test_requests_arriving_together_prefill_their_prefix_once(models, kind: str, chunk: int | None) -> None:
    """Four requests sharing a system prompt arrive at once: the system prompt is prefilled once (whole, or in chunks
    while the others wait for it), every question once, and each decodes what it would alone."""
    target, draft = models
    engine = Engine(
        target,
        drafter_for(kind, target, draft),
        SpecConfig(max_batch_size=4, prefill_chunk_tokens=chunk),
        planner=FixedGamma(3),
    )
    prompts = [SYSTEM + q for q in QUESTIONS]
    outputs, stats = run(engine, prompts)
    prefilled = sum(s.prefilled_tokens for s in stats)
    assert prefilled == len(SYSTEM) + sum(len(q) for q in QUESTIONS) - len(QUESTIONS)
    assert sum(s.prefix_hits for s in stats) == 3
    assert outputs == [fresh(models, kind, p) for p in prompts]


def test_a_long_prompt_is_prefilled_in_chunks_while_others_decode(models) -> None:
    """With a budget of 8 prompt tokens per round, a 60-token prompt arriving beside a decoding request takes 8 rounds
    to prefill, the other request emitting tokens in each, and joins the decoding batch the round after; both decode
    what they would alone."""
    target, draft = models
    engine = Engine(
        target, ModelDrafter(draft), SpecConfig(max_batch_size=2, prefill_chunk_tokens=8), planner=FixedGamma(3)
    )
    long = SamplingParams(temperature=0, max_new_tokens=40)
    a = engine.add_request(QUESTIONS[0], long)
    out = {a: list(t for u in engine.step().rows for t in u.new_tokens)}
    prompt = [(5 * i + 1) % VOCAB for i in range(61)]
    b = engine.add_request(prompt, GREEDY)
    out[b] = []
    rounds = []
    for result in engine.stream():
        rounds.append(result.stats)
        for update in result.rows:
            out[update.request_id].extend(update.new_tokens)
    prefilling = [s for s in rounds[:9]]
    assert [s.prefilled_tokens for s in prefilling] == [8] * 7 + [4, 0]
    assert all(s.batch_size == 1 and s.emitted >= 1 and s.admitted == 0 for s in prefilling[:8])  # a decodes meanwhile
    assert prefilling[8].admitted == 1 and prefilling[8].batch_size == 2
    assert out[a] == fresh(models, "model", QUESTIONS[0], long)
    assert out[b] == fresh(models, "model", prompt)


def _whole_and_chunked(drafter, prompt, parts=(1, 7, 3, 10)):
    """A greedy proposal for two rows of the same prompt: one added whole (slot 0), one started and prefilled `parts`
    units at a time, the rest at `add_rows` (slot 1)."""
    drafter.allocate(2, 128)
    drafter.add_rows([0], [prompt])
    left = drafter.start_rows([1], [prompt])[0]
    for count in parts:
        drafter.prefill_rows([1], [min(count, left)])
        left -= min(count, left)
    drafter.add_rows([1], [prompt])
    generators = (torch.Generator(), torch.Generator())
    return drafter.propose(draft_request((0, 1), (3, 3), (3, 3), (GREEDY, GREEDY), generators))


def _same_rows(proposal) -> bool:
    same = torch.equal(proposal.tokens[0], proposal.tokens[1])
    if proposal.probs is None:
        return same
    return same and torch.allclose(proposal.probs[0], proposal.probs[1], atol=1e-9)


@pytest.mark.parametrize("kind", ["model", "window", "hybrid", "suffix", "routed"])
def test_a_drafters_chunked_prefill_leaves_the_row_a_whole_one_does(models, kind: str) -> None:
    """A row whose prompt the drafter prefilled in parts (its draft model's cache, its lookup's index) drafts what a
    row it prefilled whole drafts."""
    target, draft = models
    assert _same_rows(_whole_and_chunked(drafter_for(kind, target, draft), SYSTEM + QUESTIONS[0]))


def test_a_chunked_draft_prefill_off_by_one_position_is_caught(models) -> None:
    """The broken twin: a draft model whose parts after the first start a token late drafts otherwise."""
    _, draft = models
    assert not _same_rows(_whole_and_chunked(PrefillATokenLate(draft), SYSTEM + QUESTIONS[0]))


@pytest.mark.parametrize("time_ratio, chunk, within", [(1.0, None, True), (None, 32, False)])
def test_a_rounds_prefill_takes_about_the_decodings_time(models, time_ratio, chunk, within: bool) -> None:
    """On a virtual clock (a target forward costs 2 ms and 0.5 ms per token, a draft's a tenth of that), with a time
    ratio of 1, a 120-token prompt arriving beside a decoding request is prefilled over several rounds, each round's
    prefill (the target's and the draft's) taking about what that round's decoding takes, at most 1.5x once the costs
    are measured; both requests decode what they would alone. The twin, a budget of 32 tokens alone, takes 3x."""
    target, draft = models
    clock = VirtualClock()
    engine = Engine(
        ClockedLM(target, clock, base=2e-3, per_token=5e-4),
        ModelDrafter(ClockedLM(draft, clock, base=2e-4, per_token=5e-5)),
        SpecConfig(max_batch_size=2, prefill_chunk_tokens=chunk, prefill_time_ratio=time_ratio),
        planner=FixedGamma(3),
        clock=clock,
    )
    long = SamplingParams(temperature=0, max_new_tokens=60, ignore_eos=True)
    a = engine.add_request(QUESTIONS[0], long)
    out = {a: [t for u in engine.step().rows for t in u.new_tokens]}
    prompt = [(5 * i + 1) % VOCAB for i in range(121)]
    b = engine.add_request(prompt, GREEDY)
    out[b] = []
    shares = []
    for result in engine.stream():
        stats = result.stats
        if stats.prefilled_tokens and stats.batch_size == 1:
            shares.append(stats.prefill_seconds / (stats.draft_seconds + stats.target_seconds + stats.verify_seconds))
        for update in result.rows:
            out[update.request_id].extend(update.new_tokens)
    assert len(shares) >= 4
    assert (max(shares[2:]) <= 1.5) == within
    assert out[a] == fresh(models, "model", QUESTIONS[0], long)
    assert out[b] == fresh(models, "model", prompt)


def test_a_copied_feature_heads_row_drafts_as_a_fresh_one(models) -> None:
    """The head's entries and features of the shared prefix follow the copy: its proposal equals a head fed the whole
    text afresh."""
    target, _ = models
    head = random_head(target)
    running = EagleDrafter(head, target)
    engine = Engine(target, running, SpecConfig(max_batch_size=2, prefix_cache_rows=1), planner=FixedGamma(3))
    run(engine, [SYSTEM + QUESTIONS[0]])
    engine.add_request(SYSTEM + QUESTIONS[3], SamplingParams(temperature=0, max_new_tokens=4))
    assert engine.step().stats.prefix_hits == 1
    (slot,) = running.rows
    history = list(running.rows[slot].history)
    got = running.propose(draft_request((slot,), (3,), (3,), (GREEDY,), (torch.Generator(),))).probs
    assert torch.allclose(got, _greedy_proposal(EagleDrafter(head, target), target, history), atol=1e-9)


def test_kept_rows_are_bounded_in_tokens_least_recently_used_first(models) -> None:
    target, draft = models
    prompts = [[40 + i] * 3 + SYSTEM[i : i + 30] for i in range(3)]  # 33 tokens each, no prefix shared
    engine = Engine(
        target,
        ModelDrafter(draft),
        SpecConfig(max_batch_size=1, prefix_cache_rows=3, prefix_cache_tokens=90),
        planner=FixedGamma(3),
    )
    params = SamplingParams(temperature=0, max_new_tokens=4)
    for prompt in prompts[:2]:
        run(engine, [prompt], params)
    assert engine.scheduler.usage().rows == 2
    _, stats = run(engine, [prompts[0][:20] + [1, 2]], params)  # uses (copies) the first row: now the most recent
    assert stats[0].prefix_hits == 1
    run(engine, [prompts[2]], params)  # over 90 tokens: the least recently used goes, the second prompt's
    usage = engine.scheduler.usage()
    assert usage.tokens <= 90 and usage.capacity_tokens == 90
    assert usage.bytes == usage.tokens * engine.cache.bytes_per_token
    _, stats = run(engine, [prompts[1][:20] + [1, 2]], params)
    assert stats[0].prefix_hits == 0
    _, stats = run(engine, [prompts[0][:20] + [3, 4]], params)
    assert stats[0].prefix_hits == 1


def test_no_row_is_copied_across_scopes(models) -> None:
    """A running row of scope A is not copied for a request of scope B, which prefills everything itself."""
    target, draft = models
    engine = Engine(target, ModelDrafter(draft), SpecConfig(max_batch_size=2), planner=FixedGamma(3))
    engine.add_request(SYSTEM + QUESTIONS[0], SamplingParams(temperature=0, max_new_tokens=20), cache_scope="A")
    engine.step()
    engine.add_request(SYSTEM + QUESTIONS[1], GREEDY, cache_scope="B")
    stats = engine.step().stats
    assert stats.prefix_hits == 0 and stats.prefilled_tokens == len(SYSTEM) + len(QUESTIONS[1]) - 1


def test_processors_and_logprobs_follow_a_copied_row(models) -> None:
    """Penalties, logit bias and logprobs of a request that copied its prefix are those of a fresh one."""
    target, draft = models
    params = SamplingParams(temperature=0, max_new_tokens=8, repetition_penalty=1.3, logit_bias=((4, 2.0),), logprobs=2)
    engine = Engine(
        target, ModelDrafter(draft), SpecConfig(max_batch_size=2, prefix_cache_rows=1), planner=FixedGamma(3)
    )
    run(engine, [SYSTEM + QUESTIONS[0]], params)
    engine.add_request(SYSTEM + QUESTIONS[1], params)
    copied = [u for r in engine.stream() for u in r.rows]
    alone = Engine(target, ModelDrafter(draft), SpecConfig(max_batch_size=1), planner=FixedGamma(3))
    alone.add_request(SYSTEM + QUESTIONS[1], params)
    afresh = [u for r in alone.stream() for u in r.rows]
    assert [u.new_tokens for u in copied] != [] and sum((u.new_tokens for u in copied), ()) == sum(
        (u.new_tokens for u in afresh), ()
    )
    got = [(lp.token, round(lp.logprob, 9)) for u in copied for lp in u.logprobs]
    want = [(lp.token, round(lp.logprob, 9)) for u in afresh for lp in u.logprobs]
    assert got == want


def test_the_index_finds_the_longest_shared_prefix() -> None:
    """Against a brute-force search, over random adds, removals and lookups of overlapping token rows in two scopes."""
    rng = random.Random(0)
    index, rows = PrefixIndex(), {}
    for _ in range(2000):
        op = rng.random()
        if op < 0.5:
            slot, scope = rng.randrange(12), rng.choice("ab")
            base = list(rows[rng.choice(list(rows))][1][: rng.randrange(20)]) if rows and rng.random() < 0.7 else []
            tokens = base + [rng.randrange(4) for _ in range(rng.randrange(15))]
            index.add(slot, scope, tokens)
            rows[slot] = (scope, tokens)
        elif op < 0.7 and rows:
            slot = rng.choice(list(rows))
            index.remove(slot)
            del rows[slot]
        else:
            scope = rng.choice("ab")
            query = [rng.randrange(4) for _ in range(rng.randrange(25))]
            if rows and rng.random() < 0.6:
                query = list(rows[rng.choice(list(rows))][1][: rng.randrange(25)]) + query
            among = None if rng.random() < 0.5 else set(rng.sample(range(12), 5))
            best, length = index.longest(scope, query, among)
            expected = max(
                (common_prefix(t, query) for s, (c, t) in rows.items() if c == scope and (among is None or s in among)),
                default=0,
            )
            assert length == expected
            if length:
                assert rows[best][0] == scope and common_prefix(rows[best][1], query) == length
            else:
                assert best is None


def test_a_token_budget_of_zero_shares_nothing(models) -> None:
    target, draft = models
    engine = Engine(
        target,
        ModelDrafter(draft),
        SpecConfig(max_batch_size=4, prefix_cache_rows=2, prefix_cache_tokens=0),
        planner=FixedGamma(3),
    )
    prompts = [SYSTEM + q for q in QUESTIONS]
    outputs, stats = run(engine, prompts)
    assert sum(s.prefix_hits for s in stats) == 0 and not engine.scheduler.kept
    assert sum(s.prefilled_tokens for s in stats) == sum(len(p) - 1 for p in prompts)
    assert outputs == [fresh(models, "model", p) for p in prompts]
