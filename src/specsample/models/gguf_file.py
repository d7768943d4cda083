"""Read Llama-family GGUF files with the `gguf` package: config, dequantized weights, tokenizer.

llama.cpp's converter permutes the rows of Q and K for Llama/Mistral (interleaved RoPE); we undo
that here so the weights match the Hugging Face layout our runtime and transformers use.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from specsample.models.gguf_blocks import FLOAT_TYPES, tensor_codes
from specsample.models.quant import Codes, Int4Codes, Int8Codes

# GGUF architectures whose weights our runtime runs, and the HF model_type they become
OUR_ARCHES = {"llama": "llama", "qwen2": "qwen2", "mistral": "mistral"}
_PERMUTED_QK = {"llama", "mistral"}
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def open_gguf(path: str | Path) -> Any:
    """Open a GGUF file, turning the reader's errors into one clear `ValueError`."""
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:  # the reader raises assorted errors on truncated or foreign files
        raise ValueError(f"{path} is not a readable GGUF file: {exc}") from exc


def gguf_architecture(reader: Any) -> str:
    """The `general.architecture` field (e.g. 'llama', 'gemma3')."""
    return str(_field(reader, "general.architecture"))


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise ValueError(f"GGUF file lacks the metadata field {key}")
        return default
    return field.contents()


def hf_config_from_gguf(reader: Any) -> dict[str, Any]:
    """A Hugging Face config.json dict for a Llama-family GGUF file."""
    arch = gguf_architecture(reader)
    if arch not in OUR_ARCHES:
        raise ValueError(f"GGUF architecture {arch!r} is not Llama-family; load it with runtime='hf'")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError(
            "GGUF files with precomputed rope_freqs (Llama 3.1 scaling) are not supported; "
            "load the Hugging Face folder instead"
        )
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    vocab = int(_field(reader, f"{arch}.vocab_size", len(reader.fields["tokenizer.ggml.tokens"].data)))
    config: dict[str, Any] = {
        "model_type": OUR_ARCHES[arch],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, f"{arch}.rope.dimension_count", hidden // heads)),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 2048)),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu",
    }
    scaling = str(_field(reader, f"{arch}.rope.scaling.type", "none"))
    if scaling == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(_field(reader, f"{arch}.rope.scaling.factor"))}
    elif scaling == "yarn":
        config["rope_scaling"] = {
            "rope_type": "yarn",
            "factor": float(_field(reader, f"{arch}.rope.scaling.factor")),
            "original_max_position_embeddings": int(_field(reader, f"{arch}.rope.scaling.original_context_length")),
        }
    elif scaling != "none":
        raise ValueError(f"GGUF RoPE scaling {scaling!r} is not supported")
    if "blk.0.attn_output.bias" in names:
        raise ValueError("GGUF with an attention output bias is not supported")
    if arch == "llama" and "blk.0.attn_q.bias" in names:
        raise ValueError(
            "GGUF Llama with Q/K/V bias but no output bias is not a layout our runtime knows; load it with runtime='hf'"
        )
    return config


def _unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation for `heads` heads."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def iter_hf_tensors(reader: Any, config: dict[str, Any], codes: bool = False) -> Iterator[tuple[str, Tensor | Codes]]:
    """Yield `(hf_name, float32 tensor)` for every weight, dequantized and un-permuted; with `codes`, quantized matrices
    come as their int4/int8 codes instead (`gguf_blocks.tensor_codes`), rows un-permuted the same way."""
    from gguf.quants import dequantize

    arch = gguf_architecture(reader)
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        if name is None:
            raise ValueError(f"unexpected tensor {tensor.name!r} in GGUF file")
        permuted = arch in _PERMUTED_QK and name.split(".")[-2] in heads
        if codes and tensor.tensor_type.name not in FLOAT_TYPES:
            coded = tensor_codes(tensor)
            if permuted:
                coded = _unpermute_codes(coded, heads[name.split(".")[-2]])
            yield name, coded
            continue
        values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        values = values.reshape([int(d) for d in reversed(tensor.shape)])  # GGUF lists dims fastest-first
        if arch in _PERMUTED_QK and name.endswith(("q_proj.weight", "q_proj.bias")):
            values = _unpermute(values, config["num_attention_heads"])
        elif arch in _PERMUTED_QK and name.endswith(("k_proj.weight", "k_proj.bias")):
            values = _unpermute(values, config["num_key_value_heads"])
        yield name, torch.from_numpy(np.array(values, dtype=np.float32, order="C", copy=True))


def _unpermute_codes(codes: Codes, heads: int) -> Codes:
    """Undo llama.cpp's Q/K row permutation on codes (rows carry their scales along)."""

    def rows(t: Tensor) -> Tensor:
        return torch.from_numpy(np.ascontiguousarray(_unpermute(t.numpy(), heads)))

    if isinstance(codes, Int4Codes):
        return Int4Codes(rows(codes.codes), rows(codes.scales), rows(codes.zeros), codes.group_size)
    return Int8Codes(rows(codes.codes), rows(codes.scales))


def _hf_name(gguf_name: str) -> str | None:
    fixed = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    if gguf_name in fixed:
        return fixed[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}"
    return None


def load_gguf_tokenizer(path: str | Path) -> Any:
    """The Hugging Face tokenizer stored in a GGUF file (converted by transformers)."""
    from transformers import AutoTokenizer

    path = Path(path)
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def gguf_eos_ids(reader: Any) -> list[int]:
    """End-of-sequence ids declared in the GGUF tokenizer metadata."""
    ids = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        if key in reader.fields:
            ids.append(int(reader.fields[key].contents()))
    return ids
