"""`specsample bench`: speed, acceptance and losslessness of speculative sampling, side by side with peers.

Every system sees the same prompts, seeds and token budget, interleaved prompt by prompt (the order
rotates) so machine drift hits all alike. The baseline of every speedup is target-only decoding
through our own engine.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import platform
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm import tqdm

from specsample.bench.report import machine_info
from specsample.bench.stats import acceptance_summary, percentile, predicted_speedup, two_sample_test
from specsample.bench.systems import HFGenerate, Ours, RunRecord, load_hf_peer
from specsample.config import SamplingParams, SpecConfig
from specsample.controller import ControllerConfig
from specsample.datasets import Prompt, humaneval_prompts, sharegpt_hard_prompts, sharegpt_prompts, spec_bench_prompts
from specsample.drafters.base import Drafter
from specsample.drafters.hybrid import HybridDrafter
from specsample.drafters.model import WINDOW_MODES, ModelDrafter
from specsample.models.base import CausalLM
from specsample.models.row_padding import PAD_MODES, with_target_widths
from specsample.pair import Pair, hybrid_model_spec, load_pair

COMPARE_CHOICES = ("hf", "hf-assisted", "hf-lookup")


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark run (the CLI's flags)."""

    target: str = "smollm2-135m-instruct"
    draft: str | None = None
    dataset: str = "spec-bench"
    num_prompts: int | None = None  # per category for spec-bench, in total otherwise
    max_new_tokens: int = 128
    gammas: tuple[int | str, ...] = ("auto", 1, 2, 3, 4, 5, 6, 7, 8)  # first: the main comparison's gamma
    temperatures: tuple[float, ...] = (0.0, 0.7, 1.0)
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16)
    compare: tuple[str, ...] = ()
    sweep_prompts: int = 24  # prompts for the gamma and batch sweeps
    lossless_prompts: int = 3
    lossless_samples: int = 2000
    lossless_tokens: int = 4
    dtype: str = "auto"
    device: str = "cpu"
    pad_rows: str = "auto"  # score our rounds at the target's fastest width (specsample.models.row_padding)
    seed: int = 0
    out: Path = Path("bench-out")

    @classmethod
    def quick(cls, **overrides: Any) -> BenchConfig:
        """A preset that finishes in minutes: few prompts, short generations, small sweeps."""
        base = cls(num_prompts=1, max_new_tokens=32, gammas=("auto", 2, 4, 6), temperatures=(0.0, 0.7),
                   batch_sizes=(1, 4), sweep_prompts=4, lossless_prompts=2, lossless_samples=400)
        return dataclasses.replace(base, **overrides)


