"""One set-up path from specs to engines: load the target and its drafter, measure the target's scoring widths,
size the caches, choose the planner. The CLI, the server, Ray Serve and the benchmarks all start here.

    from specsample import EngineOptions, load

    speculator = load(EngineOptions(target="smollm2-135m-instruct", gamma="auto"))
    engine = speculator.engine(max_batch_size=8)
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specsample.config import SAMPLING_MODES, SettingError, SpecConfig, TreeShape
from specsample.drafters.base import Drafter
from specsample.drafters.model import WINDOW_MODES
from specsample.drafters.suffix import SCOPES as SUFFIX_SCOPES
from specsample.engine import Engine
from specsample.grammar import GrammarCompiler
from specsample.models.base import TreeLM
from specsample.models.hub import ALIASES
from specsample.models.loader import RUNTIMES, resolve_dtype
from specsample.models.quant import DEFAULT_INT4_GROUP, INT4_GROUP_SIZES, QUANT_MODES
from specsample.models.row_padding import PAD_MODES, measure_target_widths
from specsample.options_cli import setting
from specsample.pair import Pair, load_pair
from specsample.planner import FixedGamma, GammaController, Planner

log = logging.getLogger("specsample")

DEFAULT_TARGET = "smollm2-135m-instruct"
DEFAULT_SAMPLING = "rejection"  # docs/exactness.md: what coupling costs in acceptance on the shipped pair


def parse_gamma(value: int | str) -> int | str:
    """`--gamma`: 'auto' or an integer >= 1 (given as an int or its text)."""
    if value == "auto":
        return value
    if isinstance(value, bool):
        raise ValueError(f"gamma must be an integer >= 1 or 'auto', got {value!r}")
    try:
        gamma = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"gamma must be an integer >= 1 or 'auto', got {value!r}") from None
    if gamma < 1 or str(gamma) != str(value).strip():
        raise ValueError(f"gamma must be an integer >= 1 or 'auto', got {value!r}")
    return gamma


def parse_device(spec: str | torch.device) -> torch.device:
    """`spec` as a device of a kind we run on (cpu, cuda[:N], mps), else `SettingError`. Whether this process can use
    it is `check_device`'s question."""
    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda", "mps"):
        raise SettingError("device", f"device must be cpu, cuda or cuda:N, got {spec!r}")
    return device


def parse_tree(value: str) -> TreeShape | None:
    """`--tree`: 'auto' or 'off' (None: no tree of its own) or NODES[xBRANCHxDEPTH] (`TreeShape.parse`)."""
    if not isinstance(value, str):
        raise SettingError("tree", f"tree must be 'auto', 'off' or NODES[xBRANCHxDEPTH], got {value!r}")
    return None if value.strip().lower() in ("auto", "off") else TreeShape.parse(value.strip())


def check_device(spec: str | torch.device) -> None:
    """Raise `SettingError` unless this process can use the device `spec` names: cpu, an existing CUDA device, or mps
    where available."""
    device = parse_device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch has no CUDA support" if torch.version.cuda is None else "no CUDA device is visible"
            raise SettingError("device", f"{spec}: CUDA is not available ({why}; torch {torch.__version__})")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise SettingError(
                "device",
                f"{spec}: this machine has {count} CUDA device{'' if count == 1 else 's'} (cuda:0..cuda:{count - 1})",
            )
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise SettingError("device", f"{spec}: MPS is not available")


