"""Feature drafts (EAGLE heads): the head's folder, drafting through the engine (greedy output is the target's, the
head's cache follows the committed text), the target's features at no extra forward, and training (the loss falls,
a resumed run ends where an uninterrupted one does)."""

from __future__ import annotations

import json

import pytest
import torch

from model_factory import make_tokenizer, write_hf_model
from specsample import DraftRequest, Engine, SamplingParams, SpecConfig, generate, tiny_lm
from specsample.drafters.eagle import EagleDrafter, EagleHead, HeadConfig, is_head_folder
from specsample.drafters.hybrid import HybridDrafter
from specsample.models.base import prefill_ragged
from specsample.planner import FixedGamma, GammaController

VOCAB = 48
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [9, 8, 7], [3], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]]


@pytest.fixture(scope="module")
def target():
    return tiny_lm(VOCAB, seed=3, init_scale=0.2, dtype=torch.float64)


def random_head(target, seed: int = 4) -> EagleHead:
    head = EagleHead(HeadConfig.of(target.config)).double()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in head.named_parameters():
            if not name.endswith("norm.weight"):
                param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.2)
    return head


def drafter(target, subset: list[int] | None = None) -> EagleDrafter:
    return EagleDrafter(random_head(target), target, None if subset is None else torch.tensor(subset))


