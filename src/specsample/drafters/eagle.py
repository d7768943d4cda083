"""Feature drafts (EAGLE, arXiv:2401.15077): one decoder layer that drafts from the target's own hidden states.

Entry t of the head reads the target's final hidden state f_t (what the target's output layer reads to predict
token t + 1) and the embedding of token t + 1, and predicts f_{t+1}; the target's own output layer, frozen and
shared, turns that into the next token's distribution (over an output subset, FR-Spec). Drafting on, the head reads
its own predicted feature in place of the target's. The target hands over its features of every committed position
(`add_features`), so the head's cache holds entries with true features up to the last committed token but one, and
a round's drafts are rolled back by lowering its length.

A head lives in a folder: `eagle.json` (format, the target it was trained for, its shape), `model.safetensors` (the
fc and decoder layer, float32), `draft_vocab.json` (the output subset), and its model card.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from specsample.config import TreeShape
from specsample.coupling import draw_drafts
from specsample.drafters.base import DraftRequest, Proposal, best_tree
from specsample.processors import Shaper
from specsample.kv_cache import KVCache
from specsample.models.layers import Linear, linear, prepack
from specsample.models.llama import Attention, Block, LlamaConfig, LlamaModel
from specsample.models.rope import rope_inv_freq, rope_tables
from specsample.sampling import warp_rows

FORMAT = "specsample-eagle/1"
HEAD_FILE = "eagle.json"
VOCAB_FILE = "draft_vocab.json"
MERGED_BACKLOG = 8  # a row's unfed entries up to this many go into the batch's first forward; more are fed alone


def is_head_folder(path: str | Path) -> bool:
    """Whether `path` is a folder holding a feature-draft head."""
    return (Path(path) / HEAD_FILE).is_file()


@dataclass(frozen=True)
class HeadConfig:
    """The head's shape: one decoder layer at the target's width, heads and RoPE."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: tuple | None
    max_position_embeddings: int
    vocab_size: int

    @classmethod
    def of(cls, target: LlamaConfig) -> HeadConfig:
        return cls(target.hidden_size, target.intermediate_size, target.num_heads, target.num_kv_heads,
                   target.head_dim, target.rms_norm_eps, target.rope_theta, target.rope_scaling,
                   target.max_position_embeddings, target.vocab_size)

    def layer_config(self) -> LlamaConfig:
        return LlamaConfig(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_layers=1, num_heads=self.num_heads,
                           num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                           max_position_embeddings=self.max_position_embeddings, rms_norm_eps=self.rms_norm_eps,
                           rope_theta=self.rope_theta, rope_scaling=self.rope_scaling)

    def fits(self, target: LlamaConfig) -> bool:
        return HeadConfig.of(target) == self


