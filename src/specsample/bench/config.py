"""What one `specsample bench` run does: its suites, prompts, models and sweeps (the CLI's flags)."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specsample.datasets import Prompt, humaneval_prompts, sharegpt_prompts, spec_bench_prompts
from specsample.options import EngineOptions

COMPARE_CHOICES = ("hf", "hf-assisted", "hf-lookup", "llama.cpp", "llama.cpp-lookup", "hybrid-ngram")
DRAFT_PEER = "draft:"  # --compare draft:SPEC: ours with another draft (any --draft spec) at gamma auto
SUITES = ("compare", "gamma", "batch", "lossless", "adaptive", "structured", "prefix", "replicas", "repeat", "load")
DEFAULT_SUITES = ("compare", "gamma", "batch", "lossless")
BENCH_ENGINE_DEFAULTS = EngineOptions(pad_rows="auto")  # ours score rounds at the target's fastest width


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark run (the CLI's flags)."""

    # the engine ours load: its target, draft, dtype, device, quantization, trees, sampling... (not its gamma, which
    # each system sets from `gammas`, nor `speculative`: target-only runs beside ours)
    engine: EngineOptions = BENCH_ENGINE_DEFAULTS
    suites: tuple[str, ...] = DEFAULT_SUITES
    dataset: str = "spec-bench"  # spec-bench (bundled), a file in its format, humaneval, sharegpt
    num_prompts: int | None = None  # per category for spec-bench, in total otherwise; the repeat suite's per kind
    max_new_tokens: int = 128
    gammas: tuple[int | str, ...] = ("auto", 1, 2, 3, 4, 5, 6, 7, 8)  # the first: the compare suite's gamma
    temperatures: tuple[float, ...] = (0.0, 0.7, 1.0)
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16)
    concurrency: tuple[int, ...] = (1, 2, 4, 8, 16)  # the load suite's clients (the server's batch: the largest)
    # peers: hf, hf-assisted, hf-lookup, llama.cpp, llama.cpp-lookup, hybrid-ngram, draft:SPEC (ours with that draft)
    compare: tuple[str, ...] = ()
    sweep_prompts: int = 24  # prompts of the gamma and batch sweeps (0: skip them)
    lossless_prompts: int = 3  # prompts of the losslessness test (0: skip it)
    lossless_samples: int = 2000
    lossless_tokens: int = 4
    history_tokens: int = 1500  # the prefix suite's shared system prompt (about this many tokens)
    long_prompt_tokens: int = 4000  # the prefix suite's long prompt arriving during traffic
    prefix_reps: int = 3  # runs of the prefix suite's shared-system-prompt workload with the cache on and off, each
    replicas: int = 2  # the replicas suite's Ray Serve replicas (against one)
    seed: int = 0
    out: Path = Path("bench-out")

    def __post_init__(self) -> None:
        if self.engine.gamma != "auto" or not self.engine.speculative:
            raise ValueError(
                "the benchmark sets each system's gamma (--gamma) and runs target-only beside ours: "
                "leave the engine options' gamma at auto and speculative on"
            )
        unknown = [s for s in self.suites if s not in SUITES]
        if unknown or not self.suites:
            raise ValueError(f"unknown or no suite {unknown}; choose from {', '.join(SUITES)}")
        peers = {p for p in self.compare if p not in COMPARE_CHOICES and not p.startswith(DRAFT_PEER)}
        if peers:
            raise ValueError(
                f"unknown --compare system(s) {', '.join(sorted(peers))}; choose from {', '.join(COMPARE_CHOICES)} "
                f"or {DRAFT_PEER}SPEC (ours with another draft)"
            )
        if any(p == DRAFT_PEER for p in self.compare):
            raise ValueError(f"--compare {DRAFT_PEER} needs a draft spec after the colon, e.g. {DRAFT_PEER}ngram")
        if not self.gammas or not self.temperatures or not self.batch_sizes:
            raise ValueError("--gamma, --temperature and --batch-size each need at least one value")
        for gamma in self.gammas:
            if gamma != "auto" and (isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1):
                raise ValueError(f"--gamma values must be integers >= 1 or 'auto', got {gamma!r}")
        if any(t < 0 for t in self.temperatures):
            raise ValueError(f"--temperature values must be >= 0, got {self.temperatures}")
        if any(b < 1 for b in self.batch_sizes):
            raise ValueError(f"--batch-size values must be >= 1, got {self.batch_sizes}")
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise ValueError(f"--concurrency takes values >= 1, got {self.concurrency}")
        for name in (
            "max_new_tokens",
            "lossless_samples",
            "lossless_tokens",
            "history_tokens",
            "long_prompt_tokens",
            "prefix_reps",
            "replicas",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("sweep_prompts", "lossless_prompts"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError(f"num-prompts must be >= 1, got {self.num_prompts}")

    @classmethod
    def quick(cls, **overrides: Any) -> BenchConfig:
        """A preset that finishes in minutes: one prompt per category, short generations, small sweeps."""
        base = cls(
            num_prompts=1,
            max_new_tokens=32,
            gammas=("auto", 2, 4, 6),
            temperatures=(0.0, 0.7),
            batch_sizes=(1, 4),
            sweep_prompts=4,
            lossless_prompts=2,
            lossless_samples=400,
            prefix_reps=2,
        )
        return dataclasses.replace(base, **overrides)

    @property
    def max_gamma(self) -> int:
        """The widest round any system of the run drafts (gamma auto's bound, or the widest fixed gamma)."""
        return max([self.engine.max_gamma] + [g for g in self.gammas if isinstance(g, int)])

    @property
    def engine_options(self) -> EngineOptions:
        """The options the run loads with: its engine's, with caches for its widest round."""
        return dataclasses.replace(self.engine, max_gamma=self.max_gamma)


def load_prompts(name: str, num: int | None) -> list[Prompt]:
    """Benchmark prompts: spec-bench (bundled; `num` per category), a file in its format, humaneval or sharegpt
    (`num` in all)."""
    if name == "humaneval":
        prompts = humaneval_prompts()
        return prompts[:num] if num else prompts
    if name == "sharegpt":
        return list(sharegpt_prompts(skip=16000, limit=num or 200))  # far from what drafts are trained on
    prompts = spec_bench_prompts(None if name == "spec-bench" else name)
    if num is None:
        return prompts
    seen: dict[str, int] = defaultdict(int)
    picked = []
    for p in prompts:
        if seen[p.category] < num:
            picked.append(p)
            seen[p.category] += 1
    return picked


def spread(items: list, count: int, category: Callable[[Any], str]) -> list:
    """The first `count` items taken round-robin over their categories, so a small sample covers them all."""
    queues: dict[str, list] = {}
    for item in items:
        queues.setdefault(category(item), []).append(item)
    out: list = []
    while len(out) < min(count, len(items)):
        for queue in queues.values():
            if queue and len(out) < count:
                out.append(queue.pop(0))
    return out
