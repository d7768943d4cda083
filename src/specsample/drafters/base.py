"""The one small protocol every drafter implements; the verifier never sees which drafter ran."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
from torch import Tensor

from specsample.config import SamplingParams, TreeShape
from specsample.processors import Shaper

if TYPE_CHECKING:
    from specsample.coupling import DraftNoise


@dataclass(frozen=True)
class Proposal:
    """Draft tokens for a batch, and the distributions they were drawn from."""

    tokens: Tensor  # [batch, gamma] long; entries past num_drafted are padding
    probs: Tensor | None  # [batch, gamma, vocab] warped draft distributions; None = deterministic
    num_drafted: Tensor  # [batch] long, drafts actually proposed per row (0..gamma)
    confidence: Tensor | None = None  # [batch, gamma] drafter's temperature-1 probability of each token
    # [batch, gamma]: a token tree per row, each token's parent among them (-1: the pending token; parents come
    # first). None: a chain (each token follows the previous one)
    parents: Tensor | None = None


@dataclass(frozen=True)
class Extension:
    """Drafting past a row's plan on confident drafts (gamma auto): once a row has drawn its planned drafts, it
    draws one more after its j-th while its drafts so far were all accepted with probability at least
    `bars[j - 1]`, that probability read as the product of their confidence bins' past acceptance. The rule reads
    only the draft's own probabilities of tokens it already drew, so sampling stays exact."""

    bin_acceptance: tuple[float, ...]  # past acceptance of drafts per confidence bin, len(...) equal bins of [0, 1]
    bars: tuple[float, ...]  # per draft position j (index j - 1): the least chance all j were accepted to draw j + 1

    def __post_init__(self) -> None:
        if not self.bin_acceptance or any(not 0.0 <= a <= 1.0 for a in self.bin_acceptance):
            raise ValueError(f"bin_acceptance needs one probability per bin, got {self.bin_acceptance}")

    def draws_on(self, planned: int, confidences: Sequence[float]) -> bool:
        """Whether a row planned for `planned` drafts, having drawn tokens with these confidences (at least its
        plan), draws one more."""
        drawn = len(confidences)
        if drawn < max(planned, 1) or drawn > len(self.bars):
            return False
        bins = len(self.bin_acceptance)
        chance = 1.0
        for q in confidences:
            if not q == q:  # NaN: a draft without a confidence (deterministic) says nothing
                return False
            chance *= self.bin_acceptance[min(int(q * bins), bins - 1)]
        return chance >= self.bars[drawn - 1]


@dataclass(frozen=True)
class DraftRequest:
    """What a round asks of a drafter, per row of the batch (index i) and for the round."""

    slots: tuple[int, ...]  # the rows' slots in the drafter's state
    drafts: tuple[int, ...]  # drafts planned per row (the gate may stop a row sooner); with `tree`: its depth at most
    reach: tuple[int, ...]  # most drafts per row (> drafts only as `extension` allows); with `tree`: its nodes
    params: tuple[SamplingParams, ...]
    generators: tuple[torch.Generator, ...]
    source: tuple[bool | None, ...] = ()  # True: the row's prompt lookup; False: its model; None (or empty): the
    # drafter's own rule
    stop_thresholds: tuple[float, ...] = ()  # per draft position j (index j - 1): stop after a less confident draft
    extension: Extension | None = None
    width: int = -1  # the round's widest reach: proposals are this wide (-1: max(reach))
    tree: TreeShape | None = None  # grow a token tree per row where the drafter can (see `drafts`, `reach`), else a chain
    # the rows' processors (penalties, logit bias, grammar): a drafter that draws from a distribution processes its
    # logits at each step with the tokens it drew before it in the round (`Shaper.next_logits`); None: none
    shaper: Shaper | None = None
    # coupled sampling (specsample.coupling): per row the noise its draws use in place of its generator (None: a greedy
    # row); empty: draw from the generators
    noise: tuple[DraftNoise | None, ...] = ()
    # rows sent to their lookup (source True) may propose a token tree of up to `reach[i]` nodes where their
    # continuations branch (the target scores trees); False: chains, unless `tree`
    lookup_trees: bool = False

    def __post_init__(self) -> None:
        rows = len(self.slots)
        if any(len(part) != rows for part in (self.drafts, self.reach, self.params, self.generators)):
            raise ValueError("a draft request needs one plan, reach, params and generator per slot")
        if self.source and len(self.source) != rows:
            raise ValueError(f"a draft request of {rows} rows got {len(self.source)} sources")
        if self.noise and len(self.noise) != rows:
            raise ValueError(f"a draft request of {rows} rows got {len(self.noise)} noise streams")
        if any(r < d or d < 0 for d, r in zip(self.drafts, self.reach)):
            raise ValueError(f"need 0 <= drafts <= reach per row, got {self.drafts} and {self.reach}")
        if self.width < 0:
            object.__setattr__(self, "width", max(self.reach, default=0))

    def source_of(self, row: int) -> bool | None:
        return self.source[row] if self.source else None

    def select(self, rows: Sequence[int]) -> DraftRequest:
        """The same request for some of its rows (a drafter handing them to another), as wide as the round."""
        return DraftRequest(tuple(self.slots[i] for i in rows), tuple(self.drafts[i] for i in rows),
                            tuple(self.reach[i] for i in rows), tuple(self.params[i] for i in rows),
                            tuple(self.generators[i] for i in rows),
                            tuple(self.source[i] for i in rows) if self.source else (),
                            self.stop_thresholds, self.extension, self.width, self.tree, self.shaper,
                            tuple(self.noise[i] for i in rows) if self.noise else (), self.lookup_trees)

    def refuse_extension(self, rows: Sequence[int], why: str) -> None:
        """Raise where one of `rows` may draft past its plan, which the caller cannot honour (`why`); a tree's reach is
        its nodes, not an extension."""
        past = [i for i in rows if self.reach[i] > self.drafts[i]] if self.tree is None else []
        if past:
            raise ValueError(f"rows {past} may draft past their plan, but {why}")


