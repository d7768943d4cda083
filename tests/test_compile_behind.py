"""The cache of compiled steps (models/artifacts.py) and serving while they build (server/compile_behind.py): unusable
packages are rebuilt, never a crash; the switch between rounds keeps greedy outputs; a killed build is reported and
serving goes on; /health and /metrics show the build."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from live_server import LiveServer
from model_factory import make_tokenizer, write_hf_model

from specsample import SamplingParams, SpecConfig, generate, generate_stream
from specsample.drafters.ngram import NgramDrafter
from specsample.models import artifacts, compile_events
from specsample.models.compiled import MAX_BLOCK, DecodeStep, PackagedDecode
from specsample.models.llama import LlamaModel
from specsample.models.tiny import tiny_lm
from specsample.options import EngineOptions
from specsample.server.compile_behind import CompileBehind
from specsample.server.options import ServerOptions
from specsample.server.state import SpecServer
from specsample.speculator import load

VOCAB = 64  # tests/test_compiled.py's architecture: the session builds its packages once


def tiny(seed: int):
    return tiny_lm(VOCAB, seed, init_scale=0.2)


@pytest.fixture(scope="module")
def built(compiled_steps) -> Path:
    """The folder of the tiny architecture's packages, built (once per session) in the session's cache."""
    model = tiny(1)
    assert PackagedDecode.open(model) is not None
    return artifacts.folder(DecodeStep(model), MAX_BLOCK)


def copy_command(source: Path, destination: Path, delay: float = 0.0) -> list[str]:
    """A stand-in for the build process: copies built packages into place (after `delay` seconds)."""
    code = f"import shutil, time; time.sleep({delay}); shutil.copytree({str(source)!r}, {str(destination)!r})"
    return [sys.executable, "-c", code]


def first_tokens(model, prompt: list[int], steps: int) -> torch.Tensor:
    cache, slots = model.new_cache(1, 32), torch.tensor([0])
    model.prefill(torch.tensor([prompt[:-1]]), cache, slots)
    return model.forward_cached(torch.tensor([prompt[-1:] * steps]), cache, slots)


@pytest.mark.slow
def test_an_unusable_package_is_rebuilt_with_a_warning(built, tmp_path, monkeypatch, caplog) -> None:
    """A damaged package, and packages whose key.json names another build (another torch, CPU or model), are removed
    with a warning and built again (here: the build copies good packages, so no compile is paid twice); the model
    then runs the rebuilt steps with the eager forward's logits."""
    monkeypatch.setenv(artifacts.ROOT_ENV, str(tmp_path))
    model, eager = tiny(2), tiny(2)
    folder = artifacts.folder(DecodeStep(model), MAX_BLOCK)
    shutil.copytree(built, folder)
    (folder / "view.pt2").write_bytes(b"not a package")
    with caplog.at_level(logging.WARNING):
        assert PackagedDecode.open(model, build=False) is None
    assert "view.pt2 is unusable" in caplog.text and "does not load" in caplog.text
    assert not (folder / "view.pt2").exists() and (folder / "gathered.pt2").exists()
    stale = json.loads((folder / "key.json").read_text()) | {"torch": "0.0"}
    (folder / "key.json").write_text(json.dumps(stale))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert PackagedDecode.open(model, build=False) is None
    assert "built for another model, torch or CPU" in caplog.text
    assert artifacts.ready(folder) == 0

    def build(step, graph, path, max_block):  # the real build, paid once per session by `built`
        shutil.copy(built / path.name, path)
        return 0.0

    monkeypatch.setattr(artifacts, "build", build)
    model.compile_decode()
    assert artifacts.ready(folder) == len(artifacts.GRAPHS)
    assert json.loads((folder / "key.json").read_text())["torch"] == torch.__version__
    assert torch.allclose(first_tokens(model, [1, 2, 3], 3), first_tokens(eager, [1, 2, 3], 3), atol=1e-4)


def test_packages_are_keyed_by_what_their_code_depends_on(monkeypatch) -> None:
    """Weights do not change the key (a package runs on the model's own tensors); the architecture, the dtype, the
    feature layers and torch's version do."""
    base = artifacts.folder(DecodeStep(tiny(1)), MAX_BLOCK)
    assert artifacts.folder(DecodeStep(tiny(7)), MAX_BLOCK) == base
    assert artifacts.folder(DecodeStep(tiny_lm(VOCAB, 1, num_layers=3)), MAX_BLOCK) != base
    assert artifacts.folder(DecodeStep(tiny(1).to(torch.bfloat16)), MAX_BLOCK) != base
    features = tiny(1)
    features.set_feature_layers((0, 2))
    assert artifacts.folder(DecodeStep(features), MAX_BLOCK) != base
    monkeypatch.setattr(torch, "__version__", "0.0")
    assert artifacts.folder(DecodeStep(tiny(1)), MAX_BLOCK) != base


