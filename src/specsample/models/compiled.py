"""Compiled decode steps of our Llama runtime: one token per row, and blocks of up to MAX_BLOCK tokens per row (a
verification).

Eager decoding of a small model pays per-op overhead for ~30 small ops per layer, beside matrix-vector products that
read the weights below the memory's speed. Compiling the whole step (embedding, the model's own layers, final norm:
`DecodeStep`) fuses the small ops into a few generated kernels called from a C++ wrapper.

On a CPU the step runs from AOTInductor packages (`PackagedDecode`, models/artifacts.py): built once per architecture,
kept in a cache, loaded by a later process in seconds, running on the model's own tensors; two graphs (rows in
consecutive slots of the cache read as views, rows elsewhere gathered), each for any batch and 1 to MAX_BLOCK tokens.
On CUDA it runs through `torch.compile` with CUDA graphs (`CompiledDecode`), compiled once per process.

The step attends over its rows' cache entries up to the furthest row's new position (shorter rows masked by
position), so its cost follows the context, not the allocation (a server allocates the whole context window). It is
used only where it is exact for the caller: up to MAX_BLOCK new tokens per row, for any distinct rows of the cache.
Prefill, token trees and longer blocks run the eager path (the fused step or torch ops), which computes the same
function; the graphs compiled and the calls that ran eagerly are counted (`compile_events`).
"""

from __future__ import annotations

import logging
import os
import time
import types
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.fx.experimental.sym_node import DynamicInt

from specsample.kv_cache import KVCache
from specsample.models import compile_events
from specsample.models.hub import cache_dir
from specsample.models.layers import weight_version
from specsample.models.quant import QuantLinear
from specsample.models.rope import rope_tables

log = logging.getLogger(__name__)
T = TypeVar("T", Tensor, tuple[Tensor | None, ...])

MAX_BLOCK = 16  # the most tokens per row a compiled call appends (a round's drafts and its pending token)

# CPU: freeze the weights as constants, drop the Python wrapper between kernels, and let inductor time
# its own packed C++ matrix-vector kernels against oneDNN's per weight shape (on a 2-core AVX512-BF16 CPU its
# kernels read weights faster, kernel for kernel); its stderr tables are switched off
CPU_INDUCTOR_CONFIG: dict[str, object] = {
    "freezing": True,
    "cpp_wrapper": True,
    "max_autotune": True,
    "max_autotune_gemm_backends": "CPP,ATEN",
    "autotune_num_choices_displayed": 0,
    "max_autotune_report_choices_stats": False,
}
# CUDA: CUDA graphs (inductor's cudagraph trees): each graph's kernels replay with one launch, where a small model's
# step is otherwise bound by launching hundreds of kernels. A graph is recorded per concrete shape, so there a step
# reads the cache up to a multiple of READ_BUCKET positions (entries past a row's length are masked, as always), rows
# are gathered rather than read as views at a slot offset, and the cache's stores are static addresses written in
# place (allocated once per engine)
CUDA_INDUCTOR_CONFIG: dict[str, object] = {"triton.cudagraphs": True}
READ_BUCKET = 256
# inductor's autotuner calls a deprecated storage API (torch 2.13); the warning is not the user's to act on
warnings.filterwarnings(
    "ignore", message="TypedStorage is deprecated", category=UserWarning, module=r"torch\._inductor\.select_algorithm"
)


