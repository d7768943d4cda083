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
- replicas: the prefix suite's shared-system-prompt workload through `specsample serve --replicas N` (Ray Serve,
  prefix-affinity routing) and through one replica: the prefix cache's hit rate per replica and overall
  (`replicas.py`);
- repeat: repetitive traffic (second turns, extraction, reworded questions) as a stream through one long-lived
  engine per system, so a shared suffix cache warms (`repeat.py`);
- load: a concurrency sweep through a real `specsample serve`, its default against `"speculative": false`, phases
  interleaved, output lengths fixed with `ignore_eos` (`load.py`).
"""

from __future__ import annotations

import functools
import random
import statistics
import time
from typing import Any

from specsample.bench.config import spread
from specsample.bench.context import Bench, Progress, Recorder
from specsample.bench.load import load  # noqa: F401 - a suite, found by name
from specsample.bench.prefix_prompts import CLIENTS, distinct_questions, history_message
from specsample.bench.repeat import repeat  # noqa: F401 - a suite, found by name
from specsample.bench.replicas import replicas  # noqa: F401 - a suite, found by name
from specsample.bench.stats import two_sample_test
from specsample.bench.systems import Ours, record, run_lockstep, speed_line
from specsample.bench.worker import PeerFailed
from specsample.config import Grammar, SamplingParams
from specsample.engine import Engine
from specsample.planner import FixedGamma, GammaController


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


SAMPLES = 4  # the n > 1 workload's samples of one prompt
TURNS = 6  # the multi-turn workload's chat turns
CHAT_QUESTION_CHARS = 160  # each turn's question cut to this many characters (a chat of short messages)
STREAMS = 4  # the long-prompt workload's steady streams
IDLE_ROUNDS = 48  # the rounds its streams are timed alone before the long prompt arrives
MAX_STREAM_REQUESTS = 10_000  # more questions than its streams ever send
MODES = {"cache on": None, "cache off": 0}  # prefix_cache_tokens: None shares prefixes, 0 shares none


def _serve_together(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, Any]:
    """Add every prompt at once and step until all finish: per request its time to first token and per output
    token after it, the output tokens per second overall, and the prompt tokens the target prefilled."""
    started = time.perf_counter()
    ids = [engine.add_request(p, q) for p, q in zip(prompts, params)]
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    count = dict.fromkeys(ids, 0)
    replies: dict[str, list[int]] = {i: [] for i in ids}
    prefilled = hits = 0
    for result in engine.stream():
        prefilled += result.stats.prefilled_tokens
        hits += result.stats.prefix_hits
        for update in result.rows:
            if update.new_tokens:
                first.setdefault(update.request_id, result.finished_at - started)
                last[update.request_id] = result.finished_at - started
                count[update.request_id] += len(update.new_tokens)
                replies[update.request_id].extend(update.new_tokens)
    wall = max(last.values())
    return {
        "ttft_seconds": [first[i] for i in ids],
        "tpot_seconds": [(last[i] - first[i]) / (count[i] - 1) for i in ids if count[i] > 1],
        "tokens_per_second": sum(count.values()) / wall,
        "prefilled_tokens": prefilled,
        "prefix_hits": hits,
        "replies": [replies[i] for i in ids],
    }


def _shared_system(bench: Bench, store: dict[str, Any], system: str, mode: str, rep: int) -> None:
    """CLIENTS users sending the same system prompt with different questions at once."""
    tokenizer, config = bench.tokenizer, bench.config
    prompts = [
        tokenizer.encode_messages([{"role": "system", "content": system}, {"role": "user", "content": q}])
        for q in distinct_questions(bench, CLIENTS)
    ]
    params = [SamplingParams(temperature=0, max_new_tokens=config.max_new_tokens) for _ in prompts]
    engine = bench.speculator.engine(
        CLIENTS, max(map(len, prompts)) + config.max_new_tokens + 8, prefix_cache_tokens=MODES[mode]
    )
    run = _serve_together(engine, prompts, params)
    del run["replies"]
    store["shared_system"]["prompt_tokens"] = len(prompts[0])
    store["shared_system"]["runs"][mode].append(run)


def _samples(bench: Bench, store: dict[str, Any], system: str, mode: str) -> None:
    """One prompt sampled SAMPLES times (n > 1), the samples arriving together."""
    tokenizer, config = bench.tokenizer, bench.config
    prompt = tokenizer.encode_messages(
        [{"role": "system", "content": system}, {"role": "user", "content": distinct_questions(bench, 1)[0]}]
    )
    params = [SamplingParams(temperature=0.7, max_new_tokens=config.max_new_tokens, seed=i) for i in range(SAMPLES)]
    engine = bench.speculator.engine(SAMPLES, len(prompt) + config.max_new_tokens + 8, prefix_cache_tokens=MODES[mode])
    run = _serve_together(engine, [prompt] * SAMPLES, params)
    del run["replies"]
    store["samples"]["prompt_tokens"] = len(prompt)
    store["samples"]["runs"][mode] = run


def _chat(bench: Bench, store: dict[str, Any], mode: str) -> None:
    """One user's TURNS-turn chat, each turn the whole conversation so far and a new question."""
    tokenizer, config = bench.tokenizer, bench.config
    questions = [q[:CHAT_QUESTION_CHARS] for q in distinct_questions(bench, TURNS)]
    messages: list[dict[str, str]] = []
    engine = bench.speculator.engine(
        1,
        len(tokenizer.encode("\n\n".join(questions), chat=True)) + TURNS * (config.max_new_tokens + 32),
        prefix_cache_rows=1,
        prefix_cache_tokens=MODES[mode],
    )
    prefilled, ttft = 0, []
    for question in questions:
        messages.append({"role": "user", "content": question})
        prompt = tokenizer.encode_messages(messages)
        run = _serve_together(engine, [prompt], [SamplingParams(temperature=0, max_new_tokens=config.max_new_tokens)])
        prefilled += run["prefilled_tokens"]
        ttft.append(run["ttft_seconds"][0])
        reply = run["replies"][0]
        messages.append({"role": "assistant", "content": tokenizer.decode(reply)})
    final = len(prompt) + len(reply)
    store["chat"]["runs"][mode] = {"prefilled_tokens": prefilled, "final_tokens": final, "ttft_seconds": ttft}


