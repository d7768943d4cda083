"""Theorem 1, sequences: the engine's first 3 tokens follow the target's exact joint distribution.

The exact distribution is enumerated from the target (vocabulary 8: 512 sequences); the engine
draws SAMPLES independent rows in one batch. A deliberately broken verifier must fail the same test.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
import torch
from broken import (
    BROKEN,
    ExtensionDropsToken,
    GateDropsToken,
    MedusaTreeReportsHeadProbs,
    ProbsOneStepAhead,
    SubsetProbsUnmapped,
    SuffixFrequenciesAsProbs,
    copy_prefix_off_by_one,
    coupled_trusts_the_draft,
)
from devices import DEVICE
from planner_driver import AlternatingTrees
from stats_util import chi_square

import specsample.verification.verifier as verifier_module
from specsample import Engine, ModelDrafter, SamplingParams, SpecConfig, kv_cache, tiny_lm
from specsample.api import as_drafter
from specsample.config import TreeShape
from specsample.drafters.base import Extension
from specsample.drafters.hybrid import HybridDrafter
from specsample.drafters.model import DraftWindow
from specsample.drafters.ngram import NgramDrafter
from specsample.drafters.suffix import SuffixDrafter
from specsample.models import row_kernels
from specsample.planner import FixedGamma, GammaController, RoundPlan, RowPlan
from specsample.planner.acceptance import Acceptance
from specsample.planner.chain import ChainPolicy
from specsample.planner.costs import CostModel
from specsample.planner.goodput import GoodputPolicy
from specsample.sampling import warp_probs

VOCAB = 8
LENGTH = 3
SAMPLES = 4_000
PROMPT = [1, 2]
WARPS = {
    "temperature_1": SamplingParams(temperature=1.0, max_new_tokens=LENGTH),
    "temperature_0.7_top_k_5": SamplingParams(temperature=0.7, top_k=5, max_new_tokens=LENGTH),
    "top_p_0.8": SamplingParams(temperature=1.0, top_p=0.8, max_new_tokens=LENGTH),
}


@pytest.fixture(scope="module")
def pair():
    # large init scale: peaky, clearly different distributions so broken variants stand out
    target = tiny_lm(VOCAB, seed=10, init_scale=0.2, dtype=torch.float64, device=DEVICE)
    draft = tiny_lm(VOCAB, seed=20, init_scale=0.2, num_layers=1, dtype=torch.float64, device=DEVICE)
    return target, draft


def exact_joint(target, params: SamplingParams, prompt: list[int] = PROMPT) -> np.ndarray:
    """P(x1, x2, x3 | prompt) for all VOCAB**3 sequences, indexed x1 * V^2 + x2 * V + x3."""
    seqs = torch.tensor(list(itertools.product(range(VOCAB), repeat=LENGTH)))  # [V^3, 3]
    inputs = torch.cat([torch.tensor(prompt).expand(len(seqs), -1), seqs], dim=1)
    with torch.no_grad():
        if getattr(target, "fused", None) is not None:  # the fused step's own cached forward (a block, as verified)
            cache = target.new_cache(len(seqs), inputs.shape[1])
            logits = target.forward_cached(inputs, cache, torch.arange(len(seqs)))
        else:
            logits = target(inputs)
        probs = warp_probs(logits[:, len(prompt) - 1 : -1], params)  # [V^3, 3, V]
    per_step = probs.cpu().gather(-1, seqs.unsqueeze(-1)).squeeze(-1)  # [V^3, 3]
    return per_step.prod(dim=1).cpu().numpy()


def engine_counts(
    target,
    drafter,
    params: SamplingParams,
    gamma: int,
    adaptive: bool = False,
    planner=None,
    prompt: list[int] = PROMPT,
    coupled: bool = False,
) -> np.ndarray:
    """Histogram of the first LENGTH tokens over SAMPLES independent rows of one batch."""
    config = SpecConfig(max_batch_size=SAMPLES, max_seq_len=len(prompt) + LENGTH, coupled=coupled)
    if planner is None:
        planner = GammaController(gamma) if adaptive else FixedGamma(gamma)
    return histogram(Engine(target, as_drafter(drafter), config, planner=planner), prompt, params)


def histogram(engine: Engine, prompt: list[int], params: SamplingParams) -> np.ndarray:
    """The first LENGTH tokens of SAMPLES rows of `prompt` decoded by `engine` in one batch (row i seeded 1000 + i),
    as counts over the VOCAB ** LENGTH sequences."""
    ids = [engine.add_request(prompt, dataclasses.replace(params, seed=1000 + i)) for i in range(SAMPLES)]
    out: dict[str, list[int]] = {i: [] for i in ids}
    for result in engine.stream():
        for update in result.rows:
            if update.request_id in out:  # rows added before are not counted
                out[update.request_id].extend(update.new_tokens)
    index = [sum(t * VOCAB ** (LENGTH - 1 - i) for i, t in enumerate(out[rid])) for rid in ids]
    return np.bincount(index, minlength=VOCAB**LENGTH)


@pytest.mark.parametrize("warp", list(WARPS))
def test_engine_matches_exact_distribution(pair, warp: str) -> None:
    target, draft = pair
    params = WARPS[warp]
    statistic, threshold = chi_square(engine_counts(target, draft, params, gamma=2), exact_joint(target, params))
    assert statistic < threshold, f"{warp}: chi2 {statistic:.1f} >= threshold {threshold:.1f}"


@pytest.mark.parametrize("broken", list(BROKEN))
def test_broken_verifier_fails(pair, monkeypatch, broken: str) -> None:
    target, draft = pair
    monkeypatch.setattr(verifier_module, "verify", BROKEN[broken])
    params = WARPS["temperature_1"]
    statistic, threshold = chi_square(engine_counts(target, draft, params, gamma=2), exact_joint(target, params))
    assert statistic > threshold, f"{broken} was not detected: chi2 {statistic:.1f} < {threshold:.1f}"


REPEATING = [1, 2, 3, 1, 2, 3, 1, 2]  # the context repeats itself, so prompt lookup proposes tokens


class PinnedCosts(CostModel):
    """Round costs 1 + `per_draft` per draft, whatever the timings."""

    def __init__(self, per_draft: float) -> None:
        super().__init__()
        self.per_draft = per_draft

    def round_cost(self, batch_size: int, drafts: int) -> float:
        return 1.0 + self.per_draft * drafts


class CountedPriors(Acceptance):
    """Acceptance estimates that count the priors centred by past drafts' confidences."""

    confidence_priors = 0

    def prior_centre(self, state) -> float:
        self.confidence_priors += state.predicted_trials > 0
        return super().prior_centre(state)


