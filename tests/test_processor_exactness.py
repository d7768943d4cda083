"""Sequences under processors: with penalties and logit bias, or under a grammar, the engine's first 3 tokens follow
the exact joint distribution of the target processed the same way.

The reference is enumerated from the target (vocabulary 8: 512 sequences) with the processors written out here
independently of `specsample.processors`. Penalties and bias: the draft model in chains of 2. The grammar: the
hybrid (the draft model, and prompt lookups on a repeating prompt: deterministic drafts the grammar may disallow) in
tree rounds alternating with chain rounds. min_tokens: the draft model in chains of 2, an end-of-sequence token
masked at the first two positions. Broken twins that must fail: the target's penalties counting only committed
tokens (not the round's earlier drafts), a grammar whose state is not rolled back after a rejection, a draft that
samples unprocessed but reports the processed q, and min_tokens counting only committed tokens.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
import torch
from broken import WrappedDrafter
from devices import DEVICE
from planner_driver import AlternatingTrees
from stats_util import chi_square

from specsample import Engine, ModelDrafter, SamplingParams, SpecConfig, tiny_lm
from specsample.config import Grammar, TreeShape
from specsample.drafters.hybrid import HybridDrafter
from specsample.drafters.ngram import NgramDrafter
from specsample.grammar import GrammarCompiler, Matcher
from specsample.planner import FixedGamma
from specsample.processors import Shaper
from specsample.sampling import warp_probs

VOCAB = 8
LENGTH = 3
SAMPLES = 4_000
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]  # repeats itself: prompt lookup proposes 3, 1, 2, ...
TREE = TreeShape(6, 2, 3)
PENALTIES = SamplingParams(
    temperature=0.9,
    max_new_tokens=LENGTH,
    presence_penalty=0.7,
    frequency_penalty=1.3,
    repetition_penalty=1.6,
    logit_bias={5: 1.5, 0: -1.0},
)
EOS = 4
MIN_TOKENS = SamplingParams(temperature=0.9, max_new_tokens=LENGTH, min_tokens=2)  # EOS allowed at the third token
# tokens a..h; an item is "a" then one of b-e, or one of f-h, one of a-c, then "d", or "b" alone
LETTERS = "abcdefgh"
EBNF = 'root ::= item+\nitem ::= "a" [b-e] | [f-h] [a-c] "d" | "b"'
GRAMMAR = SamplingParams(temperature=1.0, top_k=6, max_new_tokens=LENGTH, grammar=Grammar("ebnf", EBNF))
# the grammar as a hand-written automaton: state -> {allowed token: next state}
AUTOMATON = {
    "item": {0: "a", 1: "item", 5: "f", 6: "f", 7: "f"},
    "a": {1: "item", 2: "item", 3: "item", 4: "item"},
    "f": {0: "d", 1: "d", 2: "d"},
    "d": {3: "item"},
}


@pytest.fixture(scope="module")
def pair():
    target = tiny_lm(VOCAB, seed=10, init_scale=0.2, dtype=torch.float64, device=DEVICE)
    draft = tiny_lm(VOCAB, seed=20, init_scale=0.2, num_layers=1, dtype=torch.float64, device=DEVICE)
    return target, draft


def processed_reference(logits: np.ndarray, prompt: list[int], output: list[int], params: SamplingParams) -> np.ndarray:
    """The logits after the processors, written out: repetition over prompt and output, then frequency and presence
    over the output, then the bias, then the grammar's automaton."""
    out = logits.copy()
    counts = np.bincount(output, minlength=VOCAB).astype(np.float64)
    seen = (counts > 0) | np.isin(np.arange(VOCAB), prompt)
    rp = params.repetition_penalty
    out = np.where(seen, np.where(out > 0, out / rp, out * rp), out)
    out = out - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)
    for token, bias in params.logit_bias:
        out[token] += bias
    if params.grammar is not None:
        state = "item"
        for token in output:
            state = AUTOMATON[state][token]
        out = np.where(np.isin(np.arange(VOCAB), list(AUTOMATON[state])), out, -np.inf)
    if len(output) < params.min_tokens:
        out[EOS] = -np.inf
    return out


def exact_joint(target, params: SamplingParams, prompt: list[int] = PROMPT) -> np.ndarray:
    """P(x1, x2, x3 | prompt) under the processors, for all VOCAB**3 sequences (x1 * V^2 + x2 * V + x3)."""
    seqs = list(itertools.product(range(VOCAB), repeat=LENGTH))
    inputs = torch.cat([torch.tensor(prompt).expand(len(seqs), -1), torch.tensor(seqs)], dim=1)
    with torch.no_grad():
        logits = target(inputs.to(DEVICE))[:, len(prompt) - 1 : -1].cpu().numpy()  # [V^3, 3, V]
    joint = np.ones(len(seqs))
    for n, seq in enumerate(seqs):
        for t in range(LENGTH):
            processed = processed_reference(logits[n, t], prompt, list(seq[:t]), params)
            if np.isneginf(processed[seq[t]]):
                joint[n] = 0.0
                break
            probs = warp_probs(torch.tensor(processed).unsqueeze(0), params)[0].numpy()
            joint[n] *= probs[seq[t]]
    return joint


def grammars() -> GrammarCompiler:
    return GrammarCompiler.from_vocab(list(LETTERS))


