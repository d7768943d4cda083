"""The systems a benchmark compares, behind one small interface: generate for one prompt, timed."""

from __future__ import annotations

import dataclasses
import random
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
    knobs (default ControllerConfig's), its max_gamma at most the config's gamma (the draft cache's slack).
    `seed_offset` shifts every seeded request's seed: a copy of a system that samples other texts from the same
    distribution (a placebo against which to judge another policy's texts and times)."""

    def __init__(self, name: str, target: CausalLM, drafter: Drafter | None, config: SpecConfig,
                 eos: frozenset[int], keep_controller: bool = True,
                 controller_config: ControllerConfig | None = None, seed_offset: int = 0) -> None:
        self.name, self.target, self.drafter, self.config, self.eos = name, target, drafter, config, eos
        self.seed_offset = seed_offset
        knobs = controller_config or ControllerConfig()
        # a smaller max_gamma asked for is kept (it was once silently replaced by the config's gamma)
        self.controller_config = dataclasses.replace(knobs, max_gamma=min(knobs.max_gamma, config.gamma))
        self.keep_controller = keep_controller
        kept = config.adaptive and keep_controller
        self.controller = GammaController(self.controller_config) if kept else None

    def run(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[RunRecord]:
        """Generate for a batch of prompts alone, start to finish."""
        run = self.start(prompts, params)
        while run.step():
            pass
        return run.records()

    def start(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> OursRun:
        """A generation advanced one round per `step()`, so several systems can take turns (`run_lockstep`)."""
        controller = self.controller
        if controller is None and self.config.adaptive:  # a fresh controller per run, with the same knobs
            controller = GammaController(self.controller_config)
        if self.seed_offset:
            params = ([self._shifted(p) for p in params] if isinstance(params, list) else self._shifted(params))
        return OursRun(self, prompts, params, controller)

    def _shifted(self, params: SamplingParams) -> SamplingParams:
        if params.seed is None:
            return params
        return dataclasses.replace(params, seed=params.seed + self.seed_offset)


class OursRun:
    """One generation of `Ours`, advanced a round at a time. Its clock runs only inside `step()`: the
    wall time, first-token latency and token gaps it reports are its own rounds' time, not that of
    other generations stepped in between (the engine statistics in `stats` keep wall-clock times)."""

    def __init__(self, system: Ours, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 controller: GammaController | None) -> None:
        from specsample.api import generate_stream
        from specsample.metrics import StatsCollector

        self.name = system.name
        self.single = len(prompts) == 1
        self._stream = generate_stream(system.target, prompts, params, system.drafter, system.config, system.eos,
                                       controller)
        self._collector = StatsCollector()
        self._own = 0.0  # seconds spent inside step() so far: this generation's clock
        self._outputs: dict[str, list[int]] = {}
        self._stamps: dict[str, list[float]] = {}  # request id -> own-clock time of each token
        self._ids: list[str] = []
        self._rounds: list[RoundTiming] = []
        self._prefill, self._context = 0.0, len(prompts[0]) if prompts else 0
        self._prompt_tokens = self._context
        self._started: float | None = None  # wall clock at the first step (the engine statistics' TTFT origin)
        self.done = False

    def step(self) -> bool:
        """Run the next round; False once the generation has finished (nothing was run)."""
        if self.done:
            return False
        begin = time.perf_counter()
        if self._started is None:
            self._started = begin
        try:
            self._ids, result = next(self._stream)
        except StopIteration:
            self._own += time.perf_counter() - begin  # the engine's last check is the generation's time too
            self.done = True
            return False
        seconds = result.finished_at - begin
        self._own += time.perf_counter() - begin
        if self.single and result.stats.batch_size:  # one row: the round's cost is that row's
            self._prefill += result.stats.prefill_seconds
            stats = result.stats
            self._rounds.append(RoundTiming(stats.drafted, self._context, seconds - stats.prefill_seconds,
                                            stats.scored_rows > 0, stats.lookup_rows > 0,
                                            (stats.draft_seconds, stats.target_seconds, stats.verify_seconds)))
            self._context += result.stats.emitted
        if not self._collector.requests:
            for rid in self._ids:
                self._collector.request_started(rid, self._started)
        self._collector.observe(result)
        stamp = self._own - (time.perf_counter() - result.finished_at)  # when the round committed, on the own clock
        for update in result.rows:
            if update.new_tokens:
                self._outputs.setdefault(update.request_id, []).extend(update.new_tokens)
                self._stamps.setdefault(update.request_id, []).extend([stamp] * len(update.new_tokens))
        return True

    def records(self) -> list[RunRecord]:
        """One record per prompt, once `step()` has returned False."""
        if not self.done:
            raise RuntimeError("the generation has not finished: step() until it returns False")
        stats = self._collector.summary()
        timing = RunTiming(self._prompt_tokens, self._prefill, tuple(self._rounds)) if self.single else None
        records = []
        for rid in self._ids:
            times = self._stamps.get(rid, [])
            gaps = [b - a for a, b in zip(times, times[1:])]
            records.append(RunRecord(self._outputs.get(rid, []), self._own, times[0] if times else None, gaps, stats,
                                     timing))
        return records


def run_lockstep(systems: list[Ours], prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 shuffle: random.Random | None = None) -> list[list[RunRecord]]:
    """Generate the same prompts with every system, taking turns round by round, and return each system's
    records. Each system's time counts only its own rounds, so a slow stretch of the box lands on all of them
    alike, within tens of milliseconds, where back-to-back runs are a second or more apart. The systems must
    not share a drafter (each holds its own draft cache).

    Turns go in the order given, or, with `shuffle`, in an order drawn from it afresh every round: a round
    runs slower after a drafting system's round (measured 1.3%), so in a fixed order the system that always
    follows the heaviest one pays for it (benchmarks/lockstep_order.py)."""
    drafters = [id(s.drafter) for s in systems if s.drafter is not None]
    if len(drafters) != len(set(drafters)):
        raise ValueError("systems run in lockstep need a drafter each (one drafter keeps one cache)")
    runs = [s.start(prompts, params) for s in systems]
    active = list(runs)
    while active:
        if shuffle is not None:
            shuffle.shuffle(active)
        active = [run for run in active if run.step()]
    return [run.records() for run in runs]


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
