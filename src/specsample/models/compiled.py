"""Decode steps of our Llama runtime compiled with `torch.compile` (opt-in): one token per row, and blocks of up
to MAX_BLOCK tokens per row (a verification), each its own graph.

Eager decoding of a small model pays per-op overhead for ~30 small ops per layer, beside
matrix-vector products that read the weights below the memory's speed. Compiling the whole step
(all layers at once, weights frozen as constants) fuses the small ops into a few generated kernels
called from a C++ wrapper, and on CPUs lets inductor's autotuned C++ matrix-vector kernels replace
oneDNN's where they are faster. The output layer is compiled apart (`DecodeHead`) and used exactly
where the step is.

The compiled step attends over its rows' cache entries up to the furthest row's new position (shorter
rows masked by position), so its cost follows the context, not the allocation (a server allocates the
whole context window); that length, the batch and the cache's size are dynamic dimensions, so neither a
longer context nor a new request recompiles. It is used only where it is
exact for the caller: up to MAX_BLOCK new tokens per row (the block length a dynamic dimension), for any
rows of the cache (a request alone in an engine with room for more, a batch, a batch after some rows
finished). Prefill, token trees and longer blocks run the eager path, which computes the same function.
"""

from __future__ import annotations

import logging
import time
import types
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specsample.kv_cache import KVCache
from specsample.models.layers import apply_rope, weight_version
from specsample.models.rope import rope_tables
from specsample.models.quant import QuantLinear, SplitLinear

log = logging.getLogger(__name__)

MAX_BLOCK = 16  # the most tokens per row a compiled call appends (a round's drafts and its pending token)

# CPU: freeze the weights as constants, drop the Python wrapper between kernels, and let inductor time
# its own packed C++ matrix-vector kernels against oneDNN's per weight shape (on a 2-core AVX512-BF16 CPU its
# kernels read weights faster, kernel for kernel); its stderr tables are switched off
CPU_INDUCTOR_CONFIG = {"freezing": True, "cpp_wrapper": True, "max_autotune": True,
                       "max_autotune_gemm_backends": "CPP,ATEN", "autotune_num_choices_displayed": 0,
                       "max_autotune_report_choices_stats": False}
# inductor's autotuner calls a deprecated storage API (torch 2.13); the warning is not the user's to act on
warnings.filterwarnings("ignore", message="TypedStorage is deprecated", category=UserWarning,
                        module=r"torch\._inductor\.select_algorithm")


class DecodeStep(nn.Module):
    """Hidden states `[b, n, hidden]` after appending n tokens (a causal block) to each of the cache's rows
    `slots [b]`, and the model's feature layers' residual streams concatenated (`LlamaModel.set_feature_layers`;
    None where it has none)."""

    def __init__(self, model: nn.Module) -> None:  # a LlamaModel
        super().__init__()
        self.model = model

    def forward(self, tokens: Tensor, slots: Tensor, positions: Tensor, key_positions: Tensor, keys: Tensor,
                values: Tensor) -> tuple[Tensor, Tensor | None]:
        """`keys`/`values` are a `KVCache`'s stores as allocated, `[layers * rows, KVH, max_len, hd]` (one size for
        any number of rows, 1 included), written in place from `positions [b]` on; attention reads their first
        `len(key_positions)` entries (`key_positions`: 0, 1, ..)."""
        m, c = self.model, self.model.config
        heads, kv_heads, head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        groups = heads // kv_heads
        (batch, n), length = tokens.shape, key_positions.shape[0]
        x = m.embed(tokens)  # [b, n, hidden]
        new_positions = positions.view(batch, 1) + torch.arange(n, device=tokens.device).view(1, n)  # [b, n]
        cos, sin = m.rope_tables(new_positions)  # [b, n, 1, hd]
        key_pos = key_positions.view(1, 1, 1, length)
        # a KV head's query rows: its group's heads, each over the n tokens (head-major)
        query_pos = new_positions.view(batch, 1, 1, n).expand(batch, 1, groups, n).reshape(batch, 1, groups * n, 1)
        causal = key_pos <= query_pos  # [b, 1, G * n, length]; stale entries past a row's length are masked
        windowed = causal if c.sliding_window is None else causal & (key_pos > query_pos - c.sliding_window)
        rows_per_layer = keys.shape[0] // len(m.layers)
        wanted, taken = m.feature_layers or (), []
        for i, layer in enumerate(m.layers):
            if i in wanted:
                taken.append(x)
            qkv = project(layer.qkv, layer.input_norm(x))
            qkv = qkv.view(batch, n, heads + 2 * kv_heads, head_dim)
            qk = apply_rope(qkv[:, :, : heads + kv_heads], cos, sin)
            rows = slots + i * rows_per_layer  # layer i's entries of the rows
            keys[rows.view(batch, 1), :, new_positions] = qk[:, :, heads:]  # [b, n, KVH, hd]
            values[rows.view(batch, 1), :, new_positions] = qkv[:, :, heads + kv_heads:]
            mask = windowed if m.uses_window(i) else causal
            q = qk[:, :, :heads].reshape(batch, n, kv_heads, groups, head_dim).permute(0, 2, 3, 1, 4)
            row_keys = keys[:, :, :length].index_select(0, rows)  # [b, KVH, length, hd]
            row_values = values[:, :, :length].index_select(0, rows)
            out = F.scaled_dot_product_attention(q.reshape(batch, kv_heads, groups * n, head_dim), row_keys,
                                                 row_values, attn_mask=mask)  # [b, KVH, G * n, hd]
            out = out.reshape(batch, kv_heads, groups, n, head_dim).permute(0, 3, 1, 2, 4)
            x = x + project(layer.o_proj, out.reshape(batch, n, heads * head_dim))
            gate, up = project(layer.gate_up, layer.post_norm(x)).chunk(2, dim=-1)
            x = x + project(layer.down, F.silu(gate) * up)
        if len(m.layers) in wanted:
            taken.append(x)
        return m.norm(x), (torch.cat(taken, dim=-1) if taken else None)