class PinnedGate(ChainPolicy):
    """A gate that stops a chain after any draft drawn with confidence under 0.5, whatever the timings."""

    def gate(self, batch_size: int, exploring: bool):
        return [0.5] * self.max_gamma, None


class FixedGate(GammaController):
    """Gamma auto with its timing-dependent inputs pinned, so the gate always acts."""

    chain_policy = PinnedGate

    def __init__(self, max_gamma: int, per_draft: float = 0.05) -> None:
        super().__init__(max_gamma)
        self.costs, self.acceptance = PinnedCosts(per_draft), CountedPriors()


class PinnedExtension(ChainPolicy):
    """One draft a row (no neighbours tried), then drafting past the plan while a pinned extension allows (each
    confidence bin b accepted at (b + 0.5) / 10, a bar of 0.25 per position)."""

    def best_gamma(self, alpha: float, batch_size: int) -> tuple[int, float]:
        return 1, 2.0

    def neighbour(self, gamma: int, batch_size: int) -> int:
        return gamma

    def gate(self, batch_size: int, exploring: bool):
        return [], Extension(tuple((b + 0.5) / 10 for b in range(10)), (0.25,) * (self.max_gamma - 1))


class Extends(FixedGate):
    """FixedGate planning one draft a row, then drafting past the plan: the extension always acts."""

    chain_policy = PinnedExtension
    extended = 0  # rounds a row drafted past its plan of one

    def learn(self, plan, outcome) -> None:
        self.extended += sum(row.num_drafted > 1 for row in outcome.rows)
        super().learn(plan, outcome)


class ScoresThenDrafts(FixedGate):
    """A plain round, then rounds whose rows first have their draft score the token it missed, then draft: a draft
    caught up by scoring must go on to propose from exactly the committed text."""

    def plan(self, batch):
        self.round += 1
        drafts = [0 if self.round == 1 else max(0, min(2, r.remaining - 1)) for r in batch.rows]
        rows = tuple(RowPlan(drafts=d, reach=d, score_backlog=self._backlog(r)) for d, r in zip(drafts, batch.rows))
        return RoundPlan(rows, chosen_ids=tuple(r.request_id for r in batch.rows))


SUBSET = [6, 0, 3, 2, 5]  # the draft's output tokens (FR-Spec), in no particular order; 1, 4, 7 get q = 0


def subset_draft():
    """The pair's draft with an output subset: it samples among SUBSET's tokens, scoring only the last position."""
    draft = tiny_lm(VOCAB, seed=20, init_scale=0.2, num_layers=1, dtype=torch.float64, device=DEVICE)
    draft.set_output_subset(torch.tensor(SUBSET))
    return draft


