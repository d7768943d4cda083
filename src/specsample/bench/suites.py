"""The suites of `specsample bench`. Each appends its measurements to its part of the results as they are taken
(`Recorder.save()` after every prompt), so a cut-off run keeps them; `report.py` summarises whatever is there.

- compare: target-only, ours at the first --gamma, and the peers, on every prompt, at every temperature;
- gamma: target-only and every --gamma on --sweep-prompts prompts (the paper's speedup-against-gamma figure);
- batch: throughput of target-only and ours as the batch grows;
- lossless: many samples of the first tokens from speculative and target-only sampling, a two-sample test;
- adaptive: target-only, every fixed gamma, gamma auto, prompt lookup and the hybrid, round by round in
  lockstep on every prompt: does gamma auto come within 3% of the best fixed gamma without being told the
  category, and is it never more than 3% slower than target-only?
- structured: ours and target-only on prompts asking for a JSON record, each under a JSON-schema grammar and free,
  interleaved: how much of the unconstrained speed a grammar keeps;
- prefix: time to first token of a second chat turn after a first turn of --history-tokens, on an engine that
  kept the first turn's cache rows (prefix reuse) and on one that did not;
- repeat: repetitive traffic (second turns, extraction, reworded questions) as a stream through one long-lived
  engine per system, so a shared suffix cache warms (`repeat.py`);
- load: a concurrency sweep through a real `specsample serve`, its default against `"speculative": false`, phases
  interleaved, output lengths fixed with `ignore_eos` (`load.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import random
import statistics
import time
from typing import Any

from specsample.bench.config import spread
from specsample.bench.context import Bench, Progress, Recorder
from specsample.bench.load import load  # noqa: F401 - a suite, found by name
from specsample.bench.repeat import repeat  # noqa: F401 - a suite, found by name
from specsample.bench.stats import two_sample_test
from specsample.bench.systems import Ours, record, run_lockstep, speed_line
from specsample.bench.worker import PeerFailed
from specsample.config import Grammar, SamplingParams
from specsample.datasets import spec_bench_prompts
from specsample.engine import Engine
from specsample.planner import FixedGamma, GammaController
from specsample.tokenizer import Tokenizer


def _interleaved(
    bench: Bench,
    systems: list,
    indices: list[int],
    temperature: float,
    rows: list[dict[str, Any]],
    recorder: Recorder,
    label: str,
) -> None:
    """Every system on each prompt in turn, the order rotating prompt by prompt; a row per prompt. A peer that fails
    on a prompt (`PeerFailed`) is left out of that row's systems and named with its cause in the row's `failed`."""
    progress = Progress(label, len(indices))
    for n, i in enumerate(indices):
        order = systems[n % len(systems) :] + systems[: n % len(systems)]  # no system always runs first
        prompt = bench.prompts[i]
        row: dict[str, Any] = {"prompt": prompt.id, "category": prompt.category, "systems": {}}
        for system in order:
            try:
                row["systems"][system.name] = record(
                    system.run([bench.prompt_ids[i]], [bench.params(temperature, i)])[0]
                )
            except PeerFailed as exc:  # recorded; the other systems and prompts still run
                row.setdefault("failed", {})[system.name] = str(exc)
        row["systems"] = {s.name: row["systems"][s.name] for s in systems if s.name in row["systems"]}
        rows.append(row)
        recorder.save()
        progress.step(speed_line(row))
    progress.close()


def compare(bench: Bench, store: dict[str, Any], recorder: Recorder) -> None:
    """Main table: every system on every prompt, per temperature, interleaved."""
    systems = [bench.target_only(), bench.ours(bench.config.gammas[0])]
    if bench.speculator.tree is not None:
        systems.append(bench.ours(bench.config.gammas[0], tree=True))
    systems += bench.peers
    store.update(
        systems=[s.name for s in systems],
        other_drafts=[s.name for s in bench.other_drafts],  # --compare draft:SPEC: ours is compared with each
        runs={},
        compiled=bench.speculator.options.compile,
    )
    for temperature in bench.config.temperatures:
        rows = store["runs"].setdefault(str(temperature), [])
        _interleaved(
            bench, systems, list(range(len(bench.prompts))), temperature, rows, recorder, f"compare T={temperature}"
        )


def gamma(bench: Bench, store: dict[str, Any], recorder: Recorder) -> None:
    """Speed against gamma at the first temperature, on --sweep-prompts prompts spread over the categories."""
    config = bench.config
    if config.sweep_prompts == 0:
        store["skipped"] = "--sweep-prompts 0"
        return
    indices = spread(list(range(len(bench.prompts))), config.sweep_prompts, lambda i: bench.prompts[i].category)
    systems = [bench.target_only()] + [bench.ours(g) for g in config.gammas]
    store.update(
        temperature=config.temperatures[0], systems=[s.name for s in systems], gammas=list(config.gammas), rows=[]
    )
    _interleaved(bench, systems, indices, config.temperatures[0], store["rows"], recorder, "gamma sweep")


def batch(bench: Bench, store: dict[str, Any], recorder: Recorder) -> None:
    """Throughput of target-only and ours (first --gamma) as the batch grows, at the first temperature."""
    config = bench.config
    if config.sweep_prompts == 0:
        store["skipped"] = "--sweep-prompts 0"
        return
    indices = spread(list(range(len(bench.prompts))), config.sweep_prompts, lambda i: bench.prompts[i].category)
    store.update(temperature=config.temperatures[0], gamma=config.gammas[0], rows=[])
    progress = Progress("batch sweep", len(config.batch_sizes))
    for size in config.batch_sizes:
        systems = [bench.target_only(), bench.ours(config.gammas[0])]
        totals = {s.name: [0, 0.0] for s in systems}
        for start in range(0, len(indices), size):
            group = indices[start : start + size]
            params = [bench.params(config.temperatures[0], i) for i in group]
            for system in systems:
                runs = system.run([bench.prompt_ids[i] for i in group], params)
                totals[system.name][0] += sum(len(r.tokens) for r in runs)
                totals[system.name][1] += runs[0].seconds
        base, spec = (totals[s.name][0] / totals[s.name][1] for s in systems)
        store["rows"].append(
            {
                "batch_size": size,
                "target_only_tokens_per_s": base,
                "speculative_tokens_per_s": spec,
                "speedup": spec / base if base else 0.0,
            }
        )
        recorder.save()
        progress.step(f"batch {size}: {spec / base:.2f}x")
    progress.close()


def lossless(bench: Bench, store: dict[str, Any], recorder: Recorder) -> None:
    """First tokens of many samples from speculative and target-only sampling at temperature 1: a two-sample
    test per prompt (a p-value far below its level on several prompts would mean the output is not the target's)."""
    config = bench.config
    if config.lossless_prompts == 0:
        store["skipped"] = "--lossless-prompts 0"
        return
    n, tokens = config.lossless_samples, config.lossless_tokens
    indices = spread(list(range(len(bench.prompts))), config.lossless_prompts, lambda i: bench.prompts[i].category)
    store["tests"] = []
    progress = Progress("lossless", len(indices))
    for i in indices:
        samples = {}
        for speculative in (False, True):
            system = bench.ours(config.gammas[0]) if speculative else bench.target_only()
            seqs = []
            for start in range(0, n, 256):
                count = min(256, n - start)
                offset = 10**6 * (2 + speculative) + start  # disjoint seeds for the two samples
                params = [bench.params(1.0, offset + j, tokens) for j in range(count)]
                seqs += [tuple(r.tokens) for r in system.run([bench.prompt_ids[i]] * count, params)]
            samples[speculative] = seqs
        test = two_sample_test(samples[False], samples[True])
        store["tests"].append(
            {
                "prompt": bench.prompts[i].id,
                "category": bench.prompts[i].category,
                "samples": n,
                "tokens": tokens,
                "temperature": 1.0,
                **test,
            }
        )
        recorder.save()
        progress.step(f"{bench.prompts[i].category} {bench.prompts[i].id}: p = {test['p_value']:.3f}")
    progress.close()


def adaptive_systems(bench: Bench) -> list[Ours]:
    """Target-only, each fixed gamma, gamma auto, prompt lookup under gamma auto and (with a draft model) the hybrid,
    each with a drafter of its own; gamma auto keeps one planner across prompts, as a server does."""
    kind = "model" if bench.draft_model() is not None else "ngram"
    fixed = sorted({g for g in bench.config.gammas if isinstance(g, int)}) or list(range(1, 9))
    systems = [bench.target_only()]
    systems += [bench.system(f"gamma={g}", bench.fresh(kind), functools.partial(FixedGamma, g)) for g in fixed]
    auto = lambda: GammaController(bench.config.max_gamma)  # noqa: E731
    systems.append(bench.system("gamma=auto", bench.fresh(kind), auto))
    if kind == "model":
        systems.append(bench.system("ngram auto", bench.fresh("ngram"), auto))
        systems.append(bench.system("hybrid auto", bench.fresh("hybrid"), auto))
    return systems


def adaptive(bench: Bench, store: dict[str, Any], recorder: Recorder) -> None:
    """Every policy on every prompt in lockstep (turns shuffled every round), per temperature."""
    systems = adaptive_systems(bench)
    store.update(systems=[s.name for s in systems], runs={})
    shuffle = random.Random(bench.config.seed)
    for temperature in bench.config.temperatures:
        rows = store["runs"].setdefault(str(temperature), [])
        progress = Progress(f"adaptive T={temperature}", len(bench.prompts))
        for i, prompt in enumerate(bench.prompts):
            runs = run_lockstep(systems, [bench.prompt_ids[i]], [bench.params(temperature, i)], shuffle)
            row = {
                "prompt": prompt.id,
                "category": prompt.category,
                "systems": {s.name: record(r[0]) for s, r in zip(systems, runs)},
            }
            rows.append(row)
            recorder.save()
            progress.step(speed_line(row))
        progress.close()


RECORD_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "year": {"type": "integer"},
        "country": {"type": "string"},
        "known_for": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "year", "country", "known_for"],
    "additionalProperties": False,
}
JSON_PROMPTS = (
    "Give a JSON record about Ada Lovelace with her name, birth year, country and what she is known for.",
    "Describe the city of Paris as JSON: name, founding year, country, and three things it is known for.",
    "Return JSON about the Python programming language: name, year created, country, and what it is known for.",
    "Write a JSON object about Marie Curie: name, year of birth, country, and her best-known achievements.",
    "Give a JSON record about the Eiffel Tower: name, year built, country, and what it is known for.",
    "Describe Johann Sebastian Bach as JSON: name, birth year, country, and his best-known works.",
    "Return a JSON object about the bicycle: name, year invented, country of origin, and what it is known for.",
    "Write JSON about Nelson Mandela: name, year of birth, country, and what he is known for.",
)