def controller_config(spec: str) -> ControllerConfig:
    """ControllerConfig from "key=value,..." (values parsed as the field's default's type)."""
    defaults, changes = ControllerConfig(), {}
    for item in filter(None, spec.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not hasattr(defaults, key):
            raise ValueError(f"expected KEY=VALUE with KEY a ControllerConfig field, got {item!r}")
        kind = type(getattr(defaults, key))
        changes[key] = value.lower() in ("1", "true", "yes") if kind is bool else kind(value)
    return dataclasses.replace(defaults, **changes)


def add_pair_options(parser: argparse.ArgumentParser, dtype: str = "auto") -> None:
    """`--target`, `--draft`, `--draft-window`, `--dtype` and `--device`, as the benchmark scripts take them
    (`dtype`: the script's default)."""
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--draft", default=None, help="draft spec (default: the alias's)")
    parser.add_argument("--draft-window", choices=WINDOW_MODES, default="auto",
                        help="auto: the window saved with the draft; off: the draft sees the whole context")
    parser.add_argument("--dtype", default=dtype, choices=("auto", "float32", "bfloat16", "float16"),
                        help="auto: bfloat16 on CUDA (float16 where it has no bf16) and on CPUs with native bf16, "
                             "else float32; a draft at most 256 wide runs in float32 on a CPU")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]: where both models run")


# `--attention`: which SDPA kernels the runtimes may pick, as (their `cudnn_attention` switch, the kernels an outer
# `sdpa_kernel` allows, None: any). engine: their own choice (every kernel but cuDNN's in eager cached forwards,
# models/sdpa.py); torch: torch's pick everywhere (cuDNN's on Hopper, which builds a graph per context length);
# no-cudnn: every kernel but cuDNN's everywhere, uncached and compiled forwards included; math: the reference one.
ATTENTION_BACKENDS: dict[str, tuple[bool, tuple[SDPBackend, ...] | None]] = {
    "engine": (False, None),
    "torch": (True, None),
    "no-cudnn": (False, (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)),
    "math": (False, (SDPBackend.MATH,)),
}


def add_attention_option(parser: argparse.ArgumentParser) -> None:
    """`--attention` for the benchmark scripts (see ATTENTION_BACKENDS)."""
    parser.add_argument("--attention", choices=tuple(ATTENTION_BACKENDS), default="engine",
                        help="SDPA kernels: engine (the runtimes' choice: no cuDNN in cached forwards; "
                             "default), torch (torch's pick everywhere), no-cudnn (all but cuDNN's everywhere), "
                             "math (the reference kernel only)")


@contextlib.contextmanager
def attention_backends(choice: str, models: Sequence[Any]) -> Iterator[None]:
    """A context in which `models` (runtimes with a `cudnn_attention` switch) run attention with the kernels
    `choice` names (see ATTENTION_BACKENDS); their switches and torch's flags come back after."""
    if choice not in ATTENTION_BACKENDS:
        raise ValueError(f"attention kernels must be one of {', '.join(ATTENTION_BACKENDS)}, got {choice!r}")
    missing = sorted({type(m).__name__ for m in models if not hasattr(m, "cudnn_attention")})
    if missing:  # a runtime without the switch would silently keep its own choice
        raise ValueError(f"choosing attention kernels needs runtimes with a cudnn_attention switch; "
                         f"these have none: {', '.join(missing)}")
    allow_cudnn, backends = ATTENTION_BACKENDS[choice]
    before = [m.cudnn_attention for m in models]
    try:
        for m in models:
            m.cudnn_attention = allow_cudnn
        with contextlib.nullcontext() if backends is None else sdpa_kernel(list(backends)):
            yield
    finally:
        for m, allowed in zip(models, before):
            m.cudnn_attention = allowed


def add_pad_rows_option(parser: argparse.ArgumentParser) -> None:
    """`--pad-rows` for the cost-measuring benchmark scripts (off by default: their documented runs did not pad)."""
    parser.add_argument("--pad-rows", choices=PAD_MODES, default="off",
                        help="auto: score rounds at the target's fastest width (measured first, printed)")


def measured_widths(target: CausalLM, gamma: int, mode: str) -> tuple[int, ...]:
    """The target's scoring widths for rounds of up to `gamma` drafts under `--pad-rows mode`, printed when any."""
    widths = with_target_widths(SpecConfig(gamma=gamma), target, mode).target_widths
    if widths:
        print(f"target scoring widths for 1..{len(widths)} tokens: {widths}")
    return widths


def load_model_draft_pair(target: str, draft: str | None, window: str = "auto", dtype: str = "auto",
                          device: str = "cpu") -> Pair:
    """The target and its draft model, for a benchmark that measures one (n-gram is refused; hybrid, the
    default, gives its model)."""
    pair = load_pair(target, draft, dtype, device, draft_window=window)
    if isinstance(pair.drafter, HybridDrafter):
        pair = dataclasses.replace(pair, drafter=_draft_model(pair.drafter),
                                   draft_spec=hybrid_model_spec(pair.draft_spec, pair.target))
    if not isinstance(pair.drafter, ModelDrafter):
        raise SystemExit(f"this benchmark needs a draft model; got {pair.draft_spec}")
    return pair


def _draft_model(drafter: Drafter | None) -> Drafter | None:
    """The draft model a drafter drafts with: a hybrid's model, else the drafter itself."""
    return drafter.model if isinstance(drafter, HybridDrafter) else drafter


def encode_fitting(prompts: list[Prompt], tokenizer, max_seq_len: int, max_new_tokens: int,
                   chat: bool = True) -> tuple[list[Prompt], list[list[int]]]:
    """Encode each prompt's first turn and keep those that leave room for `max_new_tokens` in the
    target's context window (an error when none does)."""
    encoded = [(p, tokenizer.encode(p.turns[0], chat=chat)) for p in prompts]
    kept = [(p, ids) for p, ids in encoded if len(ids) + max_new_tokens <= max_seq_len]
    if not kept:
        raise ValueError("no prompt fits the target's context window with --max-new-tokens")
    return [p for p, _ in kept], [ids for _, ids in kept]


def load_prompts(name: str, num: int | None, seed: int) -> list[Prompt]:
    """Benchmark prompts: spec-bench (or a path to a file of that format), humaneval, sharegpt or
    sharegpt-hard (`num` of each kind)."""
    if name == "humaneval":
        prompts = humaneval_prompts()
        return prompts[:num] if num else prompts
    if name == "sharegpt":
        return list(sharegpt_prompts(skip=16000, limit=num or 200))  # far from distillation's range
    if name == "sharegpt-hard":
        return sharegpt_hard_prompts(num or 30)
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


class Bench:
    """Loads the pair and the peers once, then runs the suites."""

    def __init__(self, config: BenchConfig, progress: bool = True) -> None:
        self.config, self.progress = config, progress
        self.notes: list[str] = []
        self.pair = load_pair(config.target, config.draft, config.dtype, config.device)
        self.tokenizer = self.pair.target.tokenizer
        if self.tokenizer is None:
            raise ValueError(f"{config.target} has no tokenizer; benchmarks need text prompts")
        self.eos = self.tokenizer.eos_token_ids
        loaded = load_prompts(config.dataset, config.num_prompts, config.seed)
        chat = self.tokenizer.has_chat_template and config.dataset != "humaneval"
        self.prompts, self.prompt_ids = encode_fitting(loaded, self.tokenizer, self.pair.target.model.max_seq_len,
                                                       config.max_new_tokens, chat)
        if len(self.prompts) < len(loaded):
            self.notes.append(f"{len(loaded) - len(self.prompts)} prompts longer than the context window were skipped")
        self.max_len = max(len(i) for i in self.prompt_ids) + config.max_new_tokens + 16
        self.peers = self._load_peers()
        # measured once for every system of ours (batch 1 only); plain decoding is never padded
        self.target_widths = (with_target_widths(SpecConfig(gamma=8), self.pair.target.model, config.pad_rows)
                              .target_widths if self.pair.drafter is not None else ())
        if self.target_widths:
            self.notes.append(f"target rounds of 1..{len(self.target_widths)} tokens scored as {self.target_widths} "
                              "(measured at start-up, --pad-rows auto)")

    # ----- systems ----------------------------------------------------------------------------

    def ours(self, gamma: int | str, batch: int = 1, speculative: bool = True) -> Ours:
        adaptive = gamma == "auto"
        config = SpecConfig(gamma=8 if adaptive else max(1, int(gamma)), adaptive=adaptive, speculative=speculative,
                            max_batch_size=batch, max_seq_len=min(self.max_len, self.pair.target.model.max_seq_len),
                            target_widths=self.target_widths)
        name = f"specsample gamma={gamma}" if speculative else "target-only (ours)"
        if speculative and self.pair.drafter is None:
            raise ValueError(f"no draft for {self.config.target}: pass --draft")
        return Ours(name, self.pair.target.model, self.pair.drafter if speculative else None, config, self.eos)

    def _load_peers(self) -> list[HFGenerate]:
        peers = []
        unknown = set(self.config.compare) - set(COMPARE_CHOICES)
        if unknown:
            raise ValueError(f"unknown --compare system(s) {', '.join(sorted(unknown))}; choose from {', '.join(COMPARE_CHOICES)}")
        if not self.config.compare:
            return peers
        try:
            import transformers  # noqa: F401
        except ImportError:
            self.notes.append("transformers is not installed: peers skipped")
            return peers
        folder = self.pair.target.folder
        if folder is None:
            self.notes.append("the target was not loaded from a folder: transformers peers skipped")
            return peers
        dtype = getattr(self.pair.target.model, "dtype", torch.float32)
        hf_target = load_hf_peer(folder, dtype, self.config.device)
        if "hf" in self.config.compare:
            peers.append(HFGenerate("transformers generate", hf_target, self.eos))
        if "hf-assisted" in self.config.compare:
            model = _draft_model(self.pair.drafter)  # the default hybrid's model is transformers' assistant
            draft_folder = getattr(model, "folder", None)
            if isinstance(model, ModelDrafter) and draft_folder is not None:
                peers.append(HFGenerate("transformers assisted", hf_target, self.eos,
                                        assistant=load_hf_peer(draft_folder, dtype, self.config.device)))
            else:
                self.notes.append(f"hf-assisted skipped: the draft ({self.pair.draft_spec}) is not a model folder "
                                  "transformers can load")
        if "hf-lookup" in self.config.compare:
            peers.append(HFGenerate("transformers prompt lookup", hf_target, self.eos, prompt_lookup=5))
        return peers

    # ----- suites -----------------------------------------------------------------------------

    def _params(self, temperature: float, index: int, max_new_tokens: int | None = None) -> SamplingParams:
        return SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens or self.config.max_new_tokens,
                              seed=self.config.seed * 100_003 + index)

    def compare(self) -> dict[str, Any]:
        """Main table: every system on every prompt, per temperature, interleaved."""
        systems = [self.ours(0, speculative=False), self.ours(self.config.gammas[0])] + self.peers
        out: dict[str, Any] = {}
        bar = tqdm(total=len(self.config.temperatures) * len(self.prompts), desc="compare", disable=not self.progress)
        for temperature in self.config.temperatures:
            records: dict[str, list[tuple[Prompt, RunRecord]]] = defaultdict(list)
            for i, (prompt, ids) in enumerate(zip(self.prompts, self.prompt_ids)):
                order = systems[i % len(systems):] + systems[: i % len(systems)]  # rotate: no fixed position
                for system in order:
                    records[system.name].append((prompt, system.run([ids], self._params(temperature, i))[0]))
                bar.update(1)
            out[str(temperature)] = self._summarise(records, systems[0].name)
        bar.close()
        return out

    def _summarise(self, records: dict[str, list[tuple[Prompt, RunRecord]]], baseline: str) -> dict[str, Any]:
        categories = sorted({p.category for p, _ in records[baseline]}) + ["overall"]

        def chosen(name: str, cat: str) -> list[RunRecord]:
            return [r for p, r in records[name] if cat == "overall" or p.category == cat]

        def run_stats(name: str, cat: str) -> list[dict]:
            return [r.stats for r in chosen(name, cat) if r.stats]

        table: dict[str, Any] = {name: {cat: _speed(chosen(name, cat)) for cat in categories} for name in records}
        for name in records:
            for cat in categories:
                base = table[baseline][cat]["tokens_per_s"]
                table[name][cat]["speedup"] = table[name][cat]["tokens_per_s"] / base if base else 0.0
                stats = run_stats(name, cat)
                if stats and any(s["drafted"] for s in stats):
                    acc = acceptance_summary(stats)
                    cost = _cost_ratio(stats, run_stats(baseline, cat))
                    table[name][cat].update(acc, cost_ratio=cost)
                    if cost is not None:  # no plain rounds timed: no prediction rather than an optimistic one
                        predicted = predicted_speedup(acc["alpha"], acc["gamma_mean"], cost)
                        table[name][cat].update(predicted_speedup=predicted,
                                                measured_over_predicted=table[name][cat]["speedup"] / predicted)
        return table

    def gamma_sweep(self, temperature: float) -> dict[str, Any]:
        """Speedup and ms/token against gamma (the paper's figure), with the theory curve."""
        prompts = list(zip(self.prompts, self.prompt_ids))[: self.config.sweep_prompts]
        systems = [self.ours(0, speculative=False)] + [self.ours(g) for g in self.config.gammas]
        records: dict[str, list[tuple[Prompt, RunRecord]]] = defaultdict(list)
        for i, (prompt, ids) in enumerate(tqdm(prompts, desc="gamma sweep", disable=not self.progress)):
            for system in systems[i % len(systems):] + systems[: i % len(systems)]:
                records[system.name].append((prompt, system.run([ids], self._params(temperature, i))[0]))
        table = self._summarise(records, systems[0].name)
        points = []
        for gamma, system in zip(self.config.gammas, systems[1:]):
            row = table[system.name]["overall"]
            points.append({"gamma": gamma, "speedup": row["speedup"], "ms_per_token": row["ms_per_token"],
                           "alpha": row.get("alpha"), "cost_ratio": row.get("cost_ratio"),
                           "predicted_speedup": row.get("predicted_speedup")})
        fixed = [p for p in points if p["gamma"] != "auto" and p["alpha"] is not None and p["cost_ratio"] is not None]
        alpha = statistics.fmean(p["alpha"] for p in fixed) if fixed else 0.0
        cost = statistics.fmean(p["cost_ratio"] for p in fixed) if fixed else 0.0
        theory = [{"gamma": g, "speedup": predicted_speedup(alpha, g, cost)} for g in range(1, 11)]
        return {"temperature": temperature, "points": points, "theory": theory, "alpha": alpha, "cost_ratio": cost,
                "baseline_ms_per_token": table[systems[0].name]["overall"]["ms_per_token"]}

    def batch_sweep(self, temperature: float) -> list[dict[str, Any]]:
        """Throughput of target-only and speculative decoding as the batch grows."""
        ids = self.prompt_ids[: self.config.sweep_prompts]
        out = []
        for batch in tqdm(self.config.batch_sizes, desc="batch sweep", disable=not self.progress):
            systems = [self.ours(0, batch, speculative=False), self.ours(self.config.gammas[0], batch)]
            totals = {s.name: [0, 0.0] for s in systems}
            for start in range(0, len(ids), batch):
                group = ids[start:start + batch]
                params = [self._params(temperature, start + j) for j in range(len(group))]
                for system in systems:
                    records = system.run(group, params)
                    totals[system.name][0] += sum(len(r.tokens) for r in records)
                    totals[system.name][1] += records[0].seconds
            base, spec = (totals[s.name][0] / totals[s.name][1] for s in systems)
            out.append({"batch_size": batch, "target_only_tokens_per_s": base, "speculative_tokens_per_s": spec,
                        "speedup": spec / base if base else 0.0})
        return out

    def losslessness(self) -> list[dict[str, Any]]:
        """First tokens of many samples from speculative vs target-only sampling: a two-sample test."""
        n, tokens = self.config.lossless_samples, self.config.lossless_tokens
        out = []
        for index, (prompt, ids) in enumerate(list(zip(self.prompts, self.prompt_ids))[: self.config.lossless_prompts]):
            samples = {}
            for speculative in (False, True):
                system = self.ours(self.config.gammas[0] if speculative else 0, batch=min(n, 256), speculative=speculative)
                seqs = []
                for start in tqdm(range(0, n, 256), desc=f"lossless {index} {'spec' if speculative else 'plain'}",
                                  disable=not self.progress, leave=False):
                    count = min(256, n - start)
                    offset = 10**6 * (2 + speculative) + start  # disjoint seeds for the two samples
                    params = [self._params(1.0, offset + j, tokens) for j in range(count)]
                    seqs += [tuple(r.tokens) for r in system.run([ids] * count, params)]
                samples[speculative] = seqs
            test = two_sample_test(samples[False], samples[True])
            out.append({"prompt_id": prompt.id, "category": prompt.category, "samples": n, "tokens": tokens,
                        "temperature": 1.0, **test})
        return out


