"""The public Python API: speculative generation on a batch of token-id prompts."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from specsample.config import SamplingParams, SpecConfig
from specsample.drafters.base import Drafter
from specsample.drafters.model import ModelDrafter
from specsample.engine import Engine, RoundResult
from specsample.metrics import StatsCollector
from specsample.models.base import CausalLM
from specsample.planner import Planner


@dataclass(frozen=True)
class Completion:
    """One prompt's generated token ids."""

    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS) or "length"
    seed: int | None


@dataclass(frozen=True)
class GenerationResult:
    """Completions in prompt order, and the run's statistics (see `StatsCollector.summary`)."""

    completions: list[Completion]
    stats: dict[str, Any]


def as_drafter(draft: CausalLM | Drafter | None) -> Drafter | None:
    """Wrap a draft model in a `ModelDrafter`; pass drafters (and None) through."""
    if draft is None or isinstance(draft, Drafter):
        return draft
    if isinstance(draft, CausalLM):
        return ModelDrafter(draft)
    raise TypeError(f"draft must be a CausalLM, a Drafter or None, got {type(draft).__name__}")


def _row_params(params: SamplingParams | Sequence[SamplingParams], count: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        # one seed for the batch: each row gets seed + row so identical prompts still differ
        return [
            params if params.seed is None else dataclasses.replace(params, seed=params.seed + i) for i in range(count)
        ]
    if len(params) != count:
        raise ValueError(f"got {len(params)} SamplingParams for {count} prompts")
    return list(params)


def generate_stream(
    target: CausalLM,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
    draft: CausalLM | Drafter | None = None,
    config: SpecConfig = SpecConfig(),
    eos_token_ids: Iterable[int] = (),
    planner: Planner | None = None,
) -> Iterator[tuple[list[str], RoundResult]]:
    """Yield `(request_ids, round_result)` per round while the prompts decode.

    Up to `config.max_batch_size` prompts decode together; more wait in a queue, in order, and each joins the
    batch when a running one finishes. Request ids are in prompt order; each round's `rows` carry the tokens
    committed for each id. With `draft=None` (or `config.speculative=False`) this is plain decoding through the
    same loop. Pass the same `planner` to successive calls to keep what gamma auto learnt (costs, a pooled
    acceptance rate), as a long-running server does; by default each call starts afresh.
    """
    if not prompts:
        raise ValueError("no prompts given")
    row_params = _row_params(params, len(prompts))
    longest = max(len(p) + rp.max_new_tokens for p, rp in zip(prompts, row_params))
    sized = dataclasses.replace(
        config,
        max_batch_size=min(config.max_batch_size, len(prompts)),
        max_seq_len=config.max_seq_len or min(longest, target.max_seq_len),
    )
    engine = Engine(target, as_drafter(draft), sized, eos_token_ids, planner)
    ids = [engine.add_request(p, rp) for p, rp in zip(prompts, row_params)]
    for result in engine.stream():
        yield ids, result


def generate(
    target: CausalLM,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
    draft: CausalLM | Drafter | None = None,
    config: SpecConfig = SpecConfig(),
    eos_token_ids: Iterable[int] = (),
    planner: Planner | None = None,
) -> GenerationResult:
    """Generate for token-id prompts; returns completions in prompt order and statistics. Up to
    `config.max_batch_size` prompts decode together, the rest queue (see `generate_stream`)."""
    row_params = _row_params(params, len(prompts))
    collector = StatsCollector()
    outputs: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    started = time.perf_counter()
    request_ids: list[str] = []
    for request_ids, result in generate_stream(target, prompts, row_params, draft, config, eos_token_ids, planner):
        if not collector.requests:
            for rid in request_ids:
                collector.request_started(rid, started)
        collector.observe(result)
        for update in result.rows:
            outputs.setdefault(update.request_id, []).extend(update.new_tokens)
            if update.finish_reason is not None:
                reasons[update.request_id] = update.finish_reason
    completions = [
        Completion(list(p), outputs.get(rid, []), reasons.get(rid, "length"), rp.seed)
        for p, rid, rp in zip(prompts, request_ids, row_params)
    ]
    return GenerationResult(completions, collector.summary())
