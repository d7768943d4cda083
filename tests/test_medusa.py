"""Medusa heads: the published layouts both ways (FasterDecoding's and vLLM's), drafting through the engine (greedy
output is the target's; a row's state is the target's hidden state before its pending token, through rounds and
prefix reuse), Medusa's candidate tree, and training (the loss falls, a resumed run ends where an uninterrupted one
does, `distill --kind medusa` writes heads `generate` drafts with)."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
from model_factory import draft_request, make_tokenizer, write_hf_model
from safetensors.torch import save_file

from specsample import Engine, EngineOptions, SamplingParams, SpecConfig, generate, tiny_lm
from specsample.config import TreeShape
from specsample.drafters.hybrid import HybridDrafter
from specsample.drafters.medusa import MedusaDrafter, load_medusa_drafter, medusa_tree
from specsample.models.base import prefill_ragged
from specsample.models.loader import LoadedModel
from specsample.models.medusa_head import MedusaConfig, MedusaHeads, is_medusa_folder, load_medusa, save_medusa
from specsample.pair import load_drafter
from specsample.planner import FixedGamma, GammaController

VOCAB = 48
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [9, 8, 7], [3], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]]
SUBSET = [5, 0, 9, 3, 7, 11, 2, 40, 1, 8]
TREE = TreeShape(8, 3, 3)


@pytest.fixture(scope="module")
def target():
    return tiny_lm(VOCAB, seed=3, init_scale=0.2, dtype=torch.float64)


def random_heads(target, ids: list[int] | None = None, shared: bool = False, layers: int = 1, seed: int = 4):
    """Three Medusa heads on `target` with random weights (their draft vocabulary `ids`, default all)."""
    ids = torch.tensor(ids if ids is not None else list(range(target.vocab_size)))
    config = MedusaConfig(target.config.hidden_size, target.vocab_size, 3, layers, len(ids), shared_output=shared)
    heads = MedusaHeads(config).to(target.dtype)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in heads.named_parameters():  # soft output layers: drafts the target often accepts
            scale = 0.05 if name.startswith("outputs.") else 0.3
            param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * scale)
        heads.token_map.copy_(ids)
    return heads


def _faster_layout(heads: MedusaHeads, folder) -> None:
    """The heads written by hand as FasterDecoding/Medusa writes them (medusa_head.state_dict() of a ModuleList of
    Sequential(ResBlock..., Linear)), not through our writer."""
    c = heads.config
    tensors = {}
    for k in range(c.num_heads):
        for layer in range(c.num_layers):
            tensors[f"{k}.{layer}.linear.weight"] = heads.blocks[k][layer].weight
            tensors[f"{k}.{layer}.linear.bias"] = heads.blocks[k][layer].bias
        tensors[f"{k}.{c.num_layers}.weight"] = heads.outputs[k].weight
    folder.mkdir(parents=True)
    save_file(
        {n: t.detach().float().contiguous() for n, t in tensors.items()}, str(folder / "medusa_lm_head.safetensors")
    )
    config = {"medusa_num_heads": c.num_heads, "medusa_num_layers": c.num_layers, "base_model_name_or_path": "x"}
    (folder / "config.json").write_text(json.dumps({**config, "transformers_version": "4.36.2"}))


def _vllm_layout(heads: MedusaHeads, folder, extra_config: dict | None = None) -> None:
    """The heads written by hand as vLLM's MedusaModel loads them (blocks.*, lm_heads.*, token_map)."""
    c = heads.config
    tensors = {"token_map": heads.token_map.clone()}
    for k in range(c.num_heads):
        for layer in range(c.num_layers):
            tensors[f"blocks.{k}.layers.{layer}.weight"] = heads.blocks[k][layer].weight.detach().float()
            tensors[f"blocks.{k}.layers.{layer}.bias"] = heads.blocks[k][layer].bias.detach().float()
    for k in range(1 if c.shared_output else c.num_heads):
        tensors[f"lm_heads.{k}.weight"] = heads.outputs[k].weight.detach().float()
    folder.mkdir(parents=True)
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(folder / "model.safetensors"))
    config = {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "hidden_size": c.hidden_size,
        "vocab_size": c.vocab_size,
        "num_heads": c.num_heads,
        "num_hidden_layers": c.num_layers,
        "truncated_vocab_size": c.draft_vocab_size,
        "original_lm_head": c.shared_output,
        "medusa_fc_bias": True,
        **(extra_config or {}),
    }
    (folder / "config.json").write_text(json.dumps(config))


