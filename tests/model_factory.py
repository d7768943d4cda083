"""Small real-format models written by the tests: HF folders (Llama, Qwen2, Mistral, Gemma 3) with a
byte-level BPE tokenizer and a chat template, and GGUF files written with the `gguf` package. No network.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "the quick brown fox jumps over the lazy dog. " * 3,
    "speculative sampling makes decoding faster without changing the output distribution.",
    "hello world, this is a tiny tokenizer for tests of a language model engine.",
]


def make_tokenizer(vocab_size: int = 300):
    """A byte-level BPE tokenizer (special tokens first) wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def write_hf_model(
    folder: Path,
    model_type: str = "llama",
    vocab_size: int | None = None,
    seed: int = 0,
    max_position_embeddings: int = 256,
    tokenizer=None,
    **overrides,
) -> Path:
    """Random-init a small transformers model of `model_type`, save it (and a tokenizer) to `folder`."""
    import transformers

    tokenizer = tokenizer if tokenizer is not None else make_tokenizer()
    vocab = vocab_size or len(tokenizer)
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    common.update(overrides)
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    }[model_type]
    if model_type == "gemma3":
        common.update(head_dim=16, query_pre_attn_scalar=16)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**common)).eval()
    with torch.no_grad():  # larger weights than the default init: peakier, less tie-prone logits
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.1)
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return folder


def _permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row permutation (the inverse of what our reader undoes)."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def write_llama_gguf(
    hf_folder: Path, out: Path, quantize_ffn: bool = True, types: dict[str, str] | None = None
) -> Path:
    """Write the Llama model in `hf_folder` as a GGUF file laid out like llama.cpp's converter does. `types` maps
    GGUF tensor-name fragments to quantization types (e.g. {"attn_": "Q4_0", "ffn_": "Q4_1", "token_embd": "Q8_0"},
    the first match wins; matrices only); without it, `quantize_ffn` stores the MLP matrices as Q8_0."""
    import json

    import gguf
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    config = json.loads((hf_folder / "config.json").read_text())
    tensors = load_file(str(hf_folder / "model.safetensors"))
    tok = AutoTokenizer.from_pretrained(str(hf_folder))
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(config.get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_rope_dimension_count(config["hidden_size"] // config["num_attention_heads"])
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = set(tok.all_special_tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    writer.add_bos_token_id(tok.bos_token_id)
    writer.add_eos_token_id(tok.eos_token_id)
    writer.add_chat_template(CHAT_TEMPLATE)
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    layer = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    for name, value in tensors.items():
        array = value.float().numpy()
        if name in names:
            gguf_name = names[name]
        else:
            index, rest = name.removeprefix("model.layers.").split(".", 1)
            gguf_name = f"blk.{index}.{layer[rest]}"
        if gguf_name.endswith("attn_q.weight"):
            array = _permute(array, config["num_attention_heads"])
        elif gguf_name.endswith("attn_k.weight"):
            array = _permute(array, config["num_key_value_heads"])
        kind = None
        if array.ndim == 2 and types is not None:
            kind = next((t for fragment, t in types.items() if fragment in gguf_name), None)
        elif quantize_ffn and "ffn_" in gguf_name and gguf_name.endswith(".weight") and "norm" not in gguf_name:
            kind = "Q8_0"
        if kind is not None:
            qtype = gguf.GGMLQuantizationType[kind]
            packed = gguf.quants.quantize(array, qtype)
            writer.add_tensor(gguf_name, packed, raw_shape=packed.shape, raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def draft_request(
    slots,
    drafts,
    reach,
    params,
    generators,
    source=(),
    stop_thresholds=(),
    extension=None,
    width=-1,
    tree=None,
    shaper=None,
    noise=(),
    lookup_trees=False,
):
    """A `DraftRequest` from per-row sequences (slots, planned drafts, reach, params, generators, and optionally
    sources and coupled noise), as the tests write them."""
    from specsample.drafters.base import DraftRequest, DraftRow
    from specsample.planner.base import DraftSource

    rows = len(slots)
    if any(len(part) != rows for part in (drafts, reach, params, generators)) or (source and len(source) != rows):
        raise ValueError("a draft request needs one plan, reach, params, generator (and source) per slot")
    return DraftRequest(
        tuple(
            DraftRow(
                slots[i],
                drafts[i],
                reach[i],
                params[i],
                generators[i],
                source[i] if source else DraftSource.EITHER,
                noise[i] if noise else None,
            )
            for i in range(rows)
        ),
        tuple(stop_thresholds),
        extension,
        width,
        tree,
        shaper,
        coupled=bool(noise),
        lookup_trees=lookup_trees,
    )
