"""Coupled sampling: a seeded request gives the same tokens whatever the plan (gamma, gamma auto, trees, drafter) and
whatever shares its batch, the tokens plain decoding with that seed gives. Its exactness is tested in
test_exactness.py."""

from __future__ import annotations

import httpx
import pytest
import torch

from specsample import ModelDrafter, SamplingParams, SpecConfig, generate
from specsample.config import TreeShape
from specsample.drafters.hybrid import HybridDrafter
from specsample.drafters.ngram import NgramDrafter
from specsample.planner import FixedGamma, GammaController
from specsample.verification.coupled import NoiseStream, position_gumbels

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
COMPANIONS = [[7, 7, 7], [1, 2, 3, 1, 2, 3, 1, 2, 3], [30, 29]]
PARAMS = SamplingParams(temperature=0.8, top_k=20, max_new_tokens=24, seed=1234)
COMPANION_PARAMS = [
    SamplingParams(temperature=1.0, max_new_tokens=25, seed=5),
    SamplingParams(temperature=0, max_new_tokens=24),
    SamplingParams(temperature=0.6, top_p=0.9, max_new_tokens=12, seed=99),
]


def _run(
    target,
    drafter,
    planner,
    companions: bool,
    coupled: bool = True,
    tree: TreeShape | None = None,
    speculative: bool = True,
) -> list[int]:
    """The seeded request's tokens, run alone or first in a batch with the companions."""
    prompts = [PROMPT] + (COMPANIONS if companions else [])
    params = [PARAMS] + (COMPANION_PARAMS if companions else [])
    config = SpecConfig(max_batch_size=len(prompts), coupled=coupled, speculative=speculative)
    return generate(target, prompts, params, draft=drafter, config=config, planner=planner).completions[0].token_ids


def test_a_seed_gives_the_same_tokens_under_any_plan_and_batch(tiny_target, tiny_draft) -> None:
    plain = _run(tiny_target, None, FixedGamma(1), companions=False, speculative=False)
    runs = {
        "gamma 1, alone": _run(tiny_target, ModelDrafter(tiny_draft), FixedGamma(1), companions=False),
        "gamma 4, in a batch": _run(tiny_target, ModelDrafter(tiny_draft), FixedGamma(4), companions=True),
        "gamma auto, in a batch": _run(tiny_target, ModelDrafter(tiny_draft), GammaController(4), companions=True),
        "hybrid, gamma 3": _run(
            tiny_target, HybridDrafter(ModelDrafter(tiny_draft), NgramDrafter(min_n=1)), FixedGamma(3), companions=True
        ),
        "prompt lookup, gamma 4": _run(tiny_target, NgramDrafter(min_n=1), FixedGamma(4), companions=True),
        "trees": _run(
            tiny_target,
            ModelDrafter(tiny_draft),
            FixedGamma(4, tree=TreeShape(6, 2, 3)),
            companions=True,
            tree=TreeShape(6, 2, 3),
        ),
    }
    assert len(plain) == PARAMS.max_new_tokens
    for name, tokens in runs.items():
        assert tokens == plain, name


def test_rejection_sampling_depends_on_the_plan(tiny_target, tiny_draft) -> None:
    """What the test above rules out happens without coupling: the same seed, another gamma, other tokens."""
    one = _run(tiny_target, ModelDrafter(tiny_draft), FixedGamma(1), companions=False, coupled=False)
    four = _run(tiny_target, ModelDrafter(tiny_draft), FixedGamma(4), companions=True, coupled=False)
    assert one != four


def test_noise_depends_on_seed_and_position_only() -> None:
    stream = NoiseStream(7, 50)
    first = stream.gumbel(3).clone()
    stream.gumbel(4)
    stream.forget_before(4)
    assert torch.equal(stream.gumbel(3), first)  # recomputed, not advanced
    assert torch.equal(position_gumbels(7, 3, 50), first)
    assert not torch.equal(position_gumbels(7, 4, 50), first)
    assert not torch.equal(position_gumbels(8, 3, 50), first)
    assert torch.equal(position_gumbels(2**64 - 1, 0, 5), position_gumbels(2**64 - 1, 0, 5))


@pytest.mark.parametrize("speculative", [True, False])
def test_greedy_rows_beside_coupled_rows_stay_greedy(tiny_target, tiny_draft, speculative: bool) -> None:
    greedy = SamplingParams(temperature=0, max_new_tokens=20)
    alone = generate(tiny_target, [PROMPT], greedy).completions[0].token_ids
    mixed = generate(
        tiny_target,
        [PROMPT, PROMPT],
        [greedy, PARAMS],
        draft=ModelDrafter(tiny_draft),
        config=SpecConfig(max_batch_size=2, coupled=True, speculative=speculative),
        planner=FixedGamma(3),
    )
    assert mixed.completions[0].token_ids == alone