def _fresh_proposal(heads: MedusaHeads, target, history: list[int], tree: TreeShape | None = TREE):
    """A fresh row fed `history`'s true states: its greedy proposal (a tree, or a chain of 3)."""
    drafter = MedusaDrafter(heads, target)
    drafter.allocate(1, 64)
    drafter.add_rows([0], [history])
    cache = target.new_cache(1, 64)
    drafter.add_features([0], prefill_ragged(target, cache, torch.tensor([0]), [history[:-1]], features=True))
    greedy = SamplingParams(temperature=0)
    return drafter.propose(draft_request((0,), (3,), (8 if tree else 3,), (greedy,), (torch.Generator(),), tree=tree))


def _same(a, b) -> bool:
    return (
        torch.equal(a.tokens, b.tokens)
        and torch.equal(a.num_drafted, b.num_drafted)
        and (a.parents is None) == (b.parents is None)
        and (a.parents is None or torch.equal(a.parents, b.parents))
        and (a.probs is None or torch.allclose(a.probs, b.probs, atol=1e-6))
    )


@pytest.mark.parametrize("layout", ["medusa", "vllm"])
def test_published_heads_draft_as_the_same_weights_in_memory(layout, tmp_path) -> None:
    """A checkpoint in each published layout, written by hand, drafts exactly like the same weights in memory, and
    greedy decoding with it is plain greedy decoding (float32)."""
    target = tiny_lm(VOCAB, seed=3, init_scale=0.2, dtype=torch.float32)
    ids = None if layout == "medusa" else SUBSET
    heads = random_heads(target, ids, shared=layout == "vllm").float()
    folder = tmp_path / layout
    (_faster_layout if layout == "medusa" else _vllm_layout)(heads, folder)
    assert is_medusa_folder(folder) and not is_medusa_folder(tmp_path)
    loaded = load_medusa_drafter(folder, target).heads
    from_spec = load_drafter(str(folder), LoadedModel(target, None, "tiny", "ours"), EngineOptions(dtype="float32"))
    assert isinstance(from_spec, MedusaDrafter)  # what --draft FOLDER loads
    for tree in (TREE, None):
        assert _same(
            _fresh_proposal(loaded, target, PROMPTS[0], tree), _fresh_proposal(heads, target, PROMPTS[0], tree)
        )
    params = SamplingParams(temperature=0, max_new_tokens=12)
    reference = [c.token_ids for c in generate(target, PROMPTS, params).completions]
    for planner in (FixedGamma(3, tree=TREE), FixedGamma(3)):
        drafter = load_medusa_drafter(folder, target)
        result = generate(target, PROMPTS, params, draft=drafter, config=SpecConfig(max_batch_size=4), planner=planner)
        assert [c.token_ids for c in result.completions] == reference
        assert result.stats["drafted"] > 0


@pytest.mark.parametrize("layout", ["medusa", "vllm"])
def test_written_heads_keep_every_tensor(target, layout, tmp_path) -> None:
    heads = random_heads(target, None if layout == "medusa" else SUBSET, shared=layout == "vllm").float()
    save_medusa(heads, tmp_path / "heads", layout, dtype=torch.float32)
    config = json.loads((tmp_path / "heads" / "config.json").read_text())
    assert config.get("medusa_num_heads", config.get("num_heads")) == 3
    loaded = load_medusa(tmp_path / "heads", target.config.hidden_size, VOCAB)
    assert loaded.config == heads.config
    for name, value in heads.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    if layout == "medusa":  # FasterDecoding's layout holds whole-vocabulary layers only
        with pytest.raises(ValueError, match="whole vocabulary"):
            save_medusa(random_heads(target, SUBSET), tmp_path / "subset", "medusa")


def test_heads_that_do_not_fit_the_target_are_refused_by_name(target, tmp_path) -> None:
    heads = random_heads(target, SUBSET).float()
    _vllm_layout(heads, tmp_path / "vocab", {"vocab_size": VOCAB + 1})
    with pytest.raises(ValueError, match="vocabulary is 49 tokens"):
        load_medusa_drafter(tmp_path / "vocab", target)
    narrow = tiny_lm(VOCAB, seed=3, hidden_size=32)
    _faster_layout(random_heads(target).float(), tmp_path / "wide")
    with pytest.raises(ValueError, match="64 wide, the target's hidden size is 32"):
        load_medusa_drafter(tmp_path / "wide", narrow)
    _vllm_layout(heads, tmp_path / "shape", {"truncated_vocab_size": len(SUBSET) + 1})
    with pytest.raises(ValueError, match="their config makes it"):
        load_medusa(tmp_path / "shape", target.config.hidden_size, VOCAB)


