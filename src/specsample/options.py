"""The engine's settings, one record: `EngineOptions`, whose fields are the flags of `specsample generate`, `serve` and
`bench` and the arguments of Ray replicas (`options_cli`), checked when the record is made, before anything loads."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specsample.config import SAMPLING_MODES, SettingError, TreeShape
from specsample.drafters.model import WINDOW_MODES
from specsample.drafters.suffix import SUFFIX_CACHE_SCOPES
from specsample.models.hub import ALIASES
from specsample.models.loader import RUNTIMES, resolve_dtype
from specsample.models.quant import DEFAULT_INT4_GROUP, INT4_GROUP_SIZES, QUANT_MODES
from specsample.models.row_padding import PAD_MODES
from specsample.options_cli import check_choices, setting

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
        help="model runtime: fused (our Llama-family runtime with each forward's decoder layers in one native call: "
        "CPUs with AVX512-BF16, bfloat16 and int4/int8 weights), ours (our runtime on torch ops), hf "
        "(transformers) or auto (fused where it applies, else ours, else hf)",
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
        choices=SUFFIX_CACHE_SCOPES,
        help="what suffix drafts (the hybrid's lookup, --draft suffix) come from: global "
        "(the request and the outputs of the engine's recent requests, shared "
        "across clients: a request decodes faster where another client wrote the "
        "same text, a timing side channel) or request (the request alone); "
        "docs/serving.md#the-suffix-cache",
    )

    def __post_init__(self) -> None:
        """Every setting is checked here (a choice against its setting's `choices`); whether this process can use
        the device, by `load` before it loads anything (a Ray driver may lack the GPUs its replicas have)."""
        try:
            object.__setattr__(self, "gamma", parse_gamma(self.gamma))
        except ValueError as exc:
            raise SettingError("gamma", str(exc)) from None
        if isinstance(self.max_gamma, bool) or not isinstance(self.max_gamma, int) or self.max_gamma < 1:
            raise SettingError("max_gamma", f"max_gamma must be an integer >= 1, got {self.max_gamma!r}")
        parse_tree(self.tree)  # a bad tree fails here, before anything loads
        check_choices(self)
        if self.quantize in ("int8", "int4") and self.runtime == "hf":
            raise SettingError("quantize", f"quantize {self.quantize} needs our Llama-family runtime, not runtime hf")
        try:
            resolve_dtype(self.dtype, torch.device("cpu"))
        except ValueError as exc:
            raise SettingError("dtype", str(exc)) from None
        parse_device(self.device)
        if self.compile and self.runtime == "hf":
            raise ValueError("--compile needs our Llama-family runtime, not --runtime hf")
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
        return self.gamma if isinstance(self.gamma, int) else self.max_gamma  # an int, or "auto"

    @property
    def tree_shape(self) -> TreeShape | None:
        """The tree `tree` names (None: off, or auto: see `Speculator.tree`)."""
        return parse_tree(self.tree)
