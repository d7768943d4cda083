"""Recorded outputs of seeded generations: the same seeds give the same tokens, round for round.

`golden/engine_outputs.json` holds, per case, the requests (prompts, sampling settings, seeds), the drafter,
gamma (fixed or auto), the batch limit and what the engine produced: every request's tokens and finish reason,
and per round the batch size, drafts, accepted drafts, rows in fallback, rows scoring a backlog, rows
proposing a prompt lookup and rows drafting past their plan. Time comes from a virtual clock that advances
only in model forwards, so gamma auto's choices are a function of the work done, not of the machine.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from virtual_clock import ClockedLM, VirtualClock

from specsample import Engine, SamplingParams, SpecConfig, tiny_lm
from specsample.drafters.hybrid import HybridDrafter
from specsample.drafters.model import DraftWindow, ModelDrafter
from specsample.drafters.ngram import NgramDrafter
from specsample.planner import FixedGamma, GammaController

CASES = json.loads((Path(__file__).parent / "golden" / "engine_outputs.json").read_text())
COSTS = {"target": (0.010, 0.0008), "draft": (0.0015, 0.0002)}  # virtual seconds: per forward, per row-token


@pytest.fixture(scope="module")
def tiny_models():
    """A tiny target and a draft made from it by perturbing every weight (acceptance ~0.3-0.45)."""
    target = tiny_lm(32, seed=1, init_scale=0.2, dtype=torch.float64)
    draft = copy.deepcopy(target)
    noise = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if not name.endswith("norm.weight"):
                param.add_(torch.randn(param.shape, generator=noise, dtype=param.dtype) * 0.02)
    return target, draft, None


@pytest.fixture(scope="module")
def smollm2_models():
    from specsample.models.hub import ALIASES
    from specsample.models.loader import load_model

    target = load_model("smollm2-135m-instruct", dtype="float32")
    draft = load_model(ALIASES["smollm2-135m-instruct"].draft_model, dtype="float32")
    return target.model, draft.model, DraftWindow.from_folder(draft.folder)


def _drafter(kind: str, draft, clock: VirtualClock, window):
    if kind == "none":
        return None
    if kind == "ngram":
        return NgramDrafter()
    model = ModelDrafter(ClockedLM(draft, clock, *COSTS["draft"]), None, window)
    return model if kind == "model" else HybridDrafter(model, NgramDrafter())  # the hybrid as recorded: n-gram lookup


def _run(case: dict, models) -> tuple[list[list[int]], list[str], list[list[int]]]:
    target, draft, window = models
    clock = VirtualClock()
    gamma = case["gamma"]
    config = SpecConfig(
        speculative=case["drafter"] != "none",
        max_batch_size=case["max_batch_size"],
        max_seq_len=case["max_seq_len"],
        target_widths=tuple(case["target_widths"]),
    )
    planner = GammaController(6) if gamma == "auto" else FixedGamma(gamma)
    engine = Engine(
        ClockedLM(target, clock, *COSTS["target"]),
        _drafter(case["drafter"], draft, clock, window),
        config,
        case["eos"],
        planner,
        clock=clock,
    )
    ids = [
        engine.add_request(
            r["prompt"],
            SamplingParams(
                temperature=r["temperature"],
                top_k=r.get("top_k"),
                top_p=r.get("top_p", 1.0),
                max_new_tokens=r["max_new_tokens"],
                seed=r["seed"],
            ),
            speculative=r.get("speculative", True),
            gamma=r.get("gamma"),
        )
        for r in case["requests"]
    ]
    outputs: dict[str, list[int]] = {i: [] for i in ids}
    finish: dict[str, str] = {}
    rounds = []
    for result in engine.stream():
        s = result.stats
        if s.batch_size:
            rounds.append(
                [s.batch_size, s.drafted, s.accepted, s.fallback_rows, s.scored_rows, s.lookup_rows, s.extended_rows]
            )
        for update in result.rows:
            outputs[update.request_id].extend(update.new_tokens)
            if update.finish_reason:
                finish[update.request_id] = update.finish_reason
    return [outputs[i] for i in ids], [finish[i] for i in ids], rounds


def _check(case: dict, models) -> None:
    outputs, finish, rounds = _run(case, models)
    assert outputs == case["outputs"]
    assert finish == case["finish"]
    assert rounds == case["rounds"]


@pytest.mark.parametrize("case", [c for c in CASES if c["models"] == "tiny"], ids=lambda c: c["name"])
def test_tiny_pair_reproduces_recorded_outputs(case: dict, tiny_models) -> None:
    _check(case, tiny_models)


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if c["models"] == "smollm2"], ids=lambda c: c["name"])
def test_shipped_pair_reproduces_recorded_outputs(case: dict, smollm2_models) -> None:
    _check(case, smollm2_models)


def record(names: set[str]) -> None:
    """Run the named cases again and write what they produce as their recorded outputs; a greedy case's tokens must
    not change (they are the target's own), only its rounds."""
    models = {}
    for case in CASES:
        if case["name"] not in names:
            continue
        kind = case["models"]
        if kind not in models:
            models[kind] = tiny_models.__wrapped__() if kind == "tiny" else smollm2_models.__wrapped__()
        outputs, finish, rounds = _run(case, models[kind])
        greedy = all(r["temperature"] == 0 for r in case["requests"])
        if greedy and (outputs, finish) != (case["outputs"], case["finish"]):
            raise SystemExit(f"{case['name']}: greedy tokens changed; not recording")
        case.update(outputs=outputs, finish=finish, rounds=rounds)
        print(f"recorded {case['name']}")
    (Path(__file__).parent / "golden" / "engine_outputs.json").write_text(json.dumps(CASES))


if __name__ == "__main__":  # python tests/test_golden.py CASE...: record those cases again after a planner change
    import sys

    record(set(sys.argv[1:]))