def _adaptive_cases(draft):
    return {
        "hybrid": (HybridDrafter(ModelDrafter(draft), SuffixDrafter(), min_match=2), False, None),  # the default's
        "auto_gamma_with_gate": (ModelDrafter(draft), True, FixedGate(3)),
        # lookups sized by the controller from their own acceptance, the model drafting (gated) where none matches
        "hybrid_auto": (
            HybridDrafter(ModelDrafter(draft), NgramDrafter(min_n=1), min_match=2),
            True,
            FixedGate(3, per_draft=0.3),
        ),  # lookups and model drafts each win some rounds
        # the draft sees 3 of the prompt's 7 fed tokens (a re-windowed row is a fresh draft on another
        # view: tests/test_draft_window.py; 3 new tokens are too few to reach a limit)
        "draft_window": (ModelDrafter(draft, window=DraftWindow(sink=1, recent=2, limit=9)), True, FixedGate(3)),
        "backlog_scoring": (ModelDrafter(draft), True, ScoresThenDrafts(3)),
        # one draft planned, more while the drafts so far were likely accepted (no exploring: plans stay at one)
        "extension": (ModelDrafter(draft), True, Extends(3)),
        "output_subset": (ModelDrafter(subset_draft()), False, None),
    }


# deterministic drafts alone: the hybrid's lookups (suffix drafting at a fixed gamma, n-gram lookup under gamma auto)
# and test_suffix_drafting_from_other_requests_is_exact
@pytest.mark.parametrize(
    "case",
    ["hybrid", "auto_gamma_with_gate", "hybrid_auto", "draft_window", "backlog_scoring", "extension", "output_subset"],
)
def test_adaptive_drafting_is_exact(pair, case: str) -> None:
    target, draft = pair
    drafter, adaptive, controller = _adaptive_cases(draft)[case]
    params = WARPS["temperature_1"]
    counts = engine_counts(target, drafter, params, gamma=3, adaptive=adaptive, planner=controller, prompt=REPEATING)
    if case == "backlog_scoring":
        assert controller.scored >= SAMPLES  # every row's draft scored the token of its plain round
    elif case == "extension":
        assert controller.extended >= SAMPLES // 4  # rows drafted past their plan of one
    elif controller is not None:
        assert any(t > 0 for t in controller.acceptance.bin_trials)  # the gate had drafts to act on
        assert controller.acceptance.confidence_priors > 0  # ...and plans used priors centred by their confidences
    if case == "hybrid_auto":
        assert controller.lookup_rounds >= SAMPLES // 4  # lookups ran, beside the model's gated drafts above
    statistic, threshold = chi_square(counts, exact_joint(target, params, REPEATING))
    assert statistic < threshold, f"{case}: chi2 {statistic:.1f} >= threshold {threshold:.1f}"


# what earlier requests of PROMPT wrote, in the shared cache before the measured ones start: after [1, 2], 3 or 6
# (2/5 each) or 5, so lookups branch
WRITTEN = [(3, 4, 5), (6, 7, 0), (3, 4, 1), (6, 2, 2), (5, 5, 5)]


class TakesLookups(FixedGate):
    """FixedGate proposing every lookup token offered (up to its gamma): lookup rounds draft their widest trees."""

    def lookup_length(self, request_id: str, available: int, batch_size: int) -> tuple[int, float]:
        return min(available, self.max_gamma), 2.0


def suffix_counts(target, drafter, suffix: SuffixDrafter) -> np.ndarray:
    """Histogram of the first LENGTH tokens of SAMPLES rows decoded in one batch under gamma auto (rounds of lookups
    alone may draft trees) by `drafter` (`suffix`, or wrapping it), after WRITTEN went into the shared cache
    (through slots the engine does not use): PROMPT is too short to match itself, so every draft comes from what
    other requests wrote, then from what the other rows commit."""
    config = SpecConfig(max_batch_size=SAMPLES, max_seq_len=len(PROMPT) + LENGTH)
    engine = Engine(target, drafter, config, planner=TakesLookups(3))  # a new engine resets its drafter: fill after
    for slot, written in enumerate(WRITTEN, start=SAMPLES):
        suffix.add_rows([slot], [PROMPT])
        suffix.commit([slot], [list(written)])
        suffix.release_rows([slot])
    return histogram(engine, PROMPT, WARPS["temperature_1"])


