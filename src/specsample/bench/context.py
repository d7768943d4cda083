"""A benchmark run's loaded models, prompts and systems, its progress lines and its results file."""

from __future__ import annotations

import functools
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from specsample.bench.config import DRAFT_PEER, BenchConfig, load_prompts
from specsample.bench.repeat_stream import context_needed, workload
from specsample.bench.systems import HFGenerate, Ours, load_hf_peer
from specsample.config import SamplingParams
from specsample.drafters.base import Drafter
from specsample.drafters.hybrid import HybridDrafter, Lookup
from specsample.drafters.model import ModelDrafter
from specsample.drafters.ngram import NgramDrafter
from specsample.drafters.suffix import SuffixDrafter
from specsample.engine import Engine
from specsample.planner import FixedGamma, GammaController, Planner
from specsample.speculator import Speculator, load
from specsample.tokenizer import Tokenizer


class Progress:
    """A bar on a terminal; elsewhere (a log, CI) one line per step on stderr."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.done = label, total, 0
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=label, file=sys.stderr)

    def step(self, detail: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
        else:
            print(f"specsample bench: {self.label} {self.done}/{self.total}: {detail}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class Recorder:
    """The run's results dict, written to `out/results.json` (atomically) and `out/results.md` on every `save()`."""

    def __init__(self, out: Path, results: dict[str, Any]) -> None:
        self.out, self.results = out, results
        out.mkdir(parents=True, exist_ok=True)

    def save(self, plots: bool = False) -> None:
        from specsample.bench.report import write_report

        self.results["wall_seconds"] = time.time() - self.results["started"]
        tmp = self.out / "results.json.tmp"
        tmp.write_text(json.dumps(self.results, indent=1) + "\n")
        os.replace(tmp, self.out / "results.json")
        write_report(self.results, self.out, plots=plots)