def engine_counts(target, drafter, params: SamplingParams, planner) -> np.ndarray:
    """Histogram of the first LENGTH tokens over SAMPLES rows of one batch."""
    config = SpecConfig(max_batch_size=SAMPLES, max_seq_len=len(PROMPT) + LENGTH)
    eos = [EOS] if params.min_tokens else []  # with min_tokens = LENGTH - 1, EOS may end only the last token
    engine = Engine(target, drafter, config, eos_token_ids=eos, planner=planner, grammars=grammars())
    ids = [engine.add_request(PROMPT, dataclasses.replace(params, seed=7000 + i)) for i in range(SAMPLES)]
    out: dict[str, list[int]] = {i: [] for i in ids}
    for result in engine.stream():
        for update in result.rows:
            assert update.finish_reason != "error"
            out[update.request_id].extend(update.new_tokens)
    index = [sum(t * VOCAB ** (LENGTH - 1 - i) for i, t in enumerate(out[rid])) for rid in ids]
    return np.bincount(index, minlength=VOCAB**LENGTH)


def test_penalties_and_bias_are_exact(pair) -> None:
    target, draft = pair
    counts = engine_counts(target, ModelDrafter(draft), PENALTIES, FixedGamma(2))
    statistic, threshold = chi_square(counts, exact_joint(target, PENALTIES))
    assert statistic < threshold, f"chi2 {statistic:.1f} >= threshold {threshold:.1f}"


def test_grammar_with_lookups_and_trees_is_exact(pair) -> None:
    target, draft = pair
    drafter = HybridDrafter(ModelDrafter(draft), NgramDrafter(min_n=1), min_match=1)
    statistic, threshold = chi_square(
        engine_counts(target, drafter, GRAMMAR, AlternatingTrees(TREE)), exact_joint(target, GRAMMAR)
    )
    assert statistic < threshold, f"chi2 {statistic:.1f} >= threshold {threshold:.1f}"


def test_min_tokens_is_exact(pair) -> None:
    target, draft = pair
    counts = engine_counts(target, ModelDrafter(draft), MIN_TOKENS, FixedGamma(2))
    statistic, threshold = chi_square(counts, exact_joint(target, MIN_TOKENS))
    assert statistic < threshold, f"chi2 {statistic:.1f} >= threshold {threshold:.1f}"


def _min_tokens_of_committed_tokens_only(monkeypatch) -> None:
    """Every position of a round masked as if the round's earlier drafts were not output yet."""
    monkeypatch.setattr(Shaper, "output_lengths", lambda self, index, drafts_before: self.output_length[index])


def _penalties_of_committed_tokens_only(monkeypatch) -> None:
    """The target's positions processed as if no draft preceded them in the round."""
    real = Shaper.block_logits

    def broken(self, logits, slots, tokens, parents):
        pending_only = tokens[:, :1].expand(tokens.shape).clone()
        processed = real(self, logits, slots, pending_only, None)
        return processed

    monkeypatch.setattr(Shaper, "block_logits", broken)


def _grammar_not_rolled_back(monkeypatch) -> None:
    """A matcher that commits the round's tokens on top of the drafts it followed, rejected ones included."""

    def broken(self, tokens):
        for token in tokens:
            if not self._matcher.is_terminated():
                self._matcher.accept_token(int(token))
        self._path = []
        return True

    monkeypatch.setattr(Matcher, "commit", broken)


class DrawsUnprocessed(WrappedDrafter):
    """A draft model that draws each token from its unprocessed distribution while reporting the processed one."""

    def __init__(self, draft) -> None:
        super().__init__(ModelDrafter(draft))

    def propose(self, request):
        unprocessed = self.inner.propose(dataclasses.replace(request, shaper=None, tree=None))
        # the processed q of the same drafts: processed logits at each drawn position, warped
        logits = torch.log(unprocessed.probs.clamp(min=1e-300))
        paths = [[row[:j] for j in range(len(row))] for row in unprocessed.tokens.tolist()]
        probs = unprocessed.probs.clone()
        for j in range(unprocessed.tokens.shape[1]):
            shaped = request.shaper.next_logits(logits[:, j], request.slots, [p[j] for p in paths])
            probs[:, j] = warp_probs(shaped, request.params[0])
        return dataclasses.replace(unprocessed, probs=probs)


@pytest.mark.parametrize(
    "broken",
    [
        "penalties_of_committed_tokens_only",
        "grammar_not_rolled_back",
        "draws_unprocessed",
        "min_tokens_of_committed_tokens_only",
    ],
)
def test_broken_processing_fails(pair, monkeypatch, broken: str) -> None:
    target, draft = pair
    params, drafter, planner = PENALTIES, ModelDrafter(draft), FixedGamma(2)
    if broken == "penalties_of_committed_tokens_only":
        _penalties_of_committed_tokens_only(monkeypatch)
    elif broken == "grammar_not_rolled_back":
        _grammar_not_rolled_back(monkeypatch)
        params, planner = GRAMMAR, FixedGamma(1)
    elif broken == "min_tokens_of_committed_tokens_only":
        _min_tokens_of_committed_tokens_only(monkeypatch)
        params = MIN_TOKENS
    else:
        drafter = DrawsUnprocessed(draft)
    statistic, threshold = chi_square(engine_counts(target, drafter, params, planner), exact_joint(target, params))
    assert statistic > threshold, f"{broken} was not detected: chi2 {statistic:.1f} < {threshold:.1f}"