def test_suffix_drafting_from_other_requests_is_exact(pair) -> None:
    """Suffix drafts (chains and trees of frequent continuations) taken from a cache other requests wrote to: the
    tokens follow the target's joint distribution. (The hybrid's suffix drafts beside its model: the hybrid case of
    `test_adaptive_drafting_is_exact`.)"""
    suffix = SuffixDrafter()
    counts = suffix_counts(pair[0], suffix, suffix)
    assert suffix.proposed["shared"] >= SAMPLES and suffix.proposed["own"] == 0  # every draft from others' text
    assert suffix.proposed["trees"] >= SAMPLES  # ...every row's first a tree
    statistic, threshold = chi_square(counts, exact_joint(pair[0], WARPS["temperature_1"]))
    assert statistic < threshold, f"chi2 {statistic:.1f} >= threshold {threshold:.1f}"


def test_suffix_frequencies_reported_as_draft_probabilities_fail(pair) -> None:
    """Suffix drafts verified as if drawn from their estimated probabilities (they were chosen, not drawn) must
    fail the same test."""
    suffix = SuffixDrafter()
    counts = suffix_counts(pair[0], SuffixFrequenciesAsProbs(suffix, VOCAB), suffix)
    statistic, threshold = chi_square(counts, exact_joint(pair[0], WARPS["temperature_1"]))
    assert statistic > threshold, f"the broken suffix draft was not detected: chi2 {statistic:.1f} < {threshold:.1f}"


def test_gate_that_drops_the_token_fails(pair) -> None:
    target, draft = pair
    params = WARPS["temperature_1"]
    counts = engine_counts(
        target,
        GateDropsToken(ModelDrafter(draft)),
        params,
        gamma=3,
        adaptive=True,
        planner=FixedGate(3),
        prompt=REPEATING,
    )
    statistic, threshold = chi_square(counts, exact_joint(target, params, REPEATING))
    assert statistic > threshold, f"the broken gate was not detected: chi2 {statistic:.1f} < {threshold:.1f}"


def test_extension_that_drops_the_token_fails(pair) -> None:
    target, draft = pair
    params = WARPS["temperature_1"]
    counts = engine_counts(
        target,
        ExtensionDropsToken(ModelDrafter(draft)),
        params,
        gamma=3,
        adaptive=True,
        planner=Extends(3),
        prompt=REPEATING,
    )
    statistic, threshold = chi_square(counts, exact_joint(target, params, REPEATING))
    assert statistic > threshold, f"the broken extension was not detected: chi2 {statistic:.1f} < {threshold:.1f}"


def test_subset_draft_probabilities_at_the_wrong_ids_fail(pair) -> None:
    target, _ = pair
    params = WARPS["temperature_1"]
    counts = engine_counts(target, SubsetProbsUnmapped(ModelDrafter(subset_draft())), params, gamma=3, prompt=REPEATING)
    statistic, threshold = chi_square(counts, exact_joint(target, params, REPEATING))
    assert statistic > threshold, (
        f"unmapped subset probabilities were not detected: chi2 {statistic:.1f} < {threshold:.1f}"
    )


FEATURE_PROMPTS = [REPEATING, [4, 1, 6], [2]]  # ragged: 7, 2 and 0 prompt tokens fed before the first round
FEATURE_WARP = SamplingParams(temperature=0.7, top_k=6, top_p=0.9, max_new_tokens=LENGTH)


def feature_draft(target, subset: list[int] | None = SUBSET):
    """An EAGLE-3 head on the pair's target (its fused features: the embedding, the middle and the last layer's
    output), its draft vocabulary `subset`, its weights random: distributions that differ by position."""
    from specsample.drafters.eagle import EagleDrafter
    from specsample.models.eagle_head import EagleHead, HeadConfig

    ids = torch.tensor(subset if subset is not None else list(range(VOCAB)))
    head = EagleHead(HeadConfig.for_target(target.config, len(ids), (0, 1, 2))).double()
    generator = torch.Generator().manual_seed(30)
    with torch.no_grad():
        for name, param in head.named_parameters():
            if not name.endswith("norm.weight"):
                param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.5)
        head.lm_head.weight.mul_(0.1)  # a layer that moves its output each step, logits that stay soft
        head.d2t.copy_(ids - torch.arange(len(ids)))
    return EagleDrafter(head.to(DEVICE), target)


