"""Turn the engine's options (its target, its draft) into a loaded target and a drafter, with clear errors."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError

from specsample.drafters.base import Drafter, check_vocabulary
from specsample.drafters.eagle import EagleDrafter, is_head_folder, load_head_drafter
from specsample.drafters.hybrid import HybridDrafter
from specsample.drafters.medusa import MedusaDrafter, is_medusa_folder, load_medusa_drafter
from specsample.drafters.model import DraftWindow, ModelDrafter
from specsample.drafters.ngram import NgramDrafter
from specsample.drafters.suffix import SuffixDrafter
from specsample.models.hub import ALIASES, FetchError, builtin_draft
from specsample.models.llama import LlamaModel
from specsample.models.loader import LoadedModel, load_model
from specsample.options import EngineOptions

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
    draft: str  # the draft loaded: `options.draft`, else the target alias's default ('none' without speculation)
    options: EngineOptions  # what the pair was loaded with: a draft swapped in later (/admin/draft) loads the same way

    def warm_up_batches(self) -> None:
        """Compile now the graphs of compiled models (the target, a draft model, a feature draft's step) for batches
        of 2+ rows, which an engine running several requests at once calls: not in its first batched round. Nothing
        where nothing is compiled, or where it is compiled already."""
        compiled = getattr(self.target.model, "compiled", None)
        if compiled is not None:
            compiled.warm_up(blocks=self.drafter is not None, batches=True)
        drafter = self.drafter.model if isinstance(self.drafter, HybridDrafter) else self.drafter
        draft_compiled = getattr(drafter.model, "compiled", None) if isinstance(drafter, ModelDrafter) else None
        if draft_compiled is not None:
            draft_compiled.warm_up(blocks=True, batches=True)
        elif isinstance(drafter, EagleDrafter) and drafter.compiled is not None:
            drafter.compiled.warm_up(drafter.embed, batches=True)

    def load_draft(self, draft: str) -> Drafter | None:
        """Another drafter for this target, loaded as this pair's was (`load_drafter` with the pair's options)."""
        return load_drafter(draft, self.target, self.options)


def resolve_draft(target: LoadedModel, draft: str | None) -> str:
    """The draft to use: the one asked for, else the target alias's default, else n-gram lookup."""
    if draft:
        return draft
    return target.default_draft or "ngram"


def load_drafter(draft: str, target: LoadedModel, options: EngineOptions = EngineOptions()) -> Drafter | None:
    """Build the drafter `draft` names: 'ngram' (prompt lookup), 'suffix' (suffix drafting), 'none',
    'hybrid[:MODEL]' (suffix drafting where the text repeats, the model elsewhere), 'self:int4' or 'self:int8' (the
    target's own weights, quantized: a draft without training), or any model spec sharing the target's tokenizer.
    It loads as `options` say (their target and draft aside): on their `device` in their `dtype`, compiled with
    `compile`; a draft model's weights held as `draft_quantize` (int4 in groups of `quant_group`), attending as
    `draft_window` says; suffix drafts from `suffix_cache_scope`.

    A draft that exists but cannot be loaded (out of memory, unreadable files) is not fatal: we
    decode without speculation and say so loudly. Under dtype 'auto' a narrow draft on a CPU (hidden size
    up to SMALL_DRAFT_HIDDEN, on our runtime's torch ops, not compiled) runs in float32, whatever the target's dtype.
    """
    if draft in NO_DRAFT:
        return None
    if draft == "ngram":
        return NgramDrafter()
    if draft == SUFFIX:
        return SuffixDrafter(options.suffix_cache_scope)
    if is_hybrid(draft):
        model_draft = hybrid_model(draft, target)
        model = load_drafter(model_draft, target, options)
        if model is None:  # the model failed to load (already logged): keep suffix drafting at least
            log.warning("hybrid drafting continues with suffix drafting only")
            return SuffixDrafter(options.suffix_cache_scope)
        if not isinstance(model, (ModelDrafter, EagleDrafter, MedusaDrafter)):
            raise ValueError(f"hybrid drafting needs a draft model or a feature draft, got {model_draft!r}")
        return HybridDrafter(model, SuffixDrafter(options.suffix_cache_scope))
    if draft.startswith(SELF_DRAFT):
        return _self_draft(draft, target, options)
    head = builtin_draft(draft) or (Path(draft) if Path(draft).is_dir() else None)
    if head is not None and is_medusa_folder(head):
        if not isinstance(target.model, LlamaModel):
            raise ValueError(f"{draft} holds Medusa heads: they need the target on our Llama-family runtime")
        try:
            return load_medusa_drafter(head, target.model)
        except (OSError, RuntimeError, MemoryError, SafetensorError) as exc:
            log.warning("draft %s could not be loaded (%s): decoding WITHOUT speculation", draft, exc)
            return None
    if head is not None and is_head_folder(head):
        if not isinstance(target.model, LlamaModel):
            raise ValueError(
                f"{draft} is a feature draft (EAGLE head): it needs the target on our Llama-family "
                "runtime, not the transformers adapter"
            )
        try:
            return load_head_drafter(head, target.model, compile=options.compile)
        except (OSError, RuntimeError, MemoryError, SafetensorError) as exc:
            log.warning("draft %s could not be loaded (%s): decoding WITHOUT speculation", draft, exc)
            return None
    try:
        loaded = _load_draft_model(draft, options, options.dtype)
        if options.dtype == "auto" and not options.compile and _small_on_cpu(loaded.model):
            loaded = _load_draft_model(draft, options, torch.float32)  # again, from the stored weights
            log.info("draft %s runs in float32: a small draft steps faster in float32 on a CPU", draft)
    except (OSError, RuntimeError, MemoryError, FetchError, SafetensorError) as exc:
        log.warning("draft %s could not be loaded (%s): decoding WITHOUT speculation", draft, exc)
        return None
    check_vocabulary(loaded.model.vocab_size, target.model.vocab_size)
    if target.tokenizer is not None and loaded.tokenizer is not None:
        if target.tokenizer.hf.get_vocab() != loaded.tokenizer.hf.get_vocab():
            raise ValueError(
                "draft tokenizer maps tokens to different ids than the target's; pick a draft "
                "trained with the target's tokenizer, or use --draft ngram"
            )
    _warm_blocks(loaded.model)
    window = DraftWindow.from_folder(loaded.folder) if options.draft_window == "auto" else None
    return ModelDrafter(loaded.model, loaded.folder, window)


