"""The systems a benchmark compares, behind one small interface: generate for one prompt, timed."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from specsample.bench.round_costs import RoundTiming, RunTiming
from specsample.config import SamplingParams, SpecConfig
from specsample.controller import ControllerConfig, GammaController
from specsample.drafters.base import Drafter
from specsample.models.base import CausalLM


@dataclass
class RunRecord:
    """One generation: tokens, wall time, first-token latency, per-token gaps, engine statistics, and
    (batch-1 runs of our engine) every round's draft count, context and time."""

    tokens: list[int]
    seconds: float
    ttft: float | None
    tpots: list[float] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    timing: RunTiming | None = None


class System(Protocol):
    name: str

    def run(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[RunRecord]:
        """Generate for a batch of prompts (the batch is decoded together)."""
        ...


class Ours:
    """specsample's engine: target-only (drafter None) or speculative. The engine re-allocates the
    drafter's state for every run, so one drafter serves all runs. With gamma auto, one controller
    also serves all runs (as in a server, it keeps the costs and acceptance it measured) unless
    `keep_controller` is False, when every run starts a new one from the priors. `controller_config`: its
    knobs (default ControllerConfig's; max_gamma is always the config's gamma)."""

    def __init__(self, name: str, target: CausalLM, drafter: Drafter | None, config: SpecConfig,
                 eos: frozenset[int], keep_controller: bool = True,
                 controller_config: ControllerConfig | None = None) -> None:
        self.name, self.target, self.drafter, self.config, self.eos = name, target, drafter, config, eos
        self.controller_config = dataclasses.replace(controller_config or ControllerConfig(), max_gamma=config.gamma)
        self.keep_controller = keep_controller
        kept = config.adaptive and keep_controller
        self.controller = GammaController(self.controller_config) if kept else None

    def run(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[RunRecord]:
        from specsample.api import generate_stream
        from specsample.metrics import StatsCollector

        drafter = self.drafter
        collector = StatsCollector()
        started = time.perf_counter()
        outputs: dict[str, list[int]] = {}
        stamps: dict[str, list[float]] = {}
        ids: list[str] = []
        rounds: list[RoundTiming] = []
        prefill, previous, context = 0.0, started, len(prompts[0]) if prompts else 0
        controller = self.controller
        if controller is None and self.config.adaptive:  # a fresh controller per run, with the same knobs
            controller = GammaController(self.controller_config)
        for ids, result in generate_stream(self.target, prompts, params, drafter, self.config, self.eos, controller):
            seconds, previous = result.finished_at - previous, result.finished_at
            if len(prompts) == 1 and result.stats.batch_size:  # one row: the round's cost is that row's
                prefill += result.stats.prefill_seconds
                rounds.append(RoundTiming(result.stats.drafted, context, seconds - result.stats.prefill_seconds,
                                          result.stats.scored_rows > 0))
                context += result.stats.emitted
            if not collector.requests:
                for rid in ids:
                    collector.request_started(rid, started)
            collector.observe(result)
            for update in result.rows:
                if update.new_tokens:
                    outputs.setdefault(update.request_id, []).extend(update.new_tokens)
                    stamps.setdefault(update.request_id, []).extend([result.finished_at] * len(update.new_tokens))
        wall = time.perf_counter() - started
        stats = collector.summary()
        timing = RunTiming(len(prompts[0]), prefill, tuple(rounds)) if len(prompts) == 1 else None
        records = []
        for rid in ids:
            times = stamps.get(rid, [])
            gaps = [b - a for a, b in zip(times, times[1:])]
            records.append(RunRecord(outputs.get(rid, []), wall, times[0] - started if times else None, gaps, stats,
                                     timing))
        return records


class _HFStreamer:
    """Records when each generated token arrives (transformers' streamer protocol)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.counts: list[int] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # the first call carries the prompt
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())
        self.counts.append(int(value.numel()))

    def end(self) -> None:
        pass


class HFGenerate:
    """transformers `generate()`: plain, assisted by the same draft, or prompt lookup (batch 1)."""

    def __init__(self, name: str, model: Any, eos: frozenset[int], assistant: Any = None,
                 prompt_lookup: int | None = None) -> None:
        self.name, self.model, self.eos, self.assistant, self.prompt_lookup = name, model, eos, assistant, prompt_lookup

    def run(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[RunRecord]:
        rows = params if isinstance(params, list) else [params] * len(prompts)
        return [self._one(p, q) for p, q in zip(prompts, rows)]

    @torch.inference_mode()
    def _one(self, prompt: list[int], params: SamplingParams) -> RunRecord:
        kwargs: dict[str, Any] = {"max_new_tokens": params.max_new_tokens, "eos_token_id": sorted(self.eos) or None,
                                  "pad_token_id": sorted(self.eos)[0] if self.eos else 0}
        if params.greedy:
            kwargs.update(do_sample=False)
        else:
            kwargs.update(do_sample=True, temperature=params.temperature, top_p=params.top_p,
                          top_k=params.top_k or 0, min_p=params.min_p or None)
        if self.assistant is not None:
            kwargs["assistant_model"] = self.assistant
        if self.prompt_lookup is not None:
            kwargs["prompt_lookup_num_tokens"] = self.prompt_lookup
        if params.seed is not None:
            torch.manual_seed(params.seed)
        streamer = _HFStreamer()
        ids = torch.tensor([prompt], device=self.model.device)
        started = time.perf_counter()
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), streamer=streamer, **kwargs)
        if ids.device.type == "cuda":
            torch.cuda.synchronize(ids.device)  # like ours: the wall time includes queued GPU work
        wall = time.perf_counter() - started
        tokens = out[0, len(prompt):].tolist()
        per_token = [t for t, c in zip(streamer.times, streamer.counts) for _ in range(c)]
        gaps = [b - a for a, b in zip(per_token, per_token[1:])]
        return RunRecord(tokens, wall, streamer.times[0] - started if streamer.times else None, gaps, {})


def load_hf_peer(folder, dtype: torch.dtype, device: str | torch.device = "cpu") -> Any:
    """The same weights through transformers (a peer for the comparison), on the device ours runs on."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).to(device).eval()