class DecodeStep(nn.Module):
    """Hidden states `[b, n, hidden]` after appending n tokens (a causal block) to each of the cache's rows
    `slots [b]`, and the model's feature layers' residual streams concatenated (`LlamaModel.set_feature_layers`;
    None where it has none): the model's own layers (`Block.forward`, the code its eager forward runs), attending
    through `StoreAttention`."""

    inv_freq: Tensor

    def __init__(self, model: Any) -> None:  # a LlamaModel (models/llama.py imports this module)
        super().__init__()
        self.model = model
        # RoPE's frequencies, a buffer (the model keeps them as a plain attribute, in float32 whatever its dtype), so
        # that a compiled package reads them as one of the model's tensors, like its weights
        self.register_buffer("inv_freq", model._inv_freq.to(model.device), persistent=False)

    def forward(
        self,
        tokens: Tensor,
        slots: Tensor,
        positions: Tensor,
        key_positions: Tensor,
        keys: Tensor,
        values: Tensor,
        first: int | None,
    ) -> tuple[Tensor, Tensor | None]:
        """`keys`/`values` are a `KVCache`'s stores as allocated, `[1 + layers * rows, KVH, max_len, hd]` (one size
        for any number of rows, 1 included; row 0 spare), written in place from `positions [b]` on; attention reads
        their first `len(key_positions)` entries (`key_positions`: 0, 1, ..). `first`: where the rows are consecutive
        slots `first, first + 1, ..`, attention reads each layer's rows as a view of the stores, as the eager forward
        does; None: it gathers them (a copy, as the eager forward's)."""
        m = self.model
        batch, n = tokens.shape
        x = m.embed(tokens)  # [b, n, hidden]
        new_positions = positions.view(batch, 1) + torch.arange(n, device=tokens.device).view(1, n)  # [b, n]
        rope = rope_tables(self.inv_freq, m.rope_scale, new_positions, m.dtype)  # cos, sin [b, n, 1, hd]
        attend = StoreAttention(
            m.config, m.uses_window, keys, values, slots, new_positions, key_positions, first, len(m.layers)
        )
        wanted, taken = m.feature_layers or (), []
        for i, layer in enumerate(m.layers):
            if i in wanted:
                taken.append(x)
            x = layer(x, rope, attend)
        if len(m.layers) in wanted:
            taken.append(x)
        return m.norm(x), (torch.cat(taken, dim=-1) if taken else None)


class StoreAttention:
    """Attention for `Block.forward` inside a compiled step, layer after layer: each layer's new keys and values
    written into the cache's flat stores at the new positions, then each query attends over its row's entries up to
    `len(key_positions)`, masked by position (causal; the sliding window where the layer has one)."""

    def __init__(
        self,
        config: Any,  # the layers' LlamaConfig (heads, KV heads, sliding window)
        uses_window: Callable[[int], bool],  # whether layer i attends through the sliding window
        keys: Tensor,  # the stores, [1 + layers * rows, KVH, max_len, hd]
        values: Tensor,
        slots: Tensor,  # [b]
        new_positions: Tensor,  # [b, n]
        key_positions: Tensor,  # [length]: 0, 1, ..
        first: int | None,  # the first of consecutive slots (rows read as views), or None (gathered)
        num_layers: int,
    ) -> None:
        self.uses_window, self.keys, self.values, self.slots, self.first = uses_window, keys, values, slots, first
        self.new_positions, self.length, self.layer = new_positions, key_positions.shape[0], 0
        self.rope_positions = new_positions  # what a layer that makes its own RoPE tables rotates by
        self.groups = config.num_heads // config.num_kv_heads
        self.rows_per_layer = (keys.shape[0] - 1) // num_layers
        batch, n = new_positions.shape
        key_pos = key_positions.view(1, 1, 1, self.length)
        # a KV head's query rows: its group's heads, each over the n tokens (head-major)
        query_pos = new_positions.view(batch, 1, 1, n).expand(batch, 1, self.groups, n)
        query_pos = query_pos.reshape(batch, 1, self.groups * n, 1)
        self.causal = key_pos <= query_pos  # [b, 1, G * n, length]; stale entries past a row's length are masked
        window = config.sliding_window
        self.windowed = self.causal if window is None else self.causal & (key_pos > query_pos - window)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """`q [b, n, H, hd]`, `k`/`v [b, n, KVH, hd]` -> `[b, n, H * hd]`."""
        batch, n, heads, head_dim = q.shape
        kv_heads, i, length = k.shape[2], self.layer, self.length
        self.layer += 1
        rows = self.slots + (1 + i * self.rows_per_layer)  # layer i's entries of the rows
        self.keys[rows.view(batch, 1), :, self.new_positions] = k
        self.values[rows.view(batch, 1), :, self.new_positions] = v
        mask = self.windowed if self.uses_window(i) else self.causal
        grouped = q.reshape(batch, n, kv_heads, self.groups, head_dim).permute(0, 2, 3, 1, 4)
        if self.first is None:  # [b, KVH, length, hd]
            row_keys = self.keys[:, :, :length].index_select(0, rows)
            row_values = self.values[:, :, :length].index_select(0, rows)
        else:
            start = self.first + 1 + i * self.rows_per_layer
            row_keys = self.keys.narrow(0, start, batch)[:, :, :length]
            row_values = self.values.narrow(0, start, batch)[:, :, :length]
        out = F.scaled_dot_product_attention(
            grouped.reshape(batch, kv_heads, self.groups * n, head_dim), row_keys, row_values, attn_mask=mask
        )  # [b, KVH, G * n, hd]
        out = out.reshape(batch, kv_heads, self.groups, n, head_dim).permute(0, 3, 1, 2, 4)
        return out.reshape(batch, n, heads * head_dim)