def structured(bench: Bench, store: dict[str, Any], recorder: Recorder) -> None:
    """Ours (first --gamma) and target-only on JSON prompts, each with RECORD_SCHEMA's grammar and without, the
    four in an order rotating prompt by prompt, per temperature."""
    tokenizer = bench.tokenizer
    prompts = [tokenizer.encode(text, chat=tokenizer.has_chat_template) for text in JSON_PROMPTS]
    grammar = Grammar.json_schema(RECORD_SCHEMA)
    max_seq_len = max(len(p) for p in prompts) + bench.config.max_new_tokens
    ours, base = bench.ours(bench.config.gammas[0], max_seq_len=max_seq_len), bench.target_only(max_seq_len)
    systems = [(f"{s.name}{tag}", s, g) for s in (ours, base) for tag, g in (("", None), (" json_schema", grammar))]
    store.update(systems=[name for name, _, _ in systems], schema=RECORD_SCHEMA, runs={})
    for temperature in bench.config.temperatures:
        rows = store["runs"].setdefault(str(temperature), [])
        progress = Progress(f"structured T={temperature}", len(prompts))
        for i, prompt in enumerate(prompts):
            row: dict[str, Any] = {"prompt": i, "category": "json", "systems": {}}
            for name, system, grammar_or_none in systems[i % len(systems) :] + systems[: i % len(systems)]:
                params = SamplingParams(
                    temperature=temperature,
                    max_new_tokens=bench.config.max_new_tokens,
                    seed=bench.config.seed * 100_003 + i,
                    grammar=grammar_or_none,
                )
                row["systems"][name] = record(system.run([prompt], [params])[0])
            row["systems"] = {name: row["systems"][name] for name, _, _ in systems}
            rows.append(row)
            recorder.save()
            progress.step(speed_line(row))
        progress.close()


