"""Feature drafts (EAGLE-3 heads): the published folder layout both ways, drafting through the engine (greedy output is
the target's, the head's cache follows the committed text, prefix reuse keeps its rows), the target's fused features
from the forward that scores, data the target writes itself, and training (the loss falls, a resumed run ends where
an uninterrupted one does, its steps draft as inference does)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from model_factory import draft_request, make_tokenizer, write_hf_model
from safetensors.torch import save_file

from specsample import Engine, SamplingParams, SpecConfig, generate, tiny_lm
from specsample.drafters.eagle import EagleDrafter
from specsample.drafters.hybrid import HybridDrafter
from specsample.models.base import prefill_ragged
from specsample.models.eagle_head import EagleHead, HeadConfig, is_head_folder, load_head, save_head
from specsample.planner import FixedGamma

VOCAB = 48
LAYERS = (0, 1, 2)  # the tiny target's: its embedding output, its middle, its last layer's output
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [9, 8, 7], [3], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]]


@pytest.fixture(scope="module")
def target():
    return tiny_lm(VOCAB, seed=3, init_scale=0.2, dtype=torch.float64)


def random_head(target, seed: int = 4, draft_ids: list[int] | None = None, scale: float = 0.2) -> EagleHead:
    """An EAGLE-3 head on `target` with random weights (its draft vocabulary `draft_ids`, default all)."""
    ids = torch.tensor(draft_ids if draft_ids is not None else list(range(target.vocab_size)))
    head = EagleHead(HeadConfig.for_target(target.config, len(ids), LAYERS)).double()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in head.named_parameters():
            if not name.endswith("norm.weight"):
                param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * scale)
        head.d2t.copy_(ids - torch.arange(len(ids)))
    return head


def drafter(target, draft_ids: list[int] | None = None) -> EagleDrafter:
    return EagleDrafter(random_head(target, draft_ids=draft_ids), target)


def _published(head: EagleHead, folder, extra_config: dict | None = None) -> None:
    """The head written by hand in the layout vLLM and SGLang read (split q/k/v and gate/up under `midlayer.`, d2t and
    t2d, a LlamaForCausalLMEagle3 config), not through our writer."""
    c = head.config
    q, k, v = head.qkv.weight.detach().split(
        [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
    )
    gate, up = head.gate_up.weight.detach().chunk(2)
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
    t2d[head.draft_ids] = True
    tensors = {
        "fc.weight": head.fc.weight,
        "midlayer.input_layernorm.weight": head.input_norm.weight,
        "midlayer.hidden_norm.weight": head.hidden_norm.weight,
        "midlayer.self_attn.q_proj.weight": q,
        "midlayer.self_attn.k_proj.weight": k,
        "midlayer.self_attn.v_proj.weight": v,
        "midlayer.self_attn.o_proj.weight": head.o_proj.weight,
        "midlayer.post_attention_layernorm.weight": head.post_norm.weight,
        "midlayer.mlp.gate_proj.weight": gate,
        "midlayer.mlp.up_proj.weight": up,
        "midlayer.mlp.down_proj.weight": head.down.weight,
        "norm.weight": head.norm.weight,
        "lm_head.weight": head.lm_head.weight,
        "d2t": head.d2t,
        "t2d": t2d,
    }
    folder.mkdir(parents=True)
    save_file(
        {
            name: t.detach().contiguous() if name in ("d2t", "t2d") else t.detach().float().contiguous()
            for name, t in tensors.items()
        },
        str(folder / "model.safetensors"),
    )
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "num_hidden_layers": 1,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "draft_vocab_size": c.draft_vocab_size,
        "torch_dtype": "float32",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(c.feature_layers)},
        **(extra_config or {}),
    }
    (folder / "config.json").write_text(json.dumps(config))


def _greedy_proposal(drafter_: EagleDrafter, target, history: list[int], gamma: int = 3) -> torch.Tensor:
    """A fresh row fed `history`'s true features: its greedy proposal's probabilities `[1, gamma, vocab]`."""
    drafter_.allocate(1, 64)
    drafter_.add_rows([0], [history])
    cache = target.new_cache(1, 64)
    drafter_.add_features([0], prefill_ragged(target, cache, torch.tensor([0]), [history[:-1]], features=True))
    greedy = SamplingParams(temperature=0)
    return drafter_.propose(draft_request((0,), (gamma,), (gamma,), (greedy,), (torch.Generator(),))).probs


def test_a_head_in_the_published_layout_drafts_as_the_same_weights_in_memory(target, tmp_path) -> None:
    head = random_head(target, draft_ids=[5, 0, 9, 3, 7, 11, 2, 40])
    _published(head, tmp_path / "published")
    assert is_head_folder(tmp_path / "published") and not is_head_folder(tmp_path)
    loaded = load_head(tmp_path / "published", target.config).double()
    history = PROMPTS[0]
    expected = _greedy_proposal(EagleDrafter(head, target), target, history)
    assert torch.equal(_greedy_proposal(EagleDrafter(loaded, target), target, history), expected)


def test_a_written_head_keeps_every_tensor(target, tmp_path) -> None:
    head = random_head(target, draft_ids=[5, 0, 9, 3, 7, 11, 2, 40]).float()
    save_head(head, tmp_path / "head", dtype=torch.float32)
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 8
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(LAYERS)
    loaded = load_head(tmp_path / "head", target.config)
    for name, value in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    from safetensors.torch import load_file

    tensors = load_file(str(tmp_path / "head" / "model.safetensors"))
    assert tensors["t2d"].dtype == torch.bool and int(tensors["t2d"].sum()) == 8
    assert sorted(torch.nonzero(tensors["t2d"]).flatten().tolist()) == sorted([5, 0, 9, 3, 7, 11, 2, 40])


def test_a_head_that_does_not_fit_the_target_is_refused_by_name(target, tmp_path) -> None:
    head = random_head(target)
    _published(head, tmp_path / "vocab", {"vocab_size": VOCAB + 1})
    with pytest.raises(ValueError, match="vocabulary 49"):
        load_head(tmp_path / "vocab", target.config)
    wide = tiny_lm(VOCAB, seed=3, hidden_size=32)
    _published(head, tmp_path / "wide")
    with pytest.raises(ValueError, match="target hidden size 64"):
        load_head(tmp_path / "wide", wide.config)
    _published(head, tmp_path / "deep", {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 7]}})
    with pytest.raises(ValueError, match="feature layers"):
        load_head(tmp_path / "deep", target.config)
    _published(head, tmp_path / "layers", {"num_hidden_layers": 2})
    with pytest.raises(ValueError, match="num_hidden_layers"):
        load_head(tmp_path / "layers", target.config)
    _published(head, tmp_path / "shape", {"intermediate_size": 7})
    with pytest.raises(ValueError, match="config.json makes it"):
        load_head(tmp_path / "shape", target.config)


@pytest.mark.parametrize("planner", ["fixed", "auto"])
def test_greedy_drafting_from_features_equals_target_only(target, planner) -> None:
    """Ragged rows, fixed gamma and gamma auto (a hybrid with prompt lookup too): the target's greedy output."""
    params = SamplingParams(temperature=0, max_new_tokens=20)
    reference = [c.token_ids for c in generate(target, PROMPTS, params).completions]
    for make in (lambda: drafter(target), lambda: HybridDrafter(drafter(target, [0, 1, 2, 3, 5, 8, 13, 21, 34]))):
        config = SpecConfig(max_batch_size=3)
        result = generate(target, PROMPTS, params, draft=make(), config=config)
        assert [c.token_ids for c in result.completions] == reference
        assert result.stats["drafted"] > 0