def project(layer: nn.Module, x: Tensor) -> Tensor:
    """A projection as inductor can lower it: F.linear on a float layer's plain weights (not its prepacked oneDNN path,
    which inductor cannot lower; with frozen weights it prepacks them itself), a quantized layer's kernel op."""
    if isinstance(layer, (QuantLinear, SplitLinear)):
        return layer.compute(x)
    return F.linear(x, layer.weight, layer.bias)


class DecodeHead(nn.Module):
    """Logits `[b, 1, vocab]` from final hidden states: the output layer, or its FR-Spec subset.

    The weights it reads are its own parameters (the model's output weights, or the subset's gathered
    rows), so freezing makes them constants that inductor packs for its generated matrix-vector kernel.
    """

    def __init__(self, model: nn.Module) -> None:  # a LlamaModel
        super().__init__()
        self.vocab_size = model.vocab_size
        self.subset = model.output_subset
        self.quantized: nn.Module | None = None  # a quantized output layer (or its subset rows)
        if isinstance(model.lm_head, QuantLinear):
            self.quantized = model.lm_head if self.subset is None else model.subset_layer()
        else:
            weight = model.lm_head.weight if self.subset is None else model.subset_weight()
            self.weight = nn.Parameter(weight.detach(), requires_grad=False)
        if self.subset is not None:
            self.register_buffer("subset_ids", self.subset, persistent=False)

    def forward(self, hidden: Tensor) -> Tensor:
        logits = F.linear(hidden, self.weight) if self.quantized is None else self.quantized.compute(hidden)
        if self.subset is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy(-1, self.subset_ids, logits)


def _private_forward(module: nn.Module) -> nn.Module:
    """Give `module` its own copy of its class's forward code, so torch.compile caches it apart.

    Dynamo keeps compiled code per code object: a private copy means recompiling after an in-place
    weight update (or for another model) cannot hit the old frozen constants.
    """
    forward = type(module).forward
    code = types.FunctionType(forward.__code__.replace(), forward.__globals__, "forward")
    module.forward = types.MethodType(code, module)
    return module


def _dynamic_reads(cache: KVCache, length: int, device: torch.device) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """The key positions `[length]` a compiled step's attention reads (at least 2: dynamo specialises a size of 1;
    at most the allocation) and the cache's stores, their sizes marked dynamic: neither a longer context nor a cache
    with more rows recompiles the step."""
    key_positions = torch.arange(min(max(length, 2), cache.key_store.shape[3]), device=device)
    torch._dynamo.mark_dynamic(key_positions, 0)
    stores = (cache.flat_keys, cache.flat_values)
    for tensor in stores:
        for dim in (0, 2):
            if tensor.shape[dim] > 1:  # dynamo always specialises size 1
                torch._dynamo.mark_dynamic(tensor, dim)
    return key_positions, stores


