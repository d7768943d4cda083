"""One options record: every field of `EngineOptions` (and of `ServerOptions`), given with a value other than its
default at each entry point (generate, serve, serve --replicas, a Serve config's arguments, bench), reaches the
options the pair is loaded with (or the server is built with), and the built engine follows them; every entry
point refuses the same bad combination the same way."""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
from dataclasses import fields, replace

import pytest
import torch
from model_factory import make_tokenizer, write_hf_model

import specsample.bench.context as bench_context
import specsample.models.compiled as compiled_module
import specsample.pair as pair_module
import specsample.server.serve as serve_module
import specsample.server.state as server_state
import specsample.speculator as speculator_module
from specsample.bench.config import BENCH_ENGINE_DEFAULTS, BenchConfig
from specsample.cli import BENCH_SETS, build_parser, main
from specsample.drafters.ngram import NgramDrafter
from specsample.models import row_kernels
from specsample.models.loader import LoadedModel
from specsample.models.tiny import tiny_lm
from specsample.options import EngineOptions
from specsample.options_cli import settings
from specsample.planner import FixedGamma
from specsample.server.options import SERVE_ENGINE_DEFAULTS, ServerOptions, serve_engine_options

# for each field, values other than a default, as (value, the text a Serve config YAML gives); an entry point takes
# the first that differs from its own default
ENGINE_VALUES = {
    "target": [("/no/such/target", "/no/such/target")],
    "draft": [("ngram", "ngram")],
    "gamma": [(3, "3")],
    "max_gamma": [(12, "12")],  # above the benchmark's widest fixed gamma (8), so its run keeps it
    "tree": [("8", "8")],
    "speculative": [(False, "false")],
    "dtype": [("float32", "float32")],
    "device": [("cuda:1", "cuda:1")],  # parsed only: loading is replaced here
    "runtime": [("hf", "hf")],
    "compile": [(True, "true"), (False, "false")],
    "quantize": [("int8", "int8")],
    "quant_group": [(64, "64")],
    "draft_quantize": [("int4", "int4")],
    "pad_rows": [("auto", "auto"), ("off", "off")],
    "draft_window": [("off", "off")],
    "sampling": [("coupled", "coupled")],
    "deterministic": [(True, "true")],
    "suffix_cache_scope": [("request", "request")],
}
SERVER_VALUES = {
    "model_name": ("served-name", "served-name"),
    "api_key": ("key-1", "key-1"),
    "min_acceptance": (0.5, "0.5"),
    "max_batch_size": (3, "3"),
    "max_seq_len": (512, "512"),
    "admin_key": ("key-2", "key-2"),
    "models_dir": ("MODELS_DIR", "MODELS_DIR"),  # a folder of the test's
    "max_body_bytes": (4096, "4096"),
    "prefix_cache_rows": (2, "2"),
    "prefix_cache_tokens": (5000, "5000"),
    "prefill_chunk_tokens": (64, "64"),
    "prefill_time_ratio": (0.5, "0.5"),
    "metrics_key": ("key-3", "key-3"),
    "grammar_compile_timeout": (2.5, "2.5"),
    "grammar_workers": (3, "3"),
    "shutdown_timeout": (1.5, "1.5"),
}
# as deploy/serve_config.yaml names them
RAY_NAMES = {"target": "model", "model_name": "served_model_name", "max_seq_len": "max_model_len"}


class Built(Exception):
    """Raised where an entry point hands over what it built, so the test can stop it there."""


def test_the_tables_cover_every_setting() -> None:
    assert set(ENGINE_VALUES) == {f.name for f in fields(EngineOptions)}
    assert set(SERVER_VALUES) == set(settings(ServerOptions))


