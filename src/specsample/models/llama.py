"""Our Llama-family runtime (Llama, SmolLM2, Qwen2, Mistral) in plain PyTorch.

Decoding writes into a preallocated `KVCache` with a length per row, so batches with ragged
acceptance and O(1) rollback need no copies. Q/K/V and gate/up projections are fused at load time:
fewer, larger matmuls matter on CPU, where decode is bound by reading the weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specsample.kv_cache import KVCache
from specsample.models import compile_events, row_kernels
from specsample.models.fused import FusedStep
from specsample.models.fused import unsupported as unsupported_fused
from specsample.models.invariant import FIXED_ROWS, QueryGroups, exact_attention
from specsample.models.layers import Linear, RMSNorm, apply_rope, linear, prepack, weight_version
from specsample.models.quant import Int8Linear, Projection, QuantEmbedding, QuantLinear
from specsample.models.rope import rope_inv_freq, rope_tables
from specsample.models.sdpa import without_cudnn_attention
from specsample.token_tree import tree_ancestors

if TYPE_CHECKING:
    from specsample.models.compiled import CompiledDecode, PackagedDecode

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class LlamaConfig:
    """The architecture fields our runtime reads from a Hugging Face config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # frozen dict of HF rope parameters
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 always; Llama when attention_bias
    o_bias: bool = False  # Llama attention_bias
    mlp_bias: bool = False
    sliding_window: int | None = None  # Mistral, some Qwen2; None = full attention everywhere
    window_layers: tuple[int, ...] | None = None  # layers that use the window; None = all of them
    model_type: str = "llama"

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> LlamaConfig:
        """Build from a Hugging Face config dict; unsupported fields are errors, not silently dropped."""
        model_type = hf.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not a Llama-family architecture our runtime supports "
                f"({', '.join(SUPPORTED_MODEL_TYPES)}); load it with runtime='hf'"
            )
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (only silu)")
        heads = hf["num_attention_heads"]
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))) != 1.0:
            raise ValueError("partial_rotary_factor != 1 is not supported")
        attention_bias = bool(hf.get("attention_bias", False))
        use_window = hf.get("use_sliding_window")
        use_window = model_type == "mistral" if use_window is None else use_window
        window = hf.get("sliding_window") if use_window else None
        window_layers = None
        if window is not None and model_type == "qwen2":  # Qwen2 windows layers >= max_window_layers
            first = int(hf.get("max_window_layers", 0))
            window_layers = tuple(range(first, hf["num_hidden_layers"]))
        if window is not None and hf.get("layer_types"):
            window_layers = tuple(i for i, t in enumerate(hf["layer_types"]) if t == "sliding_attention")
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
            rope_theta=theta,
            rope_scaling=None if rope_type == "default" else tuple(sorted(rope.items())),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias or model_type == "qwen2",
            o_bias=attention_bias and model_type != "qwen2",
            mlp_bias=bool(hf.get("mlp_bias", False)),
            sliding_window=window,
            window_layers=window_layers,
            model_type=model_type,
        )

    def to_hf(self) -> dict[str, Any]:
        """The Hugging Face config.json dict for these weights (model_type llama/mistral/qwen2)."""
        arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
        out: dict[str, Any] = {
            "architectures": [arch[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
        }
        if self.rope_scaling is not None:
            out["rope_scaling"] = dict(self.rope_scaling)
        if self.model_type == "llama":
            out["attention_bias"] = self.qkv_bias
            out["mlp_bias"] = self.mlp_bias
        if self.sliding_window is not None:
            out["sliding_window"] = self.sliding_window
            out["use_sliding_window"] = True
            if self.window_layers is not None:
                out["layer_types"] = [
                    "sliding_attention" if i in self.window_layers else "full_attention" for i in range(self.num_layers)
                ]
        return out


class Block(nn.Module):
    """One decoder layer: attention with GQA and RoPE, then a SwiGLU MLP."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        qkv_out = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.qkv: Projection = Linear(config.hidden_size, qkv_out, bias=config.qkv_bias)
        self.o_proj: Projection = Linear(config.num_heads * config.head_dim, config.hidden_size, bias=config.o_bias)
        self.post_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.gate_up: Projection = Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down: Projection = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], attend: Attention) -> Tensor:
        batch, n, _ = x.shape
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qkv = self.qkv(self.input_norm(x)).view(batch, n, heads + 2 * kv_heads, self.head_dim)
        qk = apply_rope(qkv[:, :, : heads + kv_heads], *rope)  # rotate q and k in one pass
        attn = attend(qk[:, :, :heads], qk[:, :, heads:], qkv[:, :, heads + kv_heads :])  # [b, n, H * hd]
        x = x + self.o_proj(attn)
        gate, up = self.gate_up(self.post_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def window_layers(config: LlamaConfig) -> frozenset[int]:
    """Indices of the layers that attend through the sliding window (when there is one)."""
    return frozenset(range(config.num_layers) if config.window_layers is None else config.window_layers)


class Attention:
    """Attention for one forward call: where new keys go, and which cached keys each query sees.

    Grouped-query attention runs as one SDPA per KV head whose query rows are the group's heads
    times the positions: measured 4x faster on CPU than SDPA's `enable_gqa` at 300 cached tokens.
    """

    def __init__(
        self,
        cache: KVCache | None,
        slots: Tensor | None,
        starts: Tensor,
        n: int,
        config: LlamaConfig,
        groups: int,
        device: torch.device,
        parents: Tensor | None = None,
        visible: Tensor | None = None,
        rope_positions: Tensor | None = None,
        exact: bool = False,
    ) -> None:
        """`parents [b, n]`: the new tokens form a tree per row (token i's parent among them, -1 for the first):
        each token sees the cached context and its ancestors, at the position of its depth (its cache entry stays
        at its index in the block, for the caller to compact). `visible [b, n, kv_len]` and `rope_positions [b, n]`
        say it outright instead (a tree grown over several calls). None: a causal block. `exact`: every query attends
        as a one-token decode step would (deterministic mode, `invariant.exact_attention`)."""
        self.cache, self.layer, self.groups = cache, 0, groups
        batch = starts.shape[0]
        self.kv_len = int(starts.max()) + n
        uniform = bool((starts == starts[0]).all())
        first = int(slots[0]) if slots is not None else 0
        # rows that sit in consecutive slots are read as a slice (a view), never gathered
        self.row_range = (
            (first, first + batch)
            if slots is not None and bool((slots.cpu() == torch.arange(first, first + batch)).all())
            else None
        )
        # fastest path: consecutive slots and one start -> writes are slices too
        self.start = int(starts[0]) if uniform and self.row_range is not None else None
        self.positions = (starts.unsqueeze(1) + torch.arange(n).unsqueeze(0)).to(device)  # [b, n]
        if slots is not None and self.start is None:
            self.index = (slots.to(device).view(batch, 1, 1), self.positions.view(batch, 1, n))
            self.slots = slots.to(device)
        key_pos = torch.arange(self.kv_len, device=device).view(1, 1, -1)
        visible = key_pos <= self.positions.unsqueeze(-1)  # [b, n, kv_len] causal
        self.rope_positions = self.positions  # [b, n] the positions RoPE rotates by
        if parents is not None:
            if config.sliding_window is not None:
                raise ValueError("token trees are not supported with sliding-window attention")
            ancestors, depths = tree_ancestors(parents.cpu())  # [b, n, n], [b, n]
            self.rope_positions = (starts.unsqueeze(1) + depths).to(device)
            block = torch.zeros(batch, n, self.kv_len, dtype=torch.bool)
            for row in range(batch):  # the block's columns of each row: its ancestors; before them the context
                start = int(starts[row])
                block[row, :, :start] = True
                block[row, :, start : start + n] = ancestors[row]
            visible = block.to(device)
        elif rope_positions is not None:
            if visible is None or config.sliding_window is not None:
                raise ValueError("explicit positions need an explicit mask, and no sliding window")
            self.rope_positions, visible = rope_positions.to(device), visible.to(device)
        decode = self.start is not None and n == 1 and rope_positions is None  # sees every cached key
        self.mask = None if decode else self._grouped(visible, groups)
        window = config.sliding_window
        self.window_mask = None
        if window is not None and self.kv_len > window:  # shorter rows never reach past the window
            self.window_mask = self._grouped(visible & (key_pos > self.positions.unsqueeze(-1) - window), groups)
        self.window_layers = window_layers(config)
        self.exact: tuple[QueryGroups, QueryGroups] | None = None  # per layer kind (full, window): who attends together
        if exact:
            windowed = visible if window is None else visible & (key_pos > self.positions.unsqueeze(-1) - window)
            self.exact = (QueryGroups.of(visible.cpu()), QueryGroups.of(windowed.cpu()))

    @staticmethod
    def _grouped(visible: Tensor, groups: int) -> Tensor:
        """`[b, n, kv_len]` -> `[b, 1, groups * n, kv_len]`: the same mask for every head of a group."""
        batch, n, kv_len = visible.shape
        return visible.unsqueeze(1).expand(batch, groups, n, kv_len).reshape(batch, 1, groups * n, kv_len)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        batch, n, heads, head_dim = q.shape
        kv_heads = k.shape[2]
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [b, KVH, n, hd]
        if self.cache is not None:
            k, v = self._write_and_read(k, v)  # [b, KVH, kv_len, hd]
        windowed = self.window_mask is not None and self.layer in self.window_layers
        mask = self.window_mask if windowed else self.mask
        self.layer += 1
        if self.exact is not None:
            return exact_attention(q.view(batch, n, kv_heads, self.groups, head_dim), k, v, self.exact[windowed])
        if n == 1:  # decode: a group's heads are already adjacent query rows
            out = F.scaled_dot_product_attention(q.view(batch, kv_heads, self.groups, head_dim), k, v, attn_mask=mask)
            return out.reshape(batch, 1, heads * head_dim)  # CUDA SDPA output is not view-compatible
        if self.cache is None and mask is self.mask:  # training: plain causal, let SDPA use its fused kernel
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True, enable_gqa=True)
            return out.transpose(1, 2).reshape(batch, n, heads * head_dim)
        grouped = q.view(batch, n, kv_heads, self.groups, head_dim).permute(0, 2, 3, 1, 4)
        grouped = grouped.reshape(batch, kv_heads, self.groups * n, head_dim)
        out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask)  # [b, KVH, G * n, hd]
        out = out.reshape(batch, kv_heads, self.groups, n, head_dim).permute(0, 3, 1, 2, 4)
        return out.reshape(batch, n, heads * head_dim)

    def _write_and_read(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        assert self.cache is not None
        key_cache, value_cache = self.cache.keys[self.layer], self.cache.values[self.layer]
        n = k.shape[2]
        if self.start is not None and self.row_range is not None:
            lo, hi = self.row_range
            key_cache[lo:hi, :, self.start : self.start + n] = k
            value_cache[lo:hi, :, self.start : self.start + n] = v
        else:
            rows, positions = self.index
            heads = torch.arange(k.shape[1], device=k.device).view(1, -1, 1)
            key_cache[rows, heads, positions] = k
            value_cache[rows, heads, positions] = v
        if self.row_range is not None:
            lo, hi = self.row_range
            return key_cache[lo:hi, :, : self.kv_len], value_cache[lo:hi, :, : self.kv_len]
        return key_cache[self.slots, :, : self.kv_len], value_cache[self.slots, :, : self.kv_len]


class LlamaModel(nn.Module):
    """A Llama-family decoder implementing the `CausalLM` protocol."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.vocab_size = config.vocab_size
        self.max_seq_len = config.max_position_embeddings
        if config.num_heads % config.num_kv_heads:
            raise ValueError(
                f"num_heads ({config.num_heads}) must be a multiple of num_kv_heads ({config.num_kv_heads})"
            )
        self.groups = config.num_heads // config.num_kv_heads
        self.embed: nn.Embedding | QuantEmbedding = nn.Embedding(config.vocab_size, config.hidden_size)
        # registered as a ModuleList, used as the sequence of Blocks it holds
        self.layers = cast(Sequence[Block], nn.ModuleList(Block(config) for _ in range(config.num_layers)))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head: Linear | QuantLinear = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.output_subset: Tensor | None = None
        self._subset_weight: Tensor | None = None  # inference copy of the subset's output rows
        self._subset_packed: Tensor | None = None
        self._subset_layer: Int8Linear | None = None  # a quantized output layer's subset rows
        self._subset_version = -1
        inv_freq, scale = rope_inv_freq(config)
        self._inv_freq = inv_freq.float()  # not a buffer: must stay float32 when weights go bf16
        self.rope_scale = scale
        self.window_layers = window_layers(config) if config.sliding_window is not None else frozenset()
        self.compiled: CompiledDecode | PackagedDecode | None = None  # see compile_decode()
        self.fused: FusedStep | None = None  # see use_fused_step()
        # let torch pick cuDNN's attention in eager cached forwards: it builds a graph per context length
        self.cudnn_attention = False  # (models/sdpa.py); the compiled decode step's shapes never change
        self.deterministic = False  # see set_deterministic()
        # what `*_features` return (see set_feature_layers): None, the final normed hidden states; else the residual
        # stream entering each of these layers, concatenated (EAGLE-3's fused features)
        self.feature_layers: tuple[int, ...] | None = None

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def pack_for_cpu(self) -> bool:
        """Prepack every projection for fast CPU decoding where that is faster (a no-op elsewhere); True if all
        packed."""
        return all([m.pack() for m in self.modules() if isinstance(m, Linear)])

    def _apply(
        self, fn: Callable[[Tensor], Tensor], recurse: bool = True
    ) -> LlamaModel:  # moving or casting the weights invalidates packed copies
        for m in self.modules():
            if isinstance(m, Linear):
                m.packed = None
        out = super()._apply(fn, recurse)
        if self.compiled is not None:  # compiled for the old weights: compile again on first use
            self.compile_decode()
        if self.fused is not None:  # built over the old weights: build again where it still applies
            self.use_fused_step(unsupported_fused(self) is None)
        self.set_output_subset(self.output_subset)  # re-place on the new device, drop stale copies
        return out

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (quantized layers hold integer codes and compute in the kernels' dtype)."""
        return self.norm.weight.dtype

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def feature_size(self) -> int:
        """The width of what `*_features` return: the hidden size, times the feature layers where they are set."""
        return self.config.hidden_size * (1 if self.feature_layers is None else len(self.feature_layers))

    def set_feature_layers(self, layers: tuple[int, ...] | None) -> None:
        """Make `forward_cached_features`, `prefill_features` and `forward_cached_tree` return, per position, the
        residual stream entering each of `layers` (0-based, ascending; `num_layers` means the output of the last
        layer before the final norm), concatenated `[..., len(layers) * hidden]`: what an EAGLE-3 head reads (vLLM's
        auxiliary hidden states). None: the final normed hidden states (an EAGLE head's features)."""
        if layers is not None:
            layers = tuple(int(i) for i in layers)
            if (
                not layers
                or list(layers) != sorted(set(layers))
                or not 0 <= layers[0] <= layers[-1] <= len(self.layers)
            ):
                raise ValueError(
                    f"feature layers must be distinct ascending layer indices in 0..{len(self.layers)}, got {layers}"
                )
        if layers != self.feature_layers:
            self.feature_layers = layers
            if self.compiled is not None:  # its graphs return the old features: compile again on first use
                self.compile_decode()

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        """Preallocate a KV cache for `num_slots` rows of `max_len` tokens in the model's dtype."""
        c = self.config
        return KVCache(c.num_layers, num_slots, max_len, c.num_kv_heads, c.head_dim, self.dtype, self.device)

    def uses_window(self, layer: int) -> bool:
        """Whether `layer` attends through the sliding window."""
        return layer in self.window_layers

    def compile_decode(
        self, warm_up: bool = False, blocks: bool = False, batches: bool = False
    ) -> CompiledDecode | PackagedDecode:
        """Run one-token decode steps and blocks of up to 16 tokens per row (verification) compiled from now on
        (inference only); returns the compiled step (also `self.compiled`).

        On a CPU: the model's compiled packages (`PackagedDecode`, models/artifacts.py), loaded in seconds from the
        cache, or compiled now where missing (1-3 min per graph, two graphs, on a 2-core CPU; `specsample compile`
        fills the cache ahead of time); they read the model's own weights, so an in-place update is read as it is.
        On a GPU: `torch.compile` with CUDA graphs (`CompiledDecode`), each graph compiled on first use or now with
        `warm_up` (the one-token step, with `blocks` the block too, with `batches` both for batches of 2+ rows too),
        its weights frozen: an in-place weight update makes the next call recompile (docs/runtime.md).
        """
        from specsample.models.compiled import CompiledDecode, PackagedDecode

        if self.deterministic:
            raise ValueError(
                "a compiled decode step cannot run in deterministic mode (its kernels differ from the eager forward's)"
            )
        if self.device.type == "cpu":
            packaged = PackagedDecode.open(self)
            assert packaged is not None  # every graph is built where missing
            self.compiled = packaged
            return packaged
        self.compiled = compiled = CompiledDecode(self)
        if warm_up:
            compiled.warm_up(blocks, batches)
        return compiled

    def use_fused_step(self, on: bool = True) -> None:
        """Run cached forwards (prefill, decode steps, verification blocks and trees) through the fused step
        (`models/fused.py`: the decoder stack in one native call), or with `on` False through torch ops. Raises where
        the fused step cannot run this model (`fused.unsupported` says why). A compiled decode step, where there is
        one, still runs the forwards it takes; deterministic mode runs torch ops."""
        self.fused = FusedStep(self) if on else None
        for layer in (self.lm_head, self._subset_layer):  # the output layer multiplies on the fused step's threads
            if isinstance(layer, QuantLinear):
                layer.pool = on

    @property
    def step_path(self) -> str:
        """Which code runs the cached forwards: "compiled" (a compiled decode step), "fused-amx" or "fused-avx512"
        (the fused step, its products on AMX tiles or AVX-512) or "torch" (torch ops)."""
        if self.compiled is not None:
            return "compiled"
        if self.fused is not None and not self.deterministic:
            return "fused-amx" if row_kernels.uses_amx() else "fused-avx512"
        return "torch"

    def set_deterministic(self, on: bool = True) -> None:
        """Compute every position exactly as a one-token forward of its row alone would, whatever the tokens scored
        with it and the rows beside it (`models/invariant.py`): projections multiply FIXED_ROWS rows at a time, each
        query attends alone. Slower (docs/exactness.md); not with a compiled decode step, whose kernels differ."""
        if on and self.compiled is not None:
            raise ValueError(
                "deterministic mode cannot run a compiled decode step (its kernels differ from the "
                "eager forward's); load the model without compile_decode"
            )
        self.deterministic = on
        for module in self.modules():
            if isinstance(module, Linear):
                module.fixed_rows = FIXED_ROWS if on else None

    def rope_tables(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """RoPE cos and sin `[b, n, 1, hd]` in the model's dtype for `positions [b, n]`."""
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        return rope_tables(self._inv_freq, self.rope_scale, positions, self.dtype)

    def hidden_states(self, tokens: Tensor, attend: Attention) -> tuple[Tensor, Tensor | None]:
        """Final normed hidden states `[b, n, hidden]` for `tokens [b, n]`, and the feature layers' residual streams
        concatenated `[b, n, len(feature_layers) * hidden]` (None where no feature layers are set)."""
        x = self.embed(tokens)
        rope = self.rope_tables(attend.rope_positions)
        taken = []
        wanted = self.feature_layers or ()
        for i, layer in enumerate(self.layers):
            if i in wanted:
                taken.append(x)
            x = layer(x, rope, attend)
        if len(self.layers) in wanted:
            taken.append(x)
        return self.norm(x), (torch.cat(taken, dim=-1) if taken else None)

    def set_output_subset(self, token_ids: Tensor | None) -> None:
        """Restrict the output layer to `token_ids` (FR-Spec): other tokens get probability 0.

        For a small draft the full-vocabulary output layer is most of its cost; the verifier handles
        draft probability 0, so sampling stays exact.
        """
        self._subset_weight = self._subset_packed = self._subset_layer = None
        if token_ids is None:
            self.output_subset = None
            return
        ids = torch.as_tensor(token_ids, dtype=torch.long).cpu().clone()  # ours: a caller's later edits can't reach it
        if ids.dim() != 1 or len(ids) == 0 or int(ids.max()) >= self.vocab_size or int(ids.min()) < 0:
            raise ValueError(f"output subset must be token ids in [0, {self.vocab_size})")
        if len(torch.unique(ids)) != len(ids):
            raise ValueError("output subset has repeated token ids")
        self.output_subset = ids.to(self.device)

    def subset_logits(self, hidden: Tensor) -> Tensor:
        """Logits over the output subset `[b, n, K]`, from the (trainable) output weights."""
        assert self.output_subset is not None
        if isinstance(self.lm_head, QuantLinear):
            return self.subset_layer()(hidden)
        if torch.is_grad_enabled():
            return F.linear(hidden, self.lm_head.weight[self.output_subset])
        return linear(hidden, self.subset_weight(), None, self._subset_packed)

    def subset_layer(self) -> Int8Linear:
        """A quantized output layer's rows of the output subset, gathered once."""
        assert self.output_subset is not None and isinstance(self.lm_head, Int8Linear)
        if self._subset_layer is None:
            self._subset_layer = self.lm_head.rows(self.output_subset)
            self._subset_layer.pool = self.lm_head.pool
        return self._subset_layer

    def subset_weight(self) -> Tensor:
        """The output subset's rows of the output weights `[K, hidden]`, gathered (and packed) once per update."""
        assert self.output_subset is not None
        version = weight_version(self.lm_head.weight)
        if self._subset_weight is None or version != self._subset_version:
            self._subset_weight = self.lm_head.weight.detach()[self.output_subset].contiguous()
            self._subset_packed = prepack(self._subset_weight)
            self._subset_version = version
        return self._subset_weight

    def logits(self, hidden: Tensor) -> Tensor:
        """Full-vocabulary logits `[b, n, vocab]`; outside an output subset they are -inf."""
        if self.output_subset is None:
            return self.lm_head(hidden)
        sub = self.subset_logits(hidden)
        full = sub.new_full((*sub.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.output_subset, sub)

    @torch.inference_mode()
    def forward_cached(self, tokens: Tensor, cache: KVCache, slots: Tensor) -> Tensor:
        """Append `tokens [b, n]` to rows `slots` of `cache` and return logits `[b, n, vocab]`."""
        hidden, _, compiled = self._append(tokens, cache, slots)
        # the compiled output layer only where the compiled step ran: other shapes would compile it again
        return compiled.logits(hidden) if compiled is not None else self.logits(hidden)

    @torch.inference_mode()
    def forward_cached_last(self, tokens: Tensor, cache: KVCache, slots: Tensor, last: Tensor) -> Tensor:
        """Append `tokens [b, n]` like `forward_cached`, but return logits `[b, K]` at position `last[i]` of
        row i only, over the output subset where there is one (K its size, in its order), else the whole
        vocabulary: what a drafter samples from, without computing or copying the rest."""
        hidden, _, compiled = self._append(tokens, cache, slots)
        hidden = hidden[torch.arange(hidden.shape[0], device=hidden.device), last.to(hidden.device)]  # [b, hidden]
        if compiled is not None:  # the compiled output layer, as forward_cached: the same numbers either way
            logits = compiled.logits(hidden.unsqueeze(1))[:, 0]  # [b, vocab]
            return logits if self.output_subset is None else logits[:, self.output_subset]
        return self.lm_head(hidden) if self.output_subset is None else self.subset_logits(hidden)

    @torch.inference_mode()
    def forward_cached_features(self, tokens: Tensor, cache: KVCache, slots: Tensor) -> tuple[Tensor, Tensor]:
        """`forward_cached`, and the features `[b, n, hidden_size]` of the same positions (the final hidden states
        the logits come from, or the feature layers': `set_feature_layers`)."""
        hidden, features, compiled = self._append(tokens, cache, slots)
        return (compiled.logits(hidden) if compiled is not None else self.logits(hidden)), features

    @torch.inference_mode()
    def forward_cached_tree(
        self, tokens: Tensor, cache: KVCache, slots: Tensor, parents: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Append a token tree per row (`parents [b, n]`: each token's parent among them, -1 for the first) and
        return logits `[b, n, vocab]` and final hidden states `[b, n, hidden]`: each token sees the context and its
        ancestors, at the position of its depth. Its cache entries sit in block order: keep a path with
        `KVCache.keep_path`. The hidden states are the features (`forward_cached_features`)."""
        hidden, features, _ = self._append(tokens, cache, slots, parents)
        return self.logits(hidden), features

    @torch.inference_mode()
    def prefill(self, tokens: Tensor, cache: KVCache, slots: Tensor, chunk: int = 512) -> None:
        """Append `tokens [b, n]` to the cache without computing logits, `chunk` positions at a time (eagerly)."""
        for begin in range(0, tokens.shape[1], chunk):
            self._append(tokens[:, begin : begin + chunk], cache, slots, compiled_ok=False)

    @torch.inference_mode()
    def prefill_features(self, tokens: Tensor, cache: KVCache, slots: Tensor, chunk: int = 512) -> Tensor:
        """`prefill`, returning the features `[b, n, hidden_size]` (`forward_cached_features`)."""
        return torch.cat(
            [
                self._append(tokens[:, begin : begin + chunk], cache, slots, compiled_ok=False)[1]
                for begin in range(0, tokens.shape[1], chunk)
            ],
            dim=1,
        )

    def _append(
        self, tokens: Tensor, cache: KVCache, slots: Tensor, parents: Tensor | None = None, compiled_ok: bool = True
    ) -> tuple[Tensor, Tensor, CompiledDecode | PackagedDecode | None]:
        """Final hidden states `[b, n, hidden]` after appending `tokens` (a causal block, or a tree per row: see
        `Attention`), the features of the same positions (`forward_cached_features`), and the compiled step where it
        ran (where there is one and `compiled_ok`: not for prefill), else None."""
        n = tokens.shape[1]
        starts = cache.reserve(slots, n)
        compiled = self.compiled if compiled_ok and parents is None else None
        if compiled is not None and not compiled.applies(tokens, cache, slots):
            compiled = None
        if compiled is not None:
            if compiled.stale():
                compiled = self.compile_decode()
            hidden, features = compiled(tokens.to(self.device), cache, slots, starts)
        elif self.fused is not None and not self.deterministic:
            if self.fused.stale():
                self.use_fused_step()
            hidden, features = self.fused(
                self.embed(tokens.to(self.device)), cache, slots, starts, parents, self.feature_layers
            )
        else:
            if compiled_ok and self.compiled is not None:  # a compiled model's forward its step cannot take
                compile_events.fell_back()
            attend = Attention(
                cache, slots, starts, n, self.config, self.groups, self.device, parents, exact=self.deterministic
            )
            with without_cudnn_attention(self.cudnn_attention):
                hidden, features = self.hidden_states(tokens.to(self.device), attend)
        cache.lengths[slots.cpu()] = starts + n
        return hidden, (hidden if features is None else features), compiled

    def uncached_hidden(self, tokens: Tensor) -> Tensor:
        """Final hidden states `[b, n, hidden]` of a causal forward without a cache (training, scoring)."""
        batch, n = tokens.shape
        attend = Attention(None, None, torch.zeros(batch, dtype=torch.long), n, self.config, self.groups, self.device)
        return self.hidden_states(tokens.to(self.device), attend)[0]

    def forward(self, tokens: Tensor) -> Tensor:
        """Uncached causal forward over `tokens [b, n]` (training, parity checks): logits `[b, n, vocab]`."""
        return self.logits(self.uncached_hidden(tokens))