def counts_by_prompt(
    target, drafter, params: SamplingParams, planner, prompts: list[list[int]], coupled: bool = False
) -> list[np.ndarray]:
    """Histograms of the first LENGTH tokens per prompt, the prompts' rows interleaved in one ragged batch."""
    config = SpecConfig(max_batch_size=SAMPLES, max_seq_len=max(len(p) for p in prompts) + LENGTH, coupled=coupled)
    engine = Engine(target, drafter, config, planner=planner)
    ids = [
        engine.add_request(prompts[i % len(prompts)], dataclasses.replace(params, seed=5000 + i))
        for i in range(SAMPLES)
    ]
    out: dict[str, list[int]] = {i: [] for i in ids}
    for result in engine.stream():
        for update in result.rows:
            out[update.request_id].extend(update.new_tokens)
    hists = []
    for p in range(len(prompts)):
        index = [sum(t * VOCAB ** (LENGTH - 1 - i) for i, t in enumerate(out[rid])) for rid in ids[p :: len(prompts)]]
        hists.append(np.bincount(index, minlength=VOCAB**LENGTH))
    return hists


def _feature_chi_squares(target, drafter, planner, coupled: bool = False) -> list[tuple[float, float]]:
    return [
        chi_square(counts, exact_joint(target, FEATURE_WARP, prompt))
        for counts, prompt in zip(
            counts_by_prompt(target, drafter, FEATURE_WARP, planner, FEATURE_PROMPTS, coupled), FEATURE_PROMPTS
        )
    ]


@pytest.mark.parametrize("hybrid", [False, True], ids=["feature_draft", "hybrid_with_feature_draft"])
def test_feature_drafting_is_exact(pair, hybrid: bool) -> None:
    """A feature draft under gamma auto (gated), alone or in the hybrid, at temperature 0.7 with top-k and top-p,
    in a ragged batch: each prompt's tokens follow the target's joint distribution."""
    target, _ = pair
    drafter = feature_draft(target)
    if hybrid:
        drafter = HybridDrafter(drafter, NgramDrafter(min_n=1), min_match=2)
    planner = FixedGate(3, per_draft=0.3 if hybrid else 0.05)
    for statistic, threshold in _feature_chi_squares(target, drafter, planner):
        assert statistic < threshold, f"chi2 {statistic:.1f} >= threshold {threshold:.1f}"
    assert any(t > 0 for t in planner.acceptance.bin_trials)  # the head drafted, gated


@pytest.mark.parametrize("broken", ["one_step_ahead", "subset_unmapped"])
def test_broken_feature_drafts_fail(pair, broken: str) -> None:
    """A feature draft reporting the distribution of the next position (a feature one position off), or its subset
    probabilities at the subset's column ids, must fail the same test."""
    target, _ = pair
    wrapped = {"one_step_ahead": ProbsOneStepAhead, "subset_unmapped": SubsetProbsUnmapped}[broken]
    results = _feature_chi_squares(target, wrapped(feature_draft(target)), FixedGamma(3))  # two drafts a round
    assert any(statistic > threshold for statistic, threshold in results), results


TREE = TreeShape(6, 2, 3)  # two children a node, three deep: side branches at every depth


def medusa_draft(target, subset: list[int] | None = SUBSET):
    """Three Medusa heads on the pair's target (its final hidden states), their draft vocabulary `subset`, their
    weights random: each head's distribution differs from the next's."""
    from specsample.drafters.medusa import MedusaDrafter
    from specsample.models.medusa_head import MedusaConfig, MedusaHeads

    ids = torch.tensor(subset if subset is not None else list(range(VOCAB)))
    config = MedusaConfig(target.config.hidden_size, VOCAB, 3, 1, len(ids), shared_output=subset is not None)
    heads = MedusaHeads(config).double()
    generator = torch.Generator().manual_seed(31)
    with torch.no_grad():
        for name, param in heads.named_parameters():
            scale = 0.1 if name.startswith("outputs.") else 0.5  # soft logits, blocks that move each head's vector
            param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * scale)
        heads.token_map.copy_(ids)
    return MedusaDrafter(heads.to(DEVICE), target)


def test_medusa_chains_are_exact(pair) -> None:
    """Medusa heads drafting chains (head k's draw at depth k + 1, its distribution reported) under gamma auto (gated)
    beside prompt lookup, at temperature 0.7 with top-k and top-p, in a ragged batch."""
    target, _ = pair
    drafter = HybridDrafter(medusa_draft(target), NgramDrafter(min_n=1), min_match=2)
    planner = FixedGate(3, per_draft=0.3)
    for statistic, threshold in _feature_chi_squares(target, drafter, planner):
        assert statistic < threshold, f"chi2 {statistic:.1f} >= threshold {threshold:.1f}"
    assert any(t > 0 for t in planner.acceptance.bin_trials)  # the heads drafted, gated


