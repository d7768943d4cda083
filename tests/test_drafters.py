"""Drafter state: a model draft catching up on tokens it missed, scoring a backlog teacher-forced, drafters that
score through another, merged proposals, a drafter swapped mid-run, and drafts that fail to load."""

from __future__ import annotations

import pytest
import torch
from model_factory import draft_request

from specsample import Engine, SamplingParams, SpecConfig
from specsample.drafters.base import Abilities, NoDrafter, Proposal, merge_proposals
from specsample.drafters.hybrid import HybridDrafter
from specsample.drafters.model import DraftWindow, ModelDrafter
from specsample.drafters.ngram import NgramDrafter
from specsample.drafters.routed import RoutedDrafter
from specsample.planner import FixedGamma
from specsample.planner.base import DraftSource
from specsample.sampling import warp_probs

HISTORY = [(7 * t + 3) % 32 for t in range(60)]


def _request(
    slots: tuple[int, ...], reach: tuple[int, ...], params: tuple[SamplingParams, ...], seeds: tuple[int, ...]
):
    """Each row drafts up to `reach[i]`, its plan."""
    return draft_request(slots, reach, reach, params, tuple(torch.Generator().manual_seed(s) for s in seeds))


# ----- catching up -----------------------------------------------------------------------


def test_long_draft_backlog_never_overflows_another_rows_cache(tiny_draft) -> None:
    drafter = ModelDrafter(tiny_draft)
    drafter.allocate(2, 40 + 6)  # context 40 plus the engine's slack for gamma 4
    drafter.add_rows([0, 1], [[t % 32 for t in range(1, 39)], [1, 2, 3]])
    drafter.commit([1], [[t % 32 for t in range(4, 32)]])  # row 1 fell 28 tokens behind (an n-gram streak)
    proposal = drafter.propose(_request((0, 1), (1, 2), (SamplingParams(temperature=0),) * 2, (0, 1)))
    assert proposal.num_drafted.tolist() == [1, 2]
    assert int(drafter.cache.lengths[1]) == len(drafter.history[1]) + 1  # caught up, plus one fed draft


@pytest.mark.parametrize("behind", [3, 8, 9, 10, 30])  # backlogs 2, 7, 8 (the last merged), 9, 29
def test_a_lone_rows_backlog_drafts_as_from_a_fresh_prefill(tiny_draft, behind: int) -> None:
    """At batch 1 a short backlog rides in the first draft forward (one forward fewer per probe), a long
    one is prefilled first; either way the drafts and their probabilities are those of a fresh draft."""
    prompt = [t % 32 for t in range(1, 12)]
    missed = [(7 * t) % 32 for t in range(behind)]  # tokens committed by plain rounds
    forwards = []

    class Counting:
        def __getattr__(self, name):
            return getattr(tiny_draft, name)

        def forward_cached(self, tokens, cache, slots):
            forwards.append(tokens.shape[1])
            return tiny_draft.forward_cached(tokens, cache, slots)

        def forward_cached_last(self, tokens, cache, slots, last):
            forwards.append(tokens.shape[1])
            return tiny_draft.forward_cached_last(tokens, cache, slots, last)

    behind_drafter, fresh = ModelDrafter(Counting()), ModelDrafter(tiny_draft)
    for drafter, rows in ((behind_drafter, prompt), (fresh, prompt + missed)):
        drafter.allocate(1, 64)
        drafter.add_rows([0], [rows])
    behind_drafter.commit([0], [missed])
    params = (SamplingParams(temperature=1.0),)
    late = behind_drafter.propose(_request((0,), (3,), params, (5,)))
    ref = fresh.propose(_request((0,), (3,), params, (5,)))
    assert late.tokens.tolist() == ref.tokens.tolist()
    assert torch.allclose(late.probs, ref.probs, atol=1e-10)
    assert int(behind_drafter.cache.lengths[0]) == int(fresh.cache.lengths[0])
    # the first forward carries the backlog when it is short, else only the last 2 tokens
    assert forwards[0] == (behind + 1 if behind + 1 - 2 <= 8 else 2)


def test_a_short_backlog_in_a_batch_is_still_fed_on_its_own(tiny_draft) -> None:
    """Merged into the first forward, one row's backlog would pad the other rows past their slack."""
    drafter = ModelDrafter(tiny_draft)
    drafter.allocate(2, 24 + 6)  # context 24 plus the engine's slack for gamma 4
    drafter.add_rows([0, 1], [[t % 32 for t in range(1, 29)], [1, 2, 3]])  # row 0 near its end
    drafter.commit([1], [[4, 5, 6, 7, 8, 9]])  # row 1 is 5 tokens behind
    proposal = drafter.propose(_request((0, 1), (2, 2), (SamplingParams(temperature=0),) * 2, (0, 1)))
    assert proposal.num_drafted.tolist() == [2, 2]
    assert [int(drafter.cache.lengths[s]) for s in (0, 1)] == [len(drafter.history[s]) + 1 for s in (0, 1)]


