"""The one small protocol every model runtime implements, so the engine never sees which it is."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar, cast, runtime_checkable

import torch
from torch import Tensor


@runtime_checkable
class ModelCache(Protocol):
    """Per-row decoding state of one model; `lengths[slot]` tokens are valid in each row."""

    lengths: Tensor  # [num_slots] long, on CPU

    @property
    def num_slots(self) -> int: ...

    def truncate(self, slots: Tensor, lengths: Tensor) -> None: ...

    def reset(self, slots: Tensor) -> None: ...

    def copy_prefix(self, source: int, slot: int, length: int) -> None:
        """Make row `slot` hold the first `length` tokens of row `source` (which is unchanged)."""
        ...


C = TypeVar("C", bound=ModelCache)  # the kind of cache a model allocates, and the only kind it decodes into
C_in = TypeVar("C_in", bound=ModelCache, contravariant=True)  # the same, where a protocol only takes one


@runtime_checkable
class CausalLM(Protocol[C]):
    """A causal language model that decodes into a cache with per-row lengths."""

    vocab_size: int  # size of the output distribution
    max_seq_len: int  # context window

    @property
    def device(self) -> torch.device: ...

    def new_cache(self, num_slots: int, max_len: int) -> C:
        """Allocate decoding state for `num_slots` rows of up to `max_len` tokens."""
        ...

    def forward_cached(self, tokens: Tensor, cache: C, slots: Tensor) -> Tensor:
        """Append `tokens [b, n]` to rows `slots [b]` of `cache`; return logits `[b, n, vocab]`.

        Row i's tokens sit at positions `cache.lengths[slots[i]] + 0..n-1`; afterwards each row's
        length has grown by n. Callers roll rows back with `cache.truncate`.
        """
        ...

    def prefill(self, tokens: Tensor, cache: C, slots: Tensor) -> None:
        """Like `forward_cached` but computes no logits (the prompt before the last token)."""
        ...


@runtime_checkable
class LastPositionLM(Protocol[C_in]):
    """A model that can score only each row's last new position, over its output subset (FR-Spec drafts):
    a drafter then samples among the K tokens the draft can emit instead of the whole vocabulary."""

    output_subset: Tensor | None  # [K] token ids the output layer covers; None: the whole vocabulary

    def forward_cached_last(self, tokens: Tensor, cache: C_in, slots: Tensor, last: Tensor) -> Tensor:
        """Append `tokens [b, n]` as `forward_cached` does; logits `[b, K]` at position `last[i]` of row i."""
        ...


@runtime_checkable
class FeatureLM(Protocol[C_in]):
    """A model that also returns, from the same forward, its features at each new position: its final hidden state
    (the vector its output layer reads), or hidden states of chosen layers concatenated (EAGLE-3): a feature draft
    drafts from them at no extra cost to the target."""

    feature_size: int  # the width of a position's features

    def forward_cached_features(self, tokens: Tensor, cache: C_in, slots: Tensor) -> tuple[Tensor, Tensor]:
        """`forward_cached`, and the features `[b, n, feature_size]` of the same positions."""
        ...

    def prefill_features(self, tokens: Tensor, cache: C_in, slots: Tensor) -> Tensor:
        """`prefill`, returning the features `[b, n, feature_size]` (no logits are computed)."""
        ...


@runtime_checkable
class TreeLM(Protocol[C_in]):
    """A model that scores a token tree per row in one forward (each token sees the context and its ancestors) and
    keeps one path of it in its cache."""

    def forward_cached_tree(self, tokens: Tensor, cache: C_in, slots: Tensor, parents: Tensor) -> tuple[Tensor, Tensor]:
        """Logits `[b, n, vocab]` and final hidden states `[b, n, hidden]` of a block whose token i hangs from
        `parents[:, i]` (-1 for the first); the cache holds the block in order until a path is kept."""
        ...


class UncachedLM(Protocol):
    def forward(self, tokens: Tensor) -> Tensor: ...


def uncached_logits(model: CausalLM, tokens: Tensor) -> Tensor:
    """Logits `[b, n, vocab]` of a causal forward over `tokens [b, n]` without a cache (scoring, training data):
    every runtime's model has that forward as its `forward`."""
    return cast(UncachedLM, model).forward(tokens)


def pad_right(sequences: Sequence[Sequence[int]], device: torch.device) -> tuple[Tensor, Tensor]:
    """Right-pad token lists into `[b, max_len]`; also return each row's last real index `[b]`."""
    width = max(len(s) for s in sequences)
    out = torch.zeros(len(sequences), width, dtype=torch.long)
    for row, seq in enumerate(sequences):
        out[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
    last = torch.tensor([len(s) - 1 for s in sequences], dtype=torch.long)
    return out.to(device), last.to(device)


def prefill_ragged(
    model: CausalLM, cache: ModelCache, slots: Tensor, sequences: list[list[int]], features: bool = False
) -> list[Tensor] | None:
    """Prefill rows with sequences of different lengths (right-padded, then rolled back). With `features` (a
    `FeatureLM`), return each row's final hidden states `[len, hidden]` (empty for an empty sequence)."""
    if features and not isinstance(model, FeatureLM):
        raise TypeError(f"{type(model).__name__} returns no features")
    feature_model = model if features and isinstance(model, FeatureLM) else None
    if not any(sequences):
        return (
            None
            if feature_model is None
            else [torch.zeros(0, feature_model.feature_size, device=model.device) for _ in sequences]
        )
    has_tokens = [i for i, s in enumerate(sequences) if s]
    cramped = _cramped(cache, slots, sequences, has_tokens)
    if cramped:  # rows without room for the others' padding are prefilled alone, after the rest
        parts = [[s if i not in cramped else [] for i, s in enumerate(sequences)]]
        parts += [[s if i == j else [] for i, s in enumerate(sequences)] for j in cramped]
        results = [prefill_ragged(model, cache, slots, part, features) for part in parts]
        if not features:
            return None
        owner = {j: k + 1 for k, j in enumerate(cramped)}
        merged = []
        for i in range(len(sequences)):
            part = results[owner.get(i, 0)]
            assert part is not None  # every part returns features when asked
            merged.append(part[i])
        return merged
    rows = slots[torch.tensor(has_tokens)]
    inputs, last = pad_right([sequences[i] for i in has_tokens], model.device)
    start = cache.lengths[rows].clone()
    if feature_model is None:
        model.prefill(inputs, cache, rows)
        cache.truncate(rows, start + last.cpu() + 1)
        return None
    hidden = feature_model.prefill_features(inputs, cache, rows)
    cache.truncate(rows, start + last.cpu() + 1)
    out = [torch.zeros(0, feature_model.feature_size, dtype=hidden.dtype, device=hidden.device) for _ in sequences]
    for j, i in enumerate(has_tokens):
        out[i] = hidden[j, : len(sequences[i])]
    return out


def _cramped(cache: ModelCache, slots: Tensor, sequences: list[list[int]], has_tokens: list[int]) -> list[int]:
    """The sequences (of several) whose rows cannot hold the longest one's length: right-padding would overflow them
    (a row that starts from a long copied prefix with a short rest, beside a long new prompt)."""
    room = getattr(cache, "max_len", None)
    if room is None or len(has_tokens) < 2:
        return []
    longest = max(len(sequences[i]) for i in has_tokens)
    return [i for i in has_tokens if int(cache.lengths[int(slots[i])]) + longest > room]