@functools.cache
def _subparser(command: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def _words(command: str, name: str, value, text: str) -> list[str]:
    """The command-line words that give field `name` the value `value`, through the flag `command` has for it."""
    actions = [a for a in _subparser(command)._actions if a.dest == name]
    assert actions, f"{command} has no flag for {name}"
    for action in actions:
        if isinstance(action, argparse._StoreConstAction):  # store_true / store_false
            if action.const == value:
                return [action.option_strings[0]]
        else:
            return [action.option_strings[0], text]
    raise AssertionError(f"{command} has no flag that sets {name} to {value!r}")


def _silent(argv: list[str]) -> int:
    """`specsample ARGV` in this process, its output dropped; its exit status."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            return main(argv)
        except SystemExit as exc:  # argparse's exits
            return exc.code


class Entry:
    """An entry point run with `words` (or deployment arguments) until the pair would load; returns the options it
    would load with and the server options it would serve with."""

    def __init__(self, name: str, defaults: EngineOptions) -> None:
        self.name, self.defaults = name, defaults

    def run(self, monkeypatch, tmp_path, given: dict[str, tuple]) -> tuple[EngineOptions, ServerOptions | None]:
        seen: dict[str, object] = {}

        def load(options, say=None, compile_behind=False):
            seen["engine"] = options
            if self.name in ("generate", "bench"):
                raise Built
            return "a speculator"

        def server(speculator, options):
            seen["server"] = options
            raise Built

        monkeypatch.setattr(speculator_module, "load", load)
        monkeypatch.setattr(bench_context, "load", load)
        monkeypatch.setattr(server_state, "SpecServer", server)
        monkeypatch.setattr(serve_module, "serve_http", server)  # never serves, whatever the entry point reaches
        command = self.name if self.name in ("generate", "bench") else "serve"
        words = [w for name, (value, text) in given.items() for w in _words(command, name, value, text)]
        if self.name in ("serve --replicas", "Serve config"):
            from specsample.deploy import replica_server

            yaml = {RAY_NAMES.get(name, name): text for name, (_, text) in given.items()}
            args = _ray_args(monkeypatch, yaml=yaml) if self.name == "Serve config" else _ray_args(monkeypatch, words)
            with pytest.raises(Built):
                replica_server(args, "replica-1")
        else:
            head = {"generate": ["generate", "hi"], "serve": ["serve"], "bench": ["bench", "--out", str(tmp_path)]}
            with pytest.raises(Built):
                _silent(head[command] + words)
        return seen["engine"], seen.get("server")


def _ray_args(monkeypatch, argv: list[str] | None = None, yaml: dict | None = None) -> dict:
    """The arguments each replica is started with, by `specsample serve --replicas 2 ARGV...` or by a Serve config
    whose `args` are `yaml`, through the deployment's builder."""
    pytest.importorskip("ray.serve")
    import ray
    from ray import serve

    import specsample.deploy as deploy

    bound: dict[str, dict] = {}

    class Replica:
        @staticmethod
        def options(**placement):
            return Replica

        @staticmethod
        def bind(args):
            bound["args"] = args
            raise Built

    monkeypatch.setattr(deploy, "SpecsampleReplica", Replica)
    monkeypatch.setattr(ray, "init", lambda **kw: None)
    monkeypatch.setattr(serve, "start", lambda **kw: None)
    with pytest.raises(Built):
        if yaml is not None:
            deploy.builder(yaml | {"replicas": "2"})
        else:
            _silent(["serve", "--replicas", "2", *argv])
    return bound["args"]


ENTRIES = [
    Entry("generate", EngineOptions()),
    Entry("serve", SERVE_ENGINE_DEFAULTS),
    Entry("serve --replicas", SERVE_ENGINE_DEFAULTS),
    Entry("Serve config", SERVE_ENGINE_DEFAULTS),
    Entry("bench", BENCH_ENGINE_DEFAULTS),
]


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.name)
def test_every_engine_option_reaches_the_loaded_pair(entry, monkeypatch, tmp_path) -> None:
    """Each field alone, at a value other than this entry point's default: the options loaded are the entry point's
    defaults with that one field changed (a field dropped, swapped or fixed by an entry point fails here)."""
    for name, values in ENGINE_VALUES.items():
        if entry.name == "bench" and name in BENCH_SETS:
            continue  # the benchmark sets these per system: see test_the_benchmark_refuses_what_it_sets
        value, text = next((v, t) for v, t in values if v != getattr(entry.defaults, name))
        loaded, _ = entry.run(monkeypatch, tmp_path, {name: (value, text)})
        # serving's default compile yields to what cannot compile (deterministic mode, the transformers runtime)
        expected = (
            serve_engine_options({name: value})
            if entry.defaults is SERVE_ENGINE_DEFAULTS
            else replace(entry.defaults, **{name: value})
        )
        assert loaded == expected and getattr(loaded, name) == value, (entry.name, name)


