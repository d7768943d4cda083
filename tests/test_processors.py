"""Processors and log-probabilities through the engine: settings are checked, each emitted token's logprob is the
target's (processed) as target-only decoding computes it, greedy speculation under processors and grammars equals
target-only decoding with every drafter (chains, lookups, trees, feature drafts), and the grammar is followed.
Exactness at T > 0 is in test_processor_exactness.py."""

from __future__ import annotations

import pytest
import torch
from test_eagle import random_head
from test_medusa import random_heads

from specsample import Engine, ModelDrafter, SamplingParams, SpecConfig, tiny_lm
from specsample.config import Grammar, SettingError, TreeShape
from specsample.drafters.eagle import EagleDrafter
from specsample.drafters.hybrid import HybridDrafter
from specsample.drafters.medusa import MedusaDrafter
from specsample.drafters.ngram import NgramDrafter
from specsample.grammar import GrammarCompiler
from specsample.planner import FixedGamma

VOCAB = 16
LETTERS = "abcdefghijklmnop"
PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 9, 4], [7]]
PROCESSED = dict(presence_penalty=0.4, frequency_penalty=0.9, repetition_penalty=1.3, logit_bias={4: 2.0, 6: -3.0})
# an item is "a" then b-e, or f-h then a-c then "d", or "b"; the output is items
EBNF = 'root ::= item+\nitem ::= "a" [b-e] | [f-h] [a-c] "d" | "b"'


@pytest.fixture(scope="module")
def target():
    return tiny_lm(VOCAB, seed=3, init_scale=0.2, dtype=torch.float64)


@pytest.fixture(scope="module")
def draft():
    return tiny_lm(VOCAB, seed=5, init_scale=0.2, num_layers=1, dtype=torch.float64)


def run(
    target, drafter, params: SamplingParams, prompts=PROMPTS, tree: TreeShape | None = None, speculative: bool = True
) -> list[tuple[list[int], list]]:
    engine = Engine(
        target,
        drafter,
        SpecConfig(max_batch_size=len(prompts)),
        planner=FixedGamma(3, tree),
        grammars=GrammarCompiler.from_vocab(list(LETTERS)),
    )
    ids = [engine.add_request(p, params, speculative=speculative) for p in prompts]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    logprobs: dict[str, list] = {i: [] for i in ids}
    for result in engine.stream():
        for update in result.rows:
            assert update.finish_reason != "error"
            tokens[update.request_id].extend(update.new_tokens)
            logprobs[update.request_id].extend(update.logprobs or ())
    return [(tokens[i], logprobs[i]) for i in ids]


def reference_logits(target, prompt: list[int], output: list[int], params: SamplingParams) -> torch.Tensor:
    """Target-only: one forward over prompt + output, each position's logits processed as written out here."""
    with torch.no_grad():
        logits = target(torch.tensor([prompt + output]))[0, len(prompt) - 1 : -1].clone()  # [len(output), vocab]
    for t in range(len(output)):
        counts = torch.bincount(torch.tensor(output[:t], dtype=torch.long), minlength=VOCAB).double()
        seen = (counts > 0) | torch.isin(torch.arange(VOCAB), torch.tensor(prompt))
        row = logits[t]
        row = torch.where(
            seen, torch.where(row > 0, row / params.repetition_penalty, row * params.repetition_penalty), row
        )
        row = row - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).double()
        for token, bias in params.logit_bias:
            row[token] += bias
        logits[t] = row
    return logits


def test_settings_are_checked() -> None:
    for kwargs, name in [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {1: 101}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logprobs": 21}, "logprobs"),
        ({"grammar": "json"}, "grammar"),
    ]:
        with pytest.raises(SettingError) as caught:
            SamplingParams(**kwargs)
        assert caught.value.name == name
    with pytest.raises(SettingError, match="not valid JSON"):
        Grammar("json_schema", "{")
    assert SamplingParams(logit_bias={3: 1, 1: -2}).logit_bias == ((1, -2.0), (3, 1.0))
    assert not SamplingParams().processed and SamplingParams(presence_penalty=0.1).processed


