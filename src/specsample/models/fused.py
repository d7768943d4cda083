"""The fused step: every decoder layer of our Llama runtime's cached forwards in one native call on CPUs with
AVX512-BF16 (`kernels/fused_step.cpp`), for the one-token step, verification blocks (chains and token trees) and
batches of rows alike.

The torch path runs about 30 small ops per layer (norms, RoPE, the cache write, attention, SiLU, residual adds around
the projections); on a small model each costs more in dispatch and allocation than in arithmetic, so a token of
SmolLM2-135M is ~900 ops of overhead around ~75 MB of weight reads. The fused step runs a layer's small ops in place
between its projections (int4, int8 or bfloat16 weights, the row kernels' arithmetic), with its own attention over
the cache. It computes the same function as the torch path to bfloat16 rounding (tests/test_fused.py), and keeps the
row kernels' invariant: a position scored in a block of tokens or a tree gets bitwise what a one-token step at that
position gives.

It serves models in bfloat16 on a CPU, with projections our kernels multiply (int4 in their packed layout, int8 per
row, bfloat16) and no sliding window; `unsupported` names what stands in the way otherwise, and the model then runs
the torch path. The output layer stays a separate call (`LlamaModel.logits`: a draft's output subset, full logits).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from specsample.kv_cache import KVCache
from specsample.models import row_kernels
from specsample.models.layers import Linear, weight_version
from specsample.models.quant import KERNEL_DTYPE, Int4Linear, Int8Linear, Projection, QuantLinear, SplitLinear

INT4, INT8, BF16 = 0, 1, 2  # a projection part's kind, as fused_step.cpp reads it


def _parts(projection: Projection) -> list[Linear | QuantLinear]:
    return list(projection.parts) if isinstance(projection, SplitLinear) else [projection]


def _part_problem(part: nn.Module) -> str | None:
    """Why the fused step cannot multiply this projection part (None where it can)."""
    if isinstance(part, (Int4Linear, Int8Linear)):
        return None if part.uses_our_kernel() else f"{part.extra_repr()} does not fit our kernels' layout"
    if isinstance(part, Linear):
        weight = part.weight
        if weight.dtype != torch.bfloat16:
            return f"a {weight.dtype} projection (the fused step multiplies bfloat16, int8 and int4 weights)"
        if weight.shape[1] % 32 or weight.shape[0] % 16:
            return f"a projection of shape {tuple(weight.shape)} (needs inputs in multiples of 32, outputs of 16)"
        return None
    return f"a {type(part).__name__} projection"


def unsupported(model: Any) -> str | None:  # a LlamaModel (models/llama.py imports this module)
    """Why `model` cannot run the fused step on this machine, or None where it can."""
    config = model.config
    if model.device.type != "cpu":
        return f"it runs on CPUs (the model is on {model.device})"
    if model.dtype != KERNEL_DTYPE:
        return f"it computes in bfloat16 (the model is in {model.dtype})"
    if not row_kernels.available():
        return "our CPU kernels are not available (no AVX512-BF16 or no C++ compiler; see the log)"
    if config.sliding_window is not None:
        return "it has no sliding-window attention"
    if config.head_dim % 32 or config.head_dim > 256 or config.hidden_size % 32 or config.intermediate_size % 32:
        return "it needs head, hidden and intermediate sizes that are multiples of 32 (head size at most 256)"
    if (config.num_heads * config.head_dim) % 32:
        return "it needs heads * head size to be a multiple of 32"
    for i, layer in enumerate(model.layers):
        for name in ("qkv", "o_proj", "gate_up", "down"):
            for part in _parts(getattr(layer, name)):
                problem = _part_problem(part)
                if problem is not None:
                    return f"layer {i}'s {name} is {problem}"
    return None


def expected(device: str, dtype: str, runtime: str) -> bool:
    """Whether models loaded with these settings will run the fused step on this machine, told before loading them
    (a CPU with our kernels' instructions and a compiler, bfloat16 activations, our runtime): what decides whether a
    server compiles by default (`server/options.py`)."""
    return (
        runtime in ("auto", "fused")
        and torch.device(device).type == "cpu"
        and dtype in ("auto", "bfloat16")
        and row_kernels.can_build()
    )


@contextmanager
def torch_ops_alone(model: object) -> Iterator[None]:
    """While `model` runs the fused step, torch's own ops on the calling thread run on that thread alone: the fused
    step's pool keeps the cores busy, and OpenMP's workers, which spin for a while after each op, would take one from
    it (measured: a 6-token block 30% slower). Elsewhere, and where a compiled step (which runs on torch's threads)
    takes the model's steps, a no-op."""
    if getattr(model, "fused", None) is None or getattr(model, "compiled", None) is not None:
        yield
        return
    if torch.get_num_threads() == 1:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _add_projection(stack: Any, which: int, projection: Projection) -> None:
    for part in _parts(projection):
        bias = part.bias if part.bias is not None else torch.empty(0)
        if isinstance(part, Int4Linear):
            stack.add_part(which, INT4, part.packed, part.scales_zeros.view(KERNEL_DTYPE), part.group_size, bias)
        elif isinstance(part, Int8Linear):
            stack.add_part(which, INT8, part.codes_, part.scales.view(KERNEL_DTYPE), 0, bias)
        else:
            stack.add_part(which, BF16, part.weight.detach().contiguous(), torch.empty(0), 0, bias.detach())


class FusedStep:
    """A model's decoder stack as one native call over its current weights (build a new one after the weights
    change: `LlamaModel.use_fused_step` does)."""

    def __init__(self, model: Any) -> None:  # a LlamaModel
        problem = unsupported(model)
        if problem is not None:
            raise ValueError(f"the fused step cannot run this model: {problem}")
        config = model.config
        self.stack = torch.classes.specsample_fused.FusedStack(
            config.hidden_size,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            config.intermediate_size,
            float(config.rms_norm_eps),
            float(model.rope_scale),
            model._inv_freq.float().cpu(),
            model.norm.weight.detach().float(),
        )
        for layer in model.layers:
            self.stack.add_layer(layer.input_norm.weight.detach().float(), layer.post_norm.weight.detach().float())
            for which, projection in enumerate((layer.qkv, layer.o_proj, layer.gate_up, layer.down)):
                _add_projection(self.stack, which, projection)
        # float weights a caller can update in place (the norms are copied to float32 here): their version counters
        self.watched = [p for p in model.parameters() if weight_version(p) != -2]
        self.versions = [weight_version(p) for p in self.watched]

    def stale(self) -> bool:
        """Whether a weight changed in place since the stack was built (training a model it runs)."""
        return any(weight_version(p) != v for p, v in zip(self.watched, self.versions, strict=True))

    def __call__(
        self,
        embedded: Tensor,  # [b, n, hidden] bfloat16: the new tokens' embeddings
        cache: KVCache,
        slots: Tensor,  # [b] the rows' cache slots
        starts: Tensor,  # [b] where each row's new tokens go
        parents: Tensor | None,  # [b, n] a token tree per row (-1 for a root), or None: a causal block
        feature_layers: tuple[int, ...] | None,
    ) -> tuple[Tensor, Tensor | None]:
        """Final-normed hidden states `[b, n, hidden]`, and the residual streams entering `feature_layers`
        concatenated `[b, n, len * hidden]` (None where there are none); the new keys and values are in the cache."""
        hidden, features = self.stack.forward(
            embedded,
            cache.flat_keys,
            cache.flat_values,
            slots.cpu(),
            starts,
            cache.num_slots,
            torch.empty(0, dtype=torch.long) if parents is None else parents.cpu(),
            list(feature_layers or ()),
        )
        return hidden, (features if feature_layers else None)