@pytest.mark.slow
def test_the_switch_between_rounds_keeps_greedy_outputs(built, tmp_path, monkeypatch) -> None:
    """Serving starts eagerly, the build process ends mid-generation, the next round runs the compiled steps: the
    tokens are those of eager decoding throughout (with drafts, so verification blocks run compiled too)."""
    params = SamplingParams(temperature=0, max_new_tokens=24)
    prompts, config = [[5, 6, 7, 5, 6, 7, 5, 6]], SpecConfig(max_batch_size=2)
    reference = generate(tiny(3), prompts, params, draft=NgramDrafter(), config=config).completions[0].token_ids
    monkeypatch.setenv(artifacts.ROOT_ENV, str(tmp_path))
    model = tiny(3)
    folder = artifacts.folder(DecodeStep(model), MAX_BLOCK)
    behind = CompileBehind([model], EngineOptions(), command=copy_command(built, folder))
    assert behind.state == "compiling" and model.compiled is None
    tokens: list[int] = []
    switched_at = None
    start = compile_events.counts()
    for rounds, (_, result) in enumerate(generate_stream(model, prompts, params, NgramDrafter(), config)):
        tokens += [t for update in result.rows for t in update.new_tokens]
        if rounds == 1:  # the process finishes now; the switch comes between this round and the next
            behind.process.wait(timeout=60)
            assert behind.poll(force=True) and model.compiled is not None
            switched_at = len(tokens)
    assert switched_at is not None and 0 < switched_at < len(tokens)
    assert tokens == reference
    assert compile_events.since(start) == (0, 0)  # nothing compiled in the serving process, nothing ran eagerly
    assert behind.status() | {"elapsed_s": 0} == {
        "state": "compiled",
        "graphs_ready": 2,
        "graphs_total": 2,
        "eta_s": 0,
        "elapsed_s": 0,
    }


@pytest.fixture(scope="module")
def served_folder(tmp_path_factory) -> Path:
    return write_hf_model(tmp_path_factory.mktemp("behind") / "target", tokenizer=make_tokenizer())


def _health(server: LiveServer) -> dict:
    return httpx.get(server.url + "/health").json()


def _wait(predicate, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline
        time.sleep(0.1)


def test_a_killed_build_is_reported_and_serving_goes_on(served_folder, tmp_path, monkeypatch) -> None:
    """/health and /metrics show the build (graphs ready of the total, no ETA before the first graph); once its
    process is killed they say so, and requests are served eagerly before and after."""
    monkeypatch.setenv(artifacts.ROOT_ENV, str(tmp_path))
    speculator = load(EngineOptions(target=str(served_folder), draft="ngram", dtype="float32", runtime="ours"))
    model = speculator.pair.target.model
    assert isinstance(model, LlamaModel)
    behind = CompileBehind([model], EngineOptions(), command=[sys.executable, "-c", "import time; time.sleep(120)"])
    server = LiveServer(SpecServer(speculator, ServerOptions(model_name="m", max_seq_len=64), behind))
    try:
        status = _health(server)["compile"]
        assert status["state"] == "compiling" and (status["graphs_ready"], status["graphs_total"]) == (0, 2)
        assert status["eta_s"] is None
        metrics = httpx.get(server.url + "/metrics").text
        assert "specsample_compile_graphs_total 2.0" in metrics and "specsample_compile_eta_seconds NaN" in metrics
        body = {"model": "m", "prompt": "the quick", "max_tokens": 4, "temperature": 0}
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=30).status_code == 200
        os.kill(behind.process.pid, signal.SIGKILL)
        _wait(lambda: _health(server)["compile"]["state"] == "failed")
        health = _health(server)
        assert health["compile"]["reason"] == "the compile process was killed by signal 9"
        assert health["step"] == "torch" and model.compiled is None
        assert "specsample_compile_failed 1.0" in httpx.get(server.url + "/metrics").text
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=30).status_code == 200
    finally:
        server.close()


def test_a_complete_cache_serves_compiled_from_the_start(built, tmp_path, monkeypatch) -> None:
    """With every package in the cache no process starts: the models run compiled before the first round."""
    monkeypatch.setenv(artifacts.ROOT_ENV, str(tmp_path))
    model = tiny(4)
    shutil.copytree(built, artifacts.folder(DecodeStep(model), MAX_BLOCK))
    behind = CompileBehind([model], EngineOptions(), command=[sys.executable, "-c", "raise SystemExit(3)"])
    assert behind.process is None and behind.state == "compiled" and isinstance(model.compiled, PackagedDecode)


def test_specsample_compile_builds_what_serve_would_run(served_folder, monkeypatch, capsys) -> None:
    """`specsample compile` takes serve's flags and builds the steps of the models serve would compile (the target
    and a draft model; the build itself is replaced here); a runtime that cannot compile is refused."""
    from specsample.cli import main

    opened = []
    monkeypatch.setattr(PackagedDecode, "open", classmethod(lambda cls, model, build=True: opened.append(model)))
    draft = ["--speculative-model", str(served_folder), "--draft-quantize", "none"]
    assert main(["compile", "--model", str(served_folder), "--dtype", "float32", *draft]) == 0
    assert len(opened) == 2 and all(isinstance(m, LlamaModel) and m.dtype == torch.float32 for m in opened)
    assert "the compiled decode steps of 2 models are in" in capsys.readouterr().err
    assert main(["compile", "--model", str(served_folder), "--runtime", "hf", "--speculative-model", "ngram"]) == 2
    assert "needs our Llama-family runtime" in capsys.readouterr().err