@runtime_checkable
class Drafter(Protocol):
    """Proposes tokens for rows of a batch and follows what the verifier committed.

    Rows are identified by slot numbers the engine assigns; the drafter keeps its own state per slot.
    """

    vocab_size: int | None  # vocabulary the drafter's probabilities range over; None = any

    def allocate(self, num_slots: int, max_len: int) -> None:
        """Prepare state for `num_slots` rows of up to `max_len` tokens (called by the engine)."""
        ...

    def add_rows(self, slots: Sequence[int], prompts: Sequence[Sequence[int]]) -> None:
        """Start tracking new rows with their prompt token ids."""
        ...

    def release_rows(self, slots: Sequence[int]) -> None:
        """Forget rows that finished or were cancelled."""
        ...

    def propose(self, request: DraftRequest) -> Proposal:
        """Draft up to `request.reach[i]` tokens for row i, each drawn from its (warped) draft distribution, as a
        `[rows, request.width]` proposal.

        A drafter that reports confidence stops a row after its j-th token if its confidence is below
        `stop_thresholds[j - 1]` (the token itself is kept, so the rule depends on past draws only), and past its
        plan (`drafts[i]`) draws on only as `request.extension` allows. A drafter without confidences raises on a
        row whose reach passes its plan.
        """
        ...

    def commit(self, slots: Sequence[int], committed: Sequence[Sequence[int]]) -> None:
        """Append the tokens the engine committed this round to each row (accepted + next token)."""
        ...


@runtime_checkable
class BacklogScorer(Protocol):
    """A drafter that can score, teacher-forced, tokens the target committed without it (plain rounds): gamma auto
    learns a request's acceptance in fallback from them instead of drafting."""

    def score_backlog(self, slots: Sequence[int], counts: Sequence[int],
                      params: Sequence[SamplingParams]) -> list[list[float]]:
        """Per row, the warped draft probability of each of its last `counts[i]` committed tokens (fewer where the
        drafter already fed them), oldest first; afterwards the row lacks only its last token."""
        ...


@runtime_checkable
class PromptLookup(Protocol):
    """A drafter that proposes prompt-lookup continuations (an n-gram drafter, the hybrid): gamma auto sizes those
    rounds by the lookups' own acceptance and cost, apart from a draft model's, and runs them even where it keeps
    the model from drafting. A request's `source[i]` True sends row i to its lookup, False away from it."""

    def lookup_lengths(self, slots: Sequence[int], max_tokens: Sequence[int]) -> list[int]:
        """Per row, how many tokens (up to `max_tokens[i]`) a prompt lookup offers now; 0 where it offers none."""
        ...

    def drafts_otherwise(self, slots: Sequence[int]) -> list[bool]:
        """Per row, whether it can draft without its lookup (with a draft model) when it declines one."""
        ...


@runtime_checkable
class PrefixKeeper(Protocol):
    """A drafter that keeps a finished row's state when asked, so that the next `add_rows` of that slot reuses what
    the new prompt shares with the row's tokens (its cache of that prefix) instead of starting afresh."""

    def park_rows(self, slots: Sequence[int]) -> None:
        """The rows finished; keep their state until `add_rows` reuses the slot or `release_rows` drops it."""
        ...


@runtime_checkable
class FeatureDrafter(Protocol):
    """A drafter that drafts from the target's final hidden states (EAGLE): while `wants_features`, the engine hands
    it the target's feature of every position it commits. Per row, after each call the drafter knows the features of
    every committed token but the last (which the target scores next round)."""

    @property
    def wants_features(self) -> bool: ...

    def add_features(self, slots: Sequence[int], features: Sequence[Tensor]) -> None:
        """Per row, the target's final hidden states `[n, hidden]` of the next `n` committed positions (after
        `add_rows`: the prompt's tokens but the last; after `commit`: the pending token and the accepted drafts)."""
        ...