class DecodeHead(nn.Module):
    """Logits `[b, 1, vocab]` from final hidden states: the output layer, or its FR-Spec subset.

    The weights it reads are its own parameters (the model's output weights, or the subset's gathered
    rows), so freezing makes them constants that inductor packs for its generated matrix-vector kernel.
    """

    subset_ids: Tensor  # a buffer, where there is a subset

    def __init__(self, model: Any) -> None:  # a LlamaModel (models/llama.py imports this module)
        super().__init__()
        self.vocab_size = model.vocab_size
        self.subset = model.output_subset
        self.quantized: QuantLinear | None = None  # a quantized output layer (or its subset rows)
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


def _total_version(tensors: Sequence[Tensor]) -> int:
    """Sum of version counters: they only grow, so the sum changes exactly when some tensor was written."""
    return sum(map(weight_version, tensors))


INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def keep_artefacts_in_cache() -> Path:
    """Where inductor keeps what it compiles (its FX graph cache of generated kernels and wrappers, autotuning
    results, Triton kernels on a GPU): `TORCHINDUCTOR_CACHE_DIR` where set, else the specsample cache's `compiled`
    folder (`models/hub.py`), set before inductor first reads it. A later process finds its graphs there and
    skips code generation, C++ compilation and autotuning (docs/serving.md has start-up times)."""
    if INDUCTOR_CACHE_ENV not in os.environ:
        os.environ[INDUCTOR_CACHE_ENV] = str(cache_dir() / "compiled")
    return Path(os.environ[INDUCTOR_CACHE_ENV])


def _inductor(gm: torch.fx.GraphModule, example_inputs: list) -> object:
    """Inductor (`compile_fx`, what `backend="inductor"` runs), counting each graph it compiles (`compile_events`)."""
    from torch._inductor.compile_fx import compile_fx

    compile_events.graph_compiled()
    return compile_fx(gm, example_inputs)


def mark_rows_dynamic(*tensors: Tensor) -> None:
    """A batch of rows above 1 is a dynamic dimension (dim 0) of `tensors`: one graph for 2 rows and more; a batch
    of 1 keeps a graph of its own (dynamo specialises size 1), the latency path."""
    for tensor in tensors:
        if tensor.shape[0] > 1:
            torch._dynamo.mark_dynamic(tensor, 0)


def mark_stores_dynamic(cache: KVCache) -> tuple[Tensor, Tensor]:
    """A cache's stores as a compiled step takes them, their rows and length dynamic dimensions (no recompile for
    another engine's cache, or a longer one); on CUDA static addresses too (CUDA graphs write them in place)."""
    stores = (cache.flat_keys, cache.flat_values)
    for tensor in stores:
        for dim in (0, 2):
            if tensor.shape[dim] > 1:  # dynamo always specialises size 1
                torch._dynamo.mark_dynamic(tensor, dim)
        if tensor.device.type == "cuda":
            torch._dynamo.mark_static_address(tensor)
    return stores