@pytest.mark.parametrize(
    "entry", [e for e in ENTRIES if e.name != "generate" and e.name != "bench"], ids=lambda e: e.name
)
def test_every_server_option_reaches_the_server(entry, monkeypatch, tmp_path) -> None:
    given = {
        name: (str(tmp_path), str(tmp_path)) if value == "MODELS_DIR" else (value, text)
        for name, (value, text) in SERVER_VALUES.items()
    }
    _, served = entry.run(monkeypatch, tmp_path, given)
    expected = {name: value for name, (value, _) in given.items()}
    assert {name: getattr(served, name) for name in expected} == expected
    _, served = entry.run(monkeypatch, tmp_path, {"target": ("/models/t", "/models/t")})
    assert served.model_name == "/models/t"  # the served name defaults to the model's


def test_the_pair_loads_each_model_as_the_options_say(monkeypatch) -> None:
    """`load_pair` takes the options whole and hands each model's loading the options' own values: the target's
    layout, then a draft model's (its own quantization, the shared int4 group size, dtype, device and compiling)."""
    calls: list[tuple[str, dict]] = []

    def load_model(spec, **kwargs):
        calls.append((spec, kwargs))
        if len(calls) == 2:
            raise Built
        return LoadedModel(tiny_lm(32), None, spec, "ours")

    monkeypatch.setattr(pair_module, "load_model", load_model)
    options = EngineOptions(
        target="/the/target",
        draft="/the/draft",
        dtype="float32",
        device="cpu",
        runtime="ours",
        compile=True,
        quantize="int8",
        quant_group=64,
        draft_quantize="int4",
    )
    with pytest.raises(Built):
        pair_module.load_pair(options)
    loads = {"dtype": "float32", "device": "cpu", "compile": True, "quant_group": 64}
    assert calls == [
        ("/the/target", loads | {"runtime": "ours", "quantize": "int8"}),
        ("/the/draft", loads | {"quantize": "int4"}),
    ]


def test_the_benchmark_refuses_what_it_sets() -> None:
    assert not set(BENCH_SETS) & set(_subparser("bench").parse_args([]).flags)  # no engine flag for them
    with pytest.raises(ValueError, match="the benchmark sets each system's gamma"):
        BenchConfig(engine=EngineOptions(gamma=3))
    with pytest.raises(ValueError, match="the benchmark sets each system's gamma"):
        BenchConfig(engine=EngineOptions(speculative=False))
    assert BenchConfig(gammas=("auto", 12)).engine_options.max_gamma == 12  # caches for the widest round


def test_serve_compile_has_vllm_negation(monkeypatch) -> None:
    """Serving compiles by default where the fused step will not run; --enforce-eager (vLLM's name) turns compiling
    off and cannot be given with --compile; the default yields to deterministic mode and the transformers runtime,
    which cannot compile."""
    serve = _subparser("serve")
    assert serve.parse_args(["--enforce-eager"]).compile is False
    assert serve.parse_args(["--compile"]).compile is True
    assert serve.parse_args([]).compile is None  # not named: serve's default
    monkeypatch.setattr(row_kernels, "can_build", lambda: False)  # a CPU the fused step cannot run on
    assert serve_engine_options({"compile": None}).compile is SERVE_ENGINE_DEFAULTS.compile is True
    assert serve_engine_options({"compile": None, "deterministic": True}).compile is False
    assert serve_engine_options({"runtime": "hf"}).compile is False
    monkeypatch.setattr(row_kernels, "can_build", lambda: True)
    assert serve_engine_options({}).compile is False  # the fused step runs the steps: nothing to compile
    assert serve_engine_options({"dtype": "float32"}).compile is True
    assert serve_engine_options({"runtime": "ours"}).compile is True
    assert serve_engine_options({"compile": True}).compile is True
    assert _silent(["serve", "--compile", "--enforce-eager"]) == 2