def test_medusa_tree_takes_the_paths_of_highest_cumulative_probability() -> None:
    """Best first equals brute force: every path of up to 3 heads' top-3 ranks, ordered by score."""
    generator = torch.Generator().manual_seed(0)
    log_probs = [sorted(torch.log_softmax(torch.randn(6, generator=generator), 0).tolist(), reverse=True)[:3]]
    log_probs += [sorted(torch.log_softmax(torch.randn(6, generator=generator), 0).tolist(), reverse=True)[:3]]
    log_probs += [sorted(torch.log_softmax(torch.randn(6, generator=generator), 0).tolist(), reverse=True)[:3]]
    paths = [p for d in (1, 2, 3) for p in itertools.product(range(3), repeat=d)]
    scored = sorted(paths, key=lambda p: -sum(log_probs[j][r] for j, r in enumerate(p)))
    for budget in (1, 5, 12, 39):
        taken = medusa_tree(log_probs, budget)
        assert [path for path, _, _ in taken] == scored[:budget]
        for i, (path, parent, score) in enumerate(taken):
            assert parent == (-1 if len(path) == 1 else [p for p, _, _ in taken].index(path[:-1])) and parent < i
            assert math.isclose(score, sum(log_probs[j][r] for j, r in enumerate(path)))


@pytest.mark.parametrize("planner", ["fixed_tree", "auto_tree", "fixed_chain"])
def test_greedy_drafting_equals_target_only(target, planner) -> None:
    """Ragged rows, Medusa's trees and chains (a hybrid with prompt lookup too, shared and separate output layers
    over a draft vocabulary or the whole one): the target's greedy output."""
    params = SamplingParams(temperature=0, max_new_tokens=16)
    reference = [c.token_ids for c in generate(target, PROMPTS, params).completions]
    plans = {
        "fixed_tree": lambda: FixedGamma(3, tree=TREE),
        "auto_tree": lambda: GammaController(4, tree=TreeShape(12, 3, 3)),
        "fixed_chain": lambda: FixedGamma(3),
    }
    for make in (
        lambda: MedusaDrafter(random_heads(target), target),
        lambda: HybridDrafter(MedusaDrafter(random_heads(target, SUBSET, shared=True, layers=2), target)),
    ):
        result = generate(
            target, PROMPTS, params, draft=make(), config=SpecConfig(max_batch_size=3), planner=plans[planner]()
        )
        assert [c.token_ids for c in result.completions] == reference
        assert result.stats["drafted"] > 0


def test_a_hybrid_with_medusa_heads_probes_instead_of_scoring_backlogs(target) -> None:
    """Medusa heads keep no states of past positions, so they cannot score the tokens plain rounds committed: gamma
    auto's fallback probes a hybrid with them (it scores a draft model's backlog), and asked anyway it refuses."""
    from specsample.drafters.model import ModelDrafter

    hybrid = HybridDrafter(MedusaDrafter(random_heads(target), target))
    assert not hybrid.abilities.scores_backlog and HybridDrafter(ModelDrafter(target)).abilities.scores_backlog
    assert hybrid.abilities.reads_features
    hybrid.allocate(2, 32)
    hybrid.add_rows([0, 1], [[1, 2, 3], [4, 5]])
    with pytest.raises(ValueError, match="scores no backlogs"):
        hybrid.score_backlog([0, 1], [2, 1], [SamplingParams(), SamplingParams()])


