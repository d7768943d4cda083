"""EAGLE-3 heads (Li et al. 2025, arXiv:2503.01840) in the layout vLLM, SGLang and SpecForge read and write.

A head is one decoder layer that drafts from the target's own hidden states. Entry t reads the embedding of token
t + 1 and a hidden vector: for a position the target scored, its fused features (the residual stream entering a low,
a middle and a high layer, concatenated, through the projection `fc`); for a position the head drafted, its own
output there. Its attention projects [input_layernorm(embedding); hidden_norm(hidden)] (twice the width), the hidden
vector is the residual, and the layer's output (before the final norm) is what the next entry reads; the final norm
and the head's own output layer give the next token's logits over the draft vocabulary, `d2t` mapping draft ids to
the target's (target id = draft id + d2t[draft id]).

The folder layout (what `LlamaForCausalLMEagle3` loaders read):

    config.json        architectures ["LlamaForCausalLMEagle3"], the layer's shape, vocab_size (the target's),
                       draft_vocab_size, target_hidden_size, eagle_config.eagle_aux_hidden_state_layer_ids
    model.safetensors  fc.weight [H, 3 * Ht], midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight,
                       midlayer.self_attn.{q,k,v,o}_proj.weight (q/k/v read 2 * H), midlayer.mlp.{gate,up,down}_proj
                       .weight, norm.weight, lm_head.weight [K, H], d2t [K] int64, t2d [V] bool; embed_tokens.weight
                       only where the head has its own (else it shares the target's)

The feature layers are indices into the target's layers: layer i's input (vLLM's auxiliary hidden states; default
2, L // 2 and L - 3 of L layers).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from specsample.kv_cache import KVCache
from specsample.models.layers import Linear, RMSNorm, apply_rope
from specsample.models.llama import Attention, LlamaConfig
from specsample.models.rope import rope_inv_freq, rope_tables

ARCHITECTURE = "LlamaForCausalLMEagle3"
ARCHITECTURES = (ARCHITECTURE, "Eagle3LlamaForCausalLM")  # the names loaders accept
CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low, middle and high layer of a target with `num_layers` layers (vLLM's default: 2, L // 2, L - 3);
    for a target under 6 layers, its first layer's input, its middle and its last layer's output."""
    if num_layers >= 6:
        return (2, num_layers // 2, num_layers - 3)
    return tuple(sorted({0, num_layers // 2, num_layers}))


@dataclass(frozen=True)
class HeadConfig:
    """The head's shape, and the target features it reads."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: tuple | None
    max_position_embeddings: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    feature_layers: tuple[int, ...]
    norm_before_residual: bool = False  # the residual is the normed hidden vector (some published heads)

    def __post_init__(self) -> None:
        if len(self.feature_layers) < 1 or self.draft_vocab_size > self.vocab_size:
            raise ValueError(
                f"a head needs feature layers and a draft vocabulary within the target's, got "
                f"{self.feature_layers} and {self.draft_vocab_size} of {self.vocab_size}"
            )

    @classmethod
    def for_target(
        cls, target: LlamaConfig, draft_vocab_size: int, feature_layers: tuple[int, ...] | None = None
    ) -> HeadConfig:
        """A head at the target's width, heads and RoPE."""
        return cls(
            target.hidden_size,
            target.intermediate_size,
            target.num_heads,
            target.num_kv_heads,
            target.head_dim,
            target.rms_norm_eps,
            target.rope_theta,
            target.rope_scaling,
            target.max_position_embeddings,
            target.vocab_size,
            draft_vocab_size,
            target.hidden_size,
            tuple(feature_layers or default_feature_layers(target.num_layers)),
        )

    @property
    def feature_size(self) -> int:
        """The width of the fused features the head reads."""
        return self.target_hidden_size * len(self.feature_layers)

    def layer_config(self) -> LlamaConfig:
        """The shape our attention reads (one layer)."""
        return LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=1,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
        )

    def to_hf(self, dtype: torch.dtype) -> dict[str, Any]:
        """config.json for `LlamaForCausalLMEagle3` loaders."""
        out = {
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
            "num_hidden_layers": 1,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "mlp_bias": False,
            "norm_before_residual": self.norm_before_residual,
            "torch_dtype": str(dtype).removeprefix("torch."),
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": list(self.feature_layers),
                "use_aux_hidden_state": True,
            },
        }
        if self.rope_scaling is not None:
            out["rope_scaling"] = dict(self.rope_scaling)
        return out

    @classmethod
    def from_hf(cls, hf: dict[str, Any], target_layers: int) -> HeadConfig:
        """From a head's config.json; what this runtime cannot run is refused by name."""
        if not set(hf.get("architectures") or ()) & set(ARCHITECTURES):
            raise ValueError(f"not an EAGLE-3 head: architectures {hf.get('architectures')}, expected {ARCHITECTURE}")
        for key, supported in (
            ("num_hidden_layers", 1),
            ("hidden_act", "silu"),
            ("attention_bias", False),
            ("mlp_bias", False),
        ):
            if hf.get(key, supported) != supported:
                raise ValueError(f"this runtime runs EAGLE-3 heads with {key} {supported!r}, the head has {hf[key]!r}")
        eagle = hf.get("eagle_config") or {}
        if eagle.get("use_aux_hidden_state", True) is not True:
            raise ValueError("the head does not read fused target features (use_aux_hidden_state false): not run here")
        layers = eagle.get("eagle_aux_hidden_state_layer_ids") or default_feature_layers(target_layers)
        heads = hf["num_attention_heads"]
        rope = dict(hf.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        return cls(
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
            rope_theta=float(hf.get("rope_theta", 10000.0)),
            rope_scaling=None if rope_type == "default" else tuple(sorted(rope.items())),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            vocab_size=hf["vocab_size"],
            draft_vocab_size=hf.get("draft_vocab_size") or hf["vocab_size"],
            target_hidden_size=hf.get("target_hidden_size") or hf["hidden_size"],
            feature_layers=tuple(int(i) for i in layers),
            norm_before_residual=bool(hf.get("norm_before_residual", False)),
        )

    def check_target(self, target: LlamaConfig, has_embedding: bool) -> None:
        """Raise `ValueError` naming the mismatch where the head cannot draft for `target`."""
        problems = []
        if self.vocab_size != target.vocab_size:
            problems.append(f"vocabulary {self.vocab_size} (the target's: {target.vocab_size})")
        if self.target_hidden_size != target.hidden_size:
            problems.append(f"target hidden size {self.target_hidden_size} (the target's: {target.hidden_size})")
        if not has_embedding and self.hidden_size != target.hidden_size:
            problems.append(
                f"hidden size {self.hidden_size} without its own embedding (the target's embedding is "
                f"{target.hidden_size} wide)"
            )
        if max(self.feature_layers) > target.num_layers or min(self.feature_layers) < 0:
            problems.append(f"feature layers {list(self.feature_layers)} (the target has {target.num_layers})")
        if problems:
            raise ValueError("the EAGLE-3 head does not fit this target: " + "; ".join(problems))


class EagleHead(nn.Module):
    """One EAGLE-3 decoder layer with its projection of the fused features, final norm and output layer."""

    d2t: Tensor  # a buffer: draft id -> target id - draft id

    def __init__(self, config: HeadConfig, own_embedding: bool = False) -> None:
        super().__init__()
        self.config = config
        self.layer_config = config.layer_config()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.fc = Linear(c.feature_size, c.hidden_size, bias=False)
        self.input_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)  # the token embedding's
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.qkv = Linear(2 * c.hidden_size, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim, bias=False)
        self.o_proj = Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.post_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.gate_up = Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.down = Linear(c.intermediate_size, c.hidden_size, bias=False)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.embed = nn.Embedding(c.vocab_size, c.hidden_size) if own_embedding else None
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        inv_freq, self.rope_scale = rope_inv_freq(self.layer_config)
        self._inv_freq = inv_freq.float()  # not a buffer: stays float32 when the weights go bf16

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def draft_ids(self) -> Tensor:
        """`[K]` the target's token id of each draft id."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        c = self.layer_config
        return KVCache(1, num_slots, max_len, c.num_kv_heads, c.head_dim, self.dtype, self.device)

    def fuse(self, features: Tensor) -> Tensor:
        """The hidden vectors `[.., H]` of positions the target scored, from their fused features `[.., F]`."""
        return self.fc(features.to(self.dtype))

    def forward(self, embeddings: Tensor, hidden: Tensor, attend: Attention) -> Tensor:
        """The layer's outputs `[b, n, H]` (before the final norm: what the next entry reads) from token embeddings
        and hidden vectors `[b, n, H]` each."""
        if self._inv_freq.device != attend.rope_positions.device:
            self._inv_freq = self._inv_freq.to(attend.rope_positions.device)
        batch, n, _ = hidden.shape
        heads, kv_heads = self.num_heads, self.num_kv_heads
        normed = self.hidden_norm(hidden)
        residual = normed if self.config.norm_before_residual else hidden
        x = torch.cat([self.input_norm(embeddings), normed], dim=-1)
        qkv = self.qkv(x).view(batch, n, heads + 2 * kv_heads, self.head_dim)
        rope = rope_tables(self._inv_freq, self.rope_scale, attend.rope_positions, qkv.dtype)
        qk = apply_rope(qkv[:, :, : heads + kv_heads], *rope)
        out = attend(qk[:, :, :heads], qk[:, :, heads:], qkv[:, :, heads + kv_heads :])  # [b, n, H * hd]
        x = residual.to(out.dtype) + self.o_proj(out)
        gate, up = self.gate_up(self.post_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)

    def logits(self, outputs: Tensor) -> Tensor:
        """Logits `[.., K]` over the draft vocabulary from the layer's outputs `[.., H]`."""
        return self.lm_head(self.norm(outputs))

    def forward_cached(self, embeddings: Tensor, hidden: Tensor, cache: KVCache, slots: Tensor) -> Tensor:
        """Append `n` entries per row to rows `slots` of `cache`; their outputs `[b, n, H]`."""
        n = embeddings.shape[1]
        starts = cache.reserve(slots, n)
        groups = self.num_heads // self.num_kv_heads
        attend = Attention(cache, slots, starts, n, self.layer_config, groups, self.device)
        out = self(embeddings, hidden, attend)
        cache.lengths[slots.cpu()] = starts + n
        return out

    def forward_tree(
        self, embeddings: Tensor, hidden: Tensor, cache: KVCache, slots: Tensor, visible: Tensor, positions: Tensor
    ) -> Tensor:
        """Append entries that see what `visible [b, n, kv_len]` says (a tree grown over several calls), at RoPE
        `positions [b, n]`; their outputs `[b, n, H]`."""
        n = embeddings.shape[1]
        starts = cache.reserve(slots, n)
        groups = self.num_heads // self.num_kv_heads
        attend = Attention(
            cache,
            slots,
            starts,
            n,
            self.layer_config,
            groups,
            self.device,
            visible=visible,
            rope_positions=starts.unsqueeze(1) * 0 + positions,
        )
        out = self(embeddings, hidden, attend)
        cache.lengths[slots.cpu()] = starts + n
        return out

    def pack_for_cpu(self) -> None:
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()


# our parameter names -> the published layout's (q/k/v and gate/up are fused here, split there)
_NAMES = {
    "fc.weight": "fc.weight",
    "input_norm.weight": "midlayer.input_layernorm.weight",
    "hidden_norm.weight": "midlayer.hidden_norm.weight",
    "o_proj.weight": "midlayer.self_attn.o_proj.weight",
    "post_norm.weight": "midlayer.post_attention_layernorm.weight",
    "down.weight": "midlayer.mlp.down_proj.weight",
    "norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
    "embed.weight": "embed_tokens.weight",
    "d2t": "d2t",
}


_SPLIT = tuple(f"midlayer.self_attn.{p}_proj.weight" for p in "qkv") + (
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
)


def published_tensors(head: EagleHead, dtype: torch.dtype) -> dict[str, Tensor]:
    """The head's tensors under the published names: floats in `dtype`, d2t int64, t2d bool."""
    own = {k: v.detach().cpu() for k, v in head.state_dict().items()}
    c = head.config
    q, k, v = own.pop("qkv.weight").split(
        [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
    )
    gate, up = own.pop("gate_up.weight").chunk(2)
    out = {_NAMES[name]: tensor for name, tensor in own.items()}
    out.update(
        {
            "midlayer.self_attn.q_proj.weight": q,
            "midlayer.self_attn.k_proj.weight": k,
            "midlayer.self_attn.v_proj.weight": v,
            "midlayer.mlp.gate_proj.weight": gate,
            "midlayer.mlp.up_proj.weight": up,
        }
    )
    out = {name: t.contiguous() if name == "d2t" else t.to(dtype).contiguous() for name, t in out.items()}
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
    t2d[head.draft_ids.cpu()] = True
    out["t2d"] = t2d
    return out


def save_head(head: EagleHead, folder: Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write `config.json` and `model.safetensors` in the published layout."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(published_tensors(head, dtype), str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    (folder / CONFIG_FILE).write_text(json.dumps(head.config.to_hf(dtype), indent=2) + "\n")


def is_head_folder(path: str | Path) -> bool:
    """Whether `path` is a folder holding an EAGLE-3 head (its config.json names the architecture)."""
    config = Path(path) / CONFIG_FILE
    if not config.is_file():
        return False
    try:
        architectures = json.loads(config.read_text()).get("architectures") or ()
    except (OSError, json.JSONDecodeError, AttributeError):
        return False
    return bool(set(architectures) & set(ARCHITECTURES))


def load_head(folder: str | Path, target: LlamaConfig) -> EagleHead:
    """The head in `folder` (float32), checked against `target`: a shape that does not fit is refused by name."""
    folder = Path(folder)
    try:
        hf = json.loads((folder / CONFIG_FILE).read_text())
        tensors = load_file(str(folder / WEIGHTS_FILE))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"the EAGLE-3 head in {folder} cannot be read: {exc}") from exc
    config = HeadConfig.from_hf(hf, target.num_layers)
    tensors = {
        (name.replace("layers.0.", "midlayer.", 1) if name.startswith("layers.0.") else name): t
        for name, t in tensors.items()
    }
    config.check_target(target, "embed_tokens.weight" in tensors)
    known = set(_NAMES.values()) | set(_SPLIT) | {"t2d"}
    unknown = sorted(set(tensors) - known)
    if unknown:
        raise ValueError(f"the EAGLE-3 head in {folder} has tensors this runtime does not know: {', '.join(unknown)}")
    head = EagleHead(config, own_embedding="embed_tokens.weight" in tensors)
    state = _own_names(tensors, config)
    expected = head.state_dict()
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(f"the EAGLE-3 head in {folder} lacks {', '.join(_NAMES.get(m, m) for m in missing)}")
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise ValueError(
                f"the EAGLE-3 head in {folder}: {_NAMES.get(name, name)} is {list(tensor.shape)}, its "
                f"config.json makes it {list(expected[name].shape)}"
            )
    ids = torch.arange(config.draft_vocab_size) + state["d2t"]
    if int(ids.min()) < 0 or int(ids.max()) >= config.vocab_size or len(torch.unique(ids)) != len(ids):
        raise ValueError(f"the EAGLE-3 head in {folder}: d2t maps draft ids outside the vocabulary or twice")
    head.load_state_dict({k: (v if k == "d2t" else v.float()) for k, v in state.items()})
    return head.eval()


def _own_names(tensors: dict[str, Tensor], config: HeadConfig) -> dict[str, Tensor]:
    """Published tensors under our names (q/k/v and gate/up fused), t2d dropped (d2t says the same)."""
    back = {published: ours for ours, published in _NAMES.items()}
    out = {}
    for name, tensor in tensors.items():
        if name in back:
            out[back[name]] = tensor
    if all(p in tensors for p in _SPLIT[:3]):
        out["qkv.weight"] = torch.cat([tensors[p] for p in _SPLIT[:3]])
    mlp = _SPLIT[3:]
    if all(p in tensors for p in mlp):
        out["gate_up.weight"] = torch.cat([tensors[p] for p in mlp])
    if "d2t" in out:
        out["d2t"] = out["d2t"].long()
    return out