def test_after_rejections_the_head_drafts_as_a_fresh_head_on_the_committed_text(target) -> None:
    """The head's cache keeps only entries with the target's features of committed tokens: after rounds with
    rejections and full acceptances, in a ragged batch, its next proposal equals that of a head fed the committed
    text afresh."""
    head = random_head(target)
    running = EagleDrafter(head, target)
    engine = Engine(target, running, SpecConfig(max_batch_size=3, max_seq_len=64), planner=FixedGamma(3))
    ids = [
        engine.add_request(p, SamplingParams(temperature=1.0, max_new_tokens=30, seed=i), gamma=1 + i)
        for i, p in enumerate(PROMPTS[:3])
    ]
    rejected = accepted_all = 0
    for _ in range(8):
        result = engine.step()
        rejected += sum(u.num_accepted < u.num_drafted for u in result.rows)
        accepted_all += sum(u.num_accepted == u.num_drafted > 0 for u in result.rows)
    assert rejected and accepted_all  # both kinds of rounds happened
    greedy = SamplingParams(temperature=0)
    for slot, rid in enumerate(ids):
        history = running.rows[slot].history
        got = running.propose(draft_request((slot,), (3,), (3,), (greedy,), (torch.Generator(),))).probs
        running.commit([slot], [[]])  # roll the proposal back
        assert torch.allclose(got, _greedy_proposal(EagleDrafter(head, target), target, history), atol=1e-9), rid


