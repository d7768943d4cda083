"""Our Llama runtime's weights <-> Hugging Face parameter names (projections fused on load)."""

from __future__ import annotations

import torch
from torch import Tensor

from specsample.models.llama import LlamaModel

# Hugging Face parameter names -> ours (per layer); q/k/v and gate/up are fused on load.
_LAYER_NAMES = {
    "input_layernorm.weight": "input_norm.weight",
    "post_attention_layernorm.weight": "post_norm.weight",
    "self_attn.o_proj.weight": "o_proj.weight",
    "self_attn.o_proj.bias": "o_proj.bias",
    "mlp.down_proj.weight": "down.weight",
    "mlp.down_proj.bias": "down.bias",
}
_FUSED = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
}


def load_hf_state_dict(model: LlamaModel, tensors: dict[str, Tensor]) -> None:
    """Load Hugging Face-named tensors into `model`, fusing projections; missing weights are errors. Layers already
    holding quantized weights (models/quant_model.py) have no float parameters to load."""
    expected = {k for k in model.state_dict() if not (k == "lm_head.weight" and model.config.tie_word_embeddings)}
    ours: dict[str, Tensor] = {"norm.weight": tensors["model.norm.weight"]}
    if "embed.weight" in expected:
        ours["embed.weight"] = tensors["model.embed_tokens.weight"]
    if "lm_head.weight" in expected:
        if "lm_head.weight" not in tensors:
            raise ValueError("checkpoint has no lm_head.weight and tie_word_embeddings is false")
        ours["lm_head.weight"] = tensors["lm_head.weight"]
    for i in range(model.config.num_layers):
        prefix = f"model.layers.{i}."
        for hf_name, name in _LAYER_NAMES.items():
            if prefix + hf_name in tensors:
                ours[f"layers.{i}.{name}"] = tensors[prefix + hf_name]
        for fused, parts in _FUSED.items():
            for kind in ("weight", "bias"):
                names = [f"{prefix}{p}.{kind}" for p in parts]
                if all(n in tensors for n in names):
                    ours[f"layers.{i}.{fused}.{kind}"] = torch.cat([tensors[n] for n in names], dim=0)
    missing = sorted(expected - ours.keys())
    if missing:
        raise ValueError(
            f"checkpoint is missing weights: {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else "")
        )
    with torch.no_grad():
        params = model.state_dict()
        for name, value in ours.items():
            if params[name].shape != value.shape:
                raise ValueError(f"weight {name} has shape {tuple(value.shape)}, expected {tuple(params[name].shape)}")
            params[name].copy_(value)


def export_hf_state_dict(model: LlamaModel) -> dict[str, Tensor]:
    """Our weights under Hugging Face names (projections split again), for saving as safetensors."""
    c = model.config
    sd = model.state_dict()
    out = {"model.embed_tokens.weight": sd["embed.weight"], "model.norm.weight": sd["norm.weight"]}
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"]
    sizes = {
        "qkv": [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim],
        "gate_up": [c.intermediate_size, c.intermediate_size],
    }
    for i in range(c.num_layers):
        prefix = f"model.layers.{i}."
        for hf_name, name in _LAYER_NAMES.items():
            if f"layers.{i}.{name}" in sd:
                out[prefix + hf_name] = sd[f"layers.{i}.{name}"]
        for fused, parts in _FUSED.items():
            for kind in ("weight", "bias"):
                key = f"layers.{i}.{fused}.{kind}"
                if key in sd:
                    for part, chunk in zip(parts, sd[key].split(sizes[fused], dim=0)):
                        out[f"{prefix}{part}.{kind}"] = chunk
    return {k: v.contiguous() for k, v in out.items()}