FOLLOW_UP = "Thank you. Now summarise your answer in one sentence."


def history_message(tokenizer: Tokenizer, tokens: int) -> str:
    """Spec-Bench questions joined until the chat-rendered message holds at least `tokens` tokens."""
    parts: list[str] = []
    for prompt in spec_bench_prompts():
        parts.extend(prompt.turns)
        if len(tokenizer.encode("\n\n".join(parts), chat=tokenizer.has_chat_template)) >= tokens:
            break
    return "\n\n".join(parts)


def _first_token(engine: Engine, prompt: list[int], params: SamplingParams) -> tuple[float, list[int], dict[str, int]]:
    """Seconds from submission to the first committed token, the whole reply, and the admission's counters."""
    started = time.perf_counter()
    engine.add_request(prompt, params)
    first: float | None = None
    tokens: list[int] = []
    admission: dict[str, int] = {}
    for result in engine.stream():
        if result.stats.admitted:
            admission = {"prefix_hits": result.stats.prefix_hits, "reused_tokens": result.stats.reused_tokens}
        for update in result.rows:
            if update.new_tokens and first is None:
                first = time.perf_counter() - started
            tokens.extend(update.new_tokens)
    if first is None:
        raise RuntimeError("the request finished without a token")
    return first, tokens, admission


