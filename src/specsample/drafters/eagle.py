"""Feature drafts: an EAGLE-3 head (`models/eagle_head.py`) drafting from the target's own hidden states.

Entry t of the head reads token t + 1's embedding and, for a position the target scored, its fused features (the
target hands over its features of every position it commits: `add_features`); the head's output there predicts
token t + 2. Drafting on, an entry reads the head's own output at the entry before. The head's cache holds entries
with the target's features up to the last committed token but one, and a round's drafts are rolled back by lowering
its length. A finished row can be kept (`park_rows`) for a request that shares its prefix: its entries and the
features it knows of the shared tokens stay, and the engine hands over the features of the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from specsample.config import SamplingParams, TreeShape
from specsample.drafters.base import Abilities, DraftRequest, Proposal, best_tree, common_prefix, draw_chain
from specsample.kv_cache import KVCache
from specsample.models.eagle_head import EagleHead, is_head_folder, load_head
from specsample.models.llama import LlamaModel
from specsample.processors import Shaper
from specsample.sampling import warp_rows

__all__ = ["EagleDrafter", "is_head_folder", "load_head_drafter"]

MERGED_BACKLOG = 8  # a row's unfed entries up to this many go into the batch's first forward; more are fed alone


@dataclass
class _Row:
    history: list[int]  # committed tokens
    pending: list[Tensor]  # target features not yet fed to the head, in order ([n, F] each)
    fed: int = 0  # entries the head's cache holds with the target's features (entry t: feature t, token t + 1)
    drafted: int = 0  # speculative entries the last proposal fed past them
    reused: bool = False  # taken over from a parked row: the next features say how much of it the target kept

    @property
    def known(self) -> int:
        """Features known: one per committed token but the last."""
        return self.fed + sum(len(p) for p in self.pending)


class EagleDrafter:
    """Drafts with an EAGLE-3 head on the target's fused features; the head's own output layer covers its draft
    vocabulary (`d2t`), the target's embedding is shared unless the head has its own."""

    abilities = Abilities(scores_backlog=True, keeps_prefixes=True, copies_prefixes=True, reads_features=True)

    def __init__(self, head: EagleHead, target: LlamaModel, folder: Path | None = None, compile: bool = False) -> None:
        """`compile`: run drafting steps through a compiled graph (as `--compile` runs the target's), compiled now."""
        head.config.check_target(target.config, head.embed is not None)
        self.head = head.to(device=target.device, dtype=target.dtype).eval()
        self.target = target
        self.folder = folder
        self.vocab_size = target.vocab_size
        self.output_subset = self.head.draft_ids  # [K] the target's id of each draft id
        self.feature_layers = head.config.feature_layers
        target.set_feature_layers(self.feature_layers)
        if target.device.type == "cpu" and not compile:
            self.head.pack_for_cpu()
        self.compiled = None
        if compile:
            from specsample.models.compiled import CompiledHeadStep

            self.compiled = CompiledHeadStep(self.head)
            self.compiled.warm_up(self.embed)
        self._cache: KVCache | None = None
        self.rows: dict[int, _Row] = {}
        self._parked: dict[int, _Row] = {}

    @property
    def cache(self) -> KVCache:
        """The head's cache, once `allocate` made it."""
        if self._cache is None:
            raise RuntimeError("the drafter has no cache yet: the engine allocates it")
        return self._cache

    def embed(self, tokens: Tensor) -> Tensor:
        """Token embeddings `[.., H]` (the head's own where it has them, else the target's)."""
        table = self.head.embed if self.head.embed is not None else self.target.embed
        return table(tokens.to(self.target.device)).to(self.head.dtype)

    # ----- rows -----------------------------------------------------------------------------

    def allocate(self, num_slots: int, max_len: int) -> None:
        # the target returns the states its last allocated feature draft reads (drafts may take turns on one target)
        self.target.set_feature_layers(self.feature_layers)
        self._cache = self.head.new_cache(num_slots, max_len)
        self.rows.clear()
        self._parked.clear()

    def add_rows(self, slots: Sequence[int], prompts: Sequence[Sequence[int]]) -> None:
        """Start rows; a slot kept by `park_rows` keeps the entries and features of what its tokens share with the
        prompt (trimmed further at `add_features` to what the target kept)."""
        fresh = []
        for slot, prompt in zip(slots, prompts):
            parked = self._parked.pop(slot, None)
            shared = 0 if parked is None else common_prefix(parked.history[: parked.known], prompt[:-1])
            if parked is not None and shared:
                self.rows[slot] = _trimmed(parked, shared, list(prompt), self.cache, slot)
            else:
                self.rows[slot] = _Row(history=list(prompt), pending=[])
                fresh.append(slot)
        if fresh:
            self.cache.reset(torch.tensor(fresh, dtype=torch.long))

    def add_features(self, slots: Sequence[int], features: Sequence[Tensor]) -> None:
        for slot, feature in zip(slots, features):
            row = self.rows[slot]
            if row.reused:  # the target prefilled from where its own cache stopped: keep what precedes it
                row.reused = False
                keep = len(row.history) - 1 - len(feature)
                if keep < row.known:
                    self.rows[slot] = row = _trimmed(row, keep, row.history, self.cache, slot)
            if len(feature):
                row.pending.append(feature.detach())
            if row.known != len(row.history) - 1:
                raise ValueError(
                    f"row {slot}: features of {row.known} positions for {len(row.history)} committed "
                    "tokens (one per committed token but the last)"
                )

    def park_rows(self, slots: Sequence[int]) -> None:
        """Keep the rows' entries and features for a request sharing their prefix (`add_rows`)."""
        for slot in slots:
            row = self.rows.pop(slot)
            if row.drafted:
                self.cache.truncate(torch.tensor([slot]), torch.tensor([row.fed]))
                row.drafted = 0
            self._parked[slot] = row

    def copy_prefix(self, source: int, slot: int, tokens: Sequence[int]) -> int:
        """Start `slot` as a kept row with row `source`'s entries and features of its first `len(tokens)` positions;
        return how many positions that is. Entry t reads token t + 1, so the entries of a prefix of n tokens are its
        first n - 1; where the source has fed entries past them, their features are gone and the row starts one
        position short (the target then prefills that position too, handing over its features)."""
        self.release_rows([slot])
        donor = self.rows.get(source, self._parked.get(source))
        if donor is None:
            return 0
        known = min(len(tokens), donor.known)
        fed = min(donor.fed, max(known - 1, 0))
        pending = torch.cat(donor.pending, dim=0)[: known - fed] if fed == donor.fed and donor.pending else None
        known = fed + (0 if pending is None else len(pending))
        self.cache.copy_prefix(source, slot, fed)
        self._parked[slot] = _Row(
            history=list(tokens[:known]), pending=[] if pending is None or not len(pending) else [pending], fed=fed
        )
        return known

    def release_rows(self, slots: Sequence[int]) -> None:
        for slot in slots:
            self.rows.pop(slot, None)
            self._parked.pop(slot, None)
        self.cache.reset(torch.tensor(list(slots), dtype=torch.long))

    def commit(self, slots: Sequence[int], committed: Sequence[Sequence[int]]) -> None:
        """Drop the last proposal's speculative entries (the target's features of what was kept follow)."""
        rolled = [slot for slot in slots if self.rows[slot].drafted]
        if rolled:
            self.cache.truncate(
                torch.tensor(rolled, dtype=torch.long),
                torch.tensor([self.rows[s].fed for s in rolled], dtype=torch.long),
            )
        for slot, new in zip(slots, committed):
            row = self.rows[slot]
            row.history.extend(new)
            row.drafted = 0

    # ----- drafting -------------------------------------------------------------------------

    def step(self, tokens: Tensor, hidden: Tensor, cache: KVCache, slots: Tensor) -> tuple[Tensor, Tensor]:
        """One drafting step: an entry per row for `tokens [b, 1]` read with the head's outputs `hidden [b, 1, H]` of
        the entry before; their outputs `[b, 1, H]` and logits over the draft vocabulary `[b, K]` (one compiled graph
        where the drafter compiles)."""
        if self.compiled is not None:
            return self.compiled(self.embed(tokens), hidden, cache, slots)
        outputs = self.head.forward_cached(self.embed(tokens), hidden, cache, slots)
        return outputs, self.head.logits(outputs[:, 0])

    def _entries(self, row: _Row, count: int) -> tuple[Tensor, list[int]]:
        """The first `count` unfed entries of a row: their features `[count, F]` and tokens."""
        features = torch.cat(row.pending, dim=0)[:count]
        return features, row.history[row.fed + 1 : row.fed + 1 + count]

    def _consume(self, row: _Row, count: int) -> None:
        rest = torch.cat(row.pending, dim=0)[count:]
        row.pending = [rest] if len(rest) else []
        row.fed += count

    def _feed(self, slots: Sequence[int], features: list[Tensor], tokens: list[list[int]]) -> Tensor:
        """Feed each row its entries (right-padded, the padding rolled back); the head's output at each row's last
        entry `[b, H]`."""
        width = max(len(t) for t in tokens)
        feats = torch.zeros(
            len(slots), width, self.head.config.feature_size, dtype=self.head.dtype, device=self.target.device
        )
        ids = torch.zeros(len(slots), width, dtype=torch.long)
        for i, (f, t) in enumerate(zip(features, tokens)):
            feats[i, : len(t)] = f.to(feats.dtype)
            ids[i, : len(t)] = torch.tensor(t, dtype=torch.long)
        slot_tensor = torch.tensor(list(slots), dtype=torch.long)
        out = self.head.forward_cached(self.embed(ids), self.head.fuse(feats), self.cache, slot_tensor)
        last = torch.tensor([len(t) - 1 for t in tokens], dtype=torch.long)
        self.cache.truncate(slot_tensor, self.cache.lengths[slot_tensor] - (width - 1 - last))
        return out[torch.arange(len(slots)), last.to(out.device)]

    def _catch_up(self, slots: Sequence[int]) -> tuple[Tensor, list[bool]]:
        """Feed every row its unfed entries; the head's output predicting its next token `[b, H]`, and per row
        whether it has one (a row whose prompt was one token has no target feature before its first round). A row
        with a long backlog (after plain or lookup rounds) is fed all but its last entry alone, so it never pads
        the others' caches by more than a round's width."""
        ready = [self.rows[s].known > self.rows[s].fed for s in slots]
        fed = [s for s, r in zip(slots, ready) if r]
        predicted = torch.zeros(
            len(slots), self.head.config.hidden_size, dtype=self.head.dtype, device=self.target.device
        )
        if not fed:
            return predicted, ready
        for slot in fed:
            row = self.rows[slot]
            backlog = row.known - row.fed
            if backlog > MERGED_BACKLOG and len(fed) > 1:
                features, tokens = self._entries(row, backlog - 1)
                self._feed([slot], [features], [tokens])
                self._consume(row, backlog - 1)
        entries = [self._entries(self.rows[s], self.rows[s].known - self.rows[s].fed) for s in fed]
        predicted[torch.tensor(ready)] = self._feed(fed, [f for f, _ in entries], [t for _, t in entries])
        for slot, (_, tokens) in zip(fed, entries):
            self._consume(self.rows[slot], len(tokens))
        return predicted, ready

    @torch.inference_mode()
    def propose(self, request: DraftRequest) -> Proposal:
        """Draw up to `request.reach[i]` tokens per row from the head's logits through the shared draw loop
        (`draw_chain`: the confidence gate and the extension). With `request.tree`, grow a token tree per row instead
        (`_grow`)."""
        slots = request.slots
        predicted, ready = self._catch_up(slots)  # [b, H]
        if request.tree is not None:
            return self._grow(slots, predicted, ready, request.drafts, request.reach, request.tree, request.shaper)
        slot_tensor = torch.tensor(list(slots), dtype=torch.long)
        outputs = [predicted]

        def advance(token: Tensor) -> Tensor:
            # the next entry: the token just drawn, read with the head's output that drew it
            out, logits = self.step(token.unsqueeze(1), outputs[0].unsqueeze(1), self.cache, slot_tensor)
            outputs[0] = out[:, 0]
            for slot in slots:
                self.rows[slot].drafted += 1
            return logits

        reach = [m if r else 0 for m, r in zip(request.reach, ready)]
        return draw_chain(request, self.head.logits(predicted), advance, self.vocab_size, self.output_subset, reach)

    def _grow(
        self,
        slots: Sequence[int],
        predicted: Tensor,
        ready: list[bool],
        depths: Sequence[int],
        reach: Sequence[int],
        shape: TreeShape,
        shaper: Shaper | None = None,
    ) -> Proposal:
        """EAGLE-2's dynamic tree per row (see `TreeShape`): children by the head's top `branch` tokens, expansion by
        cumulative (temperature 1) draft probability; every child is deterministic given the past (its q one-hot),
        so the verifier tests it with the target's probability alone. A row's tree holds at most `reach[i]` nodes
        (0 where it cannot draft), `depths[i]` deep. The expanded nodes' entries sit in the head's cache after the
        true ones, each seeing the true entries and its ancestors; the commit rolls them back. With `shaper`, each
        frontier node's children are chosen among what the processors leave after the drafts down to it."""
        batch, device = len(slots), self.target.device
        budget = [min(shape.nodes, r) if ok else 0 for r, ok in zip(reach, ready)]
        limit = [min(shape.depth, d) if b else 0 for d, b in zip(depths, budget)]
        tokens: list[list[int]] = [[] for _ in range(batch)]  # per row, every node generated
        parents: list[list[int]] = [[] for _ in range(batch)]
        scores: list[list[float]] = [[] for _ in range(batch)]  # cumulative log probability
        entry: list[dict[int, int]] = [{} for _ in range(batch)]  # node -> its cache index (expanded nodes)
        frontier = [[-1] for _ in range(batch)]  # nodes expanded last (-1: the pending token)
        outputs = predicted.unsqueeze(1)  # [b, 1, H]: the head's output after each frontier node
        starts = self.cache.lengths[torch.tensor(list(slots))].clone()  # the true entries per row
        subset = self.output_subset.tolist()
        for depth in range(max(limit, default=0)):
            logits = self.head.logits(outputs.flatten(0, 1))  # [b * frontier, K]
            if shaper is not None:
                width = outputs.shape[1]
                logits = shaper.next_logits(
                    logits,
                    [slots[r] for r in range(batch) for _ in range(width)],
                    [_drafts_to(tokens[r], parents[r], node) for r in range(batch) for node in frontier[r]],
                    self.output_subset,
                )
            log_probs = torch.log_softmax(logits.float(), dim=-1)
            log_probs = log_probs.view(batch, outputs.shape[1], -1).cpu()  # [b, frontier, K]
            top = log_probs.topk(min(shape.branch, log_probs.shape[-1]), dim=-1)
            new: list[list[int]] = []
            for r in range(batch):
                born = []
                for f, parent in enumerate(frontier[r] if depth < limit[r] else ()):
                    if parent == -2:  # padding of a row with fewer nodes to expand
                        continue
                    base = 0.0 if parent < 0 else scores[r][parent]
                    for value, index in zip(top.values[r, f].tolist(), top.indices[r, f].tolist()):
                        tokens[r].append(subset[index])
                        parents[r].append(parent)
                        scores[r].append(base + value)
                        born.append(len(tokens[r]) - 1)
                new.append(sorted(born, key=lambda n: -scores[r][n])[: shape.branch] if depth + 1 < limit[r] else [])
            if not any(new):
                break
            # expand: feed each row's chosen new nodes (entry: the node's token, read with its parent's output)
            width = max(len(chosen) for chosen in new)
            ids = torch.zeros(batch, width, dtype=torch.long)
            inputs = torch.zeros(batch, width, outputs.shape[-1], dtype=outputs.dtype, device=device)
            for r, chosen in enumerate(new):
                for j, node in enumerate(chosen):
                    ids[r, j] = tokens[r][node]
                    inputs[r, j] = outputs[r, frontier[r].index(parents[r][node])]
            lengths = self.cache.lengths[torch.tensor(list(slots))]
            kv_len = int(lengths.max()) + width
            visible = torch.zeros(batch, width, kv_len, dtype=torch.bool)
            positions = torch.zeros(batch, width, dtype=torch.long)
            for r, chosen in enumerate(new):
                base, length = int(starts[r]), int(lengths[r])
                visible[r, :, :base] = True  # padding entries see the context too (never read)
                for j, node in enumerate(chosen):
                    ancestor = parents[r][node]
                    while ancestor >= 0:
                        visible[r, j, entry[r][ancestor]] = True
                        ancestor = parents[r][ancestor]
                    visible[r, j, length + j] = True
                    entry[r][node] = length + j
                    positions[r, j] = base + depth
            slot_tensor = torch.tensor(list(slots), dtype=torch.long)
            outputs = self.head.forward_tree(self.embed(ids), inputs, self.cache, slot_tensor, visible, positions)
            for slot in slots:
                self.rows[slot].drafted += width
            frontier = [chosen + [-2] * (width - len(chosen)) for chosen in new]  # padding never expands
        return best_tree(tokens, parents, scores, budget)

    @torch.inference_mode()
    def score_backlog(
        self, slots: Sequence[int], counts: Sequence[int], params: Sequence[SamplingParams]
    ) -> list[list[float]]:
        """Per row, the warped draft probability of each of its last `counts[i]` committed tokens that the head can
        predict from entries not yet fed (oldest first); the row's last entry stays unfed, for its next proposal."""
        out: list[list[float]] = []
        for slot, count, row_params in zip(slots, counts, params):
            row = self.rows[slot]
            usable = row.known - row.fed - 1  # entries whose prediction is a committed token
            count = min(count, usable)
            if count <= 0:
                out.append([])
                continue
            skip = usable - count
            if skip:
                features, tokens = self._entries(row, skip)
                self._feed([slot], [features], [tokens])
                self._consume(row, skip)
            features, tokens = self._entries(row, count)
            hidden = self.head.fuse(features.unsqueeze(0))
            outputs = self.head.forward_cached(
                self.embed(torch.tensor([tokens])), hidden, self.cache, torch.tensor([slot])
            )[0]  # [count, H]
            start = row.fed + 2  # entry t predicts token t + 2
            committed = torch.tensor(row.history[start : start + count], device=outputs.device)
            probs = warp_rows(self.head.logits(outputs), [row_params] * count)  # [count, K]
            index = self._draft_index(committed)
            chosen = probs.gather(-1, index.clamp(min=0).unsqueeze(-1)).squeeze(-1) * (index >= 0)
            out.append(chosen.float().cpu().tolist())
            self._consume(row, count)
        return out

    def _draft_index(self, tokens: Tensor) -> Tensor:
        """Each token's draft id (-1 outside the draft vocabulary)."""
        matches = self.output_subset.unsqueeze(0) == tokens.unsqueeze(1)  # [n, K]
        return torch.where(matches.any(-1), matches.float().argmax(-1), torch.full_like(tokens, -1))


