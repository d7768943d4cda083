"""Which weights of our Llama runtime are quantized, and how: the rule per `--quantize` mode, and the layers put in
place of the float ones.

- `auto`: a GGUF file's quantized tensors keep their codes (Q4_0, Q4_1, Q4_K as int4; the other quantized types as
  int8, see gguf_blocks.py); float tensors and float checkpoints stay float.
- `int4`, `int8`: every projection of the decoder layers in that layout (group-wise int4, int8 per row), whatever it
  arrived as: float weights are quantized, codes of another layout are dequantized and quantized again.
- `none`: every weight dequantized to the model's dtype.

The output layer, and an embedding tied to it, is never int4: it is the one matrix that speaks in logits, and it is
int8 (per row) whenever it is quantized. An embedding of its own stays float: one row of it is read per token.
Quantized layers are made on the CPU, where their kernels run; elsewhere they multiply by their dequantized weight.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specsample.models.quant import (
    DEFAULT_INT4_GROUP,
    INT4_GROUP_SIZES,
    QUANT_MODES,
    Codes,
    Int4Codes,
    Int8Codes,
    QuantEmbedding,
    SplitLinear,
    concat_codes,
    linear_module,
    quantize_int4,
    quantize_int8,
)

# our fused projections and the Hugging Face weights they are made of (in order)
PROJECTIONS = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o_proj": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}
OUTPUT, EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"


def check_mode(mode: str, group_size: int) -> None:
    """Refuse a mode or group size the runtime cannot honour."""
    if mode not in QUANT_MODES:
        raise ValueError(f"quantize must be one of {', '.join(QUANT_MODES)}, got {mode!r}")
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(
            f"the int4 group size must be one of {', '.join(map(str, INT4_GROUP_SIZES))}, got {group_size}"
        )


def _as_layout(value: Tensor | Codes, layout: str, group_size: int) -> Codes:
    """`value` (float weights or codes) as codes of `layout` ('int4' or 'int8'); codes already in it are kept."""
    if layout == "int4" and isinstance(value, Int4Codes) and value.group_size == group_size:
        return value
    if layout == "int8" and isinstance(value, Int8Codes):
        return value
    weights = value.dequantize() if isinstance(value, (Int4Codes, Int8Codes)) else value
    return quantize_int4(weights, group_size) if layout == "int4" else quantize_int8(weights)


def plan_weights(
    tensors: dict[str, Tensor | Codes], mode: str, tied: bool, group_size: int = DEFAULT_INT4_GROUP
) -> dict[str, Tensor | Codes]:
    """Hugging Face-named weights as the runtime will hold them under `mode`: codes for what is quantized, float
    tensors (codes dequantized) for the rest."""
    out: dict[str, Tensor | Codes] = {}
    for name, value in tensors.items():
        coded = isinstance(value, (Int4Codes, Int8Codes))
        projection = name.startswith("model.layers.") and name.endswith("_proj.weight")
        output = name == OUTPUT or (tied and name == EMBEDDING)
        if projection and mode in ("int4", "int8"):
            out[name] = _as_layout(value, mode, group_size)
        elif output and (mode in ("int4", "int8") or (mode == "auto" and coded)):
            out[name] = _as_layout(value, "int8", group_size)
        elif coded and mode == "auto" and projection:
            out[name] = value
        else:
            out[name] = value.dequantize() if coded else value
    return out


def install_quantized(model: torch.nn.Module, weights: dict[str, Tensor | Codes]) -> dict[str, Tensor]:
    """Put quantized layers into `model` (a LlamaModel on the CPU) for the coded weights, taking their biases along;
    return the float tensors left for `load_hf_state_dict`."""
    floats = {k: v for k, v in weights.items() if not isinstance(v, (Int4Codes, Int8Codes))}
    for i, layer in enumerate(model.layers):
        prefix = f"model.layers.{i}."
        for ours, parts in PROJECTIONS.items():
            codes = [weights.get(f"{prefix}{part}.weight") for part in parts]
            if not any(isinstance(c, (Int4Codes, Int8Codes)) for c in codes):
                continue
            if not all(isinstance(c, (Int4Codes, Int8Codes)) for c in codes):
                raise ValueError(f"layer {i}: {ours} mixes float and quantized weights")
            biases = [floats.pop(f"{prefix}{part}.bias", None) for part in parts]
            bias = None if all(b is None for b in biases) else torch.cat(biases)
            setattr(layer, ours, _projection(codes, bias))
    tied = model.config.tie_word_embeddings
    output = weights.get(EMBEDDING if tied else OUTPUT)
    if isinstance(output, Int8Codes):
        model.lm_head = linear_module(output)
        if tied:
            model.embed = QuantEmbedding(model.lm_head, model.norm.weight.dtype)
    return floats


def _projection(codes: list[Codes], bias: Tensor | None) -> torch.nn.Module:
    """One layer for a fused projection's parts; where their layouts differ, one per run of alike parts."""
    runs: list[list[Codes]] = []
    for part in codes:
        if runs and concat_codes([runs[-1][0], part]) is not None:
            runs[-1].append(part)
        else:
            runs.append([part])
    sizes = [sum(c.codes.shape[0] for c in run) for run in runs]
    biases = bias.split(sizes) if bias is not None else [None] * len(runs)
    layers = [linear_module(concat_codes(run), b) for run, b in zip(runs, biases)]
    return layers[0] if len(layers) == 1 else SplitLinear(layers)