@pytest.mark.parametrize("broken", ["tree_reports_head_probs", "chain_one_head_ahead"])
def test_broken_medusa_drafts_fail(pair, broken: str) -> None:
    """Medusa's tree reporting its heads' distributions as if its nodes were drawn from them, or a chain reporting
    the next head's distribution, must fail the same test."""
    target, _ = pair
    if broken == "tree_reports_head_probs":
        drafter, planner = MedusaTreeReportsHeadProbs(medusa_draft(target, None)), FixedGamma(3, tree=TREE)
    else:
        drafter, planner = ProbsOneStepAhead(medusa_draft(target)), FixedGamma(3)
    results = _feature_chi_squares(target, drafter, planner)
    assert any(statistic > threshold for statistic, threshold in results), results


def tree_drafter(pair, kind: str):
    target, draft = pair
    if kind == "model":
        return ModelDrafter(draft)
    if kind == "feature":
        return feature_draft(target)
    if kind == "medusa":
        return medusa_draft(target)
    return HybridDrafter(ModelDrafter(draft), NgramDrafter(min_n=1), min_match=1)  # lookup branches where it matches


@pytest.mark.parametrize("kind", ["model", "feature", "medusa", "hybrid_lookup"])
def test_tree_drafting_is_exact(pair, kind: str) -> None:
    """Token trees (deterministic top-k children, multi-candidate rejection sampling) from each drafter, alternating
    with chains, at temperature 0.7 with top-k and top-p, in a ragged batch: each prompt's tokens follow the target's
    joint distribution."""
    target, _ = pair
    planner = AlternatingTrees(TREE)
    for statistic, threshold in _feature_chi_squares(target, tree_drafter(pair, kind), planner):
        assert statistic < threshold, f"chi2 {statistic:.1f} >= threshold {threshold:.1f}"


def test_tree_verifier_that_keeps_the_residual_fails(pair, monkeypatch) -> None:
    """A tree verifier that tries a node's next child against the residual from before the last rejection (no
    norm(max(0, p - q)) update) must fail the same test."""
    import specsample.verification.tree as tree_module

    monkeypatch.setattr(tree_module, "rejected_residual", lambda residual, total, token, q: (residual, total))
    results = _feature_chi_squares(pair[0], tree_drafter(pair, "model"), FixedGamma(3, tree=TREE))
    assert any(statistic > threshold for statistic, threshold in results), results


COUPLED_CASES = ["model_chain", "hybrid_gamma_auto", "feature_trees"]


def _coupled_chi_squares(pair, case: str) -> list[tuple[float, float]]:
    """Coupled sampling, each output token the target's Gumbel-max with the row's noise at its position: a model draft
    at a fixed gamma; the hybrid under gamma auto (gated, lookups and model drafts); a feature draft's token trees
    alternating with chains in a ragged batch."""
    target, draft = pair
    if case == "model_chain":
        params = WARPS["temperature_0.7_top_k_5"]
        counts = engine_counts(target, ModelDrafter(draft), params, gamma=2, coupled=True)
        return [chi_square(counts, exact_joint(target, params))]
    if case == "hybrid_gamma_auto":
        params = WARPS["temperature_1"]
        drafter = HybridDrafter(ModelDrafter(draft), NgramDrafter(min_n=1), min_match=2)
        counts = engine_counts(
            target,
            drafter,
            params,
            gamma=3,
            adaptive=True,
            planner=FixedGate(3, per_draft=0.3),
            prompt=REPEATING,
            coupled=True,
        )
        return [chi_square(counts, exact_joint(target, params, REPEATING))]
    return _feature_chi_squares(target, feature_draft(target), AlternatingTrees(TREE), coupled=True)


@pytest.mark.parametrize("case", COUPLED_CASES)
def test_coupled_sampling_is_exact(pair, case: str) -> None:
    for statistic, threshold in _coupled_chi_squares(pair, case):
        assert statistic < threshold, f"{case}: chi2 {statistic:.1f} >= threshold {threshold:.1f}"


def test_coupled_noise_reused_at_every_position_fails(pair, monkeypatch) -> None:
    """Coupled sampling whose noise ignores the position (every position of a request reuses the same Gumbel noise):
    each token alone is still target-distributed, but the tokens of a sequence are no longer independent draws."""
    from specsample.verification.coupled import NoiseStream, position_gumbels

    monkeypatch.setattr(NoiseStream, "gumbel", lambda self, position: position_gumbels(self.seed, 0, self.vocab))
    results = _coupled_chi_squares(pair, "model_chain")
    assert any(statistic > threshold for statistic, threshold in results), results


def test_coupled_verifier_that_trusts_the_draft_fails(pair, monkeypatch) -> None:
    """A coupled verifier that accepts a draft because the draft's own Gumbel-max chose it (every draft), instead of
    checking it is the target's Gumbel-max token, must fail the same test."""
    monkeypatch.setattr(verifier_module, "verify_coupled", coupled_trusts_the_draft)
    results = _coupled_chi_squares(pair, "model_chain")
    assert any(statistic > threshold for statistic, threshold in results), results