def test_a_kept_row_is_reused_with_its_head_entries(target) -> None:
    """Prefix reuse with a feature draft: the next turn takes the finished row (the target prefills only the new
    tokens), and the head then drafts as a head fed the whole text afresh."""
    head = random_head(target)
    running = EagleDrafter(head, target)
    engine = Engine(
        target, running, SpecConfig(max_batch_size=1, max_seq_len=96, prefix_cache_rows=1), planner=FixedGamma(3)
    )
    first = list(range(1, 21))
    engine.add_request(first, SamplingParams(temperature=1.0, max_new_tokens=8, seed=0))
    output = []
    for result in engine.stream():
        output += [t for u in result.rows for t in u.new_tokens]
    second = first + output + [30, 31, 32]
    engine.add_request(second, SamplingParams(temperature=1.0, max_new_tokens=4, seed=1))
    result = engine.step()
    assert result.stats.prefix_hits == 1 and result.stats.reused_tokens >= len(first)
    slot = next(iter(running.rows))
    history = list(running.rows[slot].history)
    greedy = SamplingParams(temperature=0)
    got = running.propose(draft_request((slot,), (3,), (3,), (greedy,), (torch.Generator(),))).probs
    assert torch.allclose(got, _greedy_proposal(EagleDrafter(head, target), target, history), atol=1e-9)


def test_fused_features_come_from_the_forward_that_scores(target) -> None:
    """The features the engine hands over are the residual streams entering the feature layers, concatenated, from
    the same forward whose logits it scores with: no extra forward."""
    cache = target.new_cache(2, 32)
    slots = torch.tensor([0, 1])
    target.set_feature_layers(LAYERS)
    prefill_ragged(target, cache, slots, [[1, 2, 3], [4, 5]])
    calls = []
    real = type(target)._append

    def counted(self, *args):
        calls.append(1)
        return real(self, *args)

    type(target)._append = counted
    try:
        logits, features = target.forward_cached_features(torch.tensor([[6, 7], [8, 9]]), cache, slots)
    finally:
        type(target)._append = real
    assert len(calls) == 1 and features.shape == (2, 2, 3 * target.config.hidden_size)
    # the same streams computed by hand: the embedding, after layer 0, after layer 1 (the output before the norm)
    full = torch.tensor([[1, 2, 3, 6, 7], [4, 5, 8, 9, 0]])
    with torch.no_grad():
        from specsample.models.llama import Attention

        attend = Attention(None, None, torch.zeros(2, dtype=torch.long), 5, target.config, target.groups, target.device)
        x = target.embed(full)
        rope = target.rope_tables(attend.rope_positions)
        streams = [x]
        for layer in target.layers:
            x = layer(x, rope, attend)
            streams.append(x)
        expected = torch.cat(streams, dim=-1)
    assert torch.allclose(features[0], expected[0, 3:5], atol=1e-10)
    assert torch.allclose(features[1], expected[1, 2:4], atol=1e-10)
    assert torch.allclose(target.logits(target.norm(streams[-1][0, 3:5])), logits[0], atol=1e-10)


