"""Write Hugging Face model folders (config.json, safetensors, tokenizer, generation config)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor
from tqdm import tqdm

from specsample.models.gguf_file import (
    OUR_ARCHES,
    gguf_architecture,
    gguf_eos_ids,
    hf_config_from_gguf,
    iter_hf_tensors,
    load_gguf_tokenizer,
    open_gguf,
)


def save_hf_folder(
    out: Path,
    config: dict[str, Any],
    tensors: dict[str, Tensor],
    tokenizer: Any | None = None,
    eos_token_ids: Iterable[int] = (),
    dtype: torch.dtype | None = None,
) -> None:
    """Write a folder transformers and our loader both read. Tied embeddings are stored once."""
    out.mkdir(parents=True, exist_ok=True)
    if config.get("tie_word_embeddings"):
        tensors = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
        config = {
            **config,
            "torch_dtype": str(dtype).removeprefix("torch."),
            "dtype": str(dtype).removeprefix("torch."),
        }
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"}
    )
    (out / "model.safetensors").chmod(0o644)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    eos = sorted(set(int(i) for i in eos_token_ids))
    if eos:
        generation = {"eos_token_id": eos if len(eos) > 1 else eos[0]}
        if tokenizer is not None and tokenizer.bos_token_id is not None:
            generation["bos_token_id"] = int(tokenizer.bos_token_id)
        (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))


def gguf_to_hf_folder(gguf_path: Path, out: Path, progress: bool = True) -> None:
    """Convert a GGUF file into a float32 Hugging Face folder (done once per alias, then cached)."""
    reader = open_gguf(gguf_path)
    arch = gguf_architecture(reader)
    if arch in OUR_ARCHES:
        config = hf_config_from_gguf(reader)
        config["architectures"] = [
            {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}[
                config["model_type"]
            ]
        ]
        tensors = dict(
            tqdm(
                iter_hf_tensors(reader, config),
                total=len(reader.tensors),
                disable=not progress,
                desc=f"dequantizing {gguf_path.name}",
                unit="tensor",
            )
        )
        tokenizer = load_gguf_tokenizer(gguf_path)
        save_hf_folder(out, config, tensors, tokenizer, gguf_eos_ids(reader) + _end_ids(tokenizer))
        return
    _transformers_gguf_to_folder(gguf_path, out, gguf_eos_ids(reader))


def _end_ids(tokenizer: Any) -> list[int]:
    from specsample.tokenizer import Tokenizer

    return sorted(Tokenizer(tokenizer).eos_token_ids)


def _transformers_gguf_to_folder(gguf_path: Path, out: Path, eos_ids: list[int]) -> None:
    """Architectures our runtime does not cover (e.g. Gemma 3): let transformers dequantize."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    tokenizer = load_gguf_tokenizer(gguf_path)
    save_hf_folder(out, config, dict(model.state_dict()), tokenizer, eos_ids + _end_ids(tokenizer))