@pytest.mark.parametrize("command", [["generate", "hi"], ["serve"], ["bench"]])
def test_every_command_refuses_compile_with_deterministic_alike(command, capsys, monkeypatch) -> None:
    """One validation: the same refusal, exit status 2, before anything loads."""

    def load(options, say=None, compile_behind=False):
        raise Built  # the pair an entry point that let the pair through would load

    monkeypatch.setattr(speculator_module, "load", load)
    monkeypatch.setattr(bench_context, "load", load)
    assert main([*command, "--compile", "--deterministic"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "specsample: error: argument --deterministic: deterministic mode cannot run a compiled decode step "
        "(its kernels differ from the eager forward's); drop --compile (see --help)"
    ]


def test_serve_config_text_is_refused_by_name() -> None:
    pytest.importorskip("ray.serve")
    from specsample.deploy import ReplicaSettings

    for args, message in [
        ({"compile": "maybe"}, "compile: expected true or false"),
        ({"max_gamma": "many"}, "max_gamma must be an integer"),
        ({"gamma": "0"}, "gamma must be an integer >= 1 or 'auto'"),
        ({"modle": "typo"}, "unknown specsample deployment argument"),
    ]:
        with pytest.raises(ValueError, match=message):
            ReplicaSettings.from_args(args)
    replica = ReplicaSettings.from_args({"model": "m", "compile": "True", "max_model_len": "512"})
    assert ReplicaSettings.from_args(replica.as_args()) == replica


# ----- the built engine ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return write_hf_model(
        tmp_path_factory.mktemp("options") / "target", tokenizer=make_tokenizer(), max_position_embeddings=64
    )


@pytest.mark.parametrize("entry", ["generate", "serve", "serve --replicas", "bench"])
def test_the_built_engine_follows_the_options(entry, target, monkeypatch, tmp_path) -> None:
    """Real loading of a tiny pair through each entry point: the engine it builds runs a compiled target (compiling
    itself is skipped: tests/test_compiled.py runs it), drafts with prompt lookup, and couples sampled tokens."""
    monkeypatch.setattr(  # loaded without running: a package set that is never called
        compiled_module.PackagedDecode, "open", classmethod(lambda cls, model, build=True: cls(model, {}))
    )
    given = {
        "draft": ("ngram", "ngram"),
        "dtype": ("float32", "float32"),
        "compile": (True, "true"),
        "sampling": ("coupled", "coupled"),
        "pad_rows": ("off", "off"),
        "target": (str(target), str(target)),
    }
    command = entry if entry in ("generate", "bench") else "serve"
    words = [w for name, (value, text) in given.items() for w in _words(command, name, value, text)]
    built: dict[str, object] = {}
    if entry == "generate":
        real = speculator_module.Speculator.engine

        def engine(self, *args, **kwargs):
            built["engine"] = real(self, *args, **kwargs)
            raise Built

        monkeypatch.setattr(speculator_module.Speculator, "engine", engine)
        with pytest.raises(Built):
            _silent(["generate", "hi", "--gamma", "3", *words])
    elif entry == "bench":
        real_load = bench_context.load

        def load(options, say=None, compile_behind=False):
            built["engine"] = real_load(options, say).engine()
            raise Built

        monkeypatch.setattr(bench_context, "load", load)
        with pytest.raises(Built):
            _silent(["bench", "--out", str(tmp_path), *words])
    else:
        servers = []
        monkeypatch.setattr(serve_module, "serve_http", lambda server, host, port: servers.append(server))
        argv = ["--num-speculative-tokens", "3", *words]
        if entry == "serve":
            assert _silent(["serve", *argv]) == 0
        else:
            from specsample.deploy import replica_server

            servers.append(replica_server(_ray_args(monkeypatch, argv), "replica-1"))
        built["engine"] = servers[0].engine  # built, not started: nothing to stop
    engine = built["engine"]
    assert engine.target.compiled is not None and engine.target.dtype == torch.float32
    assert isinstance(getattr(engine.drafter, "current", engine.drafter), NgramDrafter)  # the server's is routed
    assert engine.config.coupled
    if entry != "bench":  # the benchmark's planner is each system's
        assert isinstance(engine.planner, FixedGamma) and engine.planner.max_gamma == 3