class Bench:
    """Loads the pair, the prompts and the peers once; builds every system the suites run."""

    def __init__(self, config: BenchConfig, say: Callable[[str], None]) -> None:
        self.config, self._say = config, say
        self.notes: list[str] = []
        self.speculator: Speculator = load(config.engine_options, say=say)
        tokenizer = self.speculator.pair.target.tokenizer
        if tokenizer is None:
            raise ValueError(f"{config.engine.target} has no tokenizer; benchmarks need text prompts")
        self.tokenizer: Tokenizer = tokenizer
        self.eos = tokenizer.eos_token_ids
        loaded = load_prompts(config.dataset, config.num_prompts)
        chat = tokenizer.has_chat_template and config.dataset != "humaneval"
        context = self.speculator.pair.target.model.max_seq_len
        encoded = [(p, tokenizer.encode(p.turns[0], chat=chat)) for p in loaded]
        kept = [(p, ids) for p, ids in encoded if len(ids) + config.max_new_tokens <= context]
        if not kept:
            raise ValueError("no prompt fits the target's context window with --max-new-tokens")
        if len(kept) < len(loaded):
            self.notes.append(f"{len(loaded) - len(kept)} prompts longer than the context window were skipped")
        self.prompts = [p for p, _ in kept]
        self.prompt_ids = [ids for _, ids in kept]
        self.max_seq_len = max(len(i) for i in self.prompt_ids) + config.max_new_tokens
        if "repeat" in config.suites:  # peers hold the repeat suite's longest request too
            self.max_seq_len = max(
                self.max_seq_len, context_needed(tokenizer, config.max_new_tokens, workload(config.num_prompts))
            )
        if self.speculator.target_widths:
            self.notes.append(
                f"target rounds of 1..{len(self.speculator.target_widths)} tokens scored as "
                f"{self.speculator.target_widths} (measured at start-up, --pad-rows auto)"
            )
        self.other_drafts: list = []  # ours with the drafts --compare draft:SPEC names (among the peers)
        self.peers = self._load_peers()

    # ----- systems ----------------------------------------------------------------------------

    def params(self, temperature: float, index: int, max_new_tokens: int | None = None) -> SamplingParams:
        return SamplingParams(
            temperature=temperature,
            max_new_tokens=max_new_tokens or self.config.max_new_tokens,
            seed=self.config.seed * 100_003 + index,
        )

    def system(
        self,
        name: str,
        drafter: Drafter | None,
        make_planner: Callable[[], Planner],
        keep_planner: bool = True,
        max_seq_len: int | None = None,
    ) -> Ours:
        """One of ours: `drafter` (None: target-only) under planners from `make_planner`, for sequences of up to
        `max_seq_len` tokens (default: the run's prompts and --max-new-tokens)."""

        def make_engine(batch: int, drafter: Drafter | None, planner: Planner) -> Engine:
            return self.speculator.engine(batch, max_seq_len or self.max_seq_len, drafter=drafter, planner=planner)

        return Ours(name, make_engine, drafter, make_planner, keep_planner)

    def target_only(self, max_seq_len: int | None = None) -> Ours:
        return self.system("target-only", None, lambda: FixedGamma(1), max_seq_len=max_seq_len)

    def ours(
        self, gamma: int | str, drafter: Drafter | None = None, tree: bool = False, max_seq_len: int | None = None
    ) -> Ours:
        """The loaded drafter (or `drafter`) at a fixed gamma or gamma auto; with `tree`, with --tree's trees."""
        if self.speculator.drafter is None:
            raise ValueError(f"no draft for {self.config.engine.target}: pass --draft")
        shape = self.speculator.tree if tree else None
        make: Callable[[], Planner] = (
            functools.partial(FixedGamma, gamma, shape)
            if isinstance(gamma, int)
            else functools.partial(GammaController, self.config.max_gamma, shape)
        )
        name = f"specsample gamma={gamma}" + (f" tree={shape}" if shape else "")
        return self.system(name, drafter or self.speculator.drafter, make, max_seq_len=max_seq_len)

    def draft_model(self) -> ModelDrafter | None:
        """A new drafter on the loaded draft model (its own cache), or None without one."""
        loaded = self.speculator.drafter
        model = loaded.model if isinstance(loaded, HybridDrafter) else loaded
        if not isinstance(model, ModelDrafter):
            return None
        return ModelDrafter(model.model, model.folder, model.window)

    def fresh(self, kind: str) -> Drafter | None:
        """A new drafter of `kind`: 'model', 'ngram', 'suffix' (global scope), 'suffix-request', 'hybrid' (with suffix
        drafting in global scope), 'hybrid-request' (...in request scope), 'hybrid-ngram' (with n-gram lookup); None
        where the pair has no draft model for it."""
        lookups: dict[str, Callable[[], Drafter]] = {
            "ngram": NgramDrafter,
            "suffix": SuffixDrafter,
            "suffix-request": lambda: SuffixDrafter("request"),
        }
        if kind in lookups:
            return lookups[kind]()
        model = self.draft_model()
        if model is None:
            return None
        hybrids: dict[str, Callable[[], Lookup]] = {
            "hybrid": SuffixDrafter,
            "hybrid-request": lambda: SuffixDrafter("request"),
            "hybrid-ngram": NgramDrafter,
        }
        if kind in hybrids:
            return HybridDrafter(model, hybrids[kind]())
        if kind != "model":
            raise ValueError(f"unknown drafter kind {kind!r}")
        return model

    def _load_peers(self) -> list:
        peers: list = []
        if "hybrid-ngram" in self.config.compare:  # the default's hybrid with prompt lookup in place of suffix drafting
            drafter = self.fresh("hybrid-ngram")
            if drafter is None:
                self.notes.append("hybrid-ngram skipped: the pair has no draft model")
            else:
                peers.append(
                    self.system(
                        "hybrid, n-gram lookup gamma=auto", drafter, lambda: GammaController(self.config.max_gamma)
                    )
                )
        for lookup in (False, True):
            if ("llama.cpp-lookup" if lookup else "llama.cpp") in self.config.compare:
                peers += self._llama_cpp(lookup)
        self.other_drafts = self._other_drafts()
        peers += self.other_drafts
        if not {p for p in self.config.compare if not p.startswith(DRAFT_PEER)} - {
            "llama.cpp",
            "llama.cpp-lookup",
            "hybrid-ngram",
        }:
            return peers
        folder = self.speculator.pair.target.folder
        if folder is None:
            self.notes.append("the target was not loaded from a folder: transformers peers skipped")
            return peers
        dtype = getattr(self.speculator.pair.target.model, "dtype", torch.float32)
        hf_target = load_hf_peer(folder, dtype, self.config.engine.device)
        if "hf" in self.config.compare:
            peers.append(HFGenerate("transformers generate", hf_target, self.eos))
        if "hf-assisted" in self.config.compare:
            model = self.draft_model()  # the default hybrid's model is transformers' assistant
            if model is not None and model.folder is not None:
                peers.append(
                    HFGenerate(
                        "transformers assisted",
                        hf_target,
                        self.eos,
                        assistant=load_hf_peer(model.folder, dtype, self.config.engine.device),
                    )
                )
            else:
                self.notes.append(
                    f"hf-assisted skipped: the draft ({self.speculator.draft}) is not a model "
                    "folder transformers can load"
                )
        if "hf-lookup" in self.config.compare:
            peers.append(HFGenerate("transformers prompt lookup", hf_target, self.eos, prompt_lookup=5))
        return peers

    def _other_drafts(self) -> list:
        """Ours at gamma auto with each draft `--compare draft:SPEC` names (under --tree auto, with its own tree), or
        a note why one is left out."""
        from specsample.pair import load_drafter

        systems = []
        for peer in self.config.compare:
            if not peer.startswith(DRAFT_PEER):
                continue
            draft = peer[len(DRAFT_PEER) :]
            drafter = load_drafter(draft, self.speculator.pair.target, self.speculator.options)
            if drafter is None:
                self.notes.append(f"{peer} skipped: the draft could not be loaded")
                continue
            shape = self.speculator.tree_for(drafter)
            name = f"{draft} gamma=auto" + (f" tree={shape}" if shape else "")
            make: Callable[[], Planner] = functools.partial(GammaController, self.config.max_gamma, shape)
            systems.append(self.system(name, drafter, make))
        return systems

    def _llama_cpp(self, lookup: bool = False) -> list:
        """llama.cpp on the target's GGUF file (an alias's, fetched if its cache lacks it), with its prompt-lookup
        draft where `lookup`, or a note why not."""
        from specsample.bench.llama_cpp import peer_or_reason
        from specsample.models.hub import ALIASES, alias_gguf

        target = self.speculator.pair.target
        gguf = target.gguf
        if gguf is None and target.spec in ALIASES:
            gguf = alias_gguf(target.spec)
        peer, reason = peer_or_reason(gguf, self.max_seq_len, self.eos, lookup=lookup)
        if peer is None or gguf is None:
            why = reason or "llama.cpp skipped: no GGUF file"
            self.notes.append(why)
            self._say(why)
            return []
        self.notes.append(
            f"{peer.name}: llama-cpp-python {peer.version} on {gguf.name}, {peer.threads} thread"
            f"{'s' if peer.threads != 1 else ''}, context "
            f"{peer.n_ctx} tokens, in a process of its own" + (f", {peer.about}" if peer.about else "")
        )
        return [peer]

    def close(self) -> None:
        """End the peers' child processes."""
        for peer in self.peers:
            close = getattr(peer, "close", None)
            if close is not None:
                close()


def environment(bench: Bench) -> dict[str, Any]:
    """What the numbers were measured on."""
    model = bench.speculator.pair.target.model
    device = model.device
    about: dict[str, Any] = {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.platform(),
        "device": str(device),
        "dtype": str(getattr(model, "dtype", "unknown")).removeprefix("torch."),
        "target": bench.config.engine.target,
        "draft": bench.speculator.draft,
        "weights": bench.speculator.pair.target.quantize,
    }
    if device.type == "cuda":
        about["gpu"] = torch.cuda.get_device_name(device)
    return about


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def commit() -> str | None:
    """The git commit of the package's checkout (marked when the tree has changes beside it), when it is one."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + (" with uncommitted changes" if dirty else "")) if head else None