def merge_proposals(parts: Sequence[tuple[Sequence[int], Proposal]], batch: int, gamma: int) -> Proposal:
    """Combine proposals made for disjoint rows of one batch.

    When any part carries probabilities, deterministic rows become one-hot rows of the same width
    and dtype (never rounded); when none does, the merged proposal is deterministic too. A
    deterministic row has no confidence (NaN), so it never calibrates the confidence gate. When any
    part is a tree, every row is (a chain as the tree of one branch).
    """
    from specsample.sampling import one_hot_like

    if len(parts) == 1 and _whole(parts[0], batch, gamma):
        return parts[0][1]  # what the copy below would hold: a copy of a [batch, gamma, vocab] was ~0.1 ms of a round
    with_probs = [part.probs for _, part in parts if part.probs is not None]
    tokens = torch.zeros(batch, gamma, dtype=torch.long)
    drafted = torch.zeros(batch, dtype=torch.long)
    confidence = torch.full((batch, gamma), float("nan"))
    probs = None
    if with_probs:
        dtype = torch.float64 if any(p.dtype == torch.float64 for p in with_probs) else torch.float32
        probs = torch.zeros(batch, gamma, with_probs[0].shape[-1], dtype=dtype)
    for rows, part in parts:
        if not rows:
            continue
        index = torch.tensor(list(rows), dtype=torch.long)
        width = part.tokens.shape[1]
        tokens[index, :width] = part.tokens.cpu()
        drafted[index] = part.num_drafted.cpu()
        if probs is not None:
            probs[index, :width] = (part.probs.cpu().to(probs.dtype) if part.probs is not None
                                    else one_hot_like(part.tokens.cpu(), probs[index, :width]))
        if part.confidence is not None:
            confidence[index, :width] = part.confidence.cpu().to(confidence.dtype)
    parents = None
    if any(part.parents is not None for _, part in parts):
        parents = chain_parents(batch, gamma)
        for rows, part in parts:
            if rows and part.parents is not None:
                parents[torch.tensor(list(rows), dtype=torch.long), : part.parents.shape[1]] = part.parents.cpu()
    return Proposal(tokens=tokens, probs=probs, num_drafted=drafted, confidence=confidence, parents=parents)


def chain_parents(batch: int, width: int) -> Tensor:
    """`[batch, width]` parents of a chain: each token follows the previous one (the first, the pending token)."""
    return (torch.arange(width) - 1).unsqueeze(0).expand(batch, width).clone()


def _whole(part: tuple[Sequence[int], Proposal], batch: int, gamma: int) -> bool:
    """Whether one proposal already is the merge of itself alone: every row in order, the full width, on the CPU, its
    probabilities (if any) in a dtype the merge keeps."""
    rows, proposal = part
    return (list(rows) == list(range(batch)) and proposal.tokens.shape == (batch, gamma)
            and (proposal.parents is None or proposal.parents.device.type == "cpu")
            and proposal.tokens.device.type == "cpu" and proposal.num_drafted.device.type == "cpu"
            and (proposal.confidence is None or proposal.confidence.device.type == "cpu")
            and (proposal.probs is None
                 or (proposal.probs.device.type == "cpu" and proposal.probs.dtype in (torch.float32, torch.float64))))


def best_tree(tokens: list[list[int]], parents: list[list[int]], scores: list[list[float]], budget: list[int]) -> Proposal:
    """Per row the `budget[i]` nodes of highest cumulative probability (a tree: ancestors rank higher), in depth
    order, as a tree proposal of deterministic drafts."""
    batch = len(tokens)
    width = max(max(budget), 1)
    out_tokens = torch.zeros(batch, width, dtype=torch.long)
    out_parents = torch.full((batch, width), -1, dtype=torch.long)
    confidence = torch.zeros(batch, width)
    counts = []
    for r in range(batch):
        kept = sorted(range(len(tokens[r])), key=lambda n: -scores[r][n])[: budget[r]]
        depth = {}
        for node in sorted(kept, key=lambda n: scores[r][n], reverse=True):
            chain, ancestor = 0, parents[r][node]
            while ancestor >= 0:
                chain, ancestor = chain + 1, parents[r][ancestor]
            depth[node] = chain
        order = sorted(kept, key=lambda n: (depth[n], -scores[r][n]))  # parents before children, best first
        index = {node: i for i, node in enumerate(order)}
        for i, node in enumerate(order):
            out_tokens[r, i] = tokens[r][node]
            parent = parents[r][node]
            out_parents[r, i] = index[parent] if parent >= 0 else -1
            confidence[r, i] = float(torch.tensor(scores[r][node]).exp())
        counts.append(len(order))
    return Proposal(tokens=out_tokens, probs=None, num_drafted=torch.tensor(counts, dtype=torch.long),
                    confidence=confidence, parents=out_parents)