def _load_draft_model(draft: str, options: EngineOptions, dtype: str | torch.dtype) -> LoadedModel:
    """A draft model loaded in `dtype`, otherwise as `options` say."""
    return load_model(
        draft,
        dtype=dtype,
        device=options.device,
        compile=options.compile,
        quantize=options.draft_quantize,
        quant_group=options.quant_group,
    )


def _self_draft(draft: str, target: LoadedModel, options: EngineOptions) -> ModelDrafter:
    """The target's own weights loaded again in the layout `draft` names ('self:int4', 'self:int8') as a draft."""
    mode = draft.removeprefix(SELF_DRAFT)
    if mode not in SELF_MODES:
        raise ValueError(f"a self-draft is {' or '.join(SELF_DRAFT + m for m in SELF_MODES)}, got {draft!r}")
    if not isinstance(target.model, LlamaModel):
        raise ValueError(f"{draft} needs the target on our Llama-family runtime, not {target.runtime!r}")
    loaded = load_model(
        target.spec,
        dtype=options.dtype,
        device=options.device,
        compile=options.compile,
        quantize=mode,
        quant_group=options.quant_group,
    )
    _warm_blocks(loaded.model)
    return ModelDrafter(loaded.model, loaded.folder, None)


def _warm_blocks(model: object) -> None:
    """Compile a compiled model's block graph now, not in the first request (a draft model catches up on accepted
    tokens in blocks, a target scores drafts in blocks); `load_model` warms only the one-token step."""
    compiled = getattr(model, "compiled", None)
    if compiled is not None:
        compiled.warm_up(blocks=True)


def _small_on_cpu(model: object) -> bool:
    """A draft on our runtime's torch ops on a CPU, narrow enough to step faster in float32 (SMALL_DRAFT_HIDDEN);
    on the fused step it stays in bfloat16, where it steps faster still."""
    return (
        isinstance(model, LlamaModel)
        and model.device.type == "cpu"
        and model.dtype != torch.float32
        and model.fused is None
        and model.config.hidden_size <= SMALL_DRAFT_HIDDEN
    )


def is_hybrid(draft: str) -> bool:
    """Whether a draft asks for hybrid drafting ('hybrid' or 'hybrid:MODEL')."""
    return draft == "hybrid" or draft.startswith("hybrid:")


def hybrid_model(draft: str, target: LoadedModel) -> str:
    """The draft model of a hybrid draft: the one named after 'hybrid:', else the target alias's."""
    return draft.partition(":")[2] or _model_draft_default(target)


def _model_draft_default(target: LoadedModel) -> str:
    alias = ALIASES.get(target.spec)
    if alias is None or alias.draft_model is None:
        raise ValueError(f"no draft model known for {target.spec}; use hybrid:MODEL_SPEC")
    return alias.draft_model


def load_pair(options: EngineOptions) -> Pair:
    """Load the target and its drafter as `options` say (the draft: `resolve_draft`; none without speculation)."""
    target = load_model(
        options.target,
        dtype=options.dtype,
        device=options.device,
        runtime=options.runtime,
        compile=options.compile,
        quantize=options.quantize,
        quant_group=options.quant_group,
    )
    draft = resolve_draft(target, options.draft) if options.speculative else "none"
    drafter = load_drafter(draft, target, options)
    if drafter is not None:
        _warm_blocks(target.model)
    return Pair(target, drafter, draft, options)
