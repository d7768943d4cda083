"""A draft language model as drafter: samples gamma tokens autoregressively from its own cache."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from specsample.config import SamplingParams
from specsample.drafters.base import Proposal
from specsample.models.base import CausalLM, ModelCache, pad_right, prefill_ragged
from specsample.sampling import sample, warp_rows

MERGED_BACKLOG = 8  # a lone row's backlog up to this long goes into its first draft forward (logits for each)


class ModelDrafter:
    """Drafts with a small causal LM sharing the target's vocabulary.

    Per slot it keeps the full token history and how much of it sits in its KV cache; each round
    first feeds what the cache lacks (the last committed token, and the last draft when every draft
    was accepted), then samples one token per step.
    """

    def __init__(self, model: CausalLM, folder: Path | None = None) -> None:
        self.model = model
        self.folder = folder  # where the draft was loaded from (peers like transformers can load it too)
        self.vocab_size = model.vocab_size
        self.cache: ModelCache | None = None
        self.history: dict[int, list[int]] = {}
        self._drafted: dict[int, list[int]] = {}  # last round's drafts per slot, to find what stays valid

    def allocate(self, num_slots: int, max_len: int) -> None:
        """(Re)allocate the draft cache; called by the engine that owns the slots."""
        self.cache = self.model.new_cache(num_slots, max_len)
        self.history.clear()
        self._drafted.clear()

    def add_rows(self, slots: Sequence[int], prompts: Sequence[Sequence[int]]) -> None:
        """Prefill each new row's prompt except its last token."""
        for slot, prompt in zip(slots, prompts):
            self.history[slot] = list(prompt)
            self._drafted[slot] = []
        slot_tensor = torch.tensor(list(slots), dtype=torch.long)
        self.cache.reset(slot_tensor)
        prefill_ragged(self.model, self.cache, slot_tensor, [list(p[:-1]) for p in prompts])

    def release_rows(self, slots: Sequence[int]) -> None:
        for slot in slots:
            self.history.pop(slot, None)
            self._drafted.pop(slot, None)
        self.cache.reset(torch.tensor(list(slots), dtype=torch.long))

    def propose(
        self,
        slots: Sequence[int],
        gamma: int,
        max_drafts: Sequence[int],
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator],
        stop_thresholds: Sequence[float] = (),
    ) -> Proposal:
        """Draw up to `max_drafts[i]` tokens per row; a row stops after its j-th token if it gave it less
        than `stop_thresholds[j - 1]` probability (at temperature 1): a stopping rule on past draws only."""
        batch = len(slots)
        slot_tensor = torch.tensor(list(slots), dtype=torch.long)
        self._catch_up(slots)
        pending = [self.history[s][int(self.cache.lengths[s]):] for s in slots]  # 1 or 2 tokens per row (a lone row: more)
        inputs, last = pad_right(pending, self.model.device)
        logits = self.model.forward_cached(inputs, self.cache, slot_tensor)  # [b, pending, vocab]
        self.cache.truncate(slot_tensor, self.cache.lengths[slot_tensor] - (inputs.shape[1] - 1 - last.cpu()))
        logits = logits[torch.arange(batch, device=logits.device), last]  # [b, vocab]
        limits = [min(gamma, m) for m in max_drafts]
        drafted = [0] * batch
        tokens, probs, confidence = [], [], []
        for step in range(gamma):
            active = [drafted[r] == step and step < limits[r] for r in range(batch)]
            if not any(active):
                break
            step_probs = warp_rows(logits, params)  # [b, vocab]
            token = sample(step_probs, generators, active)  # [b]; inactive rows draw nothing
            own = torch.softmax(logits.float(), dim=-1).gather(-1, token.unsqueeze(-1)).squeeze(-1)  # [b]
            tokens.append(token)
            probs.append(step_probs)
            confidence.append(own)
            for r in range(batch):
                if active[r]:
                    drafted[r] = step + 1
                    if step < len(stop_thresholds) and float(own[r]) < stop_thresholds[step]:
                        limits[r] = step + 1  # confidence gate: this token is kept, the round ends here
            if step + 1 < gamma and any(drafted[r] == step + 1 and step + 1 < limits[r] for r in range(batch)):
                logits = self.model.forward_cached(token.unsqueeze(1), self.cache, slot_tensor)[:, 0]
            else:
                break
        steps = len(tokens)
        draft_tokens = torch.zeros(batch, gamma, dtype=torch.long)
        draft_probs = torch.zeros(batch, gamma, self.vocab_size, dtype=probs[0].dtype if probs else torch.float32)
        draft_conf = torch.zeros(batch, gamma)
        if steps:
            draft_tokens[:, :steps] = torch.stack(tokens, dim=1).cpu()
            draft_probs[:, :steps] = torch.stack(probs, dim=1).cpu()
            draft_conf[:, :steps] = torch.stack(confidence, dim=1).cpu()
        for row, slot in enumerate(slots):
            self._drafted[slot] = draft_tokens[row, :steps].tolist()  # drawn; all but the last were fed
        return Proposal(tokens=draft_tokens, probs=draft_probs, num_drafted=torch.tensor(drafted, dtype=torch.long),
                        confidence=draft_conf)

    def _catch_up(self, slots: Sequence[int]) -> None:
        """Rows lacking more than two tokens (after an n-gram streak or plain rounds) are fed their
        backlog row by row, so a long backlog never pads into another row's cache; what is left is
        at most one pad position per row, within the cache's slack. A lone row with a short backlog
        keeps it for the round's first forward: there is no other row to pad, and at batch 1 a draft
        forward costs about the same for 1 token as for 8, so this saves a forward per probe from fallback."""
        for slot in slots:
            backlog = self.history[slot][int(self.cache.lengths[slot]):-2]
            if backlog and (len(slots) > 1 or len(backlog) > MERGED_BACKLOG):
                prefill_ragged(self.model, self.cache, torch.tensor([slot]), [backlog])

    def commit(self, slots: Sequence[int], committed: Sequence[Sequence[int]]) -> None:
        """Keep cached drafts that were committed; drop the rest by lowering the cache length."""
        keep = []
        for slot, new in zip(slots, committed):
            base = len(self.history[slot])
            drafted = self._drafted.get(slot, [])
            # the cache holds history + drafts[:-1]; entries stay valid while drafts match what was kept
            matched = 0
            while matched < min(len(drafted) - 1, len(new)) and drafted[matched] == new[matched]:
                matched += 1
            cached = int(self.cache.lengths[slot])
            keep.append(min(cached, base + matched))
            self.history[slot].extend(new)
            self._drafted[slot] = []
        self.cache.truncate(torch.tensor(list(slots), dtype=torch.long), torch.tensor(keep, dtype=torch.long))

