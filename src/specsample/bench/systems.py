"""The systems a benchmark compares, behind one small interface: generate for a batch of prompts, timed."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from specsample.config import SamplingParams
from specsample.drafters.base import Drafter
from specsample.engine import Engine
from specsample.metrics import StatsCollector, percentile
from specsample.planner import Planner


@dataclass
class RunRecord:
    """One generation: tokens, its own time, first-token latency, per-token gaps, engine statistics."""

    tokens: list[int]
    seconds: float
    ttft: float | None
    tpots: list[float] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)


class System(Protocol):
    name: str

    def run(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[RunRecord]:
        """Generate for a batch of prompts (decoded together)."""
        ...


class Ours:
    """specsample's engine with one drafter (None: target-only) and one planner policy.

    `make_engine(max_batch_size, drafter, planner)` builds each run's engine (sized to the run); `make_planner()`
    builds a planner. With `keep_planner` one planner serves every run, as in a server (gamma auto keeps the
    costs and acceptance it measured), else every run starts a new one."""

    def __init__(
        self, name: str, make_engine, drafter: Drafter | None, make_planner, keep_planner: bool = True
    ) -> None:
        self.name, self.drafter = name, drafter
        self._make_engine, self._make_planner = make_engine, make_planner
        self.planner: Planner | None = make_planner() if keep_planner else None

    def run(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[RunRecord]:
        """Generate for a batch of prompts alone, start to finish."""
        run = self.start(prompts, params)
        while run.step():
            pass
        return run.records()

    def start(self, prompts: list[list[int]], params: list[SamplingParams]) -> OursRun:
        """A generation advanced one round per `step()`, so several systems can take turns (`run_lockstep`)."""
        planner = self.planner or self._make_planner()
        return OursRun(self.name, lambda: self._make_engine(len(prompts), self.drafter, planner), prompts, params)


class OursRun:
    """One generation, advanced a round at a time on an engine built in its first step. Its clock runs only inside
    `step()`: the time, first-token latency and token gaps it reports are its own (engine set-up included), not
    those of other generations stepped in between (the engine statistics in `stats` keep wall-clock times)."""

    def __init__(
        self, name: str, make_engine: Callable[[], Engine], prompts: list[list[int]], params: list[SamplingParams]
    ) -> None:
        self.name, self._make_engine, self._prompts, self._params = name, make_engine, prompts, params
        self.engine: Engine | None = None
        self._ids: list[str] = []
        self._collector = StatsCollector()
        self._own = 0.0  # seconds spent inside step() so far: this generation's clock
        self._outputs: dict[str, list[int]] = {}
        self._stamps: dict[str, list[float]] = {}  # request id -> own-clock time of each token
        self.done = False

    def step(self) -> bool:
        """Run the next round; False once the generation has finished (nothing was run)."""
        if self.done:
            return False
        begin = time.perf_counter()
        if self.engine is None:
            self.engine = self._make_engine()
            self._ids = [self.engine.add_request(p, q) for p, q in zip(self._prompts, self._params)]
            for rid in self._ids:
                self._collector.request_started(rid, begin)
                self._outputs[rid], self._stamps[rid] = [], []
        if not self.engine.has_work():
            self.done = True
            return False
        result = self.engine.step()
        self._own += time.perf_counter() - begin
        self._collector.observe(result)
        stamp = self._own - (time.perf_counter() - result.finished_at)  # when the round committed, on the own clock
        for update in result.rows:
            self._outputs[update.request_id].extend(update.new_tokens)
            self._stamps[update.request_id].extend([stamp] * len(update.new_tokens))
        return True

    def records(self) -> list[RunRecord]:
        """One record per prompt, once `step()` has returned False."""
        if not self.done:
            raise RuntimeError("the generation has not finished: step() until it returns False")
        stats = self._collector.summary()
        records = []
        for rid in self._ids:
            times = self._stamps[rid]
            gaps = [b - a for a, b in zip(times, times[1:])]
            records.append(RunRecord(self._outputs[rid], self._own, times[0] if times else None, gaps, stats))
        return records


def run_lockstep(
    systems: list[Ours], prompts: list[list[int]], params: list[SamplingParams], shuffle: random.Random | None = None
) -> list[list[RunRecord]]:
    """Generate the same prompts with every system, taking turns round by round, and return each system's records.
    Each system's time counts only its own rounds, so a slow stretch of the machine lands on all of them alike,
    within tens of milliseconds, where back-to-back runs are a second or more apart. The systems must not share a
    drafter (each holds its own draft cache). With `shuffle`, the turns' order is drawn afresh every round: a round
    runs slower right after a drafting system's round, so in a fixed order the one that always follows the heaviest
    would pay for it."""
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

    def __init__(
        self, name: str, model: Any, eos: frozenset[int], assistant: Any = None, prompt_lookup: int | None = None
    ) -> None:
        self.name, self.model, self.eos, self.assistant, self.prompt_lookup = name, model, eos, assistant, prompt_lookup

    def run(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[RunRecord]:
        return [self._one(p, q) for p, q in zip(prompts, params)]

    @torch.inference_mode()
    def _one(self, prompt: list[int], params: SamplingParams) -> RunRecord:
        kwargs: dict[str, Any] = {
            "max_new_tokens": params.max_new_tokens,
            "eos_token_id": sorted(self.eos) or None,
            "pad_token_id": sorted(self.eos)[0] if self.eos else 0,
        }
        if params.greedy:
            kwargs.update(do_sample=False)
        else:
            kwargs.update(
                do_sample=True,
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k or 0,
                min_p=params.min_p or None,
            )
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
        tokens = out[0, len(prompt) :].tolist()
        per_token = [t for t, c in zip(streamer.times, streamer.counts) for _ in range(c)]
        gaps = [b - a for a, b in zip(per_token, per_token[1:])]
        return RunRecord(tokens, wall, streamer.times[0] - started if streamer.times else None, gaps, {})


def load_hf_peer(folder, dtype: torch.dtype, device: str | torch.device = "cpu") -> Any:
    """The same weights through transformers (a peer for the comparison), on the device ours runs on."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).to(device).eval()


STATS_KEPT = (
    "rounds",
    "drafted",
    "accepted",
    "drafts",
    "rejections",
    "gamma_mean",
    "drafted_per_position_counts",
    "accepted_per_position_counts",
    "draft_seconds",
    "target_seconds",
    "verify_seconds",
    "fallback_row_rounds",
    "lookup_row_rounds",
    "extended_row_rounds",
    "backlog_scorings",
    "tree_row_rounds",
    "tree_budgets",
    "recompiles",
    "eager_fallbacks",
)


def record(run: RunRecord) -> dict[str, Any]:
    """What the report reads of one generation."""
    return {
        "tokens": len(run.tokens),
        "seconds": run.seconds,
        "ttft": run.ttft,
        "tpot_p50": percentile(run.tpots, 50) if run.tpots else None,
        "tpot_p99": percentile(run.tpots, 99) if run.tpots else None,
        "stats": {k: run.stats[k] for k in STATS_KEPT if k in run.stats},
    }


def speed_line(row: dict[str, Any]) -> str:
    """A progress line: each system's tokens per second on one prompt, and the peers that failed on it."""
    parts = [f"{name} {r['tokens'] / r['seconds']:.1f} tok/s" for name, r in row["systems"].items() if r["seconds"] > 0]
    parts += [f"{name} FAILED: {why}" for name, why in row.get("failed", {}).items()]
    return f"{row['category']} {row['prompt']}: " + ", ".join(parts)