def read_positions(furthest: int, cache: KVCache, device: torch.device) -> Tensor:
    """0, 1, .. up to the furthest new position (at least 2: dynamo specialises a size of 1; the masked entry past
    position 0 included; on CUDA up to the next multiple of READ_BUCKET, one CUDA graph per bucket), a dynamic
    dimension: what attention reads of the cache, so a step's cost follows the context, not the allocation, and a
    longer context does not recompile."""
    length = max(furthest, 2)
    if device.type == "cuda":
        length = -(-length // READ_BUCKET) * READ_BUCKET
    positions = torch.arange(min(length, cache.key_store.shape[3]), device=device)
    torch._dynamo.mark_dynamic(positions, 0)
    return positions


def inductor_config(device: torch.device) -> dict[str, object]:
    """What inductor is patched with around a compiled call on `device` (CPU_INDUCTOR_CONFIG, CUDA_INDUCTOR_CONFIG)."""
    return {"cpu": CPU_INDUCTOR_CONFIG, "cuda": CUDA_INDUCTOR_CONFIG}.get(device.type, {})


def replayed(outputs: T) -> T:
    """`outputs` of a compiled call, copied out of the CUDA graph's buffers, which its next replay overwrites (on a
    CPU as they are)."""
    if isinstance(outputs, Tensor):
        return outputs.clone() if outputs.is_cuda else outputs
    return type(outputs)(replayed(o) if o is not None else None for o in outputs)


def view_first(slots: Tensor, device: torch.device) -> int | None:
    """Where a step reads rows `slots [b]` as a view of the cache: the first slot where they are consecutive and
    ascending (`first, first + 1, ..`); None where they are gathered (elsewhere, and always under CUDA graphs)."""
    if device.type == "cuda":
        return None
    first = int(slots[0])
    return first if len(slots) == 1 or torch.equal(slots.cpu(), torch.arange(first, first + len(slots))) else None


class CompiledDecode:
    """A compiled `DecodeStep` for one model, plus the rule for when it may be used.

    Its graphs, each compiled once per process (and found in inductor's cache by later processes): batch 1 and
    batch 2+, each for one token per row and for blocks; at batch 2+ rows in consecutive slots (read as views) and
    rows elsewhere (gathered); and a float output layer for the same batch and block kinds. `warm_up` compiles what a
    caller will run before it serves; `shapes` are the kinds compiled so far."""

    def __init__(self, model: Any) -> None:  # a LlamaModel (models/llama.py imports this module)
        keep_artefacts_in_cache()
        self.model = model
        self.step = torch.compile(_private_forward(DecodeStep(model).eval()), fullgraph=True, backend=_inductor)
        # (the output subset it was built for, the compiled head)
        self.head: tuple[Tensor | None, Callable[[Tensor], Tensor]] | None = None
        # set around each call, not as torch.compile options: freezing given as an option was not applied
        # (measured: 32 vs 19 ms per step on SmolLM2-135M bf16)
        self.inductor_config = inductor_config(model.device)
        self.shapes: set[tuple[bool, bool, bool]] = set()  # (batch 1, one token per row, rows as a view) compiled
        self.weights = list(model.parameters())
        self.weights_version = _total_version(self.weights)

    def warm_up(self, blocks: bool = False, batches: bool = False) -> None:
        """Compile now, on a throwaway cache, what serving runs, so that no request waits for a compile: the one-token
        step and the output layer for batch 1; with `blocks` the block of a verification too; with `batches`, both
        for batches of 2+ rows too, in consecutive slots and not."""
        cache = self.model.new_cache(3, 8)
        calls = [([0], 1)] + ([([0], 2)] if blocks else [])
        if batches:
            calls += [(rows, n) for rows in ([0, 1], [0, 2]) for n in ((1, 2) if blocks else (1,))]
        with torch.inference_mode():
            for rows, n in calls:
                shape = (len(rows) == 1, n == 1, view_first(torch.tensor(rows), self.model.device) is not None)
                if shape in self.shapes:
                    continue  # compiled already
                slots = torch.tensor(rows)
                cache.lengths[slots] = 1
                tokens = torch.zeros(len(rows), n, dtype=torch.long, device=self.model.device)
                self.logits(self(tokens, cache, slots, cache.lengths[slots])[0])

    def stale(self) -> bool:
        """True once any weight changed in place: the frozen constants no longer match the model."""
        return _total_version(self.weights) != self.weights_version

    @staticmethod
    def applies(tokens: Tensor, cache: KVCache, slots: Tensor) -> bool:
        """Up to MAX_BLOCK tokens per row, for distinct rows of the cache (the compiled step's contract)."""
        return tokens.shape[1] <= MAX_BLOCK and len(torch.unique(slots)) == len(slots)

    def __call__(
        self, tokens: Tensor, cache: KVCache, slots: Tensor, positions: Tensor
    ) -> tuple[Tensor, Tensor | None]:
        """Hidden states `[b, n, hidden]` for rows `slots [b]` appending `tokens [b, n]`, and their features where the
        model has feature layers (`DecodeStep`); writes their new keys and values from `positions [b]` on."""
        batch, n = tokens.shape
        reading = read_positions(int(positions.max()) + n, cache, tokens.device)
        stores = mark_stores_dynamic(cache)
        first = view_first(slots, tokens.device)
        shape = (batch == 1, n == 1, first is not None)
        if shape not in self.shapes:
            log.info(
                "compiling the decode step for batch %s, %s%s (20-80 s on a small CPU; found in inductor's "
                "cache by later processes)",
                "1" if shape[0] else "> 1",
                "one token per row" if shape[1] else "blocks of tokens",
                "" if shape[0] else ", rows in consecutive slots" if shape[2] else ", rows gathered",
            )
        start = time.perf_counter()
        # fresh tensors: dynamo guards on dispatch keys and strides, and a caller's token tensor made outside
        # inference mode, or a slice of a longer one, would differ from the engine's and recompile the step (70 s)
        tokens = tokens.clone(memory_format=torch.contiguous_format)
        slots, positions = slots.to(tokens.device).clone(), positions.to(tokens.device).clone()
        if n > 1:  # one graph for every block length
            torch._dynamo.mark_dynamic(tokens, 1)
        mark_rows_dynamic(tokens, slots, positions)
        if tokens.is_cuda:
            torch.compiler.cudagraph_mark_step_begin()
        with torch._inductor.config.patch(self.inductor_config):
            hidden = replayed(
                self.step(tokens, slots, positions, reading, *stores, None if first is None else DynamicInt(first))
            )
        if shape not in self.shapes:
            self.shapes.add(shape)
            log.info("compiled the decode step in %.0f s", time.perf_counter() - start)
        return hidden

    def logits(self, hidden: Tensor) -> Tensor:
        """The model's logits `[b, n, vocab]` from hidden states `[b, n, hidden]`, through a compiled output layer; a
        quantized output layer is one kernel call either way, and runs as it is (no graph to compile)."""
        if isinstance(self.model.lm_head, QuantLinear):
            return self.model.logits(hidden)
        subset = self.model.output_subset
        if self.head is None or self.head[0] is not subset:  # built for another subset: build again
            log.info("compiling the output layer (a few seconds)")
            self.head = (
                subset,
                torch.compile(_private_forward(DecodeHead(self.model).eval()), fullgraph=True, backend=_inductor),
            )
        if hidden.shape[1] > 1:  # one graph for every block length
            torch._dynamo.mark_dynamic(hidden, 1)
        mark_rows_dynamic(hidden)
        with torch._inductor.config.patch(self.inductor_config):
            if hidden.is_cuda:
                torch.compiler.cudagraph_mark_step_begin()
            return replayed(self.head[1](hidden))


class PackagedDecode:
    """A model's `DecodeStep` on a CPU, run from its compiled packages (`models/artifacts.py`): the graph for rows in
    consecutive slots and the graph for rows gathered, each taking any batch and blocks of 1 to MAX_BLOCK tokens, on
    the model's own tensors. Loading them takes seconds; nothing traces or compiles in the process that runs them. The
    output layer runs as the model's (one matrix product either way)."""

    def __init__(self, model: Any, runners: dict[str, Any]) -> None:  # a LlamaModel
        self.model, self.runners = model, runners

    @classmethod
    def open(cls, model: Any, base: Path | None = None, build: bool = True) -> PackagedDecode | None:
        """`model`'s packages from the cache (`artifacts.root()` or `base`), those missing or unusable built now
        where `build`; None where some are missing and `build` is False."""
        from specsample.models import artifacts

        runners = artifacts.open_or_build(DecodeStep(model).eval(), MAX_BLOCK, base, build_missing=build)
        return cls(model, runners) if len(runners) == len(artifacts.GRAPHS) else None

    def warm_up(self, blocks: bool = False, batches: bool = False) -> None:
        """Nothing to compile: every shape runs one of the two loaded graphs."""

    def stale(self) -> bool:
        """Never: the packages read the model's tensors themselves, so a weight updated in place is read as it is."""
        return False

    applies = staticmethod(CompiledDecode.applies)

    def __call__(
        self, tokens: Tensor, cache: KVCache, slots: Tensor, positions: Tensor
    ) -> tuple[Tensor, Tensor | None]:
        """As `CompiledDecode.__call__`: hidden states `[b, n, hidden]` (and features) for rows `slots [b]` appending
        `tokens [b, n]` from `positions [b]` on."""
        n = tokens.shape[1]
        reading = read_positions(int(positions.max()) + n, cache, tokens.device)
        first = view_first(slots, tokens.device)
        inputs = (
            tokens.to(torch.long).contiguous(),
            slots.to(torch.long).clone(),
            positions.to(torch.long).clone(),
            reading,
            cache.flat_keys,
            cache.flat_values,
        )
        if first is None:
            hidden, features = self.runners["gathered"](*inputs)
        else:
            hidden, features = self.runners["view"](*inputs, torch.empty(first + 1))
        return hidden, features

    def logits(self, hidden: Tensor) -> Tensor:
        """The model's logits `[b, n, vocab]` from hidden states: its own output layer."""
        out: Tensor = self.model.logits(hidden)
        return out


class HeadStep(nn.Module):
    """One drafting step of an EAGLE-3 head (`models/eagle_head.py`) on each of the cache's rows `slots [b]`: the
    entry of a drawn token read with the head's output before it, appended at `positions [b]`; its output `[b, 1, H]`
    and logits over the draft vocabulary `[b, K]`. It runs the head's own layer (`EagleHead.forward`, the code its
    eager steps run), attending through `StoreAttention`."""

    def __init__(self, head: Any) -> None:  # an EagleHead (models/eagle_head.py imports this module)
        super().__init__()
        self.head = head

    def forward(
        self,
        embeddings: Tensor,
        hidden: Tensor,
        slots: Tensor,
        positions: Tensor,
        key_positions: Tensor,
        keys: Tensor,
        values: Tensor,
    ) -> tuple[Tensor, Tensor]:
        """`keys`/`values`: the head's `KVCache` stores as allocated, `[1 + rows, KVH, max_len, hd]` (row 0 spare);
        attention gathers the rows' first `len(key_positions)` entries."""
        h = self.head
        new_positions = positions.view(embeddings.shape[0], 1)  # [b, 1]
        attend = StoreAttention(
            h.layer_config, _no_window, keys, values, slots, new_positions, key_positions, None, num_layers=1
        )
        x = h(embeddings, hidden, attend)  # [b, 1, H]
        return x, h.logits(x[:, 0])


def _no_window(layer: int) -> bool:
    """An EAGLE-3 head's layer attends over the whole context."""
    return False


class CompiledHeadStep:
    """A compiled `HeadStep` for one head: what a drafting step runs where the target runs compiled (a graph for batch
    1 and one for batches of 2+ rows)."""

    def __init__(self, head: Any) -> None:  # an EagleHead (models/eagle_head.py imports this module)
        keep_artefacts_in_cache()
        self.head = head
        self.step = torch.compile(_private_forward(HeadStep(head).eval()), fullgraph=True, backend=_inductor)
        self.inductor_config = inductor_config(head.device)
        self.batches: set[bool] = set()  # (batch 1) compiled

    def warm_up(self, embed: Callable[[Tensor], Tensor], batches: bool = False) -> None:
        """Compile the step now for batch 1 (and with `batches` for 2+ rows) on a throwaway cache (`embed`: the token
        embedding the drafter uses)."""
        cache = self.head.new_cache(2, 8)
        with torch.inference_mode():
            for rows in (1, 2) if batches else (1,):
                if (rows == 1) in self.batches:
                    continue
                hidden = torch.zeros(
                    rows, 1, self.head.config.hidden_size, dtype=self.head.dtype, device=self.head.device
                )
                slots = torch.arange(rows)
                self(embed(torch.zeros(rows, 1, dtype=torch.long)), hidden, cache, slots)
                cache.reset(slots)

    def __call__(self, embeddings: Tensor, hidden: Tensor, cache: KVCache, slots: Tensor) -> tuple[Tensor, Tensor]:
        """The head's output `[b, 1, H]` and logits `[b, K]` for one entry per row `slots [b]`, appended after each
        row's length in `cache` (which grows by one)."""
        starts = cache.reserve(slots, 1)
        reading = read_positions(int(starts.max()) + 1, cache, hidden.device)
        stores = mark_stores_dynamic(cache)
        single = len(slots) == 1
        if single not in self.batches:
            log.info(
                "compiling the feature draft's step for batch %s (10-30 s on a small CPU; found in inductor's "
                "cache by later processes)",
                "1" if single else "> 1",
            )
        inputs = (
            embeddings.contiguous(),
            hidden.contiguous(),
            slots.to(hidden.device).clone(),
            starts.to(hidden.device).clone(),
        )
        mark_rows_dynamic(*inputs)
        with torch._inductor.config.patch(self.inductor_config):
            if hidden.is_cuda:
                torch.compiler.cudagraph_mark_step_begin()
            out = replayed(self.step(*inputs, reading, *stores))
        self.batches.add(single)
        cache.lengths[slots.cpu()] = starts + 1
        return out