@pytest.fixture(scope="module")
def fused_pair():
    """The target on the fused step (bfloat16, each forward's decoder layers in one native call; heads of 32) and the
    float64 draft."""
    if torch.device(DEVICE).type != "cpu" or not row_kernels.available():
        pytest.skip("the fused step runs on CPUs with AVX512-BF16")
    target = tiny_lm(VOCAB, seed=10, init_scale=0.2, num_heads=2, dtype=torch.bfloat16)
    target.use_fused_step()
    draft = tiny_lm(VOCAB, seed=20, init_scale=0.2, num_layers=1, dtype=torch.float64)
    return target, draft


def test_fused_step_is_exact(fused_pair) -> None:
    target, draft = fused_pair
    params = WARPS["temperature_0.7_top_k_5"]
    statistic, threshold = chi_square(engine_counts(target, draft, params, gamma=2), exact_joint(target, params))
    assert statistic < threshold, f"chi2 {statistic:.1f} >= threshold {threshold:.1f}"


@pytest.mark.parametrize("broken", list(BROKEN))
def test_broken_verifier_fails_on_the_fused_step(fused_pair, monkeypatch, broken: str) -> None:
    target, draft = fused_pair
    monkeypatch.setattr(verifier_module, "verify", BROKEN[broken])
    params = WARPS["temperature_1"]
    statistic, threshold = chi_square(engine_counts(target, draft, params, gamma=2), exact_joint(target, params))
    assert statistic > threshold, f"{broken} was not detected: chi2 {statistic:.1f} < {threshold:.1f}"


@pytest.mark.parametrize("kind", ["model", "medusa"])
def test_fused_step_trees_are_exact(fused_pair, kind: str) -> None:
    """Token trees scored by the fused step's tree attention, alternating with chains, in a ragged batch: a draft
    model's, and Medusa heads' reading the fused step's final hidden states."""
    target, _ = fused_pair
    for statistic, threshold in _feature_chi_squares(target, tree_drafter(fused_pair, kind), AlternatingTrees(TREE)):
        assert statistic < threshold, f"chi2 {statistic:.1f} >= threshold {threshold:.1f}"


def test_broken_medusa_tree_fails_on_the_fused_step(fused_pair) -> None:
    """Medusa's tree reporting its heads' distributions as if its nodes were drawn from them fails on the fused step
    too."""
    target, _ = fused_pair
    drafter = MedusaTreeReportsHeadProbs(medusa_draft(target, None))
    results = _feature_chi_squares(target, drafter, FixedGamma(3, tree=TREE))
    assert any(statistic > threshold for statistic, threshold in results), results


def test_tree_verifier_that_keeps_the_residual_fails_on_the_fused_step(fused_pair, monkeypatch) -> None:
    import specsample.verification.tree as tree_module

    monkeypatch.setattr(tree_module, "rejected_residual", lambda residual, total, token, q: (residual, total))
    results = _feature_chi_squares(fused_pair[0], tree_drafter(fused_pair, "model"), FixedGamma(3, tree=TREE))
    assert any(statistic > threshold for statistic, threshold in results), results


class AlternatingGoodput(GoodputPolicy):
    """Speculation off for the whole batch every other round, on in between: every switch both ways, each round."""

    def choose(self, batch_size, rows, round_index):
        choice, memory = super().choose(batch_size, rows, round_index)
        return dataclasses.replace(choice, width=choice.width if round_index % 2 else 0), memory


class PeekingSwitch(GammaController):
    """Broken: turns speculation off for a row where the next uniform its generator will draw is under 0.5, a decision
    that reads the coins the round is about to use."""

    engine: Engine

    def plan(self, batch):
        plan = super().plan(batch)
        generators = {r.request_id: r.generator for r in self.engine.scheduler.running()}
        rows = []
        for state, row in zip(batch.rows, plan.rows):
            peek = torch.Generator().set_state(generators[state.request_id].get_state())
            rows.append(RowPlan() if float(torch.rand(1, generator=peek, dtype=torch.float64)) < 0.5 else row)
        return dataclasses.replace(plan, rows=tuple(rows), stop_thresholds=(), extension=None)


def _switching_chi_square(pair, planner: GammaController) -> tuple[float, float]:
    target, draft = pair
    params = WARPS["temperature_1"]
    config = SpecConfig(max_batch_size=SAMPLES, max_seq_len=len(PROMPT) + LENGTH)
    engine = Engine(target, ModelDrafter(draft), config, planner=planner)
    planner.engine = engine
    return chi_square(histogram(engine, PROMPT, params), exact_joint(target, params))


