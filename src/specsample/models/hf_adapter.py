"""Any transformers causal LM behind the `CausalLM` protocol (e.g. Gemma 3).

Each slot keeps its own `DynamicCache` (full-length layers, so every layer can be cropped; sliding
window attention is still applied by the model's masks). Rollback crops a slot's cache before the
next forward. Rows run one at a time: correct for ragged batches, but without batched speed; the
Llama-family runtime is the fast path.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch
from torch import Tensor

from specsample.kv_cache import RowLengths
from specsample.models.sdpa import without_cudnn_attention


class HFCache(RowLengths):
    """Per-slot transformers caches and lengths; truncation is applied lazily by cropping."""

    def __init__(self, num_slots: int, max_len: int) -> None:
        self.caches: list[Any | None] = [None] * num_slots
        self.lengths = torch.zeros(num_slots, dtype=torch.long)
        self.max_len = max_len

    def reset(self, slots: Tensor) -> None:
        for slot in slots.tolist():
            self.caches[slot] = None
        super().reset(slots)

    def copy_prefix(self, source: int, slot: int, length: int) -> None:
        """Make row `slot` hold the first `length` tokens of row `source` (a copy of its cache, cropped); `source` is
        unchanged."""
        if not 0 <= length <= int(self.lengths[source]):
            raise ValueError(f"row {source} holds {int(self.lengths[source])} entries, cannot copy {length}")
        if slot != source:
            past = self.caches[source]
            self.caches[slot] = None if past is None or length == 0 else copy.deepcopy(past)
            if self.caches[slot] is not None:
                _crop(self.caches[slot], length)
        self.lengths[slot] = length


def _crop(cache: Any, length: int) -> None:
    """Crop a transformers cache to `length` tokens (the crop API differs across versions)."""
    current = cache.get_seq_length()
    if current <= length:
        return
    if "max_length" in inspect.signature(cache.crop).parameters:
        cache.crop(length)  # transformers 4.x: absolute length
    else:
        cache.crop(length - current)  # transformers 5.x: negative count of tokens to remove


class HFCausalLM:
    """Wrap a `transformers` `PreTrainedModel` with a causal LM head."""

    def __init__(self, model: Any) -> None:
        self.model = model.eval()
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.max_seq_len = int(getattr(config, "max_position_embeddings", 2048))
        # transformers renamed past_key_values to cache (5.x); pass whichever this version takes
        self._cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        # let torch pick cuDNN's attention in cached forwards: it builds a graph per context length
        self.cudnn_attention = False  # (models/sdpa.py)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def new_cache(self, num_slots: int, max_len: int) -> HFCache:
        return HFCache(num_slots, max_len)

    @property
    def feature_size(self) -> int:
        """The width of its features: the final hidden state."""
        return int(self.model.get_output_embeddings().weight.shape[1])

    @torch.inference_mode()
    def forward_cached(self, tokens: Tensor, cache: HFCache, slots: Tensor) -> Tensor:
        """Run each row on its own cache; returns logits `[b, n, vocab]` in float32."""
        with without_cudnn_attention(self.cudnn_attention):
            return self._forward_rows(tokens, cache, slots)[0]

    @torch.inference_mode()
    def forward_cached_features(self, tokens: Tensor, cache: HFCache, slots: Tensor) -> tuple[Tensor, Tensor]:
        """`forward_cached`, and the final hidden states `[b, n, hidden]` (transformers' last hidden state, the
        output of the final norm)."""
        with without_cudnn_attention(self.cudnn_attention):
            logits, hidden = self._forward_rows(tokens, cache, slots, features=True)
        assert hidden is not None  # asked for
        return logits, hidden

    def _forward_rows(
        self, tokens: Tensor, cache: HFCache, slots: Tensor, features: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """`forward_cached`'s work, row by row: logits, and with `features` the final hidden states."""
        from transformers import DynamicCache

        n = tokens.shape[1]
        outputs, hidden = [], []
        for row, slot in enumerate(slots.tolist()):
            length = int(cache.lengths[slot])
            if length + n > cache.max_len:
                raise ValueError(
                    f"KV cache full: a row would need {length + n} positions, the cache holds {cache.max_len}"
                )
            past = cache.caches[slot] if cache.caches[slot] is not None else DynamicCache()
            _crop(past, length)
            # padded columns of a batch may run past the context: models with learned position
            # embeddings cannot take those positions, and their logits are never read, so skip them
            fed = max(1, min(n, self.max_seq_len - length))
            positions = torch.arange(length, length + fed, device=self.device)
            out = self.model(
                input_ids=tokens[row : row + 1, :fed].to(self.device),
                use_cache=True,
                output_hidden_states=features,
                position_ids=positions.unsqueeze(0),
                cache_position=positions,
                **{self._cache_arg: past},
            )
            cache.caches[slot] = past  # updated in place by the model
            cache.lengths[slot] = length + n
            logits = out.logits.float()
            if fed < n:
                logits = torch.cat([logits, logits[:, -1:].expand(1, n - fed, logits.shape[-1])], dim=1)
            outputs.append(logits)
            if features:
                last = out.hidden_states[-1]
                if fed < n:
                    last = torch.cat([last, last[:, -1:].expand(1, n - fed, last.shape[-1])], dim=1)
                hidden.append(last)
        return torch.cat(outputs, dim=0), (torch.cat(hidden, dim=0) if features else None)

    def prefill(self, tokens: Tensor, cache: HFCache, slots: Tensor) -> None:
        """Fill the caches; the logits are discarded (transformers computes them anyway)."""
        self.forward_cached(tokens, cache, slots)

    def prefill_features(self, tokens: Tensor, cache: HFCache, slots: Tensor) -> Tensor:
        """Fill the caches; the final hidden states `[b, n, hidden]`."""
        return self.forward_cached_features(tokens, cache, slots)[1]

    def forward(self, tokens: Tensor) -> Tensor:
        """Uncached forward over `tokens [b, n]`: logits `[b, n, vocab]`."""
        with torch.inference_mode():
            return self.model(input_ids=tokens.to(self.device)).logits.float()