def _total_version(tensors: list[Tensor]) -> int:
    """Sum of version counters: they only grow, so the sum changes exactly when some tensor was written."""
    return sum(map(weight_version, tensors))


class CompiledDecode:
    """A compiled `DecodeStep` for one model, plus the rule for when it may be used."""

    def __init__(self, model: nn.Module) -> None:  # a LlamaModel
        self.model = model
        self.step = torch.compile(_private_forward(DecodeStep(model).eval()), fullgraph=True)
        self.head: tuple[Tensor | None, nn.Module] | None = None  # (output subset it was built for, compiled head)
        # set around each call, not as torch.compile options: freezing given as an option was not applied
        # (measured: 32 vs 19 ms per step on SmolLM2-135M bf16)
        self.inductor_config = CPU_INDUCTOR_CONFIG if model.device.type == "cpu" else {}
        self.compiled_shapes: set[tuple[bool, bool]] = set()  # (batch 1, one token per row) compiled
        self.weights = list(model.parameters())
        self.weights_version = _total_version(self.weights)

    def warm_up(self, blocks: bool = False) -> None:
        """Compile the one-token step (and with `blocks`, the block of a verification) and the output layer now for
        batch 1 on a throwaway cache, so the first real call is not the slow one."""
        cache = self.model.new_cache(1, 8)
        with torch.inference_mode():
            for n in (1, 2) if blocks else (1,):
                if (True, n == 1) in self.compiled_shapes:  # compiled already
                    continue
                tokens = torch.zeros(1, n, dtype=torch.long, device=self.model.device)
                self.logits(self(tokens, cache, torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.long))[0])

    def stale(self) -> bool:
        """True once any weight changed in place: the frozen constants no longer match the model."""
        return _total_version(self.weights) != self.weights_version

    @staticmethod
    def applies(tokens: Tensor, cache: KVCache, slots: Tensor) -> bool:
        """Up to MAX_BLOCK tokens per row, for distinct rows of the cache (the compiled step's contract)."""
        return tokens.shape[1] <= MAX_BLOCK and len(torch.unique(slots)) == len(slots)

    def __call__(self, tokens: Tensor, cache: KVCache, slots: Tensor,
                 positions: Tensor) -> tuple[Tensor, Tensor | None]:
        """Hidden states `[b, n, hidden]` for rows `slots [b]` appending `tokens [b, n]`, and their features where the
        model has feature layers (`DecodeStep`); writes their new keys and values from `positions [b]` on."""
        # attention reads the rows' entries up to the furthest new position, not the whole allocation: the step's
        # cost follows the context. The stores' row count and length and the read length are dynamic dimensions,
        # so neither a new request nor a longer context recompiles (the read length at least 2, the masked entry
        # past position 0 included: dynamo specialises a size of 1)
        key_positions, stores = _dynamic_reads(cache, int(positions.max()) + tokens.shape[1], tokens.device)
        shape = (tokens.shape[0] == 1, tokens.shape[1] == 1)
        if shape not in self.compiled_shapes:
            log.info("compiling the decode step for batch %s, %s (20-80 s on a small CPU, once per process)",
                     "1" if shape[0] else "> 1", "one token per row" if shape[1] else "blocks of tokens")
        start = time.perf_counter()
        # a fresh tensor: dynamo guards on dispatch keys and strides, and a caller's token tensor made outside
        # inference mode, or a slice of a longer one, would differ from the engine's and recompile the step (70 s)
        tokens = tokens.clone(memory_format=torch.contiguous_format)
        if tokens.shape[1] > 1:  # one graph for every block length
            torch._dynamo.mark_dynamic(tokens, 1)
        with torch._inductor.config.patch(self.inductor_config):
            hidden = self.step(tokens, slots.to(tokens.device).clone(), positions.to(tokens.device), key_positions,
                               *stores)
        if shape not in self.compiled_shapes:
            self.compiled_shapes.add(shape)
            log.info("compiled the decode step in %.0f s", time.perf_counter() - start)
        return hidden

    def logits(self, hidden: Tensor) -> Tensor:
        """The model's logits `[b, n, vocab]` from hidden states `[b, n, hidden]`, through a compiled output layer."""
        subset = self.model.output_subset
        if self.head is None or self.head[0] is not subset:  # built for another subset: build again
            log.info("compiling the output layer (a few seconds)")
            self.head = subset, torch.compile(_private_forward(DecodeHead(self.model).eval()), fullgraph=True)
        if hidden.shape[1] > 1:  # one graph for every block length
            torch._dynamo.mark_dynamic(hidden, 1)
        with torch._inductor.config.patch(self.inductor_config):
            return self.head[1](hidden)


