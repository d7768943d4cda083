"""Collect distillation data: the target's top-k next-token distributions over token sequences.

Teacher-forced: existing conversations scored in one forward pass each (fast: most tokens).
On-policy: the target samples its own replies (batched, our engine), which are then scored.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from specsample.config import SamplingParams, SpecConfig
from specsample.datasets import Prompt
from specsample.distill.data import DataWriter, Sequence_
from specsample.engine import Engine
from specsample.models.base import CausalLM, uncached_logits
from specsample.tokenizer import Tokenizer


@dataclass(frozen=True)
class CollectConfig:
    """How much data to collect and how."""

    top_k: int = 32
    max_len: int = 512  # tokens per sequence (longer conversations are cut)
    batch_tokens: int = 2048  # tokens per teacher-forcing forward (bounds memory: logits are [tokens, vocab])
    onpolicy_batch: int = 32
    onpolicy_max_new: int = 256
    onpolicy_temperatures: tuple[float, ...] = (0.7, 0.85, 1.0)

    def __post_init__(self) -> None:
        if self.top_k < 1 or self.max_len < 2 or self.batch_tokens < self.max_len:
            raise ValueError("need top_k >= 1, max_len >= 2 and batch_tokens >= max_len")


def conversation_ids(tokenizer: Tokenizer, prompt: Prompt, max_len: int) -> tuple[list[int], int]:
    """Chat-rendered token ids of a conversation (cut at `max_len`), and where the first user turn starts."""
    messages = []
    for i, turn in enumerate(prompt.turns):
        messages.append({"role": "user", "content": turn})
        if i < len(prompt.replies):
            messages.append({"role": "assistant", "content": prompt.replies[i]})
    text = tokenizer.hf.apply_chat_template(messages, tokenize=False)
    ids = list(tokenizer.hf(text, add_special_tokens=False)["input_ids"])[:max_len]
    return ids, _system_prefix_len(tokenizer)


def _system_prefix_len(tokenizer: Tokenizer) -> int:
    """Tokens every rendered conversation starts with (the template's default system block and the
    user header): identical in every sequence, so not worth scoring."""
    one = tokenizer.encode_messages([{"role": "user", "content": "a"}])
    two = tokenizer.encode_messages([{"role": "user", "content": "b"}])
    common = 0
    while common < min(len(one), len(two)) and one[common] == two[common]:
        common += 1
    return common


@torch.inference_mode()
def score(model: CausalLM, sequences: Sequence[Sequence[int]], top_k: int) -> list[Sequence_]:
    """Teacher-force `sequences` (equal-ish lengths, one batch) and keep each position's top-k."""
    width = max(len(s) for s in sequences)
    batch = torch.zeros(len(sequences), width, dtype=torch.long)
    for row, seq in enumerate(sequences):
        batch[row, : len(seq)] = torch.tensor(seq)
    logits = uncached_logits(model, batch)  # [b, width, vocab]; right padding never affects earlier positions
    out = []
    for row, seq in enumerate(sequences):
        logp = torch.log_softmax(logits[row, : len(seq)].float(), dim=-1)
        values, ids = logp.topk(top_k, dim=-1)
        out.append(Sequence_(np.asarray(seq, dtype=np.int32), ids.cpu().numpy(), values.cpu().numpy()))
    return out


def _batches(items: list[tuple[list[int], dict]], batch_tokens: int) -> Iterator[list[tuple[list[int], dict]]]:
    """Group sequences of similar length so padding stays small."""
    items = sorted(items, key=lambda it: len(it[0]))
    batch: list[tuple[list[int], dict]] = []
    for item in items:
        if batch and (len(batch) + 1) * len(item[0]) > batch_tokens:
            yield batch
            batch = []
        batch.append(item)
    if batch:
        yield batch


def _score_items(
    model: CausalLM, items: list[tuple[list[int], dict]], config: CollectConfig
) -> tuple[list[Sequence_], list[dict]]:
    """Score (sequence, metadata) items in length-sorted batches; returns aligned sequences and metadata."""
    scored, metas = [], []
    for batch in _batches(items, config.batch_tokens):
        scored += score(model, [ids for ids, _ in batch], config.top_k)
        metas += [meta for _, meta in batch]
    return scored, metas


def collect_teacher_forced(
    model: CausalLM,
    tokenizer: Tokenizer,
    prompts: Sequence[Prompt],
    writer: DataWriter,
    config: CollectConfig,
    progress: bool = True,
) -> None:
    """Score conversations `prompts[writer.num_sequences:]` and append them; resumable."""
    done = writer.num_sequences
    todo = prompts[done:]
    bar = tqdm(total=len(prompts), initial=done, desc="teacher-forced", unit="conv", disable=not progress)
    chunk = 64  # conversations per commit
    for begin in range(0, len(todo), chunk):
        items = []
        for prompt in todo[begin : begin + chunk]:
            ids, score_from = conversation_ids(tokenizer, prompt, config.max_len)
            items.append((ids, {"id": prompt.id, "score_from": score_from}))
        writer.append(*_score_items(model, items, config))
        bar.update(len(items))
        bar.set_postfix(tokens=writer.num_tokens)
    bar.close()


def collect_on_policy(
    model: CausalLM,
    tokenizer: Tokenizer,
    prompts: Sequence[Prompt],
    writer: DataWriter,
    config: CollectConfig,
    seed: int = 0,
    progress: bool = True,
) -> None:
    """Let the target answer `prompts[writer.num_sequences:]` (sampled), then score prompt + reply."""
    done = writer.num_sequences
    bar = tqdm(total=len(prompts), initial=done, desc="on-policy", unit="reply", disable=not progress)
    started, generated = time.perf_counter(), 0
    for begin in range(done, len(prompts), config.onpolicy_batch):
        batch = prompts[begin : begin + config.onpolicy_batch]
        prompt_ids = [
            tokenizer.encode(p.turns[0], chat=True)[: config.max_len - config.onpolicy_max_new] for p in batch
        ]
        engine = Engine(
            model,
            None,
            SpecConfig(speculative=False, max_batch_size=len(batch), max_seq_len=config.max_len + 8),
            tokenizer.eos_token_ids,
        )
        temps = [
            config.onpolicy_temperatures[(begin + i) % len(config.onpolicy_temperatures)] for i in range(len(batch))
        ]
        ids = [
            engine.add_request(
                p,
                SamplingParams(
                    temperature=t, max_new_tokens=config.onpolicy_max_new, seed=seed * 1_000_003 + begin + i
                ),
            )
            for i, (p, t) in enumerate(zip(prompt_ids, temps))
        ]
        replies: dict[str, list[int]] = {i: [] for i in ids}
        for result in engine.stream():
            for update in result.rows:
                replies[update.request_id].extend(update.new_tokens)
        sequences = [p + replies[i] for p, i in zip(prompt_ids, ids)]
        generated += sum(len(replies[i]) for i in ids)
        items = [
            (seq, {"id": p.id, "score_from": len(pi), "temperature": t})
            for seq, p, pi, t in zip(sequences, batch, prompt_ids, temps)
        ]
        writer.append(*_score_items(model, items, config))
        bar.update(len(batch))
        bar.set_postfix(tokens=writer.num_tokens, sampled_tok_s=f"{generated / (time.perf_counter() - started):.0f}")
    bar.close()
