"""Turn user-facing specs (target, draft) into a loaded target and a drafter, with clear errors."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError

from specsample.drafters.base import Drafter
from specsample.drafters.eagle import EagleDrafter, is_head_folder, load_head_drafter
from specsample.drafters.hybrid import HybridDrafter
from specsample.drafters.medusa import MedusaDrafter, is_medusa_folder, load_medusa_drafter
from specsample.drafters.model import WINDOW_MODES, DraftWindow, ModelDrafter
from specsample.drafters.ngram import NgramDrafter
from specsample.drafters.suffix import SCOPES, SuffixDrafter
from specsample.models.hub import ALIASES, FetchError, builtin_draft
from specsample.models.llama import LlamaModel
from specsample.models.loader import LoadedModel, load_model
from specsample.models.quant import DEFAULT_INT4_GROUP

log = logging.getLogger("specsample")

NO_DRAFT = ("none", "off")
SUFFIX = "suffix"
SELF_DRAFT, SELF_MODES = "self:", ("int4", "int8")  # --draft self:int4: the target's weights, quantized
# a draft this narrow runs in float32 on a CPU when the dtype is "auto": per-op cost, not reading weights, sets
# its step time there, and float32 ops on its small matrices run faster than bfloat16 ones (docs/drafts.md)
SMALL_DRAFT_HIDDEN = 256


@dataclass
class Pair:
    """A target ready to serve and the drafter that speculates for it (None = plain decoding)."""

    target: LoadedModel
    drafter: Drafter | None
    draft_spec: str
    # how the draft was loaded, so a draft swapped in later (the server's /admin/draft) loads the same way
    dtype: str | torch.dtype = "auto"
    device: str | torch.device = "cpu"
    draft_window: str | DraftWindow = "auto"
    draft_quantize: str = "auto"
    group_size: int = DEFAULT_INT4_GROUP
    suffix_scope: str = "global"

    def warm_up_batches(self) -> None:
        """Compile now the graphs of compiled models (the target, a draft model, a feature draft's step) for batches
        of 2+ rows, which an engine running several requests at once calls: not in its first batched round. Nothing
        where nothing is compiled, or where it is compiled already."""
        compiled = getattr(self.target.model, "compiled", None)
        if compiled is not None:
            compiled.warm_up(blocks=self.drafter is not None, batches=True)
        drafter = self.drafter.model if isinstance(self.drafter, HybridDrafter) else self.drafter
        if isinstance(drafter, ModelDrafter) and getattr(drafter.model, "compiled", None) is not None:
            drafter.model.compiled.warm_up(blocks=True, batches=True)
        elif isinstance(drafter, EagleDrafter) and drafter.compiled is not None:
            drafter.compiled.warm_up(drafter.embed, batches=True)

    def load_draft(self, spec: str) -> Drafter | None:
        """Another drafter for this target, loaded as this pair's was (dtype, device, window, quantization, the
        suffix cache's scope)."""
        return load_drafter(
            spec,
            self.target,
            self.dtype,
            self.device,
            window=self.draft_window,
            quantize=self.draft_quantize,
            group_size=self.group_size,
            suffix_scope=self.suffix_scope,
        )


def resolve_draft_spec(target: LoadedModel, draft_spec: str | None) -> str:
    """The draft to use: the one asked for, else the target alias's default, else n-gram lookup."""
    if draft_spec:
        return draft_spec
    return target.default_draft or "ngram"


def load_drafter(
    spec: str,
    target: LoadedModel,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    compile_decode: bool = False,
    window: str | DraftWindow = "auto",
    quantize: str = "auto",
    group_size: int = DEFAULT_INT4_GROUP,
    suffix_scope: str = "global",
) -> Drafter | None:
    """Build the drafter for `spec`: 'ngram' (prompt lookup), 'suffix' (suffix drafting), 'none',
    'hybrid[:MODEL]' (suffix drafting where the text repeats, the model elsewhere), 'self:int4' or 'self:int8' (the
    target's own weights, quantized: a draft without training), or any model spec sharing the target's tokenizer.
    `compile_decode` compiles a draft model's one-token steps (see `load_model`). `window`: what a draft model
    attends to, 'auto' (the `DraftWindow` saved in its folder, else the whole context), 'off' (the whole
    context) or a `DraftWindow`. `quantize`, `group_size`: how a draft model's weights are held (`load_model`).
    `suffix_scope`: what suffix drafts come from, 'global' (the request and recent requests' outputs) or
    'request' (the request alone).

    A draft that exists but cannot be loaded (out of memory, unreadable files) is not fatal: we
    decode without speculation and say so loudly. Under dtype 'auto' a narrow draft on a CPU (hidden size
    up to SMALL_DRAFT_HIDDEN, on our runtime, not compiled) runs in float32, whatever the target's dtype.
    """
    if isinstance(window, str) and window not in WINDOW_MODES:
        raise ValueError(f"draft window must be one of {', '.join(WINDOW_MODES)} or a DraftWindow, got {window!r}")
    if suffix_scope not in SCOPES:
        raise ValueError(f"suffix cache scope must be one of {', '.join(SCOPES)}, got {suffix_scope!r}")
    if spec in NO_DRAFT:
        return None
    if spec == "ngram":
        return NgramDrafter()
    if spec == SUFFIX:
        return SuffixDrafter(suffix_scope)
    if is_hybrid(spec):
        model_spec = hybrid_model_spec(spec, target)
        model = load_drafter(model_spec, target, dtype, device, compile_decode, window, quantize, group_size)
        if model is None:  # the model failed to load (already logged): keep suffix drafting at least
            log.warning("hybrid drafting continues with suffix drafting only")
            return SuffixDrafter(suffix_scope)
        if not isinstance(model, (ModelDrafter, EagleDrafter, MedusaDrafter)):
            raise ValueError(f"hybrid drafting needs a draft model or a feature draft, got {model_spec!r}")
        return HybridDrafter(model, SuffixDrafter(suffix_scope))
    if spec.startswith(SELF_DRAFT):
        return _self_draft(spec, target, dtype, device, compile_decode, group_size)
    head = builtin_draft(spec) or (Path(spec) if Path(spec).is_dir() else None)
    if head is not None and is_medusa_folder(head):
        if not isinstance(target.model, LlamaModel):
            raise ValueError(f"{spec} holds Medusa heads: they need the target on our Llama-family runtime")
        try:
            return load_medusa_drafter(head, target.model)
        except (OSError, RuntimeError, MemoryError, SafetensorError) as exc:
            log.warning("draft %s could not be loaded (%s): decoding WITHOUT speculation", spec, exc)
            return None
    if head is not None and is_head_folder(head):
        if not isinstance(target.model, LlamaModel):
            raise ValueError(
                f"{spec} is a feature draft (EAGLE head): it needs the target on our Llama-family "
                "runtime, not the transformers adapter"
            )
        try:
            return load_head_drafter(head, target.model, compile=compile_decode)
        except (OSError, RuntimeError, MemoryError, SafetensorError) as exc:
            log.warning("draft %s could not be loaded (%s): decoding WITHOUT speculation", spec, exc)
            return None
    try:
        draft = load_model(
            spec, dtype=dtype, device=device, compile_decode=compile_decode, quantize=quantize, group_size=group_size
        )
        if dtype == "auto" and not compile_decode and _small_on_cpu(draft.model):
            # again, from the stored weights
            draft = load_model(spec, dtype=torch.float32, device=device, quantize=quantize, group_size=group_size)
            log.info("draft %s runs in float32: a small draft steps faster in float32 on a CPU", spec)
    except (OSError, RuntimeError, MemoryError, FetchError, SafetensorError) as exc:
        log.warning("draft %s could not be loaded (%s): decoding WITHOUT speculation", spec, exc)
        return None
    if draft.model.vocab_size != target.model.vocab_size:
        raise ValueError(
            f"draft vocabulary ({draft.model.vocab_size}) differs from target vocabulary "
            f"({target.model.vocab_size}); pick a draft trained with the target's tokenizer, or use --draft ngram"
        )
    if target.tokenizer is not None and draft.tokenizer is not None:
        if target.tokenizer.hf.get_vocab() != draft.tokenizer.hf.get_vocab():
            raise ValueError(
                "draft tokenizer maps tokens to different ids than the target's; pick a draft "
                "trained with the target's tokenizer, or use --draft ngram"
            )
    if window == "auto":
        window = DraftWindow.from_folder(draft.folder)
    _warm_blocks(draft.model)
    return ModelDrafter(draft.model, draft.folder, window if isinstance(window, DraftWindow) else None)


def _self_draft(
    spec: str,
    target: LoadedModel,
    dtype: str | torch.dtype,
    device: str | torch.device,
    compile_decode: bool,
    group_size: int,
) -> ModelDrafter:
    """The target's own weights loaded again in the layout `spec` names ('self:int4', 'self:int8') as a draft."""
    mode = spec.removeprefix(SELF_DRAFT)
    if mode not in SELF_MODES:
        raise ValueError(f"a self-draft is {' or '.join(SELF_DRAFT + m for m in SELF_MODES)}, got {spec!r}")
    if not isinstance(target.model, LlamaModel):
        raise ValueError(f"{spec} needs the target on our Llama-family runtime, not {target.runtime!r}")
    draft = load_model(
        target.spec, dtype=dtype, device=device, compile_decode=compile_decode, quantize=mode, group_size=group_size
    )
    _warm_blocks(draft.model)
    return ModelDrafter(draft.model, draft.folder, None)


def _warm_blocks(model: object) -> None:
    """Compile a compiled model's block graph now, not in the first request (a draft model catches up on accepted
    tokens in blocks, a target scores drafts in blocks); `load_model` warms only the one-token step."""
    compiled = getattr(model, "compiled", None)
    if compiled is not None:
        compiled.warm_up(blocks=True)


def _small_on_cpu(model: object) -> bool:
    """A draft on our runtime on a CPU, narrow enough to step faster in float32 (SMALL_DRAFT_HIDDEN)."""
    return (
        isinstance(model, LlamaModel)
        and model.device.type == "cpu"
        and model.dtype != torch.float32
        and model.config.hidden_size <= SMALL_DRAFT_HIDDEN
    )


def is_hybrid(spec: str) -> bool:
    """Whether a draft spec asks for hybrid drafting ('hybrid' or 'hybrid:MODEL')."""
    return spec == "hybrid" or spec.startswith("hybrid:")


def hybrid_model_spec(spec: str, target: LoadedModel) -> str:
    """The draft model of a hybrid spec: the one named after 'hybrid:', else the target alias's."""
    return spec.partition(":")[2] or _model_draft_default(target)


def _model_draft_default(target: LoadedModel) -> str:
    alias = ALIASES.get(target.spec)
    if alias is None or alias.draft_model is None:
        raise ValueError(f"no draft model known for {target.spec}; use hybrid:MODEL_SPEC")
    return alias.draft_model


def load_pair(
    target_spec: str,
    draft_spec: str | None,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    runtime: str = "auto",
    compile_decode: bool = False,
    draft_window: str | DraftWindow = "auto",
    quantize: str = "auto",
    group_size: int = DEFAULT_INT4_GROUP,
    draft_quantize: str = "auto",
    suffix_scope: str = "global",
) -> Pair:
    """Load the target and its drafter from specs (`compile_decode`, `quantize`, `group_size`: see `load_model`;
    `draft_window`, `suffix_scope`: see `load_drafter`; `draft_quantize`: a draft model's `quantize`)."""
    target = load_model(
        target_spec,
        dtype=dtype,
        device=device,
        runtime=runtime,
        compile_decode=compile_decode,
        quantize=quantize,
        group_size=group_size,
    )
    spec = resolve_draft_spec(target, draft_spec)
    drafter = load_drafter(
        spec, target, dtype, device, compile_decode, draft_window, draft_quantize, group_size, suffix_scope
    )
    if drafter is not None:
        _warm_blocks(target.model)
    return Pair(target, drafter, spec, dtype, device, draft_window, draft_quantize, group_size, suffix_scope)