class EagleHead(nn.Module):
    """fc([embedding of token t + 1 ; feature f_t]) -> one decoder layer -> predicted feature f_{t+1}."""

    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        self.config = config
        self.layer_config = config.layer_config()
        self.fc = Linear(2 * config.hidden_size, config.hidden_size, bias=True)
        self.layer = Block(self.layer_config)
        inv_freq, self.rope_scale = rope_inv_freq(self.layer_config)
        self._inv_freq = inv_freq.float()  # not a buffer: stays float32 when the weights go bf16

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        c = self.layer_config
        return KVCache(1, num_slots, max_len, c.num_kv_heads, c.head_dim, self.dtype, self.device)

    def forward(self, embeddings: Tensor, features: Tensor, attend: Attention) -> Tensor:
        """Predicted features `[b, n, hidden]` from token embeddings and features `[b, n, hidden]` each."""
        if self._inv_freq.device != attend.rope_positions.device:
            self._inv_freq = self._inv_freq.to(attend.rope_positions.device)
        x = self.fc(torch.cat([embeddings, features], dim=-1))
        rope = rope_tables(self._inv_freq, self.rope_scale, attend.rope_positions, x.dtype)
        return self.layer(x, rope, attend)

    def forward_cached(self, embeddings: Tensor, features: Tensor, cache: KVCache, slots: Tensor) -> Tensor:
        """Append `n` entries per row to rows `slots` of `cache`; their predicted features `[b, n, hidden]`."""
        n = embeddings.shape[1]
        starts = cache.reserve(slots, n)
        groups = self.layer_config.num_heads // self.layer_config.num_kv_heads
        attend = Attention(cache, slots, starts, n, self.layer_config, groups, self.device)
        out = self(embeddings, features, attend)
        cache.lengths[slots.cpu()] = starts + n
        return out

    def forward_tree(self, embeddings: Tensor, features: Tensor, cache: KVCache, slots: Tensor, visible: Tensor,
                     positions: Tensor) -> Tensor:
        """Append entries that see what `visible [b, n, kv_len]` says (a tree grown over several calls), at RoPE
        `positions [b, n]`; their predicted features `[b, n, hidden]`."""
        n = embeddings.shape[1]
        starts = cache.reserve(slots, n)
        groups = self.layer_config.num_heads // self.layer_config.num_kv_heads
        attend = Attention(cache, slots, starts, n, self.layer_config, groups, self.device, visible=visible,
                           rope_positions=starts.unsqueeze(1) * 0 + positions)
        out = self(embeddings, features, attend)
        cache.lengths[slots.cpu()] = starts + n
        return out

    def forward_uncached(self, embeddings: Tensor, features: Tensor) -> Tensor:
        """Causal forward over whole sequences (training)."""
        batch, n, _ = embeddings.shape
        groups = self.layer_config.num_heads // self.layer_config.num_kv_heads
        attend = Attention(None, None, torch.zeros(batch, dtype=torch.long), n, self.layer_config, groups,
                           self.device)
        return self(embeddings, features, attend)

    def pack_for_cpu(self) -> None:
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()

    def save(self, folder: Path, target: str, output_subset: Tensor | None, extra: dict | None = None) -> None:
        """Write the head's folder (weights float32)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().float().cpu().contiguous() for k, v in self.state_dict().items()},
                  str(folder / "model.safetensors"))
        config = asdict(self.config)
        config["rope_scaling"] = [list(item) for item in self.config.rope_scaling] if self.config.rope_scaling else None
        (folder / HEAD_FILE).write_text(json.dumps({"format": FORMAT, "target": target, "config": config,
                                                    **(extra or {})}, indent=2) + "\n")
        if output_subset is not None:
            (folder / VOCAB_FILE).write_text(json.dumps({"token_ids": output_subset.tolist()}))

    @classmethod
    def load(cls, folder: Path) -> tuple[EagleHead, Tensor | None, dict]:
        """The head in `folder`, its output subset (None: the whole vocabulary) and its description."""
        folder = Path(folder)
        try:
            about = json.loads((folder / HEAD_FILE).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{folder / HEAD_FILE} cannot be read: {exc}") from exc
        if about.get("format") != FORMAT:
            raise ValueError(f"{folder / HEAD_FILE} has format {about.get('format')!r}, expected {FORMAT!r}")
        fields = dict(about["config"])
        fields["rope_scaling"] = tuple(tuple(item) for item in fields["rope_scaling"]) if fields["rope_scaling"] else None
        head = cls(HeadConfig(**fields))
        head.load_state_dict(load_file(str(folder / "model.safetensors")))
        subset_path = folder / VOCAB_FILE
        subset = torch.tensor(json.loads(subset_path.read_text())["token_ids"]) if subset_path.exists() else None
        return head.eval(), subset, about


@dataclass
class _Row:
    history: list[int]  # committed tokens
    pending: list[Tensor]  # target features not yet fed to the head, in order ([n, hidden] each)
    fed: int = 0  # entries the head's cache holds with true features (entry t: feature t, token t + 1)
    drafted: int = 0  # speculative entries the last proposal fed past them

    @property
    def known(self) -> int:
        """Features known: one per committed token but the last."""
        return self.fed + sum(len(p) for p in self.pending)


class EagleDrafter:
    """Drafts with an `EagleHead` on the target's features, the target's embedding and output layer shared."""

    wants_features = True

    def __init__(self, head: EagleHead, target: LlamaModel, output_subset: Tensor | None = None,
                 folder: Path | None = None) -> None:
        if not head.config.fits(target.config):
            raise ValueError(f"the head was trained for another target shape ({head.config}); this target is "
                             f"{HeadConfig.of(target.config)}")
        self.head = head.to(device=target.device, dtype=target.dtype).eval()
        self.target = target
        self.folder = folder
        self.vocab_size = target.vocab_size
        self.output_subset = output_subset.to(target.device) if output_subset is not None else None
        weight = target.lm_head.weight.detach().to(target.dtype)  # a quantized output layer dequantizes to float32
        self._out_weight = (weight[self.output_subset] if self.output_subset is not None else weight).contiguous()
        self._out_packed = prepack(self._out_weight)
        if target.device.type == "cpu":
            self.head.pack_for_cpu()
        self.cache: KVCache | None = None
        self.rows: dict[int, _Row] = {}

    # ----- rows -----------------------------------------------------------------------------

    def allocate(self, num_slots: int, max_len: int) -> None:
        self.cache = self.head.new_cache(num_slots, max_len)
        self.rows.clear()

    def add_rows(self, slots: Sequence[int], prompts: Sequence[Sequence[int]]) -> None:
        for slot, prompt in zip(slots, prompts):
            self.rows[slot] = _Row(history=list(prompt), pending=[])
        self.cache.reset(torch.tensor(list(slots), dtype=torch.long))

    def add_features(self, slots: Sequence[int], features: Sequence[Tensor]) -> None:
        for slot, feature in zip(slots, features):
            row = self.rows[slot]
            if len(feature):
                row.pending.append(feature.detach())
            if row.known != len(row.history) - 1:
                raise ValueError(f"row {slot}: features of {row.known} positions for {len(row.history)} committed "
                                 "tokens (one per committed token but the last)")

    def release_rows(self, slots: Sequence[int]) -> None:
        for slot in slots:
            self.rows.pop(slot, None)
        self.cache.reset(torch.tensor(list(slots), dtype=torch.long))

    def commit(self, slots: Sequence[int], committed: Sequence[Sequence[int]]) -> None:
        """Drop the last proposal's speculative entries (the target's features of what was kept follow)."""
        rolled = [slot for slot in slots if self.rows[slot].drafted]
        if rolled:
            self.cache.truncate(torch.tensor(rolled, dtype=torch.long),
                                torch.tensor([self.rows[s].fed for s in rolled], dtype=torch.long))
        for slot, new in zip(slots, committed):
            row = self.rows[slot]
            row.history.extend(new)
            row.drafted = 0

    # ----- drafting -------------------------------------------------------------------------

    def _entries(self, row: _Row, count: int) -> tuple[Tensor, list[int]]:
        """The first `count` unfed entries of a row: their features `[count, hidden]` and tokens."""
        features = torch.cat(row.pending, dim=0)[:count]
        return features, row.history[row.fed + 1: row.fed + 1 + count]

    def _consume(self, row: _Row, count: int) -> None:
        rest = torch.cat(row.pending, dim=0)[count:]
        row.pending = [rest] if len(rest) else []
        row.fed += count

    def _feed(self, slots: Sequence[int], features: list[Tensor], tokens: list[list[int]]) -> Tensor:
        """Feed each row its entries (right-padded, the padding rolled back); the predicted feature at each row's
        last entry `[b, hidden]`."""
        width = max(len(t) for t in tokens)
        hidden = self.head.config.hidden_size
        feats = torch.zeros(len(slots), width, hidden, dtype=self.head.dtype, device=self.target.device)
        ids = torch.zeros(len(slots), width, dtype=torch.long)
        for i, (f, t) in enumerate(zip(features, tokens)):
            feats[i, : len(t)] = f.to(feats.dtype)
            ids[i, : len(t)] = torch.tensor(t, dtype=torch.long)
        slot_tensor = torch.tensor(list(slots), dtype=torch.long)
        out = self.head.forward_cached(self.target.embed(ids.to(self.target.device)), feats, self.cache, slot_tensor)
        last = torch.tensor([len(t) - 1 for t in tokens], dtype=torch.long)
        self.cache.truncate(slot_tensor, self.cache.lengths[slot_tensor] - (width - 1 - last))
        return out[torch.arange(len(slots)), last.to(out.device)]

    def _catch_up(self, slots: Sequence[int]) -> tuple[Tensor, list[bool]]:
        """Feed every row its unfed entries; the predicted feature of its next token `[b, hidden]`, and per row
        whether it has one (a row whose prompt was one token has no target feature before its first round). A row
        with a long backlog (after plain or lookup rounds) is fed all but its last entry alone, so it never pads
        the others' caches by more than a round's width."""
        ready = [self.rows[s].known > self.rows[s].fed for s in slots]
        fed = [s for s, r in zip(slots, ready) if r]
        predicted = torch.zeros(len(slots), self.head.config.hidden_size, dtype=self.head.dtype,
                                device=self.target.device)
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

    def _logits(self, features: Tensor) -> Tensor:
        """Logits `[b, K]` over the output subset (or the vocabulary) from predicted features `[b, hidden]`."""
        return linear(features, self._out_weight, None, self._out_packed)

    @torch.inference_mode()
    def propose(self, request: DraftRequest) -> Proposal:
        """Draw up to `request.reach[i]` tokens per row, each from the target's output layer on the head's predicted
        feature; the gate and the extension as for any confident draft (`ModelDrafter.propose`). With
        `request.tree`, grow a token tree per row instead (`_grow`)."""
        slots, gamma, params = request.slots, request.width, request.params
        batch = len(slots)
        predicted, ready = self._catch_up(slots)  # [b, hidden]
        if request.tree is not None:
            return self._grow(slots, predicted, ready, request.drafts, request.reach, request.tree, request.shaper)
        limits = [min(gamma, m) if r else 0 for m, r in zip(request.reach, ready)]
        planned = list(limits) if request.extension is None else [min(p, m) for p, m in zip(request.drafts, limits)]
        drafted = [0] * batch
        tokens, probs, confidence = [], [], []
        drawn: list[list[float]] = [[] for _ in range(batch)]
        paths: list[list[int]] = [[] for _ in range(batch)]  # per row, the tokens it drew this round
        slot_tensor = torch.tensor(list(slots), dtype=torch.long)
        for step in range(gamma):
            active = [drafted[r] == step and step < limits[r] for r in range(batch)]
            if not any(active):
                break
            logits = self._logits(predicted)  # [b, K]
            if request.shaper is not None:  # processed as the target's position will be: with the drafts before it
                logits = request.shaper.next_logits(logits, slots, paths, self.output_subset)
            step_probs = warp_rows(logits, params)
            index = draw_drafts(step_probs, request, step, active, self.output_subset)
            own = torch.softmax(logits.float(), dim=-1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
            token = index if self.output_subset is None else self.output_subset[index]
            tokens.append(token)
            probs.append(step_probs)
            confidence.append(own)
            own_list = own.tolist()
            token_list = token.tolist() if request.shaper is not None else None
            for r in range(batch):
                if active[r]:
                    if token_list is not None:
                        paths[r].append(token_list[r])
                    drafted[r] = step + 1
                    drawn[r].append(own_list[r])
                    if step + 1 < planned[r]:
                        if step < len(request.stop_thresholds) and own_list[r] < request.stop_thresholds[step]:
                            limits[r] = step + 1  # confidence gate: this token is kept, the round ends here
                    elif request.extension is None or not request.extension.draws_on(request.drafts[r], drawn[r]):
                        limits[r] = step + 1
            if not any(drafted[r] == step + 1 and step + 1 < limits[r] for r in range(batch)):
                break
            # the next entry: the feature just predicted and the token drawn from it
            predicted = self.head.forward_cached(self.target.embed(token.unsqueeze(1)), predicted.unsqueeze(1),
                                                 self.cache, slot_tensor)[:, 0]
            for slot in slots:
                self.rows[slot].drafted += 1
        steps = len(tokens)
        draft_tokens = torch.zeros(batch, gamma, dtype=torch.long)
        draft_probs = torch.zeros(batch, gamma, self.vocab_size, dtype=probs[0].dtype if probs else torch.float32)
        draft_conf = torch.zeros(batch, gamma)
        if steps:
            draft_tokens[:, :steps] = torch.stack(tokens, dim=1).cpu()
            stacked = torch.stack(probs, dim=1).cpu()  # [b, steps, K]
            if self.output_subset is None:
                draft_probs[:, :steps] = stacked
            else:  # back to vocabulary ids for the verifier
                draft_probs[:, :steps].index_copy_(-1, self.output_subset.cpu(), stacked)
            draft_conf[:, :steps] = torch.stack(confidence, dim=1).cpu()
        return Proposal(tokens=draft_tokens, probs=draft_probs, num_drafted=torch.tensor(drafted, dtype=torch.long),
                        confidence=draft_conf)

    def _grow(self, slots: Sequence[int], predicted: Tensor, ready: list[bool], depths: Sequence[int],
              reach: Sequence[int], shape: TreeShape, shaper: Shaper | None = None) -> Proposal:
        """EAGLE-2's dynamic tree per row (see `TreeShape`): children by the head's top `branch` tokens, expansion by
        cumulative (temperature 1) draft probability; every child is deterministic given the past (its q one-hot),
        so the verifier tests it with the target's probability alone. A row's tree holds at most `reach[i]` nodes
        (0 where it cannot draft), `depths[i]` deep. The expanded nodes' entries sit in the head's cache after the
        true ones, each seeing the true entries and its ancestors; the commit rolls them back. With `shaper`, each
        frontier node's children are chosen among what the processors leave after its path."""
        batch, device = len(slots), self.target.device
        budget = [min(shape.nodes, r) if ok else 0 for r, ok in zip(reach, ready)]
        limit = [min(shape.depth, d) if b else 0 for d, b in zip(depths, budget)]
        tokens: list[list[int]] = [[] for _ in range(batch)]  # per row, every node generated
        parents: list[list[int]] = [[] for _ in range(batch)]
        scores: list[list[float]] = [[] for _ in range(batch)]  # cumulative log probability
        entry: list[dict[int, int]] = [{} for _ in range(batch)]  # node -> its cache index (expanded nodes)
        frontier = [[-1] for _ in range(batch)]  # nodes expanded last (-1: the pending token)
        features = predicted.unsqueeze(1)  # [b, 1, hidden]: the predicted feature after each frontier node
        starts = self.cache.lengths[torch.tensor(list(slots))].clone()  # the true entries per row
        for depth in range(max(limit, default=0)):
            logits = self._logits(features.flatten(0, 1))  # [b * frontier, K]
            if shaper is not None:
                width = features.shape[1]
                logits = shaper.next_logits(logits, [slots[r] for r in range(batch) for _ in range(width)],
                                            [_path(tokens[r], parents[r], node) for r in range(batch)
                                             for node in frontier[r]], self.output_subset)
            log_probs = torch.log_softmax(logits.float(), dim=-1)
            log_probs = log_probs.view(batch, features.shape[1], -1).cpu()  # [b, frontier, K]
            top = log_probs.topk(min(shape.branch, log_probs.shape[-1]), dim=-1)
            new: list[list[int]] = []
            for r in range(batch):
                born = []
                for f, parent in enumerate(frontier[r] if depth < limit[r] else ()):
                    if parent == -2:  # padding of a row with fewer nodes to expand
                        continue
                    base = 0.0 if parent < 0 else scores[r][parent]
                    for value, index in zip(top.values[r, f].tolist(), top.indices[r, f].tolist()):
                        tokens[r].append(int(index) if self.output_subset is None
                                         else int(self.output_subset[index]))
                        parents[r].append(parent)
                        scores[r].append(base + value)
                        born.append(len(tokens[r]) - 1)
                new.append(sorted(born, key=lambda n: -scores[r][n])[: shape.branch] if depth + 1 < limit[r] else [])
            if not any(new):
                break
            # expand: feed each row's chosen new nodes (entry: the parent's predicted feature, the node's token)
            width = max(len(chosen) for chosen in new)
            ids = torch.zeros(batch, width, dtype=torch.long)
            inputs = torch.zeros(batch, width, features.shape[-1], dtype=features.dtype, device=device)
            for r, chosen in enumerate(new):
                for j, node in enumerate(chosen):
                    ids[r, j] = tokens[r][node]
                    parent = parents[r][node]
                    inputs[r, j] = features[r, frontier[r].index(parent)]
            lengths = self.cache.lengths[torch.tensor(list(slots))]
            kv_len = int(lengths.max()) + width
            visible = torch.zeros(batch, width, kv_len, dtype=torch.bool)
            positions = torch.zeros(batch, width, dtype=torch.long)
            for r, chosen in enumerate(new):
                base, length = int(starts[r]), int(lengths[r])
                visible[r, :, :base] = True  # padding entries see the context too (never read)
                for j, node in enumerate(chosen):
                    visible[r, j, :base] = True
                    ancestor = parents[r][node]
                    while ancestor >= 0:
                        visible[r, j, entry[r][ancestor]] = True
                        ancestor = parents[r][ancestor]
                    visible[r, j, length + j] = True
                    entry[r][node] = length + j
                    positions[r, j] = base + depth
            slot_tensor = torch.tensor(list(slots), dtype=torch.long)
            features = self.head.forward_tree(self.target.embed(ids.to(device)), inputs, self.cache, slot_tensor,
                                              visible, positions)
            for slot in slots:
                self.rows[slot].drafted += width
            frontier = [chosen + [-2] * (width - len(chosen)) for chosen in new]  # padding never expands
        return best_tree(tokens, parents, scores, budget)

    @torch.inference_mode()
    def score_backlog(self, slots: Sequence[int], counts: Sequence[int], params) -> list[list[float]]:
        """Per row, the warped draft probability of each of its last `counts[i]` committed tokens that the head can
        predict from entries not yet fed (oldest first); the row's last entry stays unfed, for its next proposal."""
        out = []
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
            embeddings = self.target.embed(torch.tensor([tokens], device=self.target.device))
            predicted = self.head.forward_cached(embeddings, features.unsqueeze(0).to(self.head.dtype), self.cache,
                                                 torch.tensor([slot]))[0]  # [count, hidden]
            start = row.fed + 2  # entry t predicts token t + 2
            committed = torch.tensor(row.history[start:start + count], device=predicted.device)
            probs = warp_rows(self._logits(predicted), [row_params] * count)  # [count, K]
            index = committed if self.output_subset is None else self._subset_index(committed)
            chosen = probs.gather(-1, index.clamp(min=0).unsqueeze(-1)).squeeze(-1) * (index >= 0)
            out.append(chosen.float().cpu().tolist())
            self._consume(row, count)
        return out

    def _subset_index(self, tokens: Tensor) -> Tensor:
        """Each token's column in the output subset (-1 outside it)."""
        matches = self.output_subset.unsqueeze(0) == tokens.unsqueeze(1)  # [n, K]
        return torch.where(matches.any(-1), matches.float().argmax(-1), torch.full_like(tokens, -1))


def _path(tokens: list[int], parents: list[int], node: int) -> list[int]:
    """The tokens from the pending token's first child down to `node` (-1, the pending token, and -2, padding: [])."""
    path = []
    while node >= 0:
        path.append(tokens[node])
        node = parents[node]
    return path[::-1]


def load_head_drafter(folder: str | Path, target: LlamaModel) -> EagleDrafter:
    """The feature draft in `folder` for `target` (our Llama-family runtime)."""
    if not isinstance(target, LlamaModel):
        raise ValueError("a feature draft (EAGLE head) needs the target on our Llama-family runtime")
    head, subset, _ = EagleHead.load(Path(folder))
    return EagleDrafter(head, target, subset, Path(folder))