def test_backlog_scores_are_the_heads_probabilities_of_committed_tokens(target) -> None:
    """Scoring a backlog reads the head's own distribution of each committed token, and leaves the last entry for
    the next proposal."""
    head = random_head(target)
    scorer = EagleDrafter(head, target)
    scorer.allocate(1, 64)
    history = [1, 2, 3, 4, 5, 6, 7, 8]
    scorer.add_rows([0], [history[:3]])
    cache = target.new_cache(1, 64)
    scorer.add_features([0], prefill_ragged(target, cache, torch.tensor([0]), [history[:2]], features=True))
    scorer.commit([0], [history[3:]])
    scorer.add_features(
        [0], [target.forward_cached_features(torch.tensor([history[2:-1]]), cache, torch.tensor([0]))[1][0]]
    )
    sampled = SamplingParams(temperature=1.0)
    scores = scorer.score_backlog([0], [3], [sampled])[0]
    assert len(scores) == 3
    # the head's own probabilities, entries 3..5 predicting tokens 5..7, from an uncached causal forward
    from specsample.distill.eagle import UnrolledAttention

    cache = target.new_cache(1, 64)
    features = prefill_ragged(target, cache, torch.tensor([0]), [history[:-1]], features=True)[0]
    embeddings = target.embed(torch.tensor([history[1:]]))
    attend = UnrolledAttention(head.layer_config, 1, len(history) - 1, torch.device("cpu"))
    with torch.no_grad():
        outputs = head(embeddings, head.fuse(features.unsqueeze(0)), attend)[0]
        probs = torch.softmax(head.logits(outputs), dim=-1)
    assert scores == pytest.approx([float(probs[t, history[t + 2]]) for t in (3, 4, 5)], abs=1e-9)
    proposal = scorer.propose(draft_request((0,), (2,), (2,), (sampled,), (torch.Generator().manual_seed(0),)))
    assert int(proposal.num_drafted[0]) == 2


def test_training_steps_draft_as_inference_does(target) -> None:
    """The training-time test's step s at entry t equals drafting at inference: the true entries up to t - s + 1 in
    the head's cache, then s - 1 entries read with the head's own outputs (teacher tokens)."""
    import torch.nn.functional as F

    from specsample.distill.eagle import UnrolledAttention

    head = random_head(target).eval()
    tokens = torch.tensor([[1, 5, 9, 2, 7, 3, 8, 4, 6, 10]])
    cache = target.new_cache(1, 16)
    target.set_feature_layers(LAYERS)
    features = prefill_ragged(target, cache, torch.tensor([0]), [tokens[0].tolist()], features=True)[0]
    embeddings = F.embedding(tokens[:, 1:], target.embed.weight)  # [1, 9, hidden]
    attend = UnrolledAttention(head.layer_config, 1, 9, torch.device("cpu"))
    steps = []
    with torch.no_grad():
        hidden = head.fuse(features[:-1].unsqueeze(0))
        for _ in range(3):
            out = head(embeddings, hidden, attend)
            steps.append(out)
            hidden = torch.cat([hidden[:, :1], out[:, :-1]], dim=1)
        for last in (2, 4, 6):  # the last true entry
            head_cache = head.new_cache(1, 16)
            slot = torch.tensor([0])
            out = head.forward_cached(
                embeddings[:, : last + 1], head.fuse(features[: last + 1].unsqueeze(0)), head_cache, slot
            )[:, -1:]
            assert torch.allclose(out, steps[0][:, last : last + 1], atol=1e-10)
            for step in (2, 3):
                entry = last + step - 1
                out = head.forward_cached(embeddings[:, entry : entry + 1], out, head_cache, slot)
                assert torch.allclose(out, steps[step - 1][:, entry : entry + 1], atol=1e-10), (last, step)