def test_speculation_switched_off_and_on_for_the_batch_stays_exact(pair) -> None:
    """The goodput policy's switches read only the past: rounds alternating between plain decoding and speculation
    (the draft catching up on what plain rounds committed) give the target's joint distribution."""
    planner = GammaController(2)
    planner.goodput = AlternatingGoodput(planner.costs)
    statistic, threshold = _switching_chi_square(pair, planner)
    assert statistic < threshold, f"chi2 {statistic:.1f} >= threshold {threshold:.1f}"


def test_a_switch_that_reads_the_rounds_coins_fails(pair) -> None:
    statistic, threshold = _switching_chi_square(pair, PeekingSwitch(2))
    assert statistic > threshold, f"a peeking switch was not detected: chi2 {statistic:.1f} < {threshold:.1f}"


SHARED = [(3 * i + 1) % VOCAB for i in range(18)] + PROMPT  # long enough to be copied (scheduler.MIN_REUSED)


def _copied_prefix_chi_square(target, draft) -> tuple[float, float]:
    """SAMPLES rows of SHARED, all admitted beside a running row of the same prompt, each copying that row's cache
    of it (the target's and the draft's) instead of prefilling it: their first tokens against the exact joint."""
    params = WARPS["temperature_0.7_top_k_5"]
    config = SpecConfig(max_batch_size=SAMPLES + 1, max_seq_len=len(SHARED) + LENGTH)
    engine = Engine(target, ModelDrafter(draft), config, planner=FixedGamma(2))
    engine.add_request(SHARED, params)
    engine.step()  # it runs: the rows below copy its prefix
    counts = histogram(engine, SHARED, params)
    return chi_square(counts, exact_joint(target, params, SHARED))


@pytest.mark.parametrize("path", ["torch", "fused"])
def test_rows_copying_a_prefix_are_exact(pair, path: str, request) -> None:
    target, draft = request.getfixturevalue("fused_pair") if path == "fused" else pair
    statistic, threshold = _copied_prefix_chi_square(target, draft)
    assert statistic < threshold, f"chi2 {statistic:.1f} >= threshold {threshold:.1f}"


def test_a_prefix_copy_off_by_one_position_fails(pair, monkeypatch) -> None:
    monkeypatch.setattr(kv_cache.KVCache, "copy_prefix", copy_prefix_off_by_one)
    statistic, threshold = _copied_prefix_chi_square(*pair)
    assert statistic > threshold, f"an off-by-one copy was not detected: chi2 {statistic:.1f} < {threshold:.1f}"


@pytest.mark.slow
@pytest.mark.packages  # its float64 architecture's packages are a build of their own
def test_a_switch_to_compiled_steps_between_rounds_is_exact(pair) -> None:
    """The target's steps switch from eager to its compiled packages between rounds (what a server does once their
    build is done, server/compile_behind.py): rows drafted and verified before and after the switch follow the exact
    joint distribution."""
    if torch.device(DEVICE).type != "cpu":
        pytest.skip("compiled packages run on CPUs")
    from specsample.models.compiled import PackagedDecode

    target, draft = pair
    switched = tiny_lm(VOCAB, seed=10, init_scale=0.2, dtype=torch.float64)
    compiled = PackagedDecode.open(switched)  # built once per session
    params = WARPS["temperature_1"]
    config = SpecConfig(max_batch_size=SAMPLES, max_seq_len=len(PROMPT) + LENGTH)
    engine = Engine(switched, as_drafter(draft), config, planner=FixedGamma(1))
    ids = [engine.add_request(PROMPT, dataclasses.replace(params, seed=1000 + i)) for i in range(SAMPLES)]
    out: dict[str, list[int]] = {i: [] for i in ids}
    emitted_before = 0
    for rounds, result in enumerate(engine.stream()):
        for update in result.rows:
            out[update.request_id].extend(update.new_tokens)
        if rounds == 0:  # one draft per round: every row has tokens left to decode after the switch
            emitted_before = sum(map(len, out.values()))
            switched.compiled = compiled
    assert 0 < emitted_before < SAMPLES * LENGTH
    index = [sum(t * VOCAB ** (LENGTH - 1 - i) for i, t in enumerate(out[rid])) for rid in ids]
    counts = np.bincount(index, minlength=VOCAB**LENGTH)
    statistic, threshold = chi_square(counts, exact_joint(target, params))
    assert statistic < threshold, f"chi2 {statistic:.1f} >= threshold {threshold:.1f}"