def test_engine_refuses_what_it_cannot_honour(target) -> None:
    engine = Engine(target, None, SpecConfig(max_batch_size=1))
    with pytest.raises(SettingError) as caught:
        engine.add_request([1], SamplingParams(logit_bias={VOCAB: 1.0}))
    assert caught.value.name == "logit_bias"
    with pytest.raises(SettingError, match="no grammar compiler") as caught:
        engine.add_request([1], SamplingParams(grammar=Grammar("json_object")))
    engine = Engine(target, None, SpecConfig(max_batch_size=1), grammars=GrammarCompiler.from_vocab(list(LETTERS)))
    with pytest.raises(SettingError, match="cannot be compiled") as caught:
        engine.add_request([1], SamplingParams(grammar=Grammar("ebnf", "root ::= (")))
    assert caught.value.name == "grammar"


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_are_the_targets_processed_distribution(target, draft, temperature: float) -> None:
    """Every emitted token (accepted drafts, recovered and bonus tokens; a lookup and a model draft) carries the
    log-probability target-only decoding gives it under the same processors, and the top alternatives'."""
    params = SamplingParams(temperature=temperature, max_new_tokens=12, seed=4, logprobs=3, **PROCESSED)
    drafter = HybridDrafter(ModelDrafter(draft), NgramDrafter(min_n=1), min_match=1)
    for prompt, (tokens, logprobs) in zip(PROMPTS, run(target, drafter, params)):
        assert [lp.token for lp in logprobs] == tokens and len(tokens) == 12
        expected = torch.log_softmax(reference_logits(target, prompt, tokens, params), dim=-1)  # [n, vocab]
        got = torch.tensor([lp.logprob for lp in logprobs], dtype=torch.float64)
        assert torch.allclose(got, expected.gather(-1, torch.tensor(tokens).unsqueeze(-1)).squeeze(-1), atol=1e-9)
        for position, lp in enumerate(logprobs):
            top = expected[position].topk(3)
            assert [t for t, _ in lp.top] == top.indices.tolist()
            assert torch.allclose(torch.tensor([v for _, v in lp.top], dtype=torch.float64), top.values, atol=1e-9)


@pytest.mark.parametrize("kind", ["model", "lookup", "model_tree", "feature_tree", "medusa_tree", "hybrid_tree"])
def test_greedy_under_processors_and_grammar_is_target_only(target, draft, kind: str) -> None:
    """Greedy speculation under penalties and a grammar gives target-only decoding's tokens (plain rounds through the
    same processors), with chains, lookups and trees of every drafter; the output follows the grammar."""
    tree = TreeShape(6, 2, 3) if kind.endswith("tree") else None
    make = {
        "model": lambda: ModelDrafter(draft),
        "lookup": lambda: NgramDrafter(min_n=1),
        "model_tree": lambda: ModelDrafter(draft),
        "feature_tree": lambda: EagleDrafter(random_head(target), target),
        "medusa_tree": lambda: MedusaDrafter(random_heads(target), target),
        "hybrid_tree": lambda: HybridDrafter(ModelDrafter(draft), NgramDrafter(min_n=1), min_match=1),
    }[kind]
    params = SamplingParams(temperature=0, max_new_tokens=14, grammar=Grammar("ebnf", EBNF), **PROCESSED)
    plain = run(target, None, params)
    speculative = run(target, make(), params, tree=tree)
    assert [t for t, _ in speculative] == [t for t, _ in plain]
    matcher = GrammarCompiler.from_vocab(list(LETTERS)).matcher(params.grammar)
    for tokens, _ in speculative:
        assert matcher.commit(tokens), "".join(LETTERS[t] for t in tokens)
        matcher = GrammarCompiler.from_vocab(list(LETTERS)).matcher(params.grammar)


def test_penalties_change_the_output(target, draft) -> None:
    plain = run(target, ModelDrafter(draft), SamplingParams(temperature=0, max_new_tokens=16))
    penalised = run(
        target, ModelDrafter(draft), SamplingParams(temperature=0, max_new_tokens=16, frequency_penalty=2.0)
    )
    assert [t for t, _ in plain] != [t for t, _ in penalised]
    for tokens, _ in penalised:  # a strong frequency penalty spreads the tokens out
        assert max(tokens.count(t) for t in set(tokens)) <= max(max(t.count(x) for x in set(t)) for t, _ in plain)
