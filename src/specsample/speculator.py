"""One set-up path from specs to engines: load the target and its drafter, measure the target's scoring widths,
size the caches, choose the planner. The CLI, the server, Ray Serve and the benchmarks all start here.

    from specsample import EngineOptions, load

    speculator = load(EngineOptions(target="smollm2-135m-instruct", gamma="auto"))
    engine = speculator.engine(max_batch_size=8)
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from specsample.config import SettingError, SpecConfig, TreeShape
from specsample.drafters.base import Drafter
from specsample.engine import Engine
from specsample.grammar import GrammarCompiler
from specsample.models.base import TreeLM
from specsample.models.hub import cache_dir
from specsample.models.llama import LlamaModel
from specsample.models.row_padding import measure_target_widths
from specsample.options import EngineOptions, check_device, parse_device
from specsample.pair import Pair, load_pair
from specsample.planner import FixedGamma, GammaController, Planner
from specsample.planner.profile import ProfileKey, ProfileStore, machine
from specsample.precompile import packaged_models

log = logging.getLogger("specsample")


@dataclass
class Speculator:
    """A loaded target and drafter, and what engines for them share."""

    pair: Pair
    target_widths: tuple[int, ...] = ()  # per tokens scored at batch 1, the width to score them at (pad_rows auto)
    # models running eagerly until their compiled steps, missing from the cache, are built apart (`load`'s
    # compile_behind: a server starts the build, server/compile_behind.py)
    pending_compile: tuple[LlamaModel, ...] = ()
    _grammars: GrammarCompiler | None = field(default=None, init=False, repr=False)

    def grammars(self) -> GrammarCompiler | None:
        """The grammar compiler for the target's tokenizer (built on first use; None without a tokenizer, or where
        xgrammar is not installed: requests with a grammar are then refused, naming it)."""
        tokenizer = self.pair.target.tokenizer
        if self._grammars is None and tokenizer is not None:
            try:
                self._grammars = GrammarCompiler.from_tokenizer(
                    tokenizer.hf, self.pair.target.model.vocab_size, tokenizer.eos_token_ids
                )
            except SettingError as exc:
                log.warning("%s", exc)
        return self._grammars

    @property
    def options(self) -> EngineOptions:
        """What the pair was loaded with, and what engines are built by."""
        return self.pair.options

    @property
    def drafter(self) -> Drafter | None:
        return self.pair.drafter

    @property
    def step_path(self) -> str:
        """Which code runs the target's forwards (`LlamaModel.step_path`; "transformers" on the adapter)."""
        return getattr(self.pair.target.model, "step_path", "transformers")

    @property
    def draft(self) -> str:
        """The draft in use ('none' without one)."""
        return self.pair.draft if self.pair.drafter is not None else "none"

    @property
    def tree(self) -> TreeShape | None:
        """The largest tree a round of the loaded drafter may draft (`tree_for`)."""
        return self.tree_for(self.pair.drafter)

    def tree_for(self, drafter: Drafter | None) -> TreeShape | None:
        """The largest tree a round of `drafter` may draft: the one `tree` names, or under 'auto' the drafter's own
        (its `tree`, where it declares one and the target scores trees); None: chains."""
        if self.options.tree.strip().lower() != "auto":
            return self.options.tree_shape
        own = getattr(drafter, "tree", None)
        return own if isinstance(own, TreeShape) and isinstance(self.pair.target.model, TreeLM) else None

    def profile_key(self) -> ProfileKey:
        """What gamma auto's measured costs and acceptance hold for: this machine, the pair, its runtime, dtype and
        quantization."""
        target = self.pair.target
        return ProfileKey(
            machine=machine(),
            model=f"{self.options.target} + {self.draft}",
            runtime=self.step_path,
            dtype=str(getattr(target.model, "dtype", "")),
            quantization=f"{target.quantize}/{self.options.draft_quantize}",
        )

    def planner(self) -> Planner:
        """A new planner: gamma auto (learning as it runs, from this pair's profile in the specsample cache) or the
        fixed gamma."""
        gamma, tree = self.options.gamma, self.tree
        if isinstance(gamma, int):
            return FixedGamma(gamma, tree)
        return GammaController(self.options.max_gamma, tree, ProfileStore(self.profile_key(), cache_dir()))

    def spec_config(
        self,
        max_batch_size: int = 1,
        max_seq_len: int | None = None,
        prefix_cache_rows: int = 0,
        prefix_cache_tokens: int | None = None,
        prefill_chunk_tokens: int | None = None,
        prefill_time_ratio: float | None = None,
    ) -> SpecConfig:
        return SpecConfig(
            speculative=self.options.speculative and self.pair.drafter is not None,
            max_batch_size=max_batch_size,
            max_seq_len=max_seq_len,
            target_widths=self.target_widths,
            prefix_cache_rows=prefix_cache_rows,
            prefix_cache_tokens=prefix_cache_tokens,
            prefill_chunk_tokens=prefill_chunk_tokens,
            prefill_time_ratio=prefill_time_ratio,
            coupled=self.options.coupled,
        )

    def engine(
        self,
        max_batch_size: int = 1,
        max_seq_len: int | None = None,
        *,
        drafter: Drafter | None | str = "loaded",
        planner: Planner | None = None,
        prefix_cache_rows: int = 0,
        prefix_cache_tokens: int | None = None,
        prefill_chunk_tokens: int | None = None,
        prefill_time_ratio: float | None = None,
    ) -> Engine:
        """An engine for up to `max_batch_size` running requests of up to `max_seq_len` tokens each (None: the
        target's context window). `drafter`: the loaded one ("loaded"), another (e.g. wrapped for swapping, or a
        fresh one beside an engine running in lockstep), or None for plain decoding; `planner`: one that keeps what
        an earlier engine's gamma auto learnt, or another policy (its gamma at most the options' most drafts);
        `prefix_cache_rows`, `prefix_cache_tokens`: finished requests' rows kept for requests sharing their prefix, and
        the most tokens they hold together; `prefill_chunk_tokens`, `prefill_time_ratio`: the most prompt tokens a
        round prefills while others decode, and the most time it spends on it, as a multiple of their decoding's
        (`SpecConfig`)."""
        if isinstance(drafter, str) and drafter != "loaded":
            raise ValueError(f"drafter must be a Drafter, None or 'loaded', got {drafter!r}")
        target = self.pair.target
        if self.options.compile and max_batch_size > 1:  # batched rounds' graphs compiled before the first of them
            self.pair.warm_up_batches()
        return Engine(
            target.model,
            self.pair.drafter if isinstance(drafter, str) else drafter,
            self.spec_config(
                max_batch_size,
                max_seq_len,
                prefix_cache_rows,
                prefix_cache_tokens,
                prefill_chunk_tokens,
                prefill_time_ratio,
            ),
            target.tokenizer.eos_token_ids if target.tokenizer is not None else (),
            planner if planner is not None else self.planner(),
            grammars=self.grammars(),
        )


