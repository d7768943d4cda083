"""Resolve a model spec (alias, folder, .gguf file, hub id) to a loaded model and its tokenizer."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from specsample.models.base import CausalLM
from specsample.models.cpu import cpu_has_native_bf16
from specsample.models.fused import unsupported as unsupported_fused
from specsample.models.hf_names import load_hf_state_dict
from specsample.models.hub import ALIASES, alias_folder, alias_gguf, builtin_draft
from specsample.models.llama import SUPPORTED_MODEL_TYPES, LlamaConfig, LlamaModel
from specsample.models.quant import DEFAULT_INT4_GROUP, Codes
from specsample.models.quant_model import check_mode, install_quantized, plan_weights
from specsample.tokenizer import Tokenizer

log = logging.getLogger("specsample")

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# auto: our runtime's fused step where it applies (models/fused.py), else our runtime on torch ops, else transformers
RUNTIMES = ("auto", "fused", "ours", "hf")
DRAFT_VOCAB_FILE = "draft_vocab.json"  # {"token_ids": [...]}: output tokens of a reduced-vocabulary draft


@dataclass
class LoadedModel:
    """A model ready for the engine, its tokenizer, and where it came from."""

    model: CausalLM
    tokenizer: Tokenizer | None
    spec: str
    runtime: str  # "fused" or "ours" (our Llama-family runtime, with or without the fused step) or "hf" (transformers)
    default_draft: str | None = None
    folder: Path | None = None
    gguf: Path | None = None  # the GGUF file the weights came from, if any
    quantize: str = "none"  # how the weights are held: none, auto (a GGUF's codes as stored), int8, int4


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """'auto' -> bfloat16 on CUDA and on CPUs with native bf16 (measured faster there), else float32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
        "float64": torch.float64,
    }
    if dtype in names:
        return names[dtype]
    if dtype != "auto":
        raise ValueError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def resolve_quantize(quantize: str, dtype: str | torch.dtype, device: torch.device) -> str:
    """The weights' layout `quantize` asks for here: 'auto' keeps a GGUF's codes (quantized layers, models/quant.py)
    when the dtype is left to us ('auto') on a CPU, where the kernels run, and means 'none' (dequantized weights)
    otherwise; 'int8' and 'int4' quantize every projection; 'none' dequantizes everything to the dtype."""
    if quantize == "auto":
        return "auto" if dtype == "auto" and device.type == "cpu" else "none"
    if quantize in ("int8", "int4") and device.type != "cpu":
        log.warning(
            "the int4/int8 kernels run on CPUs: on %s quantized layers multiply by their dequantized weights", device
        )
    return quantize


def load_model(
    spec: str,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    runtime: str = "auto",
    progress: bool = True,
    compile: bool = False,
    quantize: str = "auto",
    quant_group: int = DEFAULT_INT4_GROUP,
) -> LoadedModel:
    """Load `spec`: a built-in alias, a Hugging Face folder, a .gguf file or a Hugging Face Hub id.

    `quantize`: how the weights are held (`resolve_quantize`; by default a GGUF's quantized tensors run natively on a
    CPU unless a float dtype is asked for); `quant_group`: the inputs per scale of int4 weights quantized here.
    `compile` runs our runtime's one-token decode steps through `torch.compile`
    (`LlamaModel.compile_decode`), compiling before this returns; models on the transformers adapter
    cannot, and raise.
    """
    check_mode(quantize, quant_group)
    device = torch.device(device)
    mode = resolve_quantize(quantize, dtype, device)
    loaded = _load(spec, dtype, device, runtime, progress, mode, quant_group)
    if isinstance(loaded.model, LlamaModel) and runtime in ("auto", "fused"):
        problem = unsupported_fused(loaded.model)
        if problem is None:
            loaded.model.use_fused_step()
            loaded.runtime = "fused"
        elif runtime == "fused":
            raise ValueError(f"runtime 'fused' cannot run {spec}: {problem}; use runtime 'ours'")
        else:
            log.info("%s runs on torch ops, not the fused step: %s", spec, problem)
    if compile:
        if not isinstance(loaded.model, LlamaModel):
            raise ValueError(
                f"compile needs our Llama-family runtime; {spec} runs on {loaded.runtime!r}: run "
                "it eagerly (without --compile; `specsample serve --enforce-eager`)"
            )
        loaded.model.compile_decode(warm_up=True)
    return loaded