def test_regenerated_data_holds_the_targets_own_text_and_features(tmp_path) -> None:
    """The target answers two turns per conversation through the engine; each stored sequence is the text it wrote,
    its reply mask covers exactly the replies, its recorded features are those a teacher-forced forward gives; a
    cut-off run resumes with the conversations it had not finished, here with two workers writing a shard each."""
    from specsample.datasets import Prompt
    from specsample.distill.features import FeatureReader, FeatureWriter, target_features
    from specsample.distill.regenerate import Regeneration, regenerate_features, regenerate_store
    from specsample.models.loader import load_model

    tokenizer = make_tokenizer()
    folder = write_hf_model(tmp_path / "target", tokenizer=tokenizer, max_position_embeddings=256)
    loaded = load_model(str(folder), dtype="float32")
    prompts = [Prompt(str(i), "x", (f"the quick brown fox {i}", "and then"), ()) for i in range(9)]
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text("\n".join(json.dumps({"turns": list(p.turns)}) for p in prompts))
    plan = Regeneration(temperatures=(0.0, 1.0), turns=2, max_new_tokens=6, batch_size=3, chunk=2)
    writer = FeatureWriter(
        tmp_path / "data" / "shard-0", str(folder), 64, (0, 1, 2), loaded.model.vocab_size, 256, "regenerated"
    )
    regenerate_features(
        loaded.model, loaded.tokenizer, prompts, writer, plan, 10**6, max_conversations=4, progress=False
    )
    assert 4 <= writer.num_sequences < 9  # stopped: the rest are left for a resumed run
    regenerate_store(
        tmp_path / "data",
        str(folder),
        "none",
        "cpu",
        str(prompt_file),
        replace(plan, workers=2),
        (0, 1, 2),
        256,
        10**6,
        progress=False,
    )
    reader = FeatureReader(tmp_path / "data")
    assert reader.index["sequences"] == 9 and sorted(reader.index["done"]) == list(range(9))
    assert (tmp_path / "data" / "shard-1" / "index.json").exists()
    assert reader.replies() == 18  # two turns answered per conversation
    for sequence in [s for i in range(reader.num_chunks) for s in reader.chunk(i)]:
        text = tokenizer.decode(sequence.tokens.tolist())
        assert "the quick brown fox" in text and "and then" in text
        features, final = target_features(loaded.model, [sequence.tokens.tolist()], (0, 1, 2))[0]
        known = sequence.known
        assert known == len(sequence.tokens) - 1
        assert torch.allclose(sequence.features[:known].float(), features[:known].float(), atol=0.05, rtol=0.02)
        assert torch.allclose(sequence.final[:known].float(), final[:known].float(), atol=0.05, rtol=0.02)


def test_training_lowers_the_loss_and_resumes_exactly(tmp_path) -> None:
    from specsample.datasets import Prompt
    from specsample.distill.eagle import Frozen, HeadTraining, choose_vocab, init_head, train_head
    from specsample.distill.features import FeatureReader, FeatureWriter, collect_features
    from specsample.models.loader import load_model

    tokenizer = make_tokenizer()
    folder = write_hf_model(tmp_path / "target", tokenizer=tokenizer, max_position_embeddings=128)
    target = load_model(str(folder), dtype="float32")
    prompts = [
        Prompt(str(i), "x", (f"the quick brown fox {i}",), (("jumps over the lazy dog " * (1 + i % 3)),))
        for i in range(48)
    ]
    writer = FeatureWriter(tmp_path / "features", "tiny", 64, (0, 1, 2), target.model.vocab_size, 64, "teacher-forced")
    collect_features(target.model, target.tokenizer, prompts, writer, 10**6, chunk_conversations=16, progress=False)
    reader = FeatureReader(tmp_path / "features")
    assert reader.num_chunks == 3 and reader.index["sequences"] == 48
    plan = HeadTraining(
        target="tiny",
        out=tmp_path / "out",
        epochs=3,
        batch_tokens=512,
        max_len=64,
        lr=1e-2,
        warmup=2,
        eval_every=3,
        checkpoint_minutes=10**6,
        unroll=2,
    )
    ids = choose_vocab(reader, target.model.vocab_size, 40)
    frozen = Frozen(target.model, ids, torch.device("cpu"))
    with pytest.raises(ValueError, match="quantize"):
        HeadTraining(target="tiny", out=tmp_path / "out", quantize="int3")

    def run(work, stop_after=None):
        torch.manual_seed(0)
        head = init_head(target.model, ids, (0, 1, 2), 0)
        return head, train_head(head, frozen, reader, plan, work, progress=False, stop_after=stop_after)

    whole, record = run(tmp_path / "whole")
    train_tokens = sum(chunk["tokens"] for chunk in reader.index["chunks"][:-1])  # the last chunk is held out
    assert record["tokens_seen"] == plan.epochs * train_tokens  # each epoch sees every training sequence once
    assert record["token_steps"] > record["tokens_seen"] // 4  # reply entries, over both drafting steps
    curve = record["curve"]
    for step in ("", "_2"):  # both unrolled steps learn
        assert curve[-1][f"heldout_kl{step}"] < 0.8 * curve[0][f"heldout_kl{step}"]
        assert curve[-1][f"heldout_alpha{step}"] > curve[0][f"heldout_alpha{step}"]
    _, partial = run(tmp_path / "split", stop_after=4)
    assert partial["step"] == 4
    resumed, record_resumed = run(tmp_path / "split")
    assert record_resumed["step"] == record["step"]
    for name, value in whole.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], value), name