# ----- backlog scoring -------------------------------------------------------------------


def _expected(tiny_draft, context: list[int], scored: list[int], params: SamplingParams) -> list[float]:
    """The warped probability a whole-context draft on `context + scored[:-1]` gives each scored token."""
    with torch.no_grad():
        logits = tiny_draft(torch.tensor([context + scored[:-1]], device=tiny_draft.device))[0]
    probs = warp_probs(logits[len(context) - 1 :], params)  # predicts scored[0], scored[1], ...
    return probs.gather(-1, torch.tensor(scored, device=probs.device).unsqueeze(-1)).squeeze(-1).tolist()


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_scores_are_the_drafts_teacher_forced_probabilities(tiny_draft, temperature: float) -> None:
    params = SamplingParams(temperature=temperature)
    drafter = ModelDrafter(tiny_draft)
    drafter.allocate(1, 128)
    drafter.add_rows([0], [HISTORY[:20]])
    drafter.commit([0], [HISTORY[20:32]])  # twelve tokens committed without the draft
    scores = drafter.score_backlog([0], [5], [params])[0]  # the last five (the seven before: fed, unscored)
    assert scores == pytest.approx(_expected(tiny_draft, HISTORY[:27], HISTORY[27:32], params), abs=1e-9)
    assert int(drafter.cache.lengths[0]) == 31  # it lacks only the last committed token, as after a round
    assert drafter.score_backlog([0], [5], [params]) == [[]]  # nothing left that it has not fed
    drafter.commit([0], [HISTORY[32:35]])
    assert len(drafter.score_backlog([0], [50], [params])[0]) == 3  # at most what it missed


def test_a_windowed_draft_scores_on_its_view(tiny_draft) -> None:
    """A backlog that would carry the cache past the window's limit: the row is re-windowed on the history
    before the scored tokens, which it then sees after the window's view."""
    window = DraftWindow(sink=2, recent=6, limit=24)
    drafter = ModelDrafter(tiny_draft, window=window)
    drafter.allocate(1, 128)
    drafter.add_rows([0], [HISTORY[:20]])
    drafter.commit([0], [HISTORY[20:40]])
    params = SamplingParams(temperature=0.8)
    scores = drafter.score_backlog([0], [8], [params])[0]
    view, _ = window.view(HISTORY[:31])
    assert scores == pytest.approx(_expected(tiny_draft, view, HISTORY[31:40], params)[1:], abs=1e-9)
    assert int(drafter.cache.lengths[0]) <= window.limit


def test_after_scoring_the_draft_drafts_as_a_fresh_one(tiny_draft) -> None:
    drafter, fresh = ModelDrafter(tiny_draft), ModelDrafter(tiny_draft)
    for d in (drafter, fresh):
        d.allocate(1, 128)
    drafter.add_rows([0], [HISTORY[:10]])
    drafter.commit([0], [HISTORY[10:25]])
    drafter.score_backlog([0], [6], [SamplingParams(temperature=0)])
    fresh.add_rows([0], [HISTORY[:25]])
    params = (SamplingParams(temperature=0.8),)
    ours = drafter.propose(_request((0,), (3,), params, (5,)))
    theirs = fresh.propose(_request((0,), (3,), params, (5,)))
    assert torch.equal(ours.tokens, theirs.tokens)
    assert torch.allclose(ours.probs, theirs.probs, atol=1e-9)


def test_drafters_declare_what_they_can_do(tiny_draft) -> None:
    model = ModelDrafter(tiny_draft)
    assert model.abilities.scores_backlog and not model.abilities.looks_up
    assert not NgramDrafter().abilities.scores_backlog  # deterministic drafts: probes instead
    hybrid = HybridDrafter(model)
    assert hybrid.abilities.scores_backlog and hybrid.abilities.looks_up  # its model scores, its lookup offers
    routed = RoutedDrafter(NgramDrafter())  # a wrapper states what the drafter it routes to declares
    assert routed.abilities.looks_up and not routed.abilities.scores_backlog
    assert all(d.abilities.copies_prefixes for d in (model, NgramDrafter(), hybrid, routed, NoDrafter()))


class _Plain(NoDrafter):
    """A drafter that declares nothing: it neither copies a row's prefix nor reads the target's features."""

    abilities = Abilities()