@dataclass(frozen=True)
class EngineOptions:
    """Everything that decides how engines are built: the settings of `specsample generate`, `serve` and `bench`
    and of Ray replicas, whose flags are made from these fields (`options_cli`; each help is its flag's)."""

    target: str = setting(
        DEFAULT_TARGET, help=f"target model: alias ({', '.join(ALIASES)}), Hugging Face folder, .gguf file or hub id"
    )
    draft: str | None = setting(
        None,
        help="draft: a model spec sharing the target's tokenizer, 'ngram' (prompt "
        "lookup), 'suffix' (suffix drafting over the request and recent "
        "requests' outputs), 'hybrid[:MODEL]' (suffix drafting where the text "
        "repeats, the model elsewhere) or 'none'. Default: the target alias's (smollm2-135m-instruct: "
        "hybrid, with the distilled draft shipped in the package; gemma3-270m: "
        "ngram)",
    )
    gamma: int | str = setting(
        "auto",
        help="draft tokens per round, or 'auto': chosen per request online from "
        "measured acceptance and cost, up to --max-gamma, with fallback to plain "
        "decoding",
    )
    max_gamma: int = setting(8, help="upper bound for gamma auto")
    tree: str = setting(
        "auto",
        help="token trees, scored in one target forward and verified exactly: auto (the drafter's own: "
        "Medusa heads' candidate tree, chains for the other drafters), off (chains) or "
        "NODES[xBRANCHxDEPTH] (e.g. 16x4x6: up to 16 nodes, 4 children per expanded node, "
        "6 deep). With gamma auto the largest tree it may draft, only where trees measure "
        "faster than chains; with a fixed gamma that tree every round. Needs our "
        "Llama-family runtime",
    )
    speculative: bool = setting(
        True,
        help="draft and verify (false: plain decoding)",
        negation="--no-speculation",
        negation_help="plain decoding through the same loop (no draft is loaded)",
    )
    dtype: str = setting(
        "auto",
        help="auto (bf16 where the CPU runs it natively; a draft at most 256 wide runs in "
        "float32 on a CPU), float32, bfloat16",
    )
    device: str = setting("cpu", help="cpu, cuda or cuda:N (checked before any model loads)")
    runtime: str = setting(
        "auto",
        choices=RUNTIMES,
        help="model runtime: ours (Llama family), hf (transformers) or auto (ours where it applies)",
    )
    compile: bool = setting(
        False,
        help="compile decode steps and verification blocks with torch.compile (our "
        "runtime only): minutes once per process on a small CPU, then ~1.5x faster "
        "steps (docs/runtime.md)",
    )
    quantize: str = setting(
        "auto",
        choices=QUANT_MODES,
        help="how the target's weights are held: auto (a GGUF's Q4_0/Q4_1/Q4_K/Q8_0 tensors run "
        "natively as int4/int8 on a CPU, unless --dtype names a float type), none "
        "(dequantized to --dtype, e.g. bfloat16), int8 (per row) or int4 (group-wise): every "
        "projection, weight-only (docs/runtime.md)",
    )
    quant_group: int = setting(
        DEFAULT_INT4_GROUP, choices=INT4_GROUP_SIZES, help="inputs per scale of int4 weights quantized at load"
    )
    draft_quantize: str = setting("auto", choices=QUANT_MODES, help="the same for a draft model (auto: as stored)")
    pad_rows: str = setting(
        "off",
        choices=PAD_MODES,
        help="auto: first time the target's forward per number of tokens scored (a few seconds) "
        "and score rounds at the fastest width >= what they need, which pays off over long or "
        "many generations; off: score what is asked",
    )
    draft_window: str = setting(
        "auto",
        choices=WINDOW_MODES,
        help="what a draft model attends to: auto (the window saved with the draft, for the "
        "shipped one its first 32 and latest 256 tokens: it was trained on 512) or off "
        "(the whole context); never changes the output's distribution",
    )
    sampling: str | None = setting(
        None,
        choices=SAMPLING_MODES,
        help="how sampled drafts are verified: coupled (each token the target's Gumbel-max "
        "with noise keyed by seed and position, so a seed gives the same tokens "
        "whatever gamma, drafts and batch) or rejection (modified rejection sampling: "
        "accepts more drafts; a seed reproduces only under the same plan). Default: "
        f"{DEFAULT_SAMPLING}, coupled with --deterministic; both are exact "
        "(docs/exactness.md)",
    )
    deterministic: bool = setting(
        False,
        help="batch- and shape-invariant target forwards (our runtime, not with "
        "--compile): outputs are bitwise reproducible for a seed and "
        "speculative greedy equals plain greedy in every dtype; slower "
        "(docs/exactness.md)",
    )
    suffix_cache_scope: str = setting(
        "global",
        choices=SUFFIX_SCOPES,
        help="what suffix drafts (the hybrid's lookup, --draft suffix) come from: global "
        "(the request and the outputs of the engine's recent requests, shared "
        "across clients: a request decodes faster where another client wrote the "
        "same text, a timing side channel) or request (the request alone); "
        "docs/serving.md#the-suffix-cache",
    )

    def __post_init__(self) -> None:
        """Every setting is checked here; whether this process can use the device, by `load` before it loads
        anything (a Ray driver may lack the GPUs its replicas have)."""
        try:
            object.__setattr__(self, "gamma", parse_gamma(self.gamma))
        except ValueError as exc:
            raise SettingError("gamma", str(exc)) from None
        if isinstance(self.max_gamma, bool) or not isinstance(self.max_gamma, int) or self.max_gamma < 1:
            raise SettingError("max_gamma", f"max_gamma must be an integer >= 1, got {self.max_gamma!r}")
        parse_tree(self.tree)  # a bad tree fails here, before anything loads
        if self.pad_rows not in PAD_MODES:
            raise SettingError("pad_rows", f"pad_rows must be one of {', '.join(PAD_MODES)}, got {self.pad_rows!r}")
        if self.draft_window not in WINDOW_MODES:
            raise SettingError(
                "draft_window", f"draft_window must be one of {', '.join(WINDOW_MODES)}, got {self.draft_window!r}"
            )
        if self.runtime not in RUNTIMES:
            raise SettingError("runtime", f"runtime must be one of {', '.join(RUNTIMES)}, got {self.runtime!r}")
        for name in ("quantize", "draft_quantize"):
            if getattr(self, name) not in QUANT_MODES:
                raise SettingError(name, f"{name} must be one of {', '.join(QUANT_MODES)}, got {getattr(self, name)!r}")
        if self.quant_group not in INT4_GROUP_SIZES:
            raise SettingError(
                "quant_group",
                f"quant_group must be one of {', '.join(map(str, INT4_GROUP_SIZES))}, got {self.quant_group!r}",
            )
        if self.quantize in ("int8", "int4") and self.runtime == "hf":
            raise SettingError("quantize", f"quantize {self.quantize} needs our Llama-family runtime, not runtime hf")
        try:
            resolve_dtype(self.dtype, torch.device("cpu"))
        except ValueError as exc:
            raise SettingError("dtype", str(exc)) from None
        parse_device(self.device)
        if self.compile and self.runtime == "hf":
            raise ValueError("--compile needs our Llama-family runtime, not --runtime hf")
        if self.sampling is not None and self.sampling not in SAMPLING_MODES:
            raise SettingError(
                "sampling", f"sampling must be one of {', '.join(SAMPLING_MODES)}, got {self.sampling!r}"
            )
        if self.suffix_cache_scope not in SUFFIX_SCOPES:
            raise SettingError(
                "suffix_cache_scope",
                f"suffix_cache_scope must be one of {', '.join(SUFFIX_SCOPES)}, got {self.suffix_cache_scope!r}",
            )
        if not isinstance(self.deterministic, bool):
            raise SettingError("deterministic", f"deterministic must be true or false, got {self.deterministic!r}")
        if self.deterministic:
            if self.sampling == "rejection":
                raise SettingError(
                    "sampling",
                    "deterministic mode needs sampling 'coupled': with rejection sampling a "
                    "seed's tokens depend on the drafts each round proposes",
                )
            if self.compile:
                raise SettingError(
                    "deterministic",
                    "deterministic mode cannot run a compiled decode step (its "
                    "kernels differ from the eager forward's); drop --compile",
                )
            if self.runtime == "hf":
                raise SettingError(
                    "deterministic", "deterministic mode needs our Llama-family runtime, not --runtime hf"
                )

    @property
    def coupled(self) -> bool:
        """Whether sampled tokens are coupled (`sampling`, its default resolved)."""
        if self.sampling is not None:
            return self.sampling == "coupled"
        return self.deterministic or DEFAULT_SAMPLING == "coupled"

    @property
    def most_drafts(self) -> int:
        """The most drafts a chain may hold."""
        return self.max_gamma if self.gamma == "auto" else self.gamma

    @property
    def tree_shape(self) -> TreeShape | None:
        """The tree `tree` names (None: off, or auto: see `Speculator.tree`)."""
        return parse_tree(self.tree)


