"""Conversations the target writes itself, with its features recorded as it writes them.

A feature draft meets, at inference, text the target wrote: it learns best from that text (EAGLE-3 regenerates its
training data with the target). Each source conversation's user turns (up to `turns` of them) are answered in order
by the target through our engine, batched and sampled at the conversation's temperature, under the chat template
the server uses; every later turn's prompt holds the earlier turns and the target's own replies. The engine hands
its drafter the target's features of every position it commits (what it does for a feature draft at inference), so
a drafter that proposes nothing and records them (`FeatureRecorder`) collects the training data in the same
forwards that write it: no second pass over the text.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Generic, TypeVar

import torch
from torch import Tensor
from tqdm import tqdm

from specsample.config import SamplingParams, SpecConfig
from specsample.datasets import Prompt
from specsample.distill.features import (
    FeatureSequence,
    FeatureWriter,
    read_index,
    recording_layers,
    reply_spans,
    shard_folders,
    split_features,
)
from specsample.drafters.base import Abilities, DraftRequest, Proposal
from specsample.engine import Engine
from specsample.tokenizer import Tokenizer

if TYPE_CHECKING:
    from specsample.models.llama import LlamaModel
    from specsample.models.loader import LoadedModel


K = TypeVar("K")  # what a recorded request is known by


@dataclass
class _Recorded:
    tokens: list[int]
    features: list[Tensor] = field(default_factory=list)  # [n, F + hidden] per call, in order


class FeatureRecorder(Generic[K]):
    """A drafter that proposes nothing and keeps, per row, the committed tokens and the target's features of every
    position it commits; a finished row is handed to `on_finish(request_key, tokens, features)`. Rows are matched to
    requests in the order the engine admits them, which is the order they were added (`expect`)."""

    vocab_size = None
    abilities = Abilities(reads_features=True)

    def __init__(self, on_finish: Callable[[K, list[int], Tensor], None]) -> None:
        self.on_finish = on_finish
        self._expected: deque[K] = deque()
        self._rows: dict[int, tuple[K, _Recorded]] = {}

    def expect(self, key: K) -> None:
        """The next request added to the engine is `key`'s."""
        self._expected.append(key)

    def allocate(self, num_slots: int, max_len: int) -> None:
        self._rows.clear()

    def add_rows(self, slots: Sequence[int], prompts: Sequence[Sequence[int]]) -> None:
        for slot, prompt in zip(slots, prompts):
            self._rows[slot] = (self._expected.popleft(), _Recorded(list(prompt)))

    def add_features(self, slots: Sequence[int], features: Sequence[Tensor]) -> None:
        for slot, feature in zip(slots, features):
            if len(feature):
                self._rows[slot][1].features.append(feature.detach().to("cpu", torch.bfloat16))

    def commit(self, slots: Sequence[int], committed: Sequence[Sequence[int]]) -> None:
        for slot, new in zip(slots, committed):
            self._rows[slot][1].tokens.extend(new)

    def release_rows(self, slots: Sequence[int]) -> None:
        for slot in slots:
            if slot in self._rows:
                key, row = self._rows.pop(slot)
                self.on_finish(key, row.tokens, torch.cat(row.features) if row.features else torch.zeros(0, 0))

    def propose(self, request: DraftRequest) -> Proposal:
        raise RuntimeError("a feature recorder proposes nothing: run its engine without speculation")


@dataclass(frozen=True)
class Regeneration:
    """How the target rewrites a conversation source."""

    temperatures: tuple[float, ...] = (0.0, 0.7)  # conversation i is sampled at temperatures[i % len]
    turns: int = 2  # user turns answered per conversation (fewer where it has fewer or the context is full)
    max_new_tokens: int = 96  # per reply
    max_prompt_tokens: int = 768  # a first turn rendered longer than this is skipped
    batch_size: int = 48  # requests decoded together (per worker)
    chunk: int = 64  # conversations per committed chunk
    seed: int = 0
    # processes writing at once, each its own shard of the store (conversation i goes to shard i % workers); where
    # cores are shared or a step's small ops dominate, several one-thread workers outrun one worker with every thread
    workers: int = 1

    def __post_init__(self) -> None:
        if not self.temperatures or any(t < 0 for t in self.temperatures):
            raise ValueError(f"regeneration temperatures must be >= 0, got {self.temperatures}")
        if min(self.turns, self.max_new_tokens, self.max_prompt_tokens, self.batch_size, self.chunk, self.workers) < 1:
            raise ValueError("turns, max_new_tokens, max_prompt_tokens, batch_size, chunk and workers must be >= 1")


@dataclass
class _Conversation:
    index: int
    prompt: Prompt
    temperature: float
    replies: list[str] = field(default_factory=list)  # the target's, in order
    prompt_len: int = 0  # tokens of the prompt of the turn being answered


