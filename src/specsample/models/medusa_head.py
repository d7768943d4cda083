"""Medusa heads (Cai et al. 2024, arXiv:2401.10774), read and written in the layouts FasterDecoding/Medusa and vLLM use.

K heads sit on the target's last hidden state (after its final norm: what its output layer reads). Head k (0-based)
at position t guesses token t + k + 2: the target's own output layer guesses token t + 1 there, head 0 the one after.
A head is `num_layers` residual blocks, x + SiLU(W x + b), and an output layer; the output layers cover a draft
vocabulary (FR-Spec; vLLM's `token_map`: the target's id of each draft id) or the whole vocabulary, one per head or
one shared by every head (vLLM's `original_lm_head`).

Layouts (`LAYOUTS`):

    medusa  FasterDecoding/Medusa (and TGI, TensorRT-LLM): config.json with medusa_num_heads, medusa_num_layers,
            base_model_name_or_path; medusa_lm_head.safetensors (or the older medusa_lm_head.pt) with, per head k,
            "{k}.{l}.linear.weight" [H, H] and "{k}.{l}.linear.bias" [H] for l < num_layers, and "{k}.{num_layers}
            .weight" [V, H]: an output layer over the whole vocabulary per head.
    vllm    vLLM's MedusaModel: config.json with architectures ["MedusaModel"], model_type "medusa", hidden_size,
            vocab_size, num_heads, num_hidden_layers, truncated_vocab_size (the draft vocabulary), original_lm_head
            (one output layer for every head) and medusa_fc_bias; model.safetensors with "blocks.{k}.layers.{l}
            .weight" (and ".bias" with medusa_fc_bias), "lm_heads.{k}.weight" [truncated_vocab_size, H] (only
            "lm_heads.0.weight" with original_lm_head) and, for a draft vocabulary, "token_map" [truncated_vocab_size].
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from specsample.models.layers import Linear

CONFIG_FILE = "config.json"
FASTER_FILE, FASTER_LEGACY_FILE = "medusa_lm_head.safetensors", "medusa_lm_head.pt"
VLLM_FILE = "model.safetensors"
VLLM_ARCHITECTURE = "MedusaModel"
LAYOUTS = ("medusa", "vllm")  # FasterDecoding/Medusa's, vLLM's


@dataclass(frozen=True)
class MedusaConfig:
    """The heads' shape."""

    hidden_size: int  # the target's
    vocab_size: int  # the target's
    num_heads: int
    num_layers: int  # residual blocks per head
    draft_vocab_size: int  # the output layers' rows (vocab_size: the whole vocabulary)
    shared_output: bool = False  # one output layer for every head
    bias: bool = True  # the residual blocks' linear layers have biases (FasterDecoding's do)

    def __post_init__(self) -> None:
        if self.num_heads < 1 or self.num_layers < 0 or not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"Medusa heads need num_heads >= 1, num_layers >= 0 and a draft vocabulary within the target's, got "
                f"{self.num_heads}, {self.num_layers} and {self.draft_vocab_size} of {self.vocab_size}"
            )

    def check_target(self, hidden_size: int, vocab_size: int) -> None:
        """Raise `ValueError` naming the mismatch where the heads cannot draft for a target of this shape."""
        problems = []
        if self.hidden_size != hidden_size:
            problems.append(f"they are {self.hidden_size} wide, the target's hidden size is {hidden_size}")
        if self.vocab_size != vocab_size:
            problems.append(f"their vocabulary is {self.vocab_size} tokens, the target's {vocab_size}")
        if problems:
            raise ValueError("the Medusa heads do not fit this target: " + "; ".join(problems))