@pytest.mark.slow
def test_distill_writes_a_head_that_generate_drafts_with(tmp_path) -> None:
    from specsample.cli import main

    tokenizer = make_tokenizer()
    folder = write_hf_model(tmp_path / "target", tokenizer=tokenizer, max_position_embeddings=128)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"turns": [f"the quick brown fox {i}", "more"]}) for i in range(24)))
    out = tmp_path / "head"
    assert (
        main(
            [
                "distill",
                "--target",
                str(folder),
                "--out",
                str(out),
                "--prompts",
                str(prompts),
                "--tokens",
                "100000",
                "--epochs",
                "2",
                "--max-len",
                "64",
                "--batch-tokens",
                "256",
                "--draft-vocab",
                "0",
                "--regen-max-new-tokens",
                "8",
                "--regen-batch-size",
                "8",
                "--eval-prompts",
                str(prompts),
                "--eval-max-new-tokens",
                "6",
            ]
        )
        == 0
    )
    for name in ("config.json", "model.safetensors", "README.md", "eval.json", "training_curve.json"):
        assert (out / name).exists(), name
    report = json.loads((out / "eval.json").read_text())
    card = (out / "README.md").read_text()
    assert f"{report['temperatures']['0.0']['overall']['acceptance_rate']:.3f}" in card
    assert report["data"]["source"] == "regenerated"  # the default data: replies the target wrote itself
    assert f"{report['training']['token_steps']:,}" in card  # the card reports its run's record
    assert main(["distill", "--target", str(folder), "--out", str(out), "--width", "32"]) == 2  # a model-only flag
    assert (
        main(["distill", "--kind", "model", "--target", str(folder), "--out", str(tmp_path / "m"), "--unroll", "3"])
        == 2
    )  # an eagle-only flag
    assert (
        main(
            [
                "generate",
                "the quick brown fox",
                "--target",
                str(folder),
                "--draft",
                str(out),
                "--temperature",
                "0",
                "--max-new-tokens",
                "6",
                "--dtype",
                "float32",
                "--json",
            ]
        )
        == 0
    )


def test_a_head_drafts_for_a_target_with_a_quantized_output_layer(tmp_path) -> None:
    """An int8 output layer hands out float32 weights; the head and its logits run in the target's dtype."""
    from specsample.distill.eagle import init_head
    from specsample.models.loader import load_model

    folder = write_hf_model(tmp_path / "target", tokenizer=make_tokenizer(), max_position_embeddings=128)
    target = load_model(str(folder), dtype="bfloat16", quantize="int8").model
    ids = torch.arange(target.vocab_size)
    head_drafter = EagleDrafter(init_head(target, ids, (0, 1, 2), 0), target)
    params = SamplingParams(temperature=0, max_new_tokens=8)
    result = generate(
        target, PROMPTS[:2], params, draft=head_drafter, config=SpecConfig(max_batch_size=2), planner=FixedGamma(3)
    )
    assert result.stats["drafted"] > 0 and all(len(c.token_ids) == 8 for c in result.completions)