def is_quantized(model: torch.nn.Module) -> bool:
    """Whether any layer of `model` holds quantized weights."""
    from specsample.models.quant import QuantLinear

    return any(isinstance(m, QuantLinear) for m in model.modules())


def quantize_model(model: torch.nn.Module, mode: str, group_size: int = DEFAULT_INT4_GROUP) -> torch.nn.Module:
    """Quantize a float LlamaModel's layers in place as `load_model(..., quantize=mode)` would ('int8' or 'int4'),
    and return it."""
    from specsample.models.hf_names import export_hf_state_dict

    if mode not in ("int8", "int4"):
        raise ValueError(f"quantize_model takes int8 or int4, got {mode!r}")
    check_mode(mode, group_size)
    device = model.device
    weights = plan_weights(
        {k: v.detach().float().cpu() for k, v in export_hf_state_dict(model).items()},
        mode,
        model.config.tie_word_embeddings,
        group_size,
    )
    install_quantized(model, weights)
    return model.to(device)


def dequantized_model(model: torch.nn.Module, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A float copy of a quantized LlamaModel computing with the same weights (each layer's codes dequantized) in
    `dtype`: the reference its accuracy is stated against."""
    import copy

    from specsample.models.layers import Linear
    from specsample.models.quant import QuantLinear

    def floated(layer: torch.nn.Module) -> torch.nn.Module:
        if isinstance(layer, SplitLinear):
            parts = [floated(p) for p in layer.parts]
            weight = torch.cat([p.weight for p in parts])
            biases = [p.bias for p in parts]
            bias = None if all(b is None for b in biases) else torch.cat(biases)
            return _float_linear(weight, bias, Linear)
        if isinstance(layer, QuantLinear):
            return _float_linear(layer.codes().dequantize(), layer.bias, Linear)
        return layer

    copied = copy.deepcopy(model).cpu()
    for layer in copied.layers:
        for name in PROJECTIONS:
            setattr(layer, name, floated(getattr(layer, name)))
    if isinstance(copied.embed, QuantEmbedding):
        copied.lm_head = floated(copied.lm_head)
        copied.embed = torch.nn.Embedding(copied.lm_head.out_features, copied.lm_head.in_features)
        copied.embed.weight = copied.lm_head.weight
    else:
        copied.lm_head = floated(copied.lm_head)
    copied.compiled = None
    return copied.to(dtype=dtype).eval()


def _float_linear(weight: Tensor, bias: Tensor | None, kind: type) -> torch.nn.Module:
    layer = kind(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias)
    return layer