class HeadStep(nn.Module):
    """One drafting step of an EAGLE-3 head (`models/eagle_head.py`) on each of the cache's rows `slots [b]`: the
    entry of a drawn token read with the head's output before it, appended at `positions [b]`; its output `[b, 1, H]`
    and logits over the draft vocabulary `[b, K]`."""

    def __init__(self, head: nn.Module) -> None:  # an EagleHead
        super().__init__()
        self.head = head

    def forward(self, embeddings: Tensor, hidden: Tensor, slots: Tensor, positions: Tensor, key_positions: Tensor,
                keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        h, c = self.head, self.head.layer_config
        heads, kv_heads, head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        groups = heads // kv_heads
        batch, length = embeddings.shape[0], key_positions.shape[0]
        normed = h.hidden_norm(hidden)
        residual = normed if h.config.norm_before_residual else hidden
        qkv = project(h.qkv, torch.cat([h.input_norm(embeddings), normed], dim=-1)).view(batch, 1, heads + 2 * kv_heads,
                                                                                          head_dim)
        cos, sin = rope_tables(h._inv_freq, h.rope_scale, positions.view(batch, 1), qkv.dtype)
        qk = apply_rope(qkv[:, :, : heads + kv_heads], cos, sin)
        keys[slots.view(batch, 1), :, positions.view(batch, 1)] = qk[:, :, heads:]  # [b, 1, KVH, hd]
        values[slots.view(batch, 1), :, positions.view(batch, 1)] = qkv[:, :, heads + kv_heads:]
        mask = key_positions.view(1, 1, 1, length) <= positions.view(batch, 1, 1, 1)  # [b, 1, 1, length]
        q = qk[:, :, :heads].reshape(batch, kv_heads, groups, head_dim)
        out = F.scaled_dot_product_attention(q, keys[:, :, :length].index_select(0, slots),
                                             values[:, :, :length].index_select(0, slots), attn_mask=mask)
        x = residual.to(out.dtype) + project(h.o_proj, out.reshape(batch, 1, heads * head_dim))
        gate, up = project(h.gate_up, h.post_norm(x)).chunk(2, dim=-1)
        x = x + project(h.down, F.silu(gate) * up)
        return x, project(h.lm_head, h.norm(x[:, 0]))


class CompiledHeadStep:
    """A compiled `HeadStep` for one head: what a drafting step runs where the target runs compiled."""

    def __init__(self, head: nn.Module) -> None:  # an EagleHead
        self.head = head
        self.step = torch.compile(_private_forward(HeadStep(head).eval()), fullgraph=True)
        self.inductor_config = CPU_INDUCTOR_CONFIG if head.device.type == "cpu" else {}
        self.compiled = False

    def warm_up(self, embed) -> None:
        """Compile the step now for batch 1 on a throwaway cache (`embed`: the token embedding the drafter uses)."""
        cache = self.head.new_cache(1, 8)
        with torch.inference_mode():
            hidden = torch.zeros(1, 1, self.head.config.hidden_size, dtype=self.head.dtype, device=self.head.device)
            self(embed(torch.zeros(1, 1, dtype=torch.long)), hidden, cache, torch.zeros(1, dtype=torch.long))

    def __call__(self, embeddings: Tensor, hidden: Tensor, cache: KVCache, slots: Tensor) -> tuple[Tensor, Tensor]:
        """The head's output `[b, 1, H]` and logits `[b, K]` for one entry per row `slots [b]`, appended after each
        row's length in `cache` (which grows by one)."""
        starts = cache.reserve(slots, 1)
        key_positions, stores = _dynamic_reads(cache, int(starts.max()) + 1, hidden.device)
        if not self.compiled:
            log.info("compiling the feature draft's step (10-30 s on a small CPU, once per process)")
        with torch._inductor.config.patch(self.inductor_config):
            out = self.step(embeddings.contiguous(), hidden.contiguous(), slots.to(hidden.device).clone(),
                            starts.to(hidden.device), key_positions, *stores)
        self.compiled = True
        cache.lengths[slots.cpu()] = starts + 1
        return out