class MedusaHeads(nn.Module):
    """K Medusa heads: per head `num_layers` residual blocks and an output layer (or one shared by all)."""

    def __init__(self, config: MedusaConfig) -> None:
        super().__init__()
        c = config
        self.config = config
        self.blocks = nn.ModuleList(
            nn.ModuleList(Linear(c.hidden_size, c.hidden_size, bias=c.bias) for _ in range(c.num_layers))
            for _ in range(c.num_heads)
        )
        self.outputs = nn.ModuleList(
            Linear(c.hidden_size, c.draft_vocab_size, bias=False) for _ in range(1 if c.shared_output else c.num_heads)
        )
        self.register_buffer("token_map", torch.arange(c.draft_vocab_size))  # [K'] the target's id of each draft id
        self.token_map: Tensor
        self._fused: tuple[Linear, ...] = ()  # every head's first block in one layer (`fuse`), for inference

    @property
    def device(self) -> torch.device:
        return self._output(0).weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self._output(0).weight.dtype

    def _output(self, i: int) -> Linear:
        return cast(Linear, self.outputs[i])

    def _block(self, k: int, layer: int) -> Linear:
        return cast(Linear, cast(nn.ModuleList, self.blocks[k])[layer])

    @property
    def whole_vocabulary(self) -> bool:
        """Whether draft id i is token i for every token of the target's vocabulary."""
        return self.config.draft_vocab_size == self.config.vocab_size and bool(
            (self.token_map.cpu() == torch.arange(self.config.vocab_size)).all()
        )

    def head_vector(self, k: int, hidden: Tensor) -> Tensor:
        """Head k's vector `[.., H]` (its residual blocks' output) from the target's final hidden states `[.., H]`."""
        x = hidden.to(self.dtype) if not torch.is_autocast_enabled(hidden.device.type) else hidden
        for layer in range(self.config.num_layers):
            x = x + F.silu(self._block(k, layer)(x))
        return x

    def head_logits(self, k: int, vector: Tensor) -> Tensor:
        """Head k's logits `[.., K']` over the draft vocabulary from its vector `[.., H]`."""
        return self._output(0 if self.config.shared_output else k)(vector)

    def forward(self, hidden: Tensor) -> Tensor:
        """Every head's vector `[.., K, H]` from the target's final hidden states `[.., H]`."""
        if not self._fused or torch.is_grad_enabled():
            return torch.stack([self.head_vector(k, hidden) for k in range(self.config.num_heads)], dim=-2)
        # every head's first block reads the same vector: one product for all of them
        x = hidden.to(self.dtype).unsqueeze(-2)  # [.., 1, H]
        x = x + F.silu(self._fused[0](hidden.to(self.dtype)).unflatten(-1, (self.config.num_heads, -1)))  # [.., K, H]
        for layer in range(1, self.config.num_layers):
            x = torch.stack([v + F.silu(self._block(k, layer)(v)) for k, v in enumerate(x.unbind(-2))], dim=-2)
        return x

    def logits(self, vectors: Tensor) -> Tensor:
        """Logits `[.., K, K']` over the draft vocabulary from the heads' vectors `[.., K, H]`."""
        if self.config.shared_output:
            return self._output(0)(vectors)
        return torch.stack([self.head_logits(k, vectors[..., k, :]) for k in range(self.config.num_heads)], dim=-2)

    def fuse(self) -> None:
        """Stack every head's first residual block into one layer `[K * H, H]` for inference (the heads read the same
        vector there); the weights stay where they are, so training and export are unchanged. A later change of the
        weights needs another call."""
        c = self.config
        if not c.num_layers:
            return
        first = [self._block(k, 0) for k in range(c.num_heads)]
        fused = Linear(c.hidden_size, c.num_heads * c.hidden_size, bias=c.bias).to(self.device, self.dtype)
        with torch.no_grad():
            fused.weight.copy_(torch.cat([b.weight for b in first]))
            if c.bias:
                fused.bias.copy_(torch.cat([b.bias for b in first]))
        fused.requires_grad_(False)
        self._fused = (fused,)  # held outside the module's parameters: not in its state dict

    def pack_for_cpu(self) -> None:
        for module in [*self.modules(), *self._fused]:
            if isinstance(module, Linear):
                module.pack()


# ----- published layouts -------------------------------------------------------------------------


def layout_of(folder: str | Path) -> str | None:
    """The published layout of the Medusa heads in `folder` ('medusa', 'vllm'), or None where it holds none."""
    folder = Path(folder)
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(config, dict):
        return None
    if VLLM_ARCHITECTURE in (config.get("architectures") or ()) or config.get("model_type") == "medusa":
        return "vllm"
    if "medusa_num_heads" in config:
        return "medusa"
    return None


def is_medusa_folder(path: str | Path) -> bool:
    """Whether `path` is a folder holding Medusa heads in a layout this runtime reads."""
    return layout_of(path) is not None


