"""Medusa drafts: K heads (`models/medusa_head.py`) on the target's last hidden state propose a round in one pass.

The target hands over its final hidden state of every position it commits (`add_features`); a row keeps the one of
its last committed token but the pending one: the state the target predicted the pending token from. Head k reads
it and guesses the token k + 1 places past the pending token, so one forward of the heads drafts the whole round:
no drafting steps, no cache of the heads' own. A row's state is that vector (one per slot), kept across `park_rows`
for a request that shares the prefix it was computed from.

A round proposes either a chain, head k's draw at depth k + 1 (each head's warped distribution reported as the
draft's: the heads never read the drafts, and a draft's q may ignore the drafts before it), or Medusa's candidate
tree: per row the nodes of highest cumulative probability, a node at depth d being one of head d - 1's top `branch`
tokens and its score the product of the heads' probabilities along its path. Tree nodes are chosen, not drawn: each
is deterministic given the past (its q one-hot), so the verifier tests it with the target's probability alone, which
keeps the output exact at any temperature; reporting the heads' probabilities as their q would not (the broken twin
in tests/test_exactness.py).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from specsample.config import TreeShape
from specsample.drafters.base import Abilities, DraftRequest, Proposal, common_prefix, draw_chain
from specsample.models.llama import LlamaModel
from specsample.models.medusa_head import MedusaHeads, is_medusa_folder, load_medusa

__all__ = ["MedusaDrafter", "is_medusa_folder", "load_medusa_drafter", "medusa_tree"]


@dataclass
class _Row:
    history: list[int]  # committed tokens
    known: int = -1  # the position whose target state the row's slot holds (-1: none)

    @property
    def ready(self) -> bool:
        """Whether the slot holds the state of the position before the pending token."""
        return self.known >= 0 and self.known == len(self.history) - 2


TREE_NODES, TREE_BRANCH = 16, 4  # the candidate tree Medusa heads draft by preference (`--tree auto`)


class MedusaDrafter:
    """Drafts with Medusa heads on the target's final hidden states (a chain, or Medusa's candidate tree)."""

    # reads the target's final hidden states and parks finished rows; scores no backlogs (the heads keep no states of
    # past positions to score from)
    abilities = Abilities(keeps_prefixes=True, copies_prefixes=True, reads_features=True)

    def __init__(self, heads: MedusaHeads, target: LlamaModel, folder: Path | None = None) -> None:
        heads.config.check_target(target.config.hidden_size, target.vocab_size)
        self.heads = heads.to(device=target.device, dtype=target.dtype).eval()
        self.target = target
        self.folder = folder
        self.vocab_size = target.vocab_size
        # [K'] the target's id of each draft id (None: the whole vocabulary in order)
        self.output_subset = None if heads.whole_vocabulary else self.heads.token_map
        self._subset_ids = None if self.output_subset is None else self.output_subset.tolist()  # read per tree node
        target.set_feature_layers(None)  # the final normed hidden states
        self.heads.fuse()
        if target.device.type == "cpu":
            self.heads.pack_for_cpu()
        # the tree rounds draft by preference: 16 nodes, the heads' top 4 a node, as deep as the heads reach
        self.tree = TreeShape(TREE_NODES, TREE_BRANCH, min(heads.config.num_heads, TREE_NODES))
        self.states = torch.zeros(0, heads.config.hidden_size)  # [slots, H] each row's target state (`allocate`)
        self.rows: dict[int, _Row] = {}
        self._parked: dict[int, _Row] = {}

    @property
    def num_heads(self) -> int:
        return self.heads.config.num_heads

    # ----- rows -----------------------------------------------------------------------------

    def allocate(self, num_slots: int, max_len: int) -> None:
        # the target returns the states its last allocated feature draft reads (drafts may take turns on one target)
        self.target.set_feature_layers(None)
        self.states = torch.zeros(
            num_slots, self.heads.config.hidden_size, dtype=self.heads.dtype, device=self.target.device
        )
        self.rows.clear()
        self._parked.clear()

    def add_rows(self, slots: Sequence[int], prompts: Sequence[Sequence[int]]) -> None:
        """Start rows; a slot kept by `park_rows` keeps its state where the prompt shares the tokens it was computed
        from (the features of the prompt's rest, if any, replace it)."""
        for slot, prompt in zip(slots, prompts):
            parked = self._parked.pop(slot, None)
            known = -1
            if parked is not None and parked.known >= 0 and common_prefix(parked.history, prompt) > parked.known:
                known = parked.known
            self.rows[slot] = _Row(list(prompt), known)

    def add_features(self, slots: Sequence[int], features: Sequence[Tensor]) -> None:
        """Per row, the target's final hidden states `[n, H]` of its next `n` committed positions: the last one is
        the row's state (the position before the pending token)."""
        for slot, feature in zip(slots, features):
            if len(feature):
                row = self.rows[slot]
                self.states[slot] = feature[-1].to(self.states.dtype)
                row.known = len(row.history) - 2

    def park_rows(self, slots: Sequence[int]) -> None:
        """Keep the rows' states for a request sharing their prefix (`add_rows`)."""
        for slot in slots:
            self._parked[slot] = self.rows.pop(slot)

    def copy_prefix(self, source: int, slot: int, tokens: Sequence[int]) -> int:
        """The heads keep no state of a prefix to copy: a row's one state is the target's state of the position before
        its pending token, so the target copies all of `tokens` but the last and prefills on from there (at least that
        position), handing the state over (`add_features`)."""
        self.release_rows([slot])
        return max(len(tokens) - 1, 0)

    def release_rows(self, slots: Sequence[int]) -> None:
        for slot in slots:
            self.rows.pop(slot, None)
            self._parked.pop(slot, None)

    def commit(self, slots: Sequence[int], committed: Sequence[Sequence[int]]) -> None:
        for slot, new in zip(slots, committed):
            self.rows[slot].history.extend(new)

    # ----- drafting -------------------------------------------------------------------------

    def head_logits(self, slots: Sequence[int]) -> Tensor:
        """Each head's logits over the draft vocabulary `[b, K, K']` from the rows' states: one pass of the heads."""
        states = self.states[torch.tensor(list(slots), dtype=torch.long, device=self.states.device)]
        return self.heads.logits(self.heads(states))

    @torch.inference_mode()
    def propose(self, request: DraftRequest) -> Proposal:
        """A chain per row, head k's draw at depth k + 1 (through the shared draw loop `draw_chain`: the confidence
        gate, the extension up to K drafts, the processors), or with `request.tree` Medusa's candidate tree (`_tree`).
        A row without its state (a one-token prompt before its first round) drafts nothing."""
        ready = [self.rows[s].ready for s in request.slots]
        logits = self.head_logits(request.slots)  # [b, K, K']
        if request.tree is not None:
            return self._tree(logits, ready, request.drafts, request.reach, request.tree, request)
        step = [0]

        def advance(token: Tensor) -> Tensor:
            step[0] += 1  # the heads never read the drafts: the next draw is the next head's
            return logits[:, step[0]]

        reach = [min(m, self.num_heads) if r else 0 for m, r in zip(request.reach, ready)]
        return draw_chain(request, logits[:, 0], advance, self.vocab_size, self.output_subset, reach)

    def _tree(
        self,
        logits: Tensor,
        ready: list[bool],
        depths: Sequence[int],
        reach: Sequence[int],
        shape: TreeShape,
        request: DraftRequest,
    ) -> Proposal:
        """Medusa's candidate tree per row (`medusa_tree`): at most `reach[i]` nodes, `depths[i]` and K deep, each
        node one of its head's top `shape.branch` tokens. The first level's candidates are chosen among what the
        rows' processors leave (their state after the committed tokens); deeper levels from the heads' own
        distributions (a node's processing would depend on its path, which the heads never read). Every node is
        deterministic given the past, so the proposal reports no distribution."""
        if request.shaper is not None:
            first = request.shaper.next_logits(
                logits[:, 0], request.slots, [[] for _ in request.slots], self.output_subset
            )
            logits = torch.cat([first.to(logits.dtype).unsqueeze(1), logits[:, 1:]], dim=1)
        batch, heads, width = logits.shape
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        top = log_probs.topk(min(shape.branch, width), dim=-1)  # [b, K, branch]
        values, indices = top.values.cpu().tolist(), top.indices.cpu().tolist()
        ids = self._subset_ids
        trees = []
        for r in range(batch):
            depth = min(shape.depth, depths[r], heads) if ready[r] else 0
            trees.append(medusa_tree(values[r][:depth], min(shape.nodes, reach[r]) if depth else 0))
        # best first: every node comes after its parent, as a proposal's parents must
        width = max(1, max(len(t) for t in trees))
        tokens = torch.zeros(batch, width, dtype=torch.long)
        parents = torch.full((batch, width), -1, dtype=torch.long)
        confidence = torch.zeros(batch, width)
        for r, tree in enumerate(trees):
            if not tree:
                continue
            index = [indices[r][len(path) - 1][path[-1]] for path, _, _ in tree]
            tokens[r, : len(tree)] = torch.tensor([ids[i] for i in index] if ids is not None else index)
            parents[r, : len(tree)] = torch.tensor([parent for _, parent, _ in tree])
            confidence[r, : len(tree)] = torch.tensor([math.exp(score) for _, _, score in tree])
        return Proposal(
            tokens=tokens,
            probs=None,
            num_drafted=torch.tensor([len(t) for t in trees], dtype=torch.long),
            confidence=confidence,
            parents=parents,
        )


def medusa_tree(log_probs: Sequence[Sequence[float]], budget: int) -> list[tuple[tuple[int, ...], int, float]]:
    """Medusa's candidate tree: the `budget` paths of highest cumulative log probability, a path (r1, .., rd) taking
    head j's rj-th most likely token at depth j (`log_probs[j]`, each sorted, most likely first). Best first: a
    path's children and its next sibling score at most what it does, so each is considered once it is taken. Per
    node, in the order taken (parents first): its path, its parent's index among them (-1: the pending token) and
    its score."""
    if budget <= 0 or not log_probs or not log_probs[0]:
        return []
    taken: list[tuple[tuple[int, ...], int, float]] = []
    index: dict[tuple[int, ...], int] = {}
    frontier: list[tuple[float, tuple[int, ...]]] = [(-log_probs[0][0], (0,))]
    while frontier and len(taken) < budget:
        negative, path = heapq.heappop(frontier)
        score = -negative
        if score == float("-inf"):  # what is left the heads (or the processors) rule out
            break
        index[path] = len(taken)
        taken.append((path, index.get(path[:-1], -1), score))
        depth, rank = len(path) - 1, path[-1]
        if rank + 1 < len(log_probs[depth]):  # the next sibling
            sibling = score - log_probs[depth][rank] + log_probs[depth][rank + 1]
            heapq.heappush(frontier, (-sibling, path[:-1] + (rank + 1,)))
        if depth + 1 < len(log_probs):  # the first child
            heapq.heappush(frontier, (-(score + log_probs[depth + 1][0]), path + (0,)))
    return taken


def load_medusa_drafter(folder: str | Path, target: LlamaModel) -> MedusaDrafter:
    """The Medusa heads in `folder` (either published layout) as a drafter for `target` (our Llama-family runtime)."""
    if not isinstance(target, LlamaModel):
        raise ValueError("Medusa heads need the target on our Llama-family runtime (it must return its hidden states)")
    heads = load_medusa(folder, target.config.hidden_size, target.vocab_size)
    return MedusaDrafter(heads, target, Path(folder))