def load(
    options: EngineOptions = EngineOptions(), say: Callable[[str], None] | None = None, compile_behind: bool = False
) -> Speculator:
    """Load the target and drafter `options` name and measure what engines need (`say`: progress lines).

    `compile_behind` (a server): on a CPU, models whose compiled steps are all in the cache load compiled, the others
    eagerly, listed in `pending_compile` for the caller to build apart; without it they are built now."""
    say = say or log.info
    check_device(options.device)
    behind = compile_behind and options.compile and parse_device(options.device).type == "cpu"
    if behind:
        pair = load_pair(replace(options, compile=False))
        pending = tuple(model for model in packaged_models(pair) if not _load_compiled(model))
        if pending:
            say("serving without compiled decode steps until they are built (in a separate process)")
        return _measured(pair, options, say, pending)
    if options.compile:
        say(
            "compiling the decode steps after loading: on a CPU loaded from the cache of compiled steps in "
            "seconds, or built where missing (1-3 min per graph on a small CPU, once per machine; "
            "`specsample compile` builds them ahead of time); on a GPU once per process"
        )
    return _measured(load_pair(options), options, say, ())


def _load_compiled(model: LlamaModel) -> bool:
    """Run `model`'s steps from its compiled packages where the cache holds them all (True), else leave it as is."""
    from specsample.models.compiled import PackagedDecode

    model.compiled = PackagedDecode.open(model, build=False)
    return model.compiled is not None


def _measured(
    pair: Pair, options: EngineOptions, say: Callable[[str], None], pending: tuple[LlamaModel, ...]
) -> Speculator:
    """The speculator of a loaded pair, checked and measured as `options` say."""
    if options.deterministic:
        make_deterministic(pair.target.model, options.target)
    if options.tree_shape is not None and not isinstance(pair.target.model, TreeLM):
        raise SettingError(
            "tree",
            f"token trees need a target on our Llama-family runtime; {options.target} runs on "
            f"{type(pair.target.model).__name__} (use --tree off)",
        )
    widths: tuple[int, ...] = ()
    if options.pad_rows == "auto" and options.speculative and pair.drafter is not None:
        say("timing the target's forward per tokens scored (pad_rows auto)")
        widths = measure_target_widths(pair.target.model, options.most_drafts + 1)
        say(f"rounds of 1..{len(widths)} tokens scored as {widths}")
    return Speculator(pair, widths, pending)


def make_deterministic(model: object, spec: str) -> None:
    """Switch the target to batch- and shape-invariant forwards and check, on its own kernels, dtype and device, that a
    block scored beside another row gives exactly the logits of one-token forwards (`SettingError` where not)."""
    from specsample.models.invariant import check_invariance
    from specsample.models.llama import LlamaModel

    if not isinstance(model, LlamaModel):
        raise SettingError(
            "deterministic",
            f"deterministic mode needs a target on our Llama-family runtime; {spec} runs on {type(model).__name__}",
        )
    model.set_deterministic(True)
    try:
        check_invariance(model)
    except RuntimeError as exc:
        raise SettingError("deterministic", str(exc)) from None