class _Reader(NoDrafter):
    """A drafter that reads the target's features and copies no prefix."""

    abilities = Abilities(reads_features=True)

    def add_features(self, slots, features) -> None:
        return None


@pytest.mark.parametrize("wrapper", [HybridDrafter, RoutedDrafter])
def test_wrappers_copy_a_prefix_through_the_drafter_they_route_to(tiny_draft, wrapper) -> None:
    """A wrapper copies a row's prefix through its drafter where that drafter declares copying; otherwise the drafter
    starts the row afresh and the target copies all of it, unless the drafter reads the target's features (the target
    computes none for what it copies): then the target copies nothing, and the wrapper declares no copying."""
    model = ModelDrafter(tiny_draft)
    wrapped = wrapper(model)
    wrapped.allocate(3, 64)
    wrapped.add_rows([0], [HISTORY[:30]])
    assert wrapped.abilities.copies_prefixes and wrapped.copy_prefix(0, 1, HISTORY[:20]) == 20
    assert model.history[1] == HISTORY[:20] and int(model.cache.lengths[1]) == 20  # the model's own copy
    plain = wrapper(_Plain())
    assert plain.abilities.copies_prefixes and plain.copy_prefix(0, 1, HISTORY[:20]) == 20
    reader = wrapper(_Reader())
    assert not reader.abilities.copies_prefixes and reader.copy_prefix(0, 1, HISTORY[:20]) == 0


def test_a_routed_drafter_copies_no_prefix_from_a_drafter_it_replaced(tiny_draft) -> None:
    """A row of the drafter a swap replaced is not copied into the new one, which starts the copy afresh."""
    old, new = ModelDrafter(tiny_draft), ModelDrafter(tiny_draft)
    routed = RoutedDrafter(old)
    routed.allocate(3, 64)
    routed.add_rows([0], [HISTORY[:30]])
    routed.replace(new)
    assert routed.copy_prefix(0, 1, HISTORY[:20]) == 20 and 1 not in new.history and 1 not in old.history
    routed.add_rows([1], [HISTORY[:25]])
    assert new.history[1] == HISTORY[:25]


def _fed_alike(*drafters):
    """The drafters, each given slot 0 with the same prompt and then the same committed tokens (a backlog)."""
    for d in drafters:
        d.allocate(2, 128)
        d.add_rows([0], [HISTORY[:10]])
        d.commit([0], [HISTORY[10:25]])
    return drafters


def test_a_routed_drafter_scores_through_its_model_drafts(tiny_draft) -> None:
    """The server's drafter (routed, so a draft can be swapped) scores backlogs as the draft it routes to."""
    routed, model = _fed_alike(RoutedDrafter(ModelDrafter(tiny_draft)), ModelDrafter(tiny_draft))
    params = [SamplingParams(temperature=0.7)]
    assert routed.score_backlog([0], [6], params) == model.score_backlog([0], [6], params)
    routed.replace(NgramDrafter())  # rows added now go to a drafter that cannot score: they score nothing
    routed.add_rows([1], [HISTORY[:10]])
    routed.commit([1], [HISTORY[10:20]])
    assert routed.score_backlog([1], [4], params) == [[]]


def test_hybrid_scores_as_its_model(tiny_draft) -> None:
    hybrid, model = _fed_alike(
        HybridDrafter(ModelDrafter(tiny_draft), NgramDrafter(min_n=1), min_match=2), ModelDrafter(tiny_draft)
    )
    params = [SamplingParams(temperature=0.7)]
    assert hybrid.score_backlog([0], [6], params) == model.score_backlog([0], [6], params)


# ----- proposals ---------------------------------------------------------------------------


def test_merge_proposals_returns_a_whole_proposal_and_copies_parts() -> None:
    tokens = torch.tensor([[3, 4], [5, 0]])
    probs = torch.softmax(torch.randn(2, 2, 9), dim=-1)  # vocab 9
    whole = Proposal(tokens, probs, torch.tensor([2, 1]), torch.rand(2, 2))
    assert merge_proposals([([0, 1], whole)], 2, 2) is whole  # every row, full width: nothing to copy
    # rows out of order, a narrower part, or a dtype the merge widens: copied into a fresh proposal
    for rows, batch, gamma, part in (
        ([1, 0], 2, 2, whole),
        ([0, 1], 2, 3, whole),
        ([0, 1], 2, 2, Proposal(tokens, probs.bfloat16(), whole.num_drafted)),
    ):
        merged = merge_proposals([(rows, part)], batch, gamma)
        assert merged is not part and merged.probs.dtype == torch.float32 and merged.tokens.shape == (batch, gamma)
        assert merged.tokens[rows[0], :2].tolist() == part.tokens[0].tolist()
        assert torch.equal(merged.probs[rows[0], :2], part.probs[0].float())
    lookup = Proposal(torch.tensor([[7, 8]]), None, torch.tensor([2]))
    model = Proposal(torch.tensor([[1, 0]]), probs[:1], torch.tensor([1]), torch.tensor([[0.5, 0.0]]))
    merged = merge_proposals([([1], lookup), ([0], model)], 2, 2)
    assert merged.tokens.tolist() == [[1, 0], [7, 8]] and merged.num_drafted.tolist() == [1, 2]
    assert merged.probs[1, 0, 7] == 1 and merged.probs[1, 1, 8] == 1  # the lookup's row one-hot
    assert torch.isnan(merged.confidence[1]).all() and merged.confidence[0, 0] == 0.5