@dataclass
class Speculator:
    """A loaded target and drafter, and what engines for them share."""

    pair: Pair
    options: EngineOptions
    target_widths: tuple[int, ...] = ()  # per tokens scored at batch 1, the width to score them at (pad_rows auto)
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
    def drafter(self) -> Drafter | None:
        return self.pair.drafter

    @property
    def draft_spec(self) -> str:
        """The draft in use ('none' without one)."""
        return self.pair.draft_spec if self.pair.drafter is not None else "none"

    @property
    def tree(self) -> TreeShape | None:
        """The largest tree a round may draft: the one `tree` names, or under 'auto' the drafter's own (its `tree`,
        where it declares one and the target scores trees); None: chains."""
        if self.options.tree.strip().lower() != "auto":
            return self.options.tree_shape
        own = getattr(self.pair.drafter, "tree", None)
        return own if isinstance(own, TreeShape) and isinstance(self.pair.target.model, TreeLM) else None

    def planner(self) -> Planner:
        """A new planner: gamma auto (learning as it runs) or the fixed gamma."""
        gamma, tree = self.options.gamma, self.tree
        return GammaController(self.options.max_gamma, tree) if gamma == "auto" else FixedGamma(gamma, tree)

    def spec_config(
        self, max_batch_size: int = 1, max_seq_len: int | None = None, prefix_cache_rows: int = 0
    ) -> SpecConfig:
        return SpecConfig(
            speculative=self.options.speculative and self.pair.drafter is not None,
            max_batch_size=max_batch_size,
            max_seq_len=max_seq_len,
            target_widths=self.target_widths,
            prefix_cache_rows=prefix_cache_rows,
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
    ) -> Engine:
        """An engine for up to `max_batch_size` running requests of up to `max_seq_len` tokens each (None: the
        target's context window). `drafter`: the loaded one ("loaded"), another (e.g. wrapped for swapping, or a
        fresh one beside an engine running in lockstep), or None for plain decoding; `planner`: one that keeps what
        an earlier engine's gamma auto learnt, or another policy (its gamma at most the options' most drafts);
        `prefix_cache_rows`: finished requests' rows kept for requests sharing their prefix (`SpecConfig`)."""
        if isinstance(drafter, str) and drafter != "loaded":
            raise ValueError(f"drafter must be a Drafter, None or 'loaded', got {drafter!r}")
        target = self.pair.target
        if self.options.compile and max_batch_size > 1:  # batched rounds' graphs compiled before the first of them
            self.pair.warm_up_batches()
        return Engine(
            target.model,
            self.pair.drafter if isinstance(drafter, str) else drafter,
            self.spec_config(max_batch_size, max_seq_len, prefix_cache_rows),
            target.tokenizer.eos_token_ids if target.tokenizer is not None else (),
            planner if planner is not None else self.planner(),
            grammars=self.grammars(),
        )


def load(options: EngineOptions = EngineOptions(), say: Callable[[str], None] | None = None) -> Speculator:
    """Load the target and drafter `options` name and measure what engines need (`say`: progress lines)."""
    say = say or log.info
    check_device(options.device)
    if options.compile:
        say("compiling the decode steps after loading (20-80 s on a small CPU, once per process)")
    pair = load_pair(
        options.target,
        options.draft if options.speculative else "none",
        options.dtype,
        options.device,
        options.runtime,
        compile_decode=options.compile,
        draft_window=options.draft_window,
        quantize=options.quantize,
        group_size=options.quant_group,
        draft_quantize=options.draft_quantize,
        suffix_scope=options.suffix_cache_scope,
    )
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
    return Speculator(pair, options, widths)


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