def prefix(bench: Bench, store: dict[str, Any], recorder: Recorder) -> None:
    """A first chat turn of --history-tokens answered greedily (--max-new-tokens), then the second turn (history,
    reply, a short follow-up) timed to its first token: on an engine keeping one finished row for reuse and on one
    keeping none, alternating which goes first, --prefix-reps times each."""
    config, tokenizer = bench.config, bench.tokenizer
    if not tokenizer.has_chat_template:
        raise ValueError(f"{config.engine.target} has no chat template: the prefix suite replays a chat")
    messages = [{"role": "user", "content": history_message(tokenizer, config.history_tokens)}]
    first_turn = tokenizer.encode_messages(messages)
    reply_params = SamplingParams(temperature=0, max_new_tokens=config.max_new_tokens)
    modes = (("reuse", 1), ("no reuse", 0))
    store.update(
        first_turn_tokens=len(first_turn),
        reply_tokens=config.max_new_tokens,
        ttft_seconds={m: [] for m, _ in modes},
        first_turn_ttft_seconds=[],
        admission={},
    )
    progress = Progress("prefix", config.prefix_reps)
    for rep in range(config.prefix_reps):
        for mode, kept in modes if rep % 2 == 0 else modes[::-1]:
            # room for the reply, the follow-up and the template's tokens around them
            engine = bench.speculator.engine(
                1, len(first_turn) + 2 * config.max_new_tokens + 256, prefix_cache_rows=kept
            )
            first_seconds, reply, _ = _first_token(engine, first_turn, reply_params)
            turns = [{"role": "assistant", "content": tokenizer.decode(reply)}, {"role": "user", "content": FOLLOW_UP}]
            second_turn = tokenizer.encode_messages(messages + turns)
            seconds, _, store["admission"][mode] = _first_token(
                engine, second_turn, dataclasses.replace(reply_params, max_new_tokens=8)
            )
            store["ttft_seconds"][mode].append(seconds)
            store["first_turn_ttft_seconds"].append(first_seconds)
            store["second_turn_tokens"] = len(second_turn)
        recorder.save()
        times = store["ttft_seconds"]
        progress.step(
            f"second-turn TTFT {1000 * times['reuse'][-1]:.0f} ms with reuse, "
            f"{1000 * times['no reuse'][-1]:.0f} ms without"
        )
    progress.close()
    ratios = sorted(a / b for a, b in zip(store["ttft_seconds"]["no reuse"], store["ttft_seconds"]["reuse"]))
    store.update(speedup_median=statistics.median(ratios), speedup_range=[ratios[0], ratios[-1]])