def save_medusa(heads: MedusaHeads, folder: str | Path, layout: str, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write `heads` to `folder` in `layout` ('medusa': FasterDecoding's, which holds whole-vocabulary output layers,
    one per head; 'vllm': vLLM's, which holds any)."""
    folder = Path(folder)
    c = heads.config
    state = {k: v.detach().cpu() for k, v in heads.state_dict().items()}
    if layout == "medusa":
        if not heads.whole_vocabulary:
            raise ValueError(
                f"FasterDecoding's Medusa layout holds output layers over the whole vocabulary ({c.vocab_size} "
                f"tokens); these heads draft over {c.draft_vocab_size}: write them in vLLM's layout"
            )
        tensors = {}
        for k in range(c.num_heads):
            for layer in range(c.num_layers):
                tensors[f"{k}.{layer}.linear.weight"] = state[f"blocks.{k}.{layer}.weight"]
                bias = state.get(f"blocks.{k}.{layer}.bias")
                tensors[f"{k}.{layer}.linear.bias"] = torch.zeros(c.hidden_size) if bias is None else bias
            tensors[f"{k}.{c.num_layers}.weight"] = state[f"outputs.{0 if c.shared_output else k}.weight"]
        config: dict[str, Any] = {
            "medusa_num_heads": c.num_heads,
            "medusa_num_layers": c.num_layers,
            "base_model_name_or_path": None,
            "hidden_size": c.hidden_size,
            "vocab_size": c.vocab_size,
        }
        weights = FASTER_FILE
    elif layout == "vllm":
        tensors = {}
        for k in range(c.num_heads):
            for layer in range(c.num_layers):
                tensors[f"blocks.{k}.layers.{layer}.weight"] = state[f"blocks.{k}.{layer}.weight"]
                if c.bias:
                    tensors[f"blocks.{k}.layers.{layer}.bias"] = state[f"blocks.{k}.{layer}.bias"]
        for k in range(1 if c.shared_output else c.num_heads):
            tensors[f"lm_heads.{k}.weight"] = state[f"outputs.{k}.weight"]
        if not heads.whole_vocabulary:
            tensors["token_map"] = state["token_map"].long()
        config = {
            "architectures": [VLLM_ARCHITECTURE],
            "model_type": "medusa",
            "hidden_size": c.hidden_size,
            "vocab_size": c.vocab_size,
            "num_heads": c.num_heads,
            "num_hidden_layers": c.num_layers,
            "truncated_vocab_size": c.draft_vocab_size,
            "original_lm_head": c.shared_output,
            "medusa_fc_bias": c.bias,
        }
        weights = VLLM_FILE
    else:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    tensors = {k: v.contiguous() if k == "token_map" else v.to(dtype).contiguous() for k, v in tensors.items()}
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / weights), metadata={"format": "pt"})
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


def load_medusa(folder: str | Path, hidden_size: int | None = None, vocab_size: int | None = None) -> MedusaHeads:
    """The Medusa heads in `folder` (float32, either layout), checked against a target of `hidden_size` and
    `vocab_size` where given: a shape that does not fit is refused by name."""
    folder = Path(folder)
    layout = layout_of(folder)
    if layout is None:
        raise ValueError(f"{folder} holds no Medusa heads (a config.json naming MedusaModel or medusa_num_heads)")
    hf = json.loads((folder / CONFIG_FILE).read_text())
    try:
        if layout == "medusa":
            config, state = _read_faster(folder, hf)
        else:
            config, state = _read_vllm(folder, hf)
    except (OSError, RuntimeError, KeyError) as exc:
        raise ValueError(f"the Medusa heads in {folder} cannot be read: {exc}") from exc
    if hidden_size is not None and vocab_size is not None:
        config.check_target(hidden_size, vocab_size)
    heads = MedusaHeads(config)
    expected = heads.state_dict()
    for name, tensor in expected.items():
        if name not in state:
            raise ValueError(f"the Medusa heads in {folder} lack {name}")
        if state[name].shape != tensor.shape:
            raise ValueError(
                f"the Medusa heads in {folder}: {name} is {list(state[name].shape)}, their config makes it "
                f"{list(tensor.shape)}"
            )
    ids = state["token_map"]
    if int(ids.min()) < 0 or int(ids.max()) >= config.vocab_size or len(torch.unique(ids)) != len(ids):
        raise ValueError(f"the Medusa heads in {folder}: token_map maps draft ids outside the vocabulary or twice")
    heads.load_state_dict({k: (v.long() if k == "token_map" else v.float()) for k, v in state.items()})
    return heads.eval()