def test_medusa_heads_and_an_eagle3_head_take_turns_on_one_target() -> None:
    """Two feature drafts loaded on one target, each reading other states of it (the final hidden states; three
    layers' residual streams): whichever engine was built last drafts from the states it reads, and both give the
    target's greedy output."""
    from specsample.drafters.eagle import EagleDrafter
    from specsample.models.eagle_head import EagleHead, HeadConfig

    target = tiny_lm(VOCAB, seed=3, init_scale=0.2, dtype=torch.float64)
    params = SamplingParams(temperature=0, max_new_tokens=12)
    reference = [c.token_ids for c in generate(target, PROMPTS, params).completions]
    eagle = EagleDrafter(EagleHead(HeadConfig.for_target(target.config, VOCAB, (0, 1, 2))).double(), target)
    medusa = MedusaDrafter(random_heads(target), target)  # loaded last: the target now returns final hidden states
    for drafter, planner in ((eagle, FixedGamma(3)), (medusa, FixedGamma(3, tree=TREE)), (eagle, FixedGamma(2))):
        result = generate(target, PROMPTS, params, draft=drafter, config=SpecConfig(max_batch_size=3), planner=planner)
        assert [c.token_ids for c in result.completions] == reference


def test_a_rows_state_follows_the_committed_text_and_prefix_reuse(target) -> None:
    """After rounds with rejections and accepted drafts, in a ragged batch, and after a kept row is reused by the
    next turn, each row proposes what a fresh row fed its committed text proposes."""
    heads = random_heads(target, SUBSET)
    running = MedusaDrafter(heads, target)
    engine = Engine(
        target, running, SpecConfig(max_batch_size=3, max_seq_len=96, prefix_cache_rows=1), planner=FixedGamma(3)
    )
    for i, p in enumerate(PROMPTS[:3]):
        engine.add_request(p, SamplingParams(temperature=1.0, max_new_tokens=20, seed=i), gamma=1 + i % 2)
    rejected = accepted = 0
    for _ in range(6):
        result = engine.step()
        rejected += sum(u.num_accepted < u.num_drafted for u in result.rows)
        accepted += sum(u.num_accepted > 0 for u in result.rows)
    assert rejected and accepted  # the state came from the pending token's position and from accepted drafts
    greedy = SamplingParams(temperature=0)
    for slot in list(running.rows):
        history = running.rows[slot].history
        got = running.propose(draft_request((slot,), (3,), (8,), (greedy,), (torch.Generator(),), tree=TREE))
        assert _same(got, _fresh_proposal(heads, target, history)), slot
    running = MedusaDrafter(heads, target)
    engine = Engine(
        target, running, SpecConfig(max_batch_size=1, max_seq_len=96, prefix_cache_rows=1), planner=FixedGamma(3)
    )
    text = list(range(1, 21))
    engine.add_request(text, SamplingParams(temperature=1.0, max_new_tokens=8, seed=0))
    text += [t for result in engine.stream() for u in result.rows for t in u.new_tokens]
    # the next turn (the target prefills its new tokens), then exactly the kept text again (nothing to prefill: the
    # state is the kept row's)
    for prompt in (text + [30, 31, 32], None):
        prompt = prompt or text
        engine.add_request(prompt, SamplingParams(temperature=1.0, max_new_tokens=4, seed=1))
        result = engine.step()
        assert result.stats.prefix_hits == 1 and result.stats.reused_tokens >= 20
        slot = next(iter(running.rows))
        history = list(running.rows[slot].history)
        got = running.propose(draft_request((slot,), (3,), (8,), (greedy,), (torch.Generator(),), tree=TREE))
        assert _same(got, _fresh_proposal(heads, target, history))
        running.commit([slot], [[]])
        text = history + [t for result in engine.stream() for u in result.rows for t in u.new_tokens]


def _training_data(tmp_path):
    from specsample.datasets import Prompt
    from specsample.distill.features import FeatureReader, FeatureWriter, collect_features
    from specsample.models.loader import load_model

    tokenizer = make_tokenizer()
    folder = write_hf_model(tmp_path / "target", tokenizer=tokenizer, max_position_embeddings=128)
    target = load_model(str(folder), dtype="float32")
    prompts = [
        Prompt(str(i), "x", (f"the quick brown fox {i}",), (("jumps over the lazy dog " * (1 + i % 3)),))
        for i in range(48)
    ]
    writer = FeatureWriter(tmp_path / "features", "tiny", 64, (), target.model.vocab_size, 64, "teacher-forced")
    collect_features(target.model, target.tokenizer, prompts, writer, 10**6, chunk_conversations=16, progress=False)
    return target, FeatureReader(tmp_path / "features")