def _load(
    spec: str,
    dtype: str | torch.dtype,
    device: torch.device,
    runtime: str,
    progress: bool,
    quantize: str,
    quant_group: int,
) -> LoadedModel:
    if runtime not in RUNTIMES:
        raise ValueError(f"runtime must be one of {', '.join(RUNTIMES)}, got {runtime!r}")
    if quantize in ("int8", "int4") and runtime == "hf":
        raise ValueError(f"quantize {quantize} needs our Llama-family runtime, not runtime 'hf'")
    compute_dtype = resolve_dtype(dtype, device)
    default_draft = None
    if spec in ALIASES:
        folder = alias_folder(spec, progress=progress)
        default_draft = ALIASES[spec].default_draft
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
        if quantize != "none" and _use_ours(model_type, runtime):  # the weights from the alias's GGUF, as stored
            loaded = _load_gguf(
                alias_gguf(spec, progress=progress),
                spec,
                compute_dtype,
                device,
                runtime,
                quantize,
                quant_group,
                Tokenizer.from_folder(folder),
            )
            loaded.default_draft, loaded.folder = default_draft, folder
            return loaded
    elif builtin_draft(spec) is not None:
        folder = builtin_draft(spec)
    elif Path(spec).expanduser().is_dir():
        folder = Path(spec).expanduser()
    elif Path(spec).expanduser().is_file():
        path = Path(spec).expanduser()
        if path.suffix != ".gguf":
            raise ValueError(f"{spec} is a file but not a .gguf model; pass a .gguf file or a model folder")
        return _load_gguf(path, spec, compute_dtype, device, runtime, quantize, quant_group)
    elif _HUB_ID.match(spec):
        folder = _hub_folder(spec)
    else:
        raise ValueError(
            f"unknown model spec {spec!r}: not a built-in alias ({', '.join(ALIASES)}), an existing folder or "
            ".gguf file, or a Hugging Face Hub id (org/name)"
        )
    loaded = load_folder(folder, compute_dtype, device, runtime, spec, quantize, quant_group)
    loaded.default_draft = default_draft
    return loaded


def load_folder(
    folder: Path,
    dtype: torch.dtype,
    device: torch.device,
    runtime: str,
    spec: str,
    quantize: str = "none",
    quant_group: int = DEFAULT_INT4_GROUP,
) -> LoadedModel:
    """Load a Hugging Face folder with our runtime where it applies, else through transformers."""
    config_path = folder / "config.json"
    if not config_path.exists():
        raise ValueError(f"{folder} has no config.json: not a Hugging Face model folder")
    hf_config = json.loads(config_path.read_text())
    tokenizer = _folder_tokenizer(folder)
    if _use_ours(hf_config.get("model_type"), runtime):
        model = llama_from_folder(folder, hf_config, dtype, device, quantize, quant_group)
        return LoadedModel(model, tokenizer, spec, "ours", folder=folder, quantize=_held(model, quantize))
    from transformers import AutoModelForCausalLM

    from specsample.models.hf_adapter import HFCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).to(device)
    return LoadedModel(HFCausalLM(hf_model), tokenizer, spec, "hf", folder=folder)


def _use_ours(model_type: str | None, runtime: str) -> bool:
    if runtime in ("ours", "fused") and model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"our runtime supports {', '.join(SUPPORTED_MODEL_TYPES)}, not {model_type!r}; use runtime 'hf'"
        )
    return runtime != "hf" and model_type in SUPPORTED_MODEL_TYPES