def _speed(records: list[RunRecord]) -> dict[str, float]:
    tokens = sum(len(r.tokens) for r in records)
    seconds = sum(r.seconds for r in records)
    gaps = [g for r in records for g in r.tpots]
    ttfts = [r.ttft for r in records if r.ttft is not None]
    return {"prompts": len(records), "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds if seconds else 0.0,
            "ms_per_token": 1000 * seconds / tokens if tokens else 0.0,
            "ttft_p50_ms": 1000 * percentile(ttfts, 50), "tpot_p50_ms": 1000 * percentile(gaps, 50),
            "tpot_p99_ms": 1000 * percentile(gaps, 99)}


def _round_seconds(stats: list[dict]) -> float:
    """Model seconds per round (drafting, target forward, verification), pooled over runs."""
    rounds = sum(s["rounds"] for s in stats)
    seconds = sum(s["draft_seconds"] + s["target_seconds"] + s.get("verify_seconds", 0.0) for s in stats)
    return seconds / rounds if rounds else 0.0


def _cost_ratio(stats: list[dict], plain_stats: list[dict]) -> float | None:
    """Measured c from whole rounds: what each drafted position adds to a round's time, over a plain
    (target-only) round's time; None without plain rounds to compare. (The gamma controller, which must
    extrapolate to other gammas, splits the same time into a fixed overhead k and a draft step c.)

    A draft step over a target forward alone undercounts c, because scoring and verifying gamma + 1
    tokens costs more than one (docs/adaptive.md). Divided by the gamma the prediction uses (the
    rounded mean), 1 + gamma c is the measured round-time ratio, so measured / predicted then checks
    the acceptance model E(alpha, gamma) and the engine's overhead, not the cost model.
    """
    plain, spec = _round_seconds(plain_stats), _round_seconds(stats)
    rounds = sum(s["rounds"] for s in stats)
    gamma = max(1, round(sum(s["gamma_mean"] * s["rounds"] for s in stats) / rounds)) if rounds else 0
    return max(0.0, (spec / plain - 1) / gamma) if plain and spec and gamma else None