@pytest.fixture(scope="module")
def coupled_server(tmp_path_factory):
    from live_server import LiveServer
    from model_factory import make_tokenizer, write_hf_model

    from specsample.options import EngineOptions
    from specsample.server.options import ServerOptions
    from specsample.server.state import SpecServer
    from specsample.speculator import load

    root = tmp_path_factory.mktemp("coupled")
    tokenizer = make_tokenizer()
    target = write_hf_model(root / "target", "llama", tokenizer=tokenizer, max_position_embeddings=128)
    draft = write_hf_model(root / "draft", "llama", tokenizer=tokenizer, seed=3, num_hidden_layers=1)
    speculator = load(
        EngineOptions(
            target=str(target),
            draft=str(draft),
            gamma="auto",
            max_gamma=4,
            dtype="bfloat16",
            sampling="coupled",
            deterministic=True,
        )
    )
    server = LiveServer(SpecServer(speculator, ServerOptions(model_name="tiny", max_batch_size=8, max_seq_len=128)))
    yield server
    server.close()


def test_choice_i_of_seed_s_is_seed_s_plus_i(coupled_server) -> None:
    """The server seeds choice i of a request with seed + i (docs/serving.md): choice 1 of seed 77, decoded beside
    choice 0, equals a request of its own with seed 78 decoded beside other requests."""
    import concurrent.futures

    client = coupled_server.client()

    def complete(seed: int, n: int = 1, prompt: str = "hello world"):
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0.9, seed=seed, n=n)

    pair = complete(77, n=2)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        others = [pool.submit(complete, 5, 1, "the other one") for _ in range(3)]
        alone = [pool.submit(complete, seed) for seed in (77, 78)]
        [f.result() for f in others]
    texts = [c.text for c in sorted(pair.choices, key=lambda c: c.index)]
    assert texts == [alone[0].result().choices[0].text, alone[1].result().choices[0].text]
    assert texts[0] != texts[1]
    health = httpx.get(coupled_server.url + "/health").json()
    assert health["sampling"] == "coupled" and health["deterministic"] is True


def test_verify_coupled_accepts_exactly_the_targets_gumbel_max_tokens() -> None:
    from specsample.verification.coupled import DraftNoise, coupled_choices, verify_coupled

    torch.manual_seed(0)
    target_probs = torch.softmax(torch.randn(3, 4, 50, dtype=torch.float64), dim=-1)  # [b, gamma + 1, vocab]
    noise = [DraftNoise(NoiseStream(seed, 50), start) for seed, start in ((1, 0), (2, 7), (3, 2))]
    choice, _ = coupled_choices(target_probs, noise, [range(4)] * 3)
    drafts = choice[:, :3].clone()
    drafts[1, 1] = (drafts[1, 1] + 1) % 50  # row 1 differs at its second draft
    drafts[2, 0] = (drafts[2, 0] + 1) % 50  # row 2 at its first
    verdict = verify_coupled(drafts, target_probs, noise)
    assert verdict.num_accepted.tolist() == [3, 1, 0]
    assert verdict.next_token.tolist() == [int(choice[0, 3]), int(choice[1, 1]), int(choice[2, 0])]
    assert not verdict.failed.any()


def test_verify_coupled_fails_only_the_row_without_a_distribution() -> None:
    from specsample.verification.coupled import DraftNoise, verify_coupled

    target_probs = torch.full((2, 2, 10), 0.1, dtype=torch.float64)
    target_probs[1, 0] = float("nan")
    noise = [DraftNoise(NoiseStream(1, 10), 0), DraftNoise(NoiseStream(2, 10), 0)]
    verdict = verify_coupled(torch.zeros(2, 1, dtype=torch.long), target_probs, noise)
    assert verdict.failed.tolist() == [False, True]


@pytest.mark.slow
def test_real_float32_seed_gives_the_same_tokens_at_any_gamma() -> None:
    """SmolLM2-135M in float32 with its shipped hybrid draft, coupled: one seed at gamma 4, gamma auto and plain
    decoding gives the same tokens (in bfloat16 this needs deterministic mode: docs/exactness.md)."""
    from dataclasses import replace

    from specsample.options import EngineOptions
    from specsample.speculator import load

    speculator = load(EngineOptions(dtype="float32", sampling="coupled"))
    tokenizer, model = speculator.pair.target.tokenizer, speculator.pair.target.model
    for index, text in enumerate(["Write a short poem about the sea."]):
        prompt = tokenizer.encode(text, chat=True)
        params = SamplingParams(temperature=0.7, max_new_tokens=32, seed=1000 + index)
        outputs = []
        for planner in (FixedGamma(4), GammaController(8), None):
            config = replace(speculator.spec_config(1), speculative=planner is not None)
            outputs.append(
                generate(model, [prompt], params, draft=speculator.drafter, config=config, planner=planner)
                .completions[0]
                .token_ids
            )
        assert outputs[0] == outputs[1] == outputs[2], text