def regenerate_features(
    model: LlamaModel,
    tokenizer: Tokenizer,
    prompts: Iterable[Prompt],
    writer: FeatureWriter,
    plan: Regeneration,
    max_tokens: int,
    max_conversations: int | None = None,
    progress: bool = True,
    shard: tuple[int, int] = (0, 1),
    skip: frozenset[int] = frozenset(),
) -> None:
    """Have the target answer the source conversations' user turns and store each finished conversation's tokens,
    reply mask and recorded features (of the conversations of `shard` (k, n): index i with i % n == k, skipping
    those `writer` or another shard (`skip`) handled already), until the store holds `max_tokens` tokens,
    `max_conversations` conversations or the source runs out. The engine stays full: a conversation's next turn
    joins the batch as soon as its previous reply is written."""
    model.set_feature_layers(recording_layers(writer.index["feature_layers"], len(model.layers)))
    max_len = writer.index["max_len"]
    done = writer.done | skip
    mine, workers = shard
    source = ((i, p) for i, p in enumerate(prompts) if i % workers == mine and i not in done)
    finished: list[tuple[_Conversation, list[int], Tensor]] = []
    recorder: FeatureRecorder[_Conversation] = FeatureRecorder(
        lambda key, tokens, features: finished.append((key, tokens, features))
    )
    engine = Engine(
        model,
        recorder,
        SpecConfig(speculative=False, max_batch_size=plan.batch_size, max_seq_len=max_len),
        tokenizer.eos_token_ids,
    )
    bar = tqdm(
        total=max_tokens,
        initial=min(writer.num_tokens, max_tokens),
        desc="target-written conversations",
        unit="tok",
        unit_scale=True,
        disable=not progress,
    )
    pending: list[FeatureSequence] = []
    handled: list[int] = []
    running = 0

    def start(conversation: _Conversation) -> bool:
        """Queue the conversation's next turn; False where it does not fit."""
        count = len(conversation.replies) + 1
        ids = tokenizer.encode_messages(_history(conversation.prompt.turns[:count], conversation.replies))
        limit = plan.max_prompt_tokens if count == 1 else max_len - plan.max_new_tokens
        if len(ids) > limit:
            return False
        conversation.prompt_len = len(ids)
        recorder.expect(conversation)
        engine.add_request(
            ids,
            SamplingParams(
                temperature=conversation.temperature,
                max_new_tokens=plan.max_new_tokens,
                seed=plan.seed + 1000 * conversation.index + count,
            ),
        )
        return True

    def room(added: int) -> bool:
        """Whether another conversation may start: the engine's queue holds up to two batches, and the store takes
        no more than `max_conversations`."""
        if running + added >= 2 * plan.batch_size:
            return False
        return max_conversations is None or writer.num_sequences + len(pending) + running + added < max_conversations

    def refill() -> int:
        added = 0
        while room(added):
            item = next(source, None)
            if item is None:
                break
            index, prompt = item
            conversation = _Conversation(index, prompt, plan.temperatures[index % len(plan.temperatures)])
            if start(conversation):
                added += 1
            else:
                handled.append(index)
        return added

    def commit() -> None:
        nonlocal pending, handled
        before = writer.num_tokens
        writer.append(pending, handled)
        bar.update(min(writer.num_tokens, max_tokens) - min(before, max_tokens))
        bar.set_postfix(conversations=writer.num_sequences)
        pending, handled = [], []

    running += refill()
    while running and writer.num_tokens < max_tokens:
        engine.step()
        for conversation, tokens, features in finished:
            conversation.replies.append(tokenizer.decode(tokens[conversation.prompt_len :]))
            if len(conversation.replies) < min(plan.turns, len(conversation.prompt.turns)) and start(conversation):
                continue
            running -= 1
            handled.append(conversation.index)
            sequence = _sequence(model, tokenizer, conversation, tokens, features, writer.index["feature_layers"])
            if sequence is not None:
                pending.append(sequence)
        finished.clear()
        if len(handled) >= plan.chunk:
            commit()
        running += refill()
    if pending or handled:
        commit()
    bar.close()


def _history(turns: Sequence[str], replies: Sequence[str]) -> list[dict[str, str]]:
    """User turns, each but the last followed by its reply: the prompt of the last turn."""
    messages = []
    for i, turn in enumerate(turns):
        messages.append({"role": "user", "content": turn})
        if i < len(turns) - 1:
            messages.append({"role": "assistant", "content": replies[i]})
    return messages