def environment(bench: Bench) -> dict[str, Any]:
    """What the numbers were measured on."""
    model = bench.pair.target.model
    return {**machine_info(model.device), "machine": platform.platform(), "python": sys.version.split()[0],
            "dtype": str(getattr(model, "dtype", "unknown")).removeprefix("torch."),
            "target": bench.config.target, "draft": bench.pair.draft_spec}


def run(config: BenchConfig, progress: bool = True) -> dict[str, Any]:
    """Run every suite and write results.json, results.md and the plots into `config.out`."""
    from specsample.bench.report import write_report

    started = time.time()
    bench = Bench(config, progress)
    results: dict[str, Any] = {"config": {k: (str(v) if isinstance(v, Path) else v)
                                          for k, v in dataclasses.asdict(config).items()},
                               "environment": environment(bench), "notes": bench.notes}
    results["compare"] = bench.compare()
    first = config.temperatures[0]
    results["gamma_sweep"] = bench.gamma_sweep(first)
    results["batch_sweep"] = bench.batch_sweep(first)
    results["losslessness"] = bench.losslessness()
    results["wall_seconds"] = time.time() - started
    config.out.mkdir(parents=True, exist_ok=True)
    (config.out / "results.json").write_text(json.dumps(results, indent=2))
    write_report(results, config.out)
    return results