def _long_prompt(bench: Bench, store: dict[str, Any], budget: tuple[int | None, float | None], label: str) -> None:
    """STREAMS clients, each sending question after question (the next as soon as the last is answered: greedy,
    --max-new-tokens each), timed alone for IDLE_ROUNDS rounds, then while a long prompt is prefilled (until its first
    token, within `budget`: the engine's prefill_chunk_tokens and prefill_time_ratio): per stream and round, the
    round's time per token it emitted (a request's first token left out: that is its time to first token)."""
    tokenizer, config = bench.tokenizer, bench.config
    long_prompt = tokenizer.encode(history_message(tokenizer, config.long_prompt_tokens), chat=True)
    fresh = (tokenizer.encode(q, chat=True) for q in distinct_questions(bench, MAX_STREAM_REQUESTS))
    engine = bench.speculator.engine(
        STREAMS + 1, len(long_prompt) + 16, prefill_chunk_tokens=budget[0], prefill_time_ratio=budget[1]
    )
    params = SamplingParams(temperature=0, max_new_tokens=config.max_new_tokens)
    streams = {engine.add_request(next(fresh), params) for _ in range(STREAMS)}
    answering: set[str] = set()  # stream requests past their first token
    gaps: dict[str, list[float]] = {"idle": [], "long prompt": []}
    phase, previous, long_id, long_ttft, started, rounds = "warm-up", None, None, None, 0.0, 0
    while long_ttft is None:
        result = engine.step()
        rounds += 1
        for update in result.rows:
            if update.request_id == long_id and update.new_tokens:
                long_ttft = result.finished_at - started
            if update.request_id not in streams:
                continue
            if update.new_tokens and update.request_id in answering and previous is not None and phase in gaps:
                gaps[phase].append((result.finished_at - previous) / len(update.new_tokens))
            answering.add(update.request_id)
            if update.finish_reason is not None:
                streams.discard(update.request_id)
                streams.add(engine.add_request(next(fresh), params))
        previous = result.finished_at
        if phase == "warm-up" and rounds > 2:
            phase = "idle"
        elif phase == "idle" and len(gaps["idle"]) >= IDLE_ROUNDS * STREAMS:
            long_id = engine.add_request(long_prompt, SamplingParams(temperature=0, max_new_tokens=1))
            started, phase = time.perf_counter(), "long prompt"
    for request_id in streams:
        engine.cancel(request_id)
    for _ in engine.stream():
        pass
    store["long_prompt"]["prompt_tokens"] = len(long_prompt)
    store["long_prompt"]["runs"][label] = {"tpot_seconds": gaps, "long_prompt_ttft_seconds": long_ttft}


