"""A built-in tiny causal LM (nanoGPT-sized, seeded) for tests and examples.

It is our Llama-family runtime with a small config, so tests exercise the same code real models use.
"""

from __future__ import annotations

import torch

from specsample.models.llama import LlamaConfig, LlamaModel


def tiny_config(
    vocab_size: int,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_seq_len: int = 512,
    sliding_window: int | None = None,
) -> LlamaConfig:
    """A small Llama config with GQA and untied embeddings (and a sliding window on every layer if given)."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_seq_len,
        sliding_window=sliding_window,
    )


def tiny_lm(
    vocab_size: int = 64,
    seed: int = 0,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    init_scale: float = 0.02,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    max_seq_len: int = 512,
    sliding_window: int | None = None,
) -> LlamaModel:
    """A randomly initialised tiny model; the same seed gives the same weights.

    `init_scale` is the weight standard deviation: larger values give peakier, more distinct
    next-token distributions (useful for statistical tests).
    """
    config = tiny_config(vocab_size, hidden_size, num_layers, num_heads, num_kv_heads, max_seq_len, sliding_window)
    model = LlamaModel(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                continue  # norms start at 1
            param.copy_(torch.randn(param.shape, generator=generator) * init_scale)
    return model.to(device=device, dtype=dtype).eval()