def test_a_head_folder_round_trips_and_refuses_another_target(target, tmp_path) -> None:
    head = random_head(target)
    subset = torch.tensor([0, 3, 5, 7, 11])
    head.save(tmp_path / "head", "tiny", subset)
    assert is_head_folder(tmp_path / "head") and not is_head_folder(tmp_path)
    loaded, got_subset, about = EagleHead.load(tmp_path / "head")
    assert torch.equal(got_subset, subset) and about["target"] == "tiny"
    for name, value in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value.float())  # stored float32
    other = tiny_lm(VOCAB, seed=3, hidden_size=32)
    with pytest.raises(ValueError, match="another target shape"):
        EagleDrafter(loaded, other)
    (tmp_path / "head" / "eagle.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ValueError, match="format"):
        EagleHead.load(tmp_path / "head")


@pytest.mark.parametrize("planner", ["fixed", "auto"])
def test_greedy_drafting_from_features_equals_target_only(target, planner) -> None:
    """Ragged rows, fixed gamma and gamma auto (a hybrid with prompt lookup too): the target's greedy output."""
    params = SamplingParams(temperature=0, max_new_tokens=20)
    reference = [c.token_ids for c in generate(target, PROMPTS, params).completions]
    for make in (lambda: drafter(target), lambda: HybridDrafter(drafter(target, [0, 1, 2, 3, 5, 8, 13, 21, 34]))):
        config = SpecConfig(gamma=4, adaptive=planner == "auto", max_batch_size=3)
        result = generate(target, PROMPTS, params, draft=make(), config=config)
        assert [c.token_ids for c in result.completions] == reference
        assert result.stats["drafted"] > 0


def _fresh_proposal(target, head: EagleHead, history: list[int], gamma: int) -> torch.Tensor:
    """What a new drafter, fed the committed text's true features from scratch, proposes next (greedy)."""
    fresh = EagleDrafter(head, target)
    fresh.allocate(1, 64)
    fresh.add_rows([0], [history])
    cache = target.new_cache(1, 64)
    features = prefill_ragged(target, cache, torch.tensor([0]), [history[:-1]], features=True)
    fresh.add_features([0], features)
    greedy = SamplingParams(temperature=0)
    return fresh.propose(DraftRequest((0,), (gamma,), (gamma,), (greedy,), (torch.Generator(),))).probs


def test_after_rejections_the_head_drafts_as_a_fresh_head_on_the_committed_text(target) -> None:
    """The head's cache keeps only entries with true features of committed tokens: after rounds with rejections and
    full acceptances, in a ragged batch, its next proposal equals that of a head fed the committed text afresh."""
    head = random_head(target)
    running = EagleDrafter(head, target)
    engine = Engine(target, running, SpecConfig(gamma=3, max_batch_size=3, max_seq_len=64), planner=FixedGamma(3))
    ids = [engine.add_request(p, SamplingParams(temperature=1.0, max_new_tokens=30, seed=i), gamma=1 + i)
           for i, p in enumerate(PROMPTS[:3])]
    rejected = accepted_all = 0
    for _ in range(8):
        result = engine.step()
        rejected += sum(u.num_accepted < u.num_drafted for u in result.rows)
        accepted_all += sum(u.num_accepted == u.num_drafted > 0 for u in result.rows)
    assert rejected and accepted_all  # both kinds of rounds happened
    greedy = SamplingParams(temperature=0)
    for slot, rid in enumerate(ids):
        history = running.rows[slot].history
        got = running.propose(DraftRequest((slot,), (3,), (3,), (greedy,), (torch.Generator(),))).probs
        running.commit([slot], [[]])  # roll the proposal back
        assert torch.allclose(got, _fresh_proposal(target, head, history, 3), atol=1e-9), rid


def test_features_come_from_the_forward_that_scores(target) -> None:
    """The hidden states the engine hands over are those the target's output layer read: no extra forward."""
    cache = target.new_cache(2, 32)
    slots = torch.tensor([0, 1])
    prefill_ragged(target, cache, slots, [[1, 2, 3], [4, 5]])
    calls = []
    real = type(target)._append

    def counted(self, *args):
        calls.append(1)
        return real(self, *args)

    type(target)._append = counted
    try:
        logits, hidden = target.forward_cached_features(torch.tensor([[6, 7], [8, 9]]), cache, slots)
    finally:
        type(target)._append = real
    assert len(calls) == 1
    with torch.no_grad():
        assert torch.allclose(target.logits(hidden), logits)


def test_a_feature_draft_needs_a_target_that_returns_features(target) -> None:
    class LogitsOnly:  # a CausalLM without forward_cached_features
        def __init__(self, model):
            self.model, self.vocab_size, self.max_seq_len = model, model.vocab_size, model.max_seq_len
            self.device = model.device

        def new_cache(self, *args):
            return self.model.new_cache(*args)

        def forward_cached(self, *args):
            return self.model.forward_cached(*args)

        def prefill(self, *args):
            return self.model.prefill(*args)

    with pytest.raises(ValueError, match="does not return"):
        Engine(LogitsOnly(target), drafter(target))
    Engine(LogitsOnly(target), HybridDrafter(drafter(target)).lookup)  # a drafter without features runs


def test_backlog_scores_are_the_heads_probabilities_of_committed_tokens(target) -> None:
    """Scoring a backlog reads the head's own distribution of each committed token, and leaves the last entry for
    the next proposal, which then drafts as after any round."""
    head = random_head(target)
    scorer = EagleDrafter(head, target)
    scorer.allocate(1, 64)
    history = [1, 2, 3, 4, 5, 6, 7, 8]
    scorer.add_rows([0], [history[:3]])
    cache = target.new_cache(1, 64)
    scorer.add_features([0], prefill_ragged(target, cache, torch.tensor([0]), [history[:2]], features=True))
    scorer.commit([0], [history[3:]])
    scorer.add_features([0], [target.forward_cached_features(torch.tensor([history[2:-1]]), cache,
                                                             torch.tensor([0]))[1][0]])
    greedy = SamplingParams(temperature=1.0)
    scores = scorer.score_backlog([0], [3], [greedy])[0]
    assert len(scores) == 3
    # the head's probability of tokens 5..7 (entries 3..5 predict tokens 5..7)
    reference = EagleDrafter(head, target)
    reference.allocate(1, 64)
    reference.add_rows([0], [history])
    cache = target.new_cache(1, 64)
    features = prefill_ragged(target, cache, torch.tensor([0]), [history[:-1]], features=True)[0]
    embeddings = target.embed(torch.tensor([history[1:]]))
    predicted = head.double().forward_uncached(embeddings, features.unsqueeze(0))[0]
    probs = torch.softmax(reference._logits(predicted), dim=-1)
    assert scores == pytest.approx([float(probs[t, history[t + 2]]) for t in (3, 4, 5)], abs=1e-9)
    proposal = scorer.propose(DraftRequest((0,), (2,), (2,), (greedy,), (torch.Generator().manual_seed(0),)))
    assert int(proposal.num_drafted[0]) == 2


def test_training_lowers_the_loss_and_resumes_exactly(tmp_path) -> None:
    from specsample.distill.eagle import Frozen, HeadTraining, init_head, train_head
    from specsample.distill.features import FeatureReader, FeatureWriter, collect_features
    from specsample.datasets import Prompt
    from specsample.models.loader import load_model

    tokenizer = make_tokenizer()
    folder = write_hf_model(tmp_path / "target", tokenizer=tokenizer, max_position_embeddings=128)
    target = load_model(str(folder), dtype="float32")
    prompts = [Prompt(str(i), "x", (f"the quick brown fox {i}",), (("jumps over the lazy dog " * (1 + i % 3)),))
               for i in range(48)]
    writer = FeatureWriter(tmp_path / "features", "tiny", 64, target.model.vocab_size, 64)
    collect_features(target.model, target.tokenizer, prompts, writer, 10**6, chunk_conversations=16, progress=False)
    reader = FeatureReader(tmp_path / "features")
    assert reader.num_chunks == 3 and reader.index["sequences"] == 48
    plan = HeadTraining(target="tiny", out=tmp_path / "out", epochs=6, batch_tokens=256, max_len=64, lr=3e-3,
                        warmup=2, eval_every=4, checkpoint_minutes=10**6, unroll=2)
    frozen = Frozen(target.model, None, torch.device("cpu"))
    with pytest.raises(ValueError, match="quantize"):
        HeadTraining(target="tiny", out=tmp_path / "out", quantize="int3")

    def run(work, stop_after=None):
        torch.manual_seed(0)
        head = init_head(target.model, 0)
        return head, train_head(head, frozen, reader, plan, work, progress=False, stop_after=stop_after)

    whole, record = run(tmp_path / "whole")
    train_tokens = sum(chunk["tokens"] for chunk in reader.index["chunks"][:-1])  # the last chunk is held out
    assert record["tokens_seen"] == plan.epochs * train_tokens  # each epoch sees every training sequence once
    curve = record["curve"]
    assert curve[-1]["heldout_loss"] < 0.85 * curve[0]["heldout_loss"]  # over both unrolled steps
    assert curve[-1]["heldout_alpha"] > curve[0]["heldout_alpha"]
    _, partial = run(tmp_path / "split", stop_after=5)
    assert partial["step"] == 5
    resumed, record_resumed = run(tmp_path / "split")
    assert record_resumed["step"] == record["step"]
    for name, value in whole.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], value), name