def prefix(bench: Bench, store: dict[str, Any], recorder: Recorder) -> None:
    """Shared prefixes with the prefix cache on and off (`prefix_cache_tokens` 0), interleaved: CLIENTS clients
    sending one system prompt of --history-tokens with different questions at once (--prefix-reps times each),
    SAMPLES samples of one prompt, a TURNS-turn chat; and STREAMS clients sending question after question while one
    --long-prompt-tokens prompt arrives, prefilled in chunks (the server's default budget) and whole."""
    config, tokenizer = bench.config, bench.tokenizer
    if not tokenizer.has_chat_template:
        raise ValueError(f"{config.engine.target} has no chat template: the prefix suite replays chats")
    from specsample.server.options import DEFAULT_PREFILL_CHUNK, DEFAULT_PREFILL_TIME_RATIO

    system = history_message(tokenizer, config.history_tokens)
    store.update(
        clients=CLIENTS,
        shared_system={"runs": {m: [] for m in MODES}},
        samples={"n": SAMPLES, "runs": {}},
        chat={"turns": TURNS, "runs": {}},
        long_prompt={
            "streams": STREAMS,
            "chunk_tokens": DEFAULT_PREFILL_CHUNK,
            "time_ratio": DEFAULT_PREFILL_TIME_RATIO,
            "runs": {},
        },
    )
    progress = Progress("prefix", config.prefix_reps + 3)
    for rep in range(config.prefix_reps):
        for mode in list(MODES) if rep % 2 == 0 else list(MODES)[::-1]:
            _shared_system(bench, store, system, mode, rep)
        recorder.save()
        runs = store["shared_system"]["runs"]
        progress.step(
            f"{CLIENTS} clients, shared system prompt: TTFT p50 "
            f"{1000 * statistics.median(runs['cache on'][-1]['ttft_seconds']):.0f} ms with the cache, "
            f"{1000 * statistics.median(runs['cache off'][-1]['ttft_seconds']):.0f} ms without"
        )
    for mode in MODES:
        _samples(bench, store, system, mode)
    recorder.save()
    progress.step(f"n = {SAMPLES}")
    for mode in MODES:
        _chat(bench, store, mode)
    recorder.save()
    chat = store["chat"]["runs"]["cache on"]
    progress.step(f"{TURNS}-turn chat: {chat['prefilled_tokens']} tokens prefilled for {chat['final_tokens']}")
    for budget, label in (((DEFAULT_PREFILL_CHUNK, DEFAULT_PREFILL_TIME_RATIO), "chunked"), ((None, None), "whole")):
        _long_prompt(bench, store, budget, label)
        recorder.save()
    progress.step("long prompt during traffic")
    progress.close()
    runs = store["shared_system"]["runs"]
    ratios = sorted(
        statistics.median(off["ttft_seconds"]) / statistics.median(on["ttft_seconds"])
        for on, off in zip(runs["cache on"], runs["cache off"])
    )
    speeds = sorted(
        on["tokens_per_second"] / off["tokens_per_second"] for on, off in zip(runs["cache on"], runs["cache off"])
    )
    store["shared_system"].update(
        ttft_speedup=[ratios[0], statistics.median(ratios), ratios[-1]],
        throughput_gain=[speeds[0], statistics.median(speeds), speeds[-1]],
    )