def test_a_draft_request_for_some_rows_keeps_the_rounds_width_and_rule() -> None:
    """A drafter handing rows to another passes them the same round: its width, gate and extension."""
    params = tuple(SamplingParams(seed=s) for s in range(3))
    generators = tuple(torch.Generator() for _ in range(3))
    request = draft_request(
        (4, 5, 6),
        (1, 0, 2),
        (3, 0, 2),
        params,
        generators,
        source=(DraftSource.MODEL, DraftSource.EITHER, DraftSource.LOOKUP),
        stop_thresholds=(0.2,),
    )
    part = request.select([2, 0])
    assert (part.slots, part.drafts, part.reach) == ((6, 4), (2, 1), (2, 3))
    assert [part.source_of(i) for i in range(2)] == [DraftSource.LOOKUP, DraftSource.MODEL]
    assert part.params == (params[2], params[0]) and part.generators == (generators[2], generators[0])
    assert part.width == request.width == 3 and part.stop_thresholds == (0.2,)
    with pytest.raises(ValueError, match="need 0 <= drafts <= reach"):
        draft_request((4,), (3,), (2,), params[:1], generators[:1])
    with pytest.raises(ValueError, match="rows \\[0\\] may draft past their plan, but no"):
        request.refuse_extension([0, 1, 2], "no")
    request.refuse_extension([1, 2], "no")  # rows within their plan


# ----- drafts swapped or failing -----------------------------------------------------------


def test_swap_from_ngram_to_a_model_draft_mid_run(tiny_target, tiny_draft) -> None:
    routed = RoutedDrafter(NgramDrafter(min_n=1))
    engine = Engine(tiny_target, routed, SpecConfig(max_batch_size=3), planner=FixedGamma(3))
    params = SamplingParams(temperature=0.8, max_new_tokens=12, seed=0)
    engine.add_request([1, 2, 1, 2, 1], params)
    engine.step()
    routed.replace(ModelDrafter(tiny_draft))  # the running row keeps the n-gram drafter, new rows get the model
    engine.add_request([3, 4, 5], params)
    assert routed.vocab_size == tiny_draft.vocab_size
    results = list(engine.stream())
    assert sum(len(u.new_tokens) for r in results for u in r.rows) > 0 and not engine.has_work()


class _FailingDrafter(NgramDrafter):
    def allocate(self, num_slots: int, max_len: int) -> None:
        raise RuntimeError("CUDA out of memory (simulated)")


def test_draft_cache_allocation_failure_decodes_without_drafting(tiny_target, caplog) -> None:
    engine = Engine(tiny_target, _FailingDrafter(), SpecConfig(max_batch_size=2), planner=FixedGamma(4))
    assert isinstance(engine.drafter, NoDrafter)
    assert "WITHOUT speculation" in caplog.text
    engine.add_request([1, 2, 3], SamplingParams(temperature=0, max_new_tokens=5))
    tokens = [t for r in engine.stream() for u in r.rows for t in u.new_tokens]
    assert len(tokens) == 5


def test_unloadable_draft_falls_back_loudly(tmp_path, caplog) -> None:
    from model_factory import write_hf_model

    from specsample.models.loader import load_model
    from specsample.pair import load_drafter

    target = load_model(str(write_hf_model(tmp_path / "t", "llama")), dtype="float32")
    broken = write_hf_model(tmp_path / "d", "llama")
    (broken / "model.safetensors").write_bytes(b"\x00" * 64)  # unreadable weights
    assert load_drafter(str(broken), target) is None
    assert "WITHOUT speculation" in caplog.text
    with pytest.raises(ValueError, match="unknown model spec"):  # a typo is still an error
        load_drafter("no-such-draft", target)