def llama_from_folder(
    folder: Path,
    hf_config: dict,
    dtype: torch.dtype,
    device: torch.device,
    quantize: str = "none",
    quant_group: int = DEFAULT_INT4_GROUP,
) -> LlamaModel:
    """Our Llama-family runtime with the folder's safetensors weights."""
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    if index.exists():  # sharded: exactly the files the index names
        files = sorted({folder / name for name in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(folder.glob("*.safetensors"))
        if len(files) > 1:  # Mistral repos ship consolidated.safetensors beside the HF-named file(s)
            files = [f for f in files if not f.name.startswith("consolidated")] or files
    if not files:
        raise ValueError(f"{folder} has no .safetensors weights")
    tensors = {}
    for file in files:
        tensors.update(load_file(str(file)))
    model = build_llama(LlamaConfig.from_hf(hf_config), tensors, dtype, device, quantize, quant_group)
    subset_file = folder / DRAFT_VOCAB_FILE
    if subset_file.exists():  # a draft with a reduced output vocabulary (FR-Spec)
        model.set_output_subset(json.loads(subset_file.read_text())["token_ids"])
    return model


def build_llama(
    config: LlamaConfig,
    tensors: dict[str, torch.Tensor | Codes],
    dtype: torch.dtype,
    device: torch.device,
    quantize: str = "none",
    quant_group: int = DEFAULT_INT4_GROUP,
) -> LlamaModel:
    """Instantiate without random init (meta device), then load Hugging Face-named weights (float tensors, or codes
    of quantized GGUF tensors), holding them as `quantize` says (models/quant_model.py)."""
    weights = plan_weights(tensors, quantize, config.tie_word_embeddings, quant_group)
    tensors.clear()  # the caller's copies go as soon as they are planned
    with torch.device("meta"):
        model = LlamaModel(config)
    model = model.to_empty(device="cpu")
    floats = install_quantized(model, weights)
    weights.clear()
    if config.tie_word_embeddings and not isinstance(model.lm_head, torch.nn.Linear):
        floats.pop("lm_head.weight", None)
    elif config.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    load_hf_state_dict(model, {k: v.float() for k, v in floats.items()})
    model = model.to(device=device, dtype=dtype).eval()
    model.pack_for_cpu()
    return model


def _load_gguf(
    path: Path,
    spec: str,
    dtype: torch.dtype,
    device: torch.device,
    runtime: str,
    quantize: str,
    quant_group: int,
    tokenizer: Tokenizer | None = None,
) -> LoadedModel:
    from specsample.models.gguf_file import (
        OUR_ARCHES,
        gguf_architecture,
        gguf_eos_ids,
        hf_config_from_gguf,
        iter_hf_tensors,
        load_gguf_tokenizer,
        open_gguf,
    )

    reader = open_gguf(path)
    arch = gguf_architecture(reader)
    if tokenizer is None:
        tokenizer = Tokenizer(load_gguf_tokenizer(path), gguf_eos_ids(reader))
    if _use_ours(OUR_ARCHES.get(arch), runtime):
        hf_config = hf_config_from_gguf(reader)
        tensors = dict(iter_hf_tensors(reader, hf_config, codes=quantize != "none"))
        del reader  # its memory map of the file goes with it
        model = build_llama(LlamaConfig.from_hf(hf_config), tensors, dtype, device, quantize, quant_group)
        return LoadedModel(model, tokenizer, spec, "ours", gguf=path, quantize=_held(model, quantize))
    from transformers import AutoModelForCausalLM

    from specsample.models.hf_adapter import HFCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).to(device)
    return LoadedModel(HFCausalLM(hf_model), tokenizer, spec, "hf", gguf=path)


def _held(model: LlamaModel, quantize: str) -> str:
    """How the loaded weights are held: the mode, or 'none' where 'auto' found nothing quantized."""
    from specsample.models.quant_model import is_quantized

    return quantize if is_quantized(model) else "none"


def _folder_tokenizer(folder: Path) -> Tokenizer | None:
    if not any((folder / name).exists() for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return None
    return Tokenizer.from_folder(folder)


def _hub_folder(repo_id: str) -> Path:
    """Download a model folder from the Hugging Face Hub (needs network; fails fast offline)."""
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                repo_id,
                etag_timeout=10,
                allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"],
                ignore_patterns=["consolidated*"],
            )
        )
    except Exception as exc:  # the hub client raises many types for offline / missing repos
        raise ValueError(
            f"could not fetch {repo_id!r} from the Hugging Face Hub ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0]}). Offline? Download the model folder where you have access and pass "
            f"its local path, or use a built-in alias ({', '.join(ALIASES)})"
        ) from exc