def test_training_lowers_the_loss_and_resumes_exactly(tmp_path) -> None:
    from specsample.distill.eagle import choose_vocab
    from specsample.distill.medusa import MedusaTraining, init_heads, target_rows, train_heads

    target, reader = _training_data(tmp_path)
    assert reader.num_chunks == 3 and reader.index["feature_layers"] == []
    plan = MedusaTraining(
        target="tiny",
        out=tmp_path / "out",
        epochs=3,
        batch_tokens=512,
        max_len=64,
        lr=1e-2,
        warmup=2,
        eval_every=3,
        checkpoint_minutes=10**6,
        heads=2,
    )
    ids = choose_vocab(reader, target.model.vocab_size, 40)
    rows = target_rows(target.model, ids, torch.device("cpu"))

    def run(work, stop_after=None):
        torch.manual_seed(0)
        heads = init_heads(target.model, ids, plan)
        return heads, train_heads(heads, rows, reader, plan, work, progress=False, stop_after=stop_after)

    whole, record = run(tmp_path / "whole")
    train_tokens = sum(chunk["tokens"] for chunk in reader.index["chunks"][:-1])  # the last chunk is held out
    assert record["tokens_seen"] == plan.epochs * train_tokens
    curve = record["curve"]
    for k in range(2):  # both heads learn
        assert curve[-1][f"heldout_kl_{k}"] < 0.8 * curve[0][f"heldout_kl_{k}"]
        assert curve[-1][f"heldout_alpha_{k}"] > curve[0][f"heldout_alpha_{k}"]
    _, partial = run(tmp_path / "split", stop_after=4)
    assert partial["step"] == 4
    resumed, record_resumed = run(tmp_path / "split")
    assert record_resumed["step"] == record["step"]
    for name, value in whole.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], value), name


def test_distill_writes_heads_that_generate_drafts_with(tmp_path, capsys) -> None:
    from specsample.cli import main

    folder = write_hf_model(tmp_path / "target", tokenizer=make_tokenizer(), max_position_embeddings=128)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "\n".join(
            json.dumps({"turns": [f"the quick brown fox {i}"], "replies": ["jumps over the lazy dog " * (1 + i % 3)]})
            for i in range(24)
        )
    )
    out = tmp_path / "heads"
    common = ["--target", str(folder), "--prompts", str(prompts), "--max-len", "64", "--batch-tokens", "256"]
    args = ["distill", "--kind", "medusa", "--out", str(out), *common, "--tokens", "100000", "--medusa-heads", "2"]
    args += ["--eval-prompts", str(prompts), "--eval-max-new-tokens", "6", "--draft-vocab", "40"]
    assert main(args) == 0
    for name in ("config.json", "model.safetensors", "README.md", "eval.json", "training_curve.json"):
        assert (out / name).exists(), name
    report = json.loads((out / "eval.json").read_text())
    assert f"{report['temperatures']['0.0']['overall']['tokens_per_round']:.2f}" in (out / "README.md").read_text()
    assert json.loads((out / "config.json").read_text())["architectures"] == ["MedusaModel"]
    refused = ["distill", "--kind", "medusa", "--out", str(tmp_path / "x"), *common]
    assert main([*refused, "--unroll", "2"]) == 2  # an eagle-only flag
    assert main([*refused, "--layout", "medusa"]) == 2  # FasterDecoding's layout: whole-vocabulary layers only
    run = ["generate", "the quick brown fox", "--target", str(folder), "--temperature", "0", "--max-new-tokens", "6"]
    run += ["--dtype", "float32", "--json"]
    trees = {}
    for draft, tree in ((str(out), "auto"), (str(out), "off"), (f"hybrid:{out}", "6x2x2")):
        capsys.readouterr()
        assert main([*run, "--draft", draft, "--tree", tree, "--gamma", "3"]) == 0
        trees[tree] = json.loads(capsys.readouterr().out)["stats"]["tree_row_rounds"]
    assert trees["auto"] > 0 and trees["off"] == 0 and trees["6x2x2"] > 0  # auto: the heads' own tree
    evaluated = ["eval-draft", "--target", str(folder), "--draft", str(out), "--prompts", str(prompts)]
    assert main([*evaluated, "--num-prompts", "2", "--max-new-tokens", "4", "--no-cost", "--dtype", "float32"]) == 0
    assert "tokens_per_round" in capsys.readouterr().out
    wide = write_hf_model(tmp_path / "wide", tokenizer=make_tokenizer(), hidden_size=32, max_position_embeddings=128)
    assert main(["generate", "hi", "--target", str(wide), "--draft", str(out), "--max-new-tokens", "2"]) == 2
