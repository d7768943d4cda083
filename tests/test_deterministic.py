"""Deterministic mode: batch- and shape-invariant target forwards, so speculative greedy equals plain greedy token for
token in bfloat16 and a seed gives bitwise the same tokens whatever the plan and the batch; its settings are refused
where they cannot be honoured."""

from __future__ import annotations

import pytest
import torch
from test_faults import run_cli

from specsample import ModelDrafter, SamplingParams, SpecConfig, generate
from specsample.config import SettingError
from specsample.models.invariant import check_invariance
from specsample.models.tiny import tiny_lm
from specsample.options import EngineOptions
from specsample.planner import FixedGamma, GammaController
from specsample.speculator import make_deterministic

PROMPTS = [[5, 17, 300, 42, 9, 11], [400, 401, 2], [7] * 12, [123, 45, 67, 89, 10, 111, 213, 314, 415]]
GREEDY = SamplingParams(temperature=0, max_new_tokens=24)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=24, seed=2024)


def _bf16_target():
    # wide enough (256) that bfloat16 matrix products round differently by the number of rows
    return tiny_lm(512, seed=1, hidden_size=256, num_layers=2, init_scale=0.2, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def bf16_pair():
    target = _bf16_target()
    target.set_deterministic(True)
    draft = tiny_lm(512, seed=2, hidden_size=64, num_layers=1, init_scale=0.2, dtype=torch.bfloat16)
    return target, draft


def _tokens(target, draft, params, planner, companions: bool, speculative: bool = True) -> list[list[int]]:
    """The first prompt's tokens, alone or in a batch with the others (each with `params`)."""
    prompts = PROMPTS if companions else PROMPTS[:1]
    config = SpecConfig(max_batch_size=len(prompts), coupled=True, speculative=speculative)
    result = generate(
        target, prompts, params, draft=None if draft is None else ModelDrafter(draft), config=config, planner=planner
    )
    return [c.token_ids for c in result.completions]


def test_forwards_are_invariant_only_in_deterministic_mode() -> None:
    target = _bf16_target()
    with pytest.raises(RuntimeError, match="differently from one-token forwards"):
        check_invariance(target)  # the kernels' own rounding depends on the block and the batch
    target.set_deterministic(True)
    check_invariance(target)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_speculation_equals_plain_decoding_bitwise_in_bfloat16(bf16_pair, params) -> None:
    target, draft = bf16_pair
    plain = _tokens(target, None, params, FixedGamma(1), companions=False, speculative=False)[0]
    for name, planner, companions in [
        ("gamma 1", FixedGamma(1), False),
        ("gamma 4 in a batch", FixedGamma(4), True),
        ("gamma auto in a batch", GammaController(4), True),
    ]:
        assert _tokens(target, draft, params, planner, companions)[0] == plain, name


def test_every_row_of_a_batch_equals_the_row_alone(bf16_pair) -> None:
    target, draft = bf16_pair
    batched = _tokens(target, draft, GREEDY, FixedGamma(3), companions=True)
    alone = [generate(target, [p], GREEDY).completions[0].token_ids for p in PROMPTS]
    assert batched == alone


@pytest.mark.parametrize(
    "options, name",
    [
        (dict(deterministic=True, sampling="rejection"), "sampling"),
        (dict(deterministic=True, compile=True), "deterministic"),
        (dict(deterministic=True, runtime="hf"), "deterministic"),
        (dict(deterministic="yes"), "deterministic"),
        (dict(sampling="gumbel"), "sampling"),
    ],
)
def test_settings_that_cannot_be_honoured_are_refused(options, name) -> None:
    with pytest.raises(SettingError) as caught:
        EngineOptions(**options)
    assert caught.value.name == name


def test_sampling_default_and_deterministic_coupling() -> None:
    assert EngineOptions(deterministic=True).coupled
    assert EngineOptions(sampling="coupled").coupled and not EngineOptions(sampling="rejection").coupled


def test_deterministic_mode_needs_our_runtime() -> None:
    with pytest.raises(SettingError, match="our Llama-family runtime"):
        make_deterministic(object(), "some/hf-model")


@pytest.mark.parametrize("command", [["generate", "hi", "--target"], ["serve", "--model"]])
def test_cli_refuses_deterministic_rejection_before_loading(command) -> None:
    done = run_cli(*command, "no-such-model", "--deterministic", "--sampling", "rejection")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "argument --sampling" in lines[0] and "Traceback" not in done.stderr


@pytest.mark.slow
def test_real_bfloat16_speculative_greedy_equals_plain_greedy() -> None:
    """SmolLM2-135M in bfloat16 with its shipped draft, deterministic: speculative greedy (gamma 4 and gamma auto, in a
    batch) gives plain greedy's tokens for every prompt, each decoded alone."""
    from specsample.speculator import load

    speculator = load(EngineOptions(dtype="bfloat16", deterministic=True))
    tokenizer = speculator.pair.target.tokenizer
    prompts = [
        "Write a short poem about the sea.",
        "List three prime numbers and explain why they are prime.",
        "What is the capital of France? Answer in one sentence.",
    ]
    ids = [tokenizer.encode(p, chat=True) for p in prompts]
    params = SamplingParams(temperature=0, max_new_tokens=32)

    def decode(engine) -> list[list[int]]:
        request_ids = [engine.add_request(p, params) for p in ids]
        out = {r: [] for r in request_ids}
        for result in engine.stream():
            for update in result.rows:
                out[update.request_id].extend(update.new_tokens)
        return [out[r] for r in request_ids]

    plain = [decode_one(speculator, p, params) for p in ids]
    for name, planner in [("gamma 4", FixedGamma(4)), ("gamma auto", None)]:
        assert decode(speculator.engine(max_batch_size=len(ids), planner=planner)) == plain, name


def decode_one(speculator, prompt: list[int], params: SamplingParams) -> list[int]:
    """Plain decoding of one prompt alone."""
    engine = speculator.engine(drafter=None)
    request_id = engine.add_request(prompt, params)
    return [
        t
        for result in engine.stream()
        for update in result.rows
        if update.request_id == request_id
        for t in update.new_tokens
    ]