@pytest.mark.parametrize(
    "flags, compiled",
    [([], True), (["--enforce-eager"], False), (["--deterministic"], False)],
    ids=["default", "enforce-eager", "deterministic"],
)
def test_serve_compiles_by_default(flags, compiled, target, monkeypatch) -> None:
    """`specsample serve` compiles its decode steps unless --enforce-eager, or deterministic mode, which cannot
    compile: on a CPU it serves at once, eagerly, and starts the build of the target's compiled steps apart with its
    options (the build is replaced here: tests/test_compile_behind.py runs the switch)."""
    started = []

    class Behind:
        state = "compiling"

        def __init__(self, models, options) -> None:
            started.append((models, options))

        def status(self) -> dict:
            return {"state": "compiling", "graphs_ready": 0, "graphs_total": 2, "eta_s": None}

    monkeypatch.setattr(server_state, "CompileBehind", Behind)
    monkeypatch.setattr(compiled_module.PackagedDecode, "open", classmethod(lambda cls, model, build=True: None))
    servers = []
    monkeypatch.setattr(serve_module, "serve_http", lambda server, host, port: servers.append(server))
    assert (
        _silent(
            [
                "serve",
                "--model",
                str(target),
                "--speculative-model",
                "ngram",
                "--dtype",
                "float32",
                "--pad-rows",
                "off",
                *flags,
            ]
        )
        == 0
    )
    engine = servers[0].engine
    assert engine.target.compiled is None  # until the build is done
    assert engine.target.deterministic is ("--deterministic" in flags)
    if compiled:
        [(models, options)] = started
        assert models == [engine.target] and options.compile and options.target == str(target)
    else:
        assert started == []


def test_the_compiled_steps_folder_reaches_the_server_and_every_replica(monkeypatch, tmp_path) -> None:
    """`serve --compiled-steps DIR` is the folder the serving process reads and builds compiled steps in (and the
    build processes it starts, through the environment); with --replicas, every replica's environment names it."""
    from specsample.models import artifacts

    monkeypatch.setenv(artifacts.ROOT_ENV, str(tmp_path / "before"))  # restored after the test
    seen = {}

    def load(options, **_):
        seen["root"] = artifacts.root()
        raise Built

    monkeypatch.setattr(speculator_module, "load", load)
    folder = tmp_path / "steps"
    with pytest.raises(Built):
        main(["serve", "--compiled-steps", str(folder)])
    assert seen["root"] == folder

    pytest.importorskip("ray.serve")
    import ray
    from ray import serve

    import specsample.deploy as deploy

    def application(settings, options):
        seen["options"] = options
        raise Built

    monkeypatch.setattr(deploy, "application", application)
    monkeypatch.setattr(ray, "init", lambda **kw: None)
    monkeypatch.setattr(serve, "start", lambda **kw: None)
    with pytest.raises(Built):
        main(["serve", "--replicas", "2", "--compiled-steps", str(folder), "--affinity-imbalance", "3"])
    assert seen["options"]["ray_actor_options"]["runtime_env"]["env_vars"] == {artifacts.ROOT_ENV: str(folder)}
    assert seen["options"]["request_router_config"].request_router_kwargs["imbalanced_threshold"] == 3
