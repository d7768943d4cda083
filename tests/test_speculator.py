"""The one set-up path: options checked before loading, a pair loaded from specs, engines built for it."""

from __future__ import annotations

import pytest
from model_factory import make_tokenizer, write_hf_model

from specsample import EngineOptions, SamplingParams, load
from specsample.config import TreeShape
from specsample.drafters.hybrid import HybridDrafter
from specsample.drafters.ngram import NgramDrafter
from specsample.planner import FixedGamma, GammaController


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    tokenizer = make_tokenizer()
    return (
        write_hf_model(root / "target", tokenizer=tokenizer, max_position_embeddings=256),
        write_hf_model(root / "draft", tokenizer=tokenizer, seed=3, num_hidden_layers=1),
    )


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(gamma=0), "gamma must be an integer >= 1 or 'auto'"),
        (dict(gamma="fast"), "gamma must be an integer >= 1 or 'auto'"),
        (dict(gamma=True), "gamma must be an integer >= 1 or 'auto'"),
        (dict(max_gamma=0), "max_gamma must be an integer >= 1"),
        (dict(pad_rows="on"), "pad_rows must be one of auto, off"),
        (dict(draft_window="half"), "draft_window must be one of auto, off"),
        (dict(runtime="vllm"), "runtime must be one of"),
        (dict(compile=True, runtime="hf"), "--compile needs our Llama-family runtime"),
        (dict(tree="16x4"), "a tree is NODES or NODESxBRANCHxDEPTH"),
        (dict(tree="4x2x8"), "a tree of 4 nodes cannot reach depth 8"),
        (dict(tree=16), "tree must be 'auto', 'off' or NODES"),
    ],
)
def test_bad_options_are_refused_before_anything_loads(fields, message) -> None:
    with pytest.raises(ValueError, match=message):
        EngineOptions(target="/nowhere", **fields)


def test_gamma_given_as_text_is_parsed() -> None:
    assert EngineOptions(gamma="3").gamma == 3 and EngineOptions(gamma="auto").gamma == "auto"
    assert EngineOptions(gamma=4, max_gamma=2).most_drafts == 4 and EngineOptions(max_gamma=5).most_drafts == 5


def test_engines_follow_the_options(folders) -> None:
    target, draft = folders
    auto = load(EngineOptions(target=str(target), draft=f"hybrid:{draft}", max_gamma=5, dtype="float32"))
    assert isinstance(auto.drafter, HybridDrafter) and auto.draft == f"hybrid:{draft}"
    engine = auto.engine(max_batch_size=3, max_seq_len=64)
    assert isinstance(engine.planner, GammaController) and engine.planner.max_gamma == 5
    assert engine.config.max_batch_size == 3 and engine.max_seq_len == 64 and engine.planner.most_drafts == 5
    assert auto.engine().planner is not engine.planner  # each engine learns afresh unless given a planner
    assert auto.engine(planner=engine.planner).planner is engine.planner
    plain = auto.engine(drafter=None)
    rid = plain.add_request([1, 2, 3], SamplingParams(temperature=0, max_new_tokens=4))
    stats = [r.stats for r in plain.stream()]
    assert sum(s.drafted for s in stats) == 0 and rid
    fixed = load(EngineOptions(target=str(target), draft="ngram", gamma=3))
    assert isinstance(fixed.drafter, NgramDrafter) and isinstance(fixed.engine().planner, FixedGamma)
    with pytest.raises(ValueError, match="drafter must be"):
        fixed.engine(drafter="ngram")
    none = load(EngineOptions(target=str(target), speculative=False))
    assert none.drafter is None and none.draft == "none" and not none.spec_config().speculative


def test_trees_reach_the_planner_and_the_caches_or_are_refused(folders) -> None:
    target, draft = folders
    auto = load(EngineOptions(target=str(target), draft=f"hybrid:{draft}", tree="12x3x4", dtype="float32"))
    engine = auto.engine(max_batch_size=2, max_seq_len=64)
    assert [s.nodes for s in engine.planner.trees] == [8, 12] and engine.planner.tree == TreeShape(12, 3, 4)
    fixed = load(EngineOptions(target=str(target), draft="ngram", gamma=3, tree="10"))
    assert fixed.engine().planner.tree == TreeShape(10, 4, 6) and fixed.engine().planner.most_drafts == 24
    with pytest.raises(ValueError, match="token trees need a target on our Llama-family runtime"):
        load(EngineOptions(target=str(target), draft="ngram", runtime="hf", tree="8"))


def test_pad_rows_auto_measures_the_scoring_widths_once(folders) -> None:
    target, draft = folders
    said: list[str] = []
    measured = load(EngineOptions(target=str(target), draft=str(draft), gamma=3, pad_rows="auto"), say=said.append)
    assert len(measured.target_widths) == 4 and all(w >= n for n, w in enumerate(measured.target_widths, start=1))
    assert measured.engine().config.target_widths == measured.target_widths
    assert any("scored as" in line for line in said)
    assert load(EngineOptions(target=str(target), draft=str(draft), gamma=3)).target_widths == ()  # off
    assert load(EngineOptions(target=str(target), speculative=False, pad_rows="auto")).target_widths == ()