def _trimmed(row: _Row, keep: int, history: list[int], cache: KVCache, slot: int) -> _Row:
    """`row` knowing the features of its first `keep` positions only, with `history` as its tokens: entries past
    them leave the head's cache, features past them are dropped."""
    fed = min(row.fed, keep)
    cache.truncate(torch.tensor([slot]), torch.tensor([fed]))
    pending = torch.cat(row.pending, dim=0)[: keep - fed] if row.pending and keep > fed else None
    return _Row(history=history, pending=[] if pending is None or not len(pending) else [pending], fed=fed, reused=True)


def _drafts_to(tokens: list[int], parents: list[int], node: int) -> list[int]:
    """The tokens from the pending token's child down to `node` (-1, the pending token, and -2, padding: [])."""
    drafts = []
    while node >= 0:
        drafts.append(tokens[node])
        node = parents[node]
    return drafts[::-1]


def load_head_drafter(folder: str | Path, target: LlamaModel, compile: bool = False) -> EagleDrafter:
    """The EAGLE-3 head in `folder` as a drafter for `target` (our Llama-family runtime); `compile`: its drafting
    steps through a compiled graph."""
    if not isinstance(target, LlamaModel):
        raise ValueError("a feature draft (EAGLE-3 head) needs the target on our Llama-family runtime")
    return EagleDrafter(load_head(Path(folder), target.config), target, Path(folder), compile=compile)