def test_distill_writes_a_head_that_generate_drafts_with(tmp_path) -> None:
    from specsample.cli import main

    tokenizer = make_tokenizer()
    folder = write_hf_model(tmp_path / "target", tokenizer=tokenizer, max_position_embeddings=128)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"turns": [f"the quick brown fox {i}"],
                                             "replies": ["jumps over the lazy dog " * (1 + i % 3)]})
                                  for i in range(24)) + "\n" + json.dumps({"turns": ["a prompt the target answers"]}))
    out = tmp_path / "head"
    assert main(["distill", "--target", str(folder), "--out", str(out), "--prompts", str(prompts), "--tokens",
                 "100000", "--epochs", "2", "--max-len", "64", "--batch-tokens", "256", "--draft-vocab", "0",
                 "--eval-prompts", str(prompts), "--eval-max-new-tokens", "6"]) == 0
    for name in ("eagle.json", "model.safetensors", "README.md", "eval.json", "training_curve.json"):
        assert (out / name).exists(), name
    report = json.loads((out / "eval.json").read_text())
    card = (out / "README.md").read_text()
    assert f"{report['temperatures']['0.0']['overall']['acceptance_rate']:.3f}" in card
    assert "--kind eagle" not in card or "specsample distill" in card
    assert main(["distill", "--target", str(folder), "--out", str(out), "--width", "32"]) == 2  # a model-only flag
    assert main(["distill", "--kind", "model", "--target", str(folder), "--out", str(tmp_path / "m"), "--quantize",
                 "int4"]) == 2  # an eagle-only flag
    assert main(["generate", "the quick brown fox", "--target", str(folder), "--draft", str(out), "--temperature",
                 "0", "--max-new-tokens", "6", "--dtype", "float32", "--json"]) == 0


def test_training_steps_draft_as_inference_does(target) -> None:
    """The training-time test's step s at entry t equals drafting at inference: the true entries up to t - s + 1 in
    the head's cache, then s - 1 entries fed with the head's own predictions (teacher tokens)."""
    import torch.nn.functional as F

    from specsample.distill.eagle import UnrolledAttention

    head = random_head(target).eval()
    tokens = torch.tensor([[1, 5, 9, 2, 7, 3, 8, 4, 6, 10]])
    cache = target.new_cache(1, 16)
    features = prefill_ragged(target, cache, torch.tensor([0]), [tokens[0].tolist()], features=True)[0]
    embeddings = F.embedding(tokens[:, 1:], target.embed.weight)  # [1, 9, hidden]
    inputs = features[:-1].unsqueeze(0)
    attend = UnrolledAttention(head.layer_config, 1, 9, torch.device("cpu"))
    steps = []
    with torch.no_grad():
        for _ in range(3):
            out = head(embeddings, inputs, attend)
            steps.append(out)
            inputs = torch.cat([inputs[:, :1], out[:, :-1]], dim=1)
        for last in (2, 4, 6):  # the last true entry
            head_cache = head.new_cache(1, 16)
            slot = torch.tensor([0])
            predicted = head.forward_cached(embeddings[:, : last + 1], features[: last + 1].unsqueeze(0), head_cache,
                                            slot)[:, -1:]
            assert torch.allclose(predicted, steps[0][:, last:last + 1], atol=1e-10)
            for step in (2, 3):
                entry = last + step - 1
                predicted = head.forward_cached(embeddings[:, entry:entry + 1], predicted, head_cache, slot)
                assert torch.allclose(predicted, steps[step - 1][:, entry:entry + 1], atol=1e-10), (last, step)


def test_a_head_drafts_for_a_target_with_a_quantized_output_layer(tmp_path) -> None:
    """An int8 output layer hands out float32 weights; the head and its logits run in the target's dtype."""
    from specsample.distill.eagle import init_head
    from specsample.models.loader import load_model

    folder = write_hf_model(tmp_path / "target", tokenizer=make_tokenizer(), max_position_embeddings=128)
    target = load_model(str(folder), dtype="bfloat16", quantize="int8").model
    assert target.lm_head.weight.dtype != target.dtype
    head_drafter = EagleDrafter(init_head(target, 0), target)
    params = SamplingParams(temperature=0, max_new_tokens=8)
    result = generate(target, PROMPTS[:2], params, draft=head_drafter, config=SpecConfig(gamma=3, max_batch_size=2))
    assert result.stats["drafted"] > 0 and all(len(c.token_ids) == 8 for c in result.completions)
