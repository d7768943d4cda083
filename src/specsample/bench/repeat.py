"""The repeat suite: repetitive traffic, as a stream of requests through one long-lived engine per system.

The workload, built from the bundled Spec-Bench questions, is `bench/repeat_stream.py`'s.

Every system (target-only, the hybrid with n-gram lookup, the hybrid with suffix drafting in request and in global
scope, and the peers) keeps one engine for the whole stream at a temperature, so a shared cache warms as it would in
a server; each first decodes WARM_UP untimed. Then each request is decoded by every system: ours in lockstep, round
by round in an order drawn afresh every round, each on its own clock (as `run_lockstep`), then the peers one after
another in an order rotating request by request. A second turn's history holds the first reply the system itself
sent, as a client sends back what it received (at temperature 0 the same text for every system, up to the rounding
of bfloat16 scores; an empty reply where a peer failed on the first turn). A peer's failure on a request is recorded
in that row's `failed`, with its cause, and the stream goes on.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from specsample.bench.context import Bench, Progress, Recorder
from specsample.bench.repeat_stream import KINDS, Request, context_needed, workload
from specsample.bench.systems import Ours, OursRun, record, speed_line
from specsample.bench.worker import PeerFailed
from specsample.drafters.base import Drafter
from specsample.engine import Engine
from specsample.planner import GammaController

WARM_UP = "Say OK."  # each system's first request, not timed (its few tokens enter a shared cache)
WARM_UP_TOKENS = 4


def repeat_systems(bench: Bench, max_seq_len: int) -> list[Ours]:
    """Target-only and the lookups the repeat suite compares, each on an engine of its own kept for the stream."""

    def resident(name: str, drafter: Drafter | None) -> Ours:
        planner = GammaController(bench.config.engine.max_gamma)
        engine = bench.speculator.engine(1, max_seq_len, drafter=drafter, planner=planner)
        return Resident(name, engine)

    systems = [resident("target-only", None)]
    kinds = (
        (
            ("hybrid, n-gram lookup", "hybrid-ngram"),
            ("hybrid, suffix (request)", "hybrid-request"),
            ("hybrid, suffix (global)", "hybrid"),
        )
        if bench.draft_model() is not None
        else (("n-gram lookup", "ngram"), ("suffix (request)", "suffix-request"), ("suffix (global)", "suffix"))
    )
    systems += [resident(name, bench.fresh(kind)) for name, kind in kinds]
    return systems


class Resident(Ours):
    """One of ours on one engine kept across runs, as a server keeps it: each run queues its prompts on it."""

    def __init__(self, name: str, engine: Engine) -> None:
        self.name, self.drafter, self.engine, self.planner = name, engine.drafter, engine, engine.planner

    def start(self, prompts: list[list[int]], params) -> OursRun:
        return OursRun(self.name, lambda: self.engine, prompts, params)


def repeat(bench: Bench, store: dict[str, Any], recorder: Recorder) -> None:
    """The stream through every system at every --temperature, request by request: ours in lockstep (turns shuffled
    every round), then the peers in a rotating order; fresh engines per temperature. `prompt_tokens` is
    target-only's prompt (a second turn's differs between systems by their first replies)."""

    tokenizer = bench.speculator.pair.target.tokenizer
    if not tokenizer.has_chat_template:
        raise ValueError(f"{bench.config.engine.target} has no chat template: the repeat suite sends chats")
    stream = workload(bench.config.num_prompts)
    max_seq_len = context_needed(bench.speculator.pair.target.tokenizer, bench.config.max_new_tokens, stream)
    store.update(
        requests=len(stream), kinds={k: sum(r.kind == k for r in stream) for k in KINDS}, runs={}, warm_up=WARM_UP
    )
    warm_up = tokenizer.encode(WARM_UP, chat=True)
    shuffle = random.Random(bench.config.seed)
    for temperature in bench.config.temperatures:
        ours = repeat_systems(bench, max_seq_len)
        peers = [p for p in bench.peers if not isinstance(p, Ours)]
        store["systems"] = [s.name for s in ours + peers]
        for system in ours + peers:  # first-use costs (compiled graphs, allocations) land here, untimed
            try:
                system.run([warm_up], [bench.params(temperature, 10**6, WARM_UP_TOKENS)])
            except PeerFailed as exc:
                store.setdefault("warm_up_failed", {}).setdefault(str(temperature), {})[system.name] = str(exc)
        rows = store["runs"].setdefault(str(temperature), [])
        replies: dict[str, dict[int, list[int]]] = {s.name: {} for s in ours + peers}  # system -> request -> reply
        progress = Progress(f"repeat T={temperature}", len(stream))
        for i, request in enumerate(stream):
            prompts = {
                name: tokenizer.encode_messages(_messages(request, stream, own, tokenizer.decode))
                for name, own in replies.items()
            }
            params = bench.params(temperature, i)
            turn = i % max(len(peers), 1)
            named = _lockstep(ours, prompts, params, shuffle)
            failed = {}
            for peer in peers[turn:] + peers[:turn]:
                try:
                    named[peer.name] = peer.run([prompts[peer.name]], [params])[0]
                except PeerFailed as exc:
                    failed[peer.name] = str(exc)
            row = {
                "prompt": request.id,
                "category": request.kind,
                "prompt_tokens": len(prompts["target-only"]),
                "systems": {},
            }
            for name in store["systems"]:
                replies[name][i] = named[name].tokens if name in named else []  # a failed peer sent nothing
                if name in named:
                    row["systems"][name] = record(named[name])
            if failed:
                row["failed"] = failed
            rows.append(row)
            recorder.save()
            progress.step(speed_line(row))
        progress.close()
        store.setdefault("suffix_cache", {})[str(temperature)] = _cache_of(ours)


def _lockstep(systems: list[Ours], prompts: dict[str, list[int]], params, shuffle: random.Random) -> dict:
    """Each system's run of its own prompt, the systems taking turns round by round in an order drawn afresh every
    round (`run_lockstep`, with a prompt per system): name -> its record."""
    runs = {s.name: s.start([prompts[s.name]], [params]) for s in systems}
    active = list(runs.values())
    while active:
        shuffle.shuffle(active)
        active = [run for run in active if run.step()]
    return {name: run.records()[0] for name, run in runs.items()}


def _messages(
    request: Request, stream: list[Request], replies: dict[int, list[int]], decode: Callable[[list[int]], str]
) -> list[dict[str, str]]:
    """A request's chat: a second turn after its first turn and the reply the system sent to it."""
    if request.after is None:
        return list(request.messages)
    first = stream[request.after]
    return [*first.messages, {"role": "assistant", "content": decode(replies[request.after])}, *request.messages]


def _cache_of(systems: list) -> dict[str, dict[str, int]]:
    """What each system's shared suffix cache held at the end of the stream."""
    from dataclasses import asdict

    from specsample.drafters.suffix import SuffixCacheHolder

    return {
        s.name: asdict(s.drafter.suffix_cache())
        for s in systems
        if isinstance(getattr(s, "drafter", None), SuffixCacheHolder) and s.drafter.suffix_cache() is not None
    }
