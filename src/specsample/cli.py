"""`specsample` command line: generate (and the other subcommands), thin over the engine's stream."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

from specsample.config import SamplingParams, SpecConfig
from specsample.engine import Engine
from specsample.metrics import StatsCollector
from specsample.models.hub import ALIASES, FetchError

DEFAULT_TARGET = "smollm2-135m-instruct"


class CliError(Exception):
    """An error shown to the user as one line, without a traceback."""


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=DEFAULT_TARGET,
                        help=f"target model: alias ({', '.join(ALIASES)}), HF folder, .gguf file or hub id "
                             f"(default: {DEFAULT_TARGET})")
    parser.add_argument("--draft", default=None,
                        help="draft: a model spec sharing the target's tokenizer, 'ngram' (prompt lookup) or "
                             "'none'. Default: the target alias's draft; for smollm2-135m-instruct that is "
                             "'ngram' until a distilled draft ships (the best draft we have: no small model "
                             "shares its tokenizer)")
    parser.add_argument("--dtype", default="auto", help="auto (bf16 where the CPU runs it natively), float32, bfloat16")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--runtime", default="auto", choices=("auto", "ours", "hf"),
                        help="model runtime: ours for Llama-family, transformers otherwise (default auto)")


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gamma", type=int, default=5, help="draft tokens per round (default 5)")
    parser.add_argument("--temperature", type=float, default=0.7, help="0 = greedy (default 0.7)")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specsample", description="Exact speculative sampling for LLM decoding.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one prompt, streaming it as rounds commit")
    gen.add_argument("prompt")
    _add_model_args(gen)
    _add_sampling_args(gen)
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                     help="apply the chat template (default: on when the model has one)")
    gen.add_argument("--system", default=None, help="system message for --chat")
    gen.add_argument("--no-speculation", action="store_true", help="plain decoding through the same loop")
    gen.add_argument("--json", action="store_true", help="print one JSON object (text, token ids, stats)")
    gen.set_defaults(func=cmd_generate)
    return parser


def cmd_generate(args: argparse.Namespace) -> None:
    """Stream one generation to stdout; the summary line goes to stderr (or everything as JSON)."""
    from specsample.pair import load_pair

    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                            max_new_tokens=args.max_new_tokens, seed=args.seed)
    config = SpecConfig(gamma=args.gamma, speculative=not args.no_speculation, max_batch_size=1)
    pair = load_pair(args.target, "none" if args.no_speculation else args.draft, args.dtype, args.device,
                     args.runtime)
    tokenizer = pair.target.tokenizer
    if tokenizer is None:
        raise CliError(f"{args.target} has no tokenizer files; text generation needs one")
    chat = tokenizer.has_chat_template if args.chat is None else args.chat
    prompt_ids = tokenizer.encode(args.prompt, chat=chat, system=args.system)
    engine = Engine(pair.target.model, pair.drafter, config, tokenizer.eos_token_ids)
    collector = StatsCollector()
    request_id = engine.add_request(prompt_ids, params)
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
    stats = collector.summary()
    stats.update(gamma=args.gamma if pair.drafter else 0, draft=pair.draft_spec if pair.drafter else "none",
                 target=args.target)
    if args.json:
        print(json.dumps({"text": tokenizer.decode(token_ids), "token_ids": token_ids,
                          "prompt_tokens": len(prompt_ids), "finish_reason": finish_reason, "stats": stats}))
        return
    sys.stdout.write(decoder.flush() + "\n")
    sys.stdout.flush()
    print(summary_line(stats), file=sys.stderr)


def summary_line(stats: dict) -> str:
    """One human-readable line of the run's statistics."""
    return (f"[{stats['new_tokens']} new tokens | {stats['tokens_per_second']:.1f} tok/s | "
            f"TTFT {1000 * stats['ttft_seconds']:.0f} ms | TPOT {1000 * stats['tpot_seconds']:.1f} ms | "
            f"acceptance {stats['acceptance_rate']:.2f} | {stats['accepted_per_round']:.2f} accepted/round | "
            f"{stats['tokens_per_round']:.2f} tokens/round | "
            f"gamma {stats['gamma']} | draft {stats['draft']}]")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `specsample` console script."""
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ValueError, FetchError, CliError, OSError) as exc:
        print(f"specsample: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