def _read_faster(folder: Path, hf: dict[str, Any]) -> tuple[MedusaConfig, dict[str, Tensor]]:
    """FasterDecoding's layout as our config and state dict."""
    path = folder / FASTER_FILE
    if path.exists():
        tensors = load_file(str(path))
    elif (folder / FASTER_LEGACY_FILE).exists():
        tensors = torch.load(folder / FASTER_LEGACY_FILE, map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"the Medusa heads in {folder} have no {FASTER_FILE} (nor {FASTER_LEGACY_FILE})")
    tensors = {k.removeprefix("medusa_head."): v for k, v in tensors.items()}
    heads, layers = int(hf["medusa_num_heads"]), int(hf.get("medusa_num_layers", 1))
    present = sorted({int(name.split(".")[0]) for name in tensors if name.split(".")[0].isdigit()})
    if present and present[-1] + 1 < heads:  # the config may name more heads than the file holds (some do)
        heads = present[-1] + 1
    output = tensors.get(f"0.{layers}.weight")
    if output is None:
        raise ValueError(f"the Medusa heads in {folder} lack 0.{layers}.weight (the first head's output layer)")
    vocab, hidden = output.shape
    bias = "0.0.linear.bias" in tensors if layers else True
    config = MedusaConfig(hidden, vocab, heads, layers, vocab, shared_output=False, bias=bias)
    state = {"token_map": torch.arange(vocab)}
    for k in range(heads):
        for layer in range(layers):
            state[f"blocks.{k}.{layer}.weight"] = tensors[f"{k}.{layer}.linear.weight"]
            if bias:
                state[f"blocks.{k}.{layer}.bias"] = tensors[f"{k}.{layer}.linear.bias"]
        state[f"outputs.{k}.weight"] = tensors[f"{k}.{layers}.weight"]
    _refuse_unknown(
        folder,
        tensors,
        {f"{k}.{layer}.linear.{p}" for k in range(heads) for layer in range(layers) for p in ("weight", "bias")}
        | {f"{k}.{layers}.weight" for k in range(heads)},
    )
    return config, state


def _read_vllm(folder: Path, hf: dict[str, Any]) -> tuple[MedusaConfig, dict[str, Tensor]]:
    """vLLM's layout as our config and state dict."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"the Medusa heads in {folder} have no .safetensors file")
    tensors: dict[str, Tensor] = {}
    for path in files:
        tensors.update({k.removeprefix("medusa_heads."): v for k, v in load_file(str(path)).items()})
    heads = int(_first(hf, ("num_heads", "medusa_num_heads"), 5))
    layers = int(_first(hf, ("num_hidden_layers", "medusa_num_layers"), 1))
    vocab = int(hf["vocab_size"])
    draft = int(hf.get("truncated_vocab_size") or vocab)
    shared = bool(hf.get("original_lm_head", False))
    bias = bool(hf.get("medusa_fc_bias", False))
    hidden = int(hf["hidden_size"])
    token_map = tensors.get("token_map")
    if draft < vocab and token_map is None:
        raise ValueError(f"the Medusa heads in {folder} draft over {draft} of {vocab} tokens but have no token_map")
    state = {"token_map": token_map.long() if token_map is not None else torch.arange(draft)}
    for k in range(heads):
        for layer in range(layers):
            state[f"blocks.{k}.{layer}.weight"] = tensors[f"blocks.{k}.layers.{layer}.weight"]
            if bias:
                state[f"blocks.{k}.{layer}.bias"] = tensors[f"blocks.{k}.layers.{layer}.bias"]
    for k in range(1 if shared else heads):
        weight = tensors[f"lm_heads.{k}.weight"]
        if token_map is not None and weight.shape[0] > len(token_map):  # a whole-vocabulary layer: its map's rows
            weight = weight[token_map.long()]
        state[f"outputs.{k}.weight"] = weight
    known = {"token_map"} | {f"lm_heads.{k}.weight" for k in range(heads)}
    known |= {
        f"blocks.{k}.layers.{layer}.{p}" for k in range(heads) for layer in range(layers) for p in ("weight", "bias")
    }
    _refuse_unknown(folder, tensors, known)
    return MedusaConfig(hidden, vocab, heads, layers, draft, shared_output=shared, bias=bias), state


def _first(config: dict[str, Any], keys: tuple[str, ...], default: Any) -> Any:
    for key in keys:
        if key in config:
            return config[key]
    return default


def _refuse_unknown(folder: Path, tensors: dict[str, Tensor], known: set[str]) -> None:
    unknown = sorted(set(tensors) - known)
    if unknown:
        raise ValueError(f"the Medusa heads in {folder} have tensors this runtime does not know: {', '.join(unknown)}")
