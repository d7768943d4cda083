"""A draft language model as drafter: samples gamma tokens autoregressively from its own cache."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from specsample.config import SamplingParams, TreeShape
from specsample.drafters.base import (
    Abilities,
    DraftRequest,
    Proposal,
    best_tree,
    draw_chain,
    finish_rows,
    take_parts,
)
from specsample.models.base import CausalLM, LastPositionLM, ModelCache, pad_right, prefill_ragged
from specsample.sampling import warp_rows

MERGED_BACKLOG = 8  # a lone row's backlog up to this long goes into its first draft forward (logits for each)
WINDOW_FILE = "draft_window.json"  # in a draft's folder: the DraftWindow it drafts best with
WINDOW_MODES = ("auto", "off")  # --draft-window: the draft folder's DraftWindow (if any), or the whole context


@dataclass(frozen=True)
class DraftWindow:
    """The part of a long context a draft model attends to: its first `sink` tokens and its last `recent`.

    A small draft trained on short sequences drafts worse from a context longer than it learnt: the
    shipped draft saw at most 512 tokens, and on ShareGPT prompts of 800 tokens and more its greedy
    agreement with the target is higher with this window than with the whole prompt (docs/drafts.md).
    Keeping the first tokens (the chat template's system block) and the latest ones holds its
    positions within what it was trained on; when a generation grows a row's cache to `limit`
    positions, the row is re-windowed on its latest tokens (one prefill of sink + recent).
    What the draft sees changes only its proposals, never the output's distribution: the verifier
    checks every draft against the target, which always sees the whole context.
    """

    sink: int = 32
    recent: int = 256
    limit: int = 512

    def __post_init__(self) -> None:
        if self.sink < 0 or self.recent < 1:
            raise ValueError(f"need sink >= 0 and recent >= 1, got {self.sink}, {self.recent}")
        if self.limit < self.sink + self.recent + 4:  # a re-windowed row feeds 2 tokens, drafts 1, may pad 1
            raise ValueError(
                f"limit ({self.limit}) must exceed sink + recent ({self.sink + self.recent}) by at least 4"
            )

    def view(self, tokens: Sequence[int]) -> tuple[list[int], int]:
        """The tokens of `tokens` a draft attends to, and how many it skips (those between sink and recent)."""
        skipped = max(len(tokens) - self.sink - self.recent, 0)
        return list(tokens[: self.sink]) + list(tokens[self.sink + skipped :]), skipped

    @classmethod
    def trained_on(cls, max_len: int) -> DraftWindow | None:
        """The window for a draft trained on sequences of at most `max_len` tokens: re-windowed at `max_len`
        positions to its first max_len / 16 (up to 32) and latest max_len / 2 tokens; None when too short."""
        sink, recent = min(32, max_len // 16), max_len // 2
        return cls(sink=sink, recent=recent, limit=max_len) if recent >= 1 and max_len >= sink + recent + 4 else None

    def save(self, folder: Path, why: str) -> None:
        """Write the window beside a draft's weights (`draft_window.json`), where `from_folder` finds it."""
        fields = {"sink": self.sink, "recent": self.recent, "limit": self.limit, "why": why}
        (Path(folder) / WINDOW_FILE).write_text(json.dumps(fields, indent=2) + "\n")

    @classmethod
    def from_folder(cls, folder: Path | None) -> DraftWindow | None:
        """The window saved beside a draft's weights (`draft_window.json`), or None (the whole context)."""
        path = None if folder is None else Path(folder) / WINDOW_FILE
        if path is None or not path.exists():
            return None
        fields = json.loads(path.read_text())
        try:
            return cls(sink=int(fields["sink"]), recent=int(fields["recent"]), limit=int(fields["limit"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: expected integer sink, recent and limit ({exc})") from exc


class ModelDrafter:
    """Drafts with a small causal LM sharing the target's vocabulary.

    Per slot it keeps the full token history and how much of it sits in its KV cache; each round
    first feeds what the cache lacks (the last committed token, and the last draft when every draft
    was accepted), then samples one token per step. With a `window` the cache holds only the
    window's view of the history: `_skipped[slot]` history tokens are left out after the sink.
    """

    abilities = Abilities(scores_backlog=True, keeps_prefixes=True, copies_prefixes=True, chunks_prefill=True)

    def __init__(self, model: CausalLM, folder: Path | None = None, window: DraftWindow | None = None) -> None:
        self.model = model
        self.folder = folder  # where the draft was loaded from (peers like transformers can load it too)
        self.window = window  # None: the draft attends to the whole context
        self.vocab_size = model.vocab_size
        # sample among the draft's own output tokens, scoring only the last fed position (checked once: a
        # runtime protocol check inspects every member)
        self._last_only: LastPositionLM | None = model if isinstance(model, LastPositionLM) else None
        self._cache: ModelCache | None = None
        self.history: dict[int, list[int]] = {}
        self._drafted: dict[int, list[int]] = {}  # last round's drafts per slot, to find what stays valid
        self._skipped: dict[int, int] = {}  # history tokens per slot the window leaves out of the cache
        self._unfed: dict[int, list[int]] = {}  # started rows (`start_rows`): the tokens their caches still lack

    def allocate(self, num_slots: int, max_len: int) -> None:
        """(Re)allocate the draft cache; called by the engine that owns the slots. A window bounds a
        row's cache at its `limit` positions, however long the requests may be."""
        self._cache = self.model.new_cache(
            num_slots, max_len if self.window is None else min(max_len, self.window.limit)
        )
        self.history.clear()
        self._drafted.clear()
        self._skipped.clear()
        self._unfed.clear()

    @property
    def cache(self) -> ModelCache:
        """The draft's cache, once `allocate` made it."""
        if self._cache is None:
            raise RuntimeError("the drafter has no cache yet: the engine allocates it")
        return self._cache

    def add_rows(self, slots: Sequence[int], prompts: Sequence[Sequence[int]]) -> None:
        """Prefill each new row's prompt except its last token (the window's view of it, with one); a row `start_rows`
        started is fed what it has left. A slot kept by `park_rows` keeps the cache entries of what its tokens share
        with the new prompt and prefills the rest."""
        for slot, prompt in zip(slots, prompts):
            if slot in self._unfed and self.history[slot] != list(prompt):
                raise ValueError(f"row {slot} was started for another prompt")
        finish_rows(self, self._unfed, slots, prompts)

    def start_rows(self, slots: Sequence[int], prompts: Sequence[Sequence[int]]) -> list[int]:
        """Start rows as `add_rows` does, their caches holding only what a kept row shares with the prompt: per row,
        the tokens left to prefill (`prefill_rows`, in order)."""
        held = []
        for slot, prompt in zip(slots, prompts):
            reused = self._reusable(slot, prompt)
            if reused:  # the cache keeps the entries of the shared tokens (and the window's skip before them)
                self._unfed[slot] = list(prompt[reused:-1])
                held.append(reused - self._skipped[slot])
            else:
                kept, self._skipped[slot] = self.window.view(prompt[:-1]) if self.window else (list(prompt[:-1]), 0)
                self._unfed[slot] = kept
                held.append(0)
            self.history[slot] = list(prompt)
            self._drafted[slot] = []
        slot_tensor = torch.tensor(list(slots), dtype=torch.long)
        self.cache.truncate(slot_tensor, torch.minimum(self.cache.lengths[slot_tensor], torch.tensor(held)))
        return [len(self._unfed[slot]) for slot in slots]

    def prefill_rows(self, slots: Sequence[int], units: Sequence[int]) -> None:
        """Prefill each started row's next `units[i]` tokens."""
        fed = take_parts(self._unfed, slots, units)
        prefill_ragged(self.model, self.cache, torch.tensor(list(slots), dtype=torch.long), fed)

    def park_rows(self, slots: Sequence[int]) -> None:
        """Keep the rows' histories and caches for `add_rows` to reuse (`release_rows` drops them)."""
        for slot in slots:
            self._drafted[slot] = []

    def copy_prefix(self, source: int, slot: int, tokens: Sequence[int]) -> int:
        """Start `slot` as a kept row holding the cache entries of row `source`'s first `len(tokens)` tokens (those
        it holds of them); a windowed row that skipped tokens is not copied (its view would not be a fresh one's)."""
        self.release_rows([slot])
        if source not in self.history or self._skipped[source]:
            return len(tokens)
        held = min(len(tokens), self._fed(source))
        self.cache.copy_prefix(source, slot, held)
        self.history[slot], self._drafted[slot], self._skipped[slot] = list(tokens[:held]), [], 0
        return len(tokens)

    def _reusable(self, slot: int, prompt: Sequence[int]) -> int:
        """Leading prompt tokens a kept row's cache accounts for (held, or skipped by the window), 0 if none or if
        the rest would not fit the window's limit. Past the window's sink, the tokens it skipped stay skipped."""
        history = self.history.get(slot)
        if history is None:
            return 0
        shared = 0
        for a, b in zip(history[: self._fed(slot)], prompt[:-1]):
            if a != b:
                break
            shared += 1
        skipped = self._skipped[slot]
        if (
            skipped and self.window is not None and shared <= self.window.sink + skipped
        ):  # the cut would fall inside the skipped part
            return 0
        if self.window is not None and len(prompt) - 1 - skipped > self.window.limit - 4:
            return 0  # the rest would pass the limit: a fresh window view instead
        return shared

    def release_rows(self, slots: Sequence[int]) -> None:
        for slot in slots:
            self.history.pop(slot, None)
            self._drafted.pop(slot, None)
            self._skipped.pop(slot, None)
            self._unfed.pop(slot, None)
        self.cache.reset(torch.tensor(list(slots), dtype=torch.long))

    def _fed(self, slot: int) -> int:
        """History tokens the row's cache accounts for (held, or skipped by the window)."""
        return int(self.cache.lengths[slot]) + self._skipped[slot]

    def propose(self, request: DraftRequest) -> Proposal:
        """Draw up to `request.reach[i]` tokens per row through the shared draw loop (`draw_chain`: the confidence
        gate and the extension); with `request.tree`, a tree along the draft's greedy chain (`_propose_tree`)."""
        if request.tree is not None:
            return self._propose_tree(request, request.tree)
        slots = request.slots
        slot_tensor = torch.tensor(list(slots), dtype=torch.long)
        self._catch_up(slots, request.width)
        pending = [self.history[s][self._fed(s) :] for s in slots]  # 1 or 2 tokens per row (a lone row: more)
        inputs, last = pad_right(pending, self.model.device)
        logits, subset = self._logits(inputs, slot_tensor, last)  # [b, K]: K the draft's output tokens
        self.cache.truncate(slot_tensor, self.cache.lengths[slot_tensor] - (inputs.shape[1] - 1 - last.cpu()))

        def advance(token: Tensor) -> Tensor:
            return self._logits(token.unsqueeze(1), slot_tensor, torch.zeros_like(token))[0]

        proposal = draw_chain(request, logits, advance, self.vocab_size, subset)
        steps = int(proposal.num_drafted.max()) if len(slots) else 0
        for row, slot in enumerate(slots):
            self._drafted[slot] = proposal.tokens[row, :steps].tolist()  # drawn; all but the last were fed
        return proposal

    def _propose_tree(self, request: DraftRequest, shape: TreeShape) -> Proposal:
        """A tree per row along the draft's greedy chain (its spine, down to `tree.depth`): at each depth the draft's
        `tree.branch` most likely tokens, the first continuing the spine, the others leaves beside it; then the
        `reach[i]` nodes of highest cumulative draft probability, `drafts[i]` deep. Every node is deterministic given
        the past."""
        slots = request.slots
        batch = len(slots)
        slot_tensor = torch.tensor(list(slots), dtype=torch.long)
        self._catch_up(slots, shape.depth)
        pending = [self.history[s][self._fed(s) :] for s in slots]
        inputs, last = pad_right(pending, self.model.device)
        logits, subset = self._logits(inputs, slot_tensor, last)
        self.cache.truncate(slot_tensor, self.cache.lengths[slot_tensor] - (inputs.shape[1] - 1 - last.cpu()))
        tokens: list[list[int]] = [[] for _ in range(batch)]
        parents: list[list[int]] = [[] for _ in range(batch)]
        scores: list[list[float]] = [[] for _ in range(batch)]
        spine, spine_score = [-1] * batch, [0.0] * batch
        fed: list[list[int]] = [[] for _ in range(batch)]
        limit = [min(shape.depth, d) for d in request.drafts]
        for depth in range(max(limit, default=0)):
            if request.shaper is not None:  # children chosen among what the processors leave, along the spine
                logits = request.shaper.next_logits(logits, slots, fed, subset)
            top = torch.log_softmax(logits.float(), dim=-1).topk(min(shape.branch, logits.shape[-1]), dim=-1)
            id_tensor = top.indices if subset is None else subset[top.indices]
            values: list[list[float]] = top.values.tolist()
            ids: list[list[int]] = id_tensor.tolist()
            for r in range(batch):
                parent, base = spine[r], spine_score[r]
                for rank, (value, token) in enumerate(zip(values[r], ids[r]) if depth < limit[r] else ()):
                    tokens[r].append(token)
                    parents[r].append(parent)
                    scores[r].append(base + value)
                    if rank == 0:
                        spine[r], spine_score[r] = len(tokens[r]) - 1, base + value
                fed[r].append(ids[r][0])
            if depth + 1 < max(limit):
                step = torch.tensor([ids_r[0] for ids_r in ids], device=self.model.device)
                logits, _ = self._logits(step.unsqueeze(1), slot_tensor, torch.zeros_like(step))
        for row, slot in enumerate(slots):
            self._drafted[slot] = fed[row]  # the spine drawn; all but its last token fed
        return best_tree(tokens, parents, scores, list(request.reach))

    def _logits(self, inputs: Tensor, slot_tensor: Tensor, last: Tensor) -> tuple[Tensor, Tensor | None]:
        """Feed `inputs [b, n]`; logits `[b, K]` at each row's position `last[i]`, and the token ids of the K
        columns (None: the whole vocabulary, in order). A model with an output subset (FR-Spec) scores only
        its K tokens and only the last position: sampling then reads K probabilities, not the vocabulary."""
        if self._last_only is not None:
            model = self._last_only
            return model.forward_cached_last(inputs, self.cache, slot_tensor, last), model.output_subset
        logits = self.model.forward_cached(inputs, self.cache, slot_tensor)  # [b, n, vocab]
        return logits[torch.arange(inputs.shape[0], device=logits.device), last.to(logits.device)], None

    def _catch_up(self, slots: Sequence[int], gamma: int) -> None:
        """Rows lacking more than two tokens (after an n-gram streak or plain rounds) are fed their
        backlog row by row, so a long backlog never pads into another row's cache; what is left is
        at most one pad position per row, within the cache's slack. A lone row with a short backlog
        keeps it for the round's first forward: there is no other row to pad, and at batch 1 a draft
        forward costs about the same for 1 token as for 8, so this saves a forward per probe from fallback.
        With a window, a row whose round would pass the window's limit is re-windowed first."""
        for slot in slots:
            if (
                self.window is not None
                and len(self.history[slot]) - self._skipped[slot] + gamma + 1 > self.window.limit
            ):
                self._rewindow(slot, gamma)
            backlog = self.history[slot][self._fed(slot) : -2]
            if backlog and (len(slots) > 1 or len(backlog) > MERGED_BACKLOG):
                prefill_ragged(self.model, self.cache, torch.tensor([slot]), [backlog])

    def _rewindow(self, slot: int, gamma: int) -> None:
        """Rebuild a row's cache from the window's view of its history but the last two tokens (which the
        round's first forward feeds, as after any accepted round), with room for this round's drafts."""
        self._rebuild(slot, len(self.history[slot]) - 2, 2 + gamma + 1)

    def _rebuild(self, slot: int, upto: int, room_after: int) -> None:
        """Reset a row's cache to the window's view of history[:upto], leaving `room_after` positions free
        under the window's limit; where the window leaves too little room, its recent part shrinks to fit."""
        window = self.window
        assert window is not None  # a row is rebuilt only to fit its window
        room = window.limit - window.sink - room_after  # recent tokens that leave room_after free
        if room < 1:
            raise ValueError(
                f"a round of {room_after - 3} drafts does not fit the draft window (limit "
                f"{window.limit}, sink {window.sink})"
            )
        if room < window.recent:
            window = DraftWindow(window.sink, room, window.limit)
        kept, skipped = window.view(self.history[slot][:upto])
        slot_tensor = torch.tensor([slot])
        self.cache.reset(slot_tensor)
        prefill_ragged(self.model, self.cache, slot_tensor, [kept])
        self._skipped[slot] = skipped

    def score_backlog(
        self, slots: Sequence[int], counts: Sequence[int], params: Sequence[SamplingParams]
    ) -> list[list[float]]:
        """Per row, the warped draft probability of each of its last `counts[i]` committed tokens that the
        cache has not fed yet, oldest first (one forward per row; the tokens before them are fed first).
        The row then lacks only its last token, as after a round with a rejection."""
        out: list[list[float]] = []
        for slot, count, row_params in zip(slots, counts, params):
            history = self.history[slot]
            end = len(history) - 1  # history[start:end] predict history[start + 1:end + 1]
            count = min(count, end - self._fed(slot))
            if self.window is not None:
                count = min(count, self.window.limit - self.window.sink - 2)
            if count <= 0:
                out.append([])
                continue
            start = end - count
            slot_tensor = torch.tensor([slot])
            if self.window is not None and end - self._skipped[slot] > self.window.limit:
                self._rebuild(slot, start, count + 1)
            else:
                prefill_ragged(self.model, self.cache, slot_tensor, [history[self._fed(slot) : start]])
            inputs = torch.tensor([history[start:end]], dtype=torch.long, device=self.model.device)
            logits = self.model.forward_cached(inputs, self.cache, slot_tensor)[0]  # [count, vocab]
            probs = warp_rows(logits, [row_params] * count)  # [count, vocab]
            committed = torch.tensor(history[start + 1 : end + 1], device=probs.device)
            out.append(probs.gather(-1, committed.unsqueeze(-1)).squeeze(-1).float().cpu().tolist())
            self._drafted[slot] = []
        return out

    def commit(self, slots: Sequence[int], committed: Sequence[Sequence[int]]) -> None:
        """Keep cached drafts that were committed; drop the rest by lowering the cache length."""
        rolled, keep = [], []
        for slot, new in zip(slots, committed):
            base = len(self.history[slot])
            drafted = self._drafted.get(slot, [])
            if drafted:  # without drafts the cache holds history only (at most all of it): nothing to roll back
                # the cache holds history + drafts[:-1]; entries stay valid while drafts match what was kept, but
                # the last committed token is never counted as fed: the next round's first forward feeds it. (A row
                # that stopped early while the batch drew on holds filler past its drafts, which may equal it.)
                matched = 0
                while matched < min(len(drafted) - 1, len(new) - 1) and drafted[matched] == new[matched]:
                    matched += 1
                rolled.append(slot)
                keep.append(min(self._fed(slot), base + matched) - self._skipped[slot])
            self.history[slot].extend(new)
            self._drafted[slot] = []
        if rolled:
            self.cache.truncate(torch.tensor(rolled, dtype=torch.long), torch.tensor(keep, dtype=torch.long))