def _sequence(
    model: LlamaModel,
    tokenizer: Tokenizer,
    conversation: _Conversation,
    tokens: list[int],
    features: Tensor,
    feature_layers: Sequence[int],
) -> FeatureSequence | None:
    """The finished conversation as a stored sequence: the tokens the target scored (its last turn's prompt, earlier
    replies included, and the last reply), the reply mask, and the recorded features split into fused features and
    final hidden states (known for every token but the last, which was never scored)."""
    count = len(conversation.replies)
    ids, mask = reply_spans(tokenizer, conversation.prompt.turns[:count], conversation.replies[:-1])
    if ids != tokens[: len(ids)] or len(ids) != conversation.prompt_len:
        raise RuntimeError(f"conversation {conversation.index}: its prompt renders differently from what was scored")
    mask = mask + [True] * (len(tokens) - len(ids))
    if len(features) != len(tokens) - 1 or len(tokens) - len(ids) < 2:
        return None  # cancelled, or a reply of one token: nothing to learn
    fused, final = split_features(model, features, feature_layers)
    padded = torch.zeros(len(tokens), fused.shape[-1], dtype=torch.bfloat16)
    padded[: len(fused)] = fused
    finals = torch.zeros(len(tokens), final.shape[-1], dtype=torch.bfloat16)
    finals[: len(final)] = final
    return FeatureSequence(torch.tensor(tokens), padded, finals, torch.tensor(mask), len(features))


def regenerate_store(
    folder: Path,
    target: str,
    quantize: str,
    device: str,
    prompts: str,
    plan: Regeneration,
    feature_layers: Sequence[int],
    max_len: int,
    max_tokens: int,
    loaded: LoadedModel | None = None,
    progress: bool = True,
) -> None:
    """Fill the feature store in `folder` with conversations the target writes (`regenerate_features`) from the
    source `prompts` (`datasets.training_conversations`), up to `max_tokens` tokens in all: `plan.workers` processes
    at once, worker k filling `shard-k` with conversation i % workers == k, each resuming its shard and skipping what
    any shard handled. With one worker it runs here, on `loaded` (the target already loaded) where given."""
    folder = Path(folder)
    if _stored_tokens(folder) >= max_tokens:
        return  # the store already holds what was asked, whichever workers wrote it
    share = -(-max_tokens // plan.workers)
    if plan.workers == 1:
        _fill_shard(
            folder, 0, plan, target, quantize, device, prompts, feature_layers, max_len, share, loaded, progress
        )
        return
    import multiprocessing
    import time

    context = multiprocessing.get_context("spawn")
    workers = [
        context.Process(
            target=_fill_shard,
            name=f"regenerate shard {k}",
            args=(folder, k, plan, target, quantize, device, prompts, feature_layers, max_len, share, None, False),
        )
        for k in range(plan.workers)
    ]
    for worker in workers:
        worker.start()
    bar = tqdm(
        total=max_tokens,
        desc=f"target-written conversations ({plan.workers} workers)",
        unit="tok",
        unit_scale=True,
        disable=not progress,
    )
    try:
        while any(w.is_alive() for w in workers):
            time.sleep(5)
            bar.update(min(_stored_tokens(folder), max_tokens) - bar.n)
    except BaseException:
        for worker in workers:
            worker.terminate()
        raise
    finally:
        for worker in workers:
            worker.join()
        bar.close()
    failed = [w.name for w in workers if w.exitcode != 0]
    if failed:
        raise RuntimeError(f"{', '.join(failed)} failed (exit code {workers[0].exitcode}); run again to resume")


def _stored_tokens(folder: Path) -> int:
    total = 0
    for shard in shard_folders(folder):
        try:
            total += read_index(shard)["tokens"]
        except ValueError:  # being rewritten this instant: counted at the next poll
            pass
    return total


def _fill_shard(
    folder: Path,
    shard: int,
    plan: Regeneration,
    target: str,
    quantize: str,
    device: str,
    prompts: str,
    feature_layers: Sequence[int],
    max_len: int,
    max_tokens: int,
    loaded: LoadedModel | None = None,
    progress: bool = False,
) -> None:
    """One worker of `regenerate_store`: its shard of the conversations into `folder/shard-{shard}`."""
    from specsample.datasets import training_conversations
    from specsample.models.loader import load_model

    if loaded is None:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // plan.workers))
        loaded = load_model(target, device=device, quantize=quantize)
    model = loaded.llama()
    writer = FeatureWriter(
        Path(folder) / f"shard-{shard}",
        target,
        model.config.hidden_size,
        feature_layers,
        model.vocab_size,
        max_len,
        "regenerated",
    )
    elsewhere = frozenset(
        i for other in shard_folders(Path(folder)) if other.name != f"shard-{shard}" for i in read_index(other)["done"]
    )
    regenerate_features(
        model,
        loaded.text_tokenizer(),
        training_conversations(prompts),
        writer,
        plan,
        max_tokens,
        progress=progress,
        shard=(shard, plan.workers),
        skip=elsewhere,
    )
