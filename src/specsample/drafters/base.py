"""The one small protocol every drafter implements; the verifier never sees which drafter ran."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, cast, runtime_checkable

import torch
from torch import Tensor

from specsample.config import SamplingParams, TreeShape
from specsample.planner.base import DraftSource, Extension
from specsample.processors import Shaper
from specsample.sampling import sample, warp_rows
from specsample.token_tree import tree_depths
from specsample.verification.coupled import DraftNoise, gumbel_argmax

log = logging.getLogger("specsample.engine")


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
class DraftRow:
    """One row's part of a round's draft request."""

    slot: int  # the row's slot in the drafter's state
    drafts: int  # drafts planned (the gate may stop the row sooner); with the request's tree: its depth at most
    reach: int  # most drafts (> drafts only as the request's extension allows); with a tree: its nodes
    params: SamplingParams
    generator: torch.Generator
    source: DraftSource = DraftSource.EITHER  # its prompt lookup, its model, or the drafter's own rule
    noise: DraftNoise | None = None  # coupled sampling: the noise its draws use (None there: a greedy row)

    def __post_init__(self) -> None:
        if not 0 <= self.drafts <= self.reach:
            raise ValueError(f"need 0 <= drafts <= reach, got {self.drafts} and {self.reach}")


@dataclass(frozen=True)
class DraftRequest:
    """What a round asks of a drafter: one record per row, and what holds for the whole round."""

    rows: tuple[DraftRow, ...]
    stop_thresholds: tuple[float, ...] = ()  # per draft position j (index j - 1): stop after a less confident draft
    extension: Extension | None = None
    width: int = -1  # the round's widest reach: proposals are this wide (-1: the rows' widest)
    tree: TreeShape | None = None  # grow a token tree per row where the drafter can (see `DraftRow`), else a chain
    # the rows' processors (penalties, logit bias, grammar): a drafter that draws from a distribution processes its
    # logits at each step with the tokens it drew before it in the round (`Shaper.next_logits`); None: none
    shaper: Shaper | None = None
    # draws are Gumbel-max with each row's noise (specsample.verification.coupled), not from generators
    coupled: bool = False
    # rows sent to their lookup (DraftSource.LOOKUP) may propose a token tree of up to their reach in nodes where their
    # continuations branch (the target scores trees); False: chains, unless `tree`
    lookup_trees: bool = False

    def __post_init__(self) -> None:
        if self.width < 0:
            object.__setattr__(self, "width", max((r.reach for r in self.rows), default=0))

    @property
    def slots(self) -> tuple[int, ...]:
        return tuple(r.slot for r in self.rows)

    @property
    def drafts(self) -> tuple[int, ...]:
        return tuple(r.drafts for r in self.rows)

    @property
    def reach(self) -> tuple[int, ...]:
        return tuple(r.reach for r in self.rows)

    @property
    def params(self) -> tuple[SamplingParams, ...]:
        return tuple(r.params for r in self.rows)

    @property
    def generators(self) -> tuple[torch.Generator, ...]:
        return tuple(r.generator for r in self.rows)

    def source_of(self, row: int) -> DraftSource:
        return self.rows[row].source

    def select(self, rows: Sequence[int]) -> DraftRequest:
        """The same request for some of its rows (a drafter handing them to another), as wide as the round."""
        return dataclasses.replace(self, rows=tuple(self.rows[i] for i in rows))

    def refuse_extension(self, rows: Sequence[int], why: str) -> None:
        """Raise where one of `rows` may draft past its plan, which the caller cannot honour (`why`); a tree's reach is
        its nodes, not an extension."""
        past = [i for i in rows if self.rows[i].reach > self.rows[i].drafts] if self.tree is None else []
        if past:
            raise ValueError(f"rows {past} may draft past their plan, but {why}")


def draw_drafts(
    probs: Tensor, request: DraftRequest, step: int, active: Sequence[bool], subset: Tensor | None = None
) -> Tensor:
    """The tokens `[rows]` a drafter draws at draft `step` from its warped `probs [rows, K]` (K: the vocabulary, or
    the columns of an output `subset` of token ids): from each row's generator, or, under coupled sampling, as the
    Gumbel-max of its probabilities with the row's noise at that position (a row without noise, greedy, takes its
    argmax). Inactive rows draw nothing (token 0)."""
    if not request.coupled:
        return sample(probs, request.generators, active)
    rows, width = probs.shape
    gumbels = torch.zeros(rows, width, dtype=torch.float64)
    for index, row in enumerate(request.rows):
        if active[index] and row.noise is not None:
            g = row.noise.gumbel(step)
            gumbels[index] = g if subset is None else g[subset.cpu()]
    tokens = gumbel_argmax(probs, gumbels)
    return torch.where(torch.tensor(list(active), device=tokens.device), tokens, torch.zeros_like(tokens))


def draw_chain(
    request: DraftRequest,
    logits: Tensor,
    advance: Callable[[Tensor], Tensor],
    vocab_size: int,
    subset: Tensor | None = None,
    reach: Sequence[int] | None = None,
) -> Proposal:
    """The draw loop every drafter that samples from its own distributions runs: up to `reach[i]` (default the
    request's) tokens per row, `logits [b, K]` scoring the first draft (over `subset`'s token ids, else the
    vocabulary) and `advance(tokens [b])` feeding the tokens just drawn and returning the next logits.

    The confidence gate stops a row after its j-th token if its temperature-1 probability was below
    `stop_thresholds[j - 1]` (the token itself is kept, so the rule reads past draws only); past its plan a row draws
    on only as `request.extension` allows. Each step's logits are processed with the tokens the row drew before them
    in the round (`request.shaper`). The proposal's probabilities are over the vocabulary (a subset's columns put
    back at their ids)."""
    width, params = request.width, request.params
    batch = len(request.rows)
    limits = [min(width, m) for m in (request.reach if reach is None else reach)]
    extension = request.extension
    planned = list(limits) if extension is None else [min(p, m) for p, m in zip(request.drafts, limits)]
    drafted = [0] * batch
    tokens, probs, confidence = [], [], []
    drawn: list[list[float]] = [[] for _ in range(batch)]  # per row, its confidence in each token it drew
    drawn_tokens: list[list[int]] = [[] for _ in range(batch)]  # per row, the tokens it drew this round
    for step in range(width):
        active = [drafted[r] == step and step < limits[r] for r in range(batch)]
        if not any(active):
            break
        if request.shaper is not None:  # processed as the target's position will be: with the drafts before it
            logits = request.shaper.next_logits(logits, request.slots, drawn_tokens, subset)
        step_probs = warp_rows(logits, params)  # [b, K]; tokens outside the subset have probability 0
        index = draw_drafts(step_probs, request, step, active, subset)  # [b]; inactive rows draw nothing
        own = torch.softmax(logits.float(), dim=-1).gather(-1, index.unsqueeze(-1)).squeeze(-1)  # [b]
        token = index if subset is None else subset[index]  # [b] vocabulary ids
        tokens.append(token)
        probs.append(step_probs)
        confidence.append(own)
        own_list = own.tolist()  # one copy, not one per row
        token_list = token.tolist() if request.shaper is not None else None
        for r in range(batch):
            if active[r]:
                if token_list is not None:
                    drawn_tokens[r].append(token_list[r])
                drafted[r] = step + 1
                drawn[r].append(own_list[r])
                if step + 1 < planned[r]:
                    if step < len(request.stop_thresholds) and own_list[r] < request.stop_thresholds[step]:
                        limits[r] = step + 1  # confidence gate: this token is kept, the round ends here
                elif extension is None or not extension.draws_on(request.drafts[r], drawn[r]):
                    limits[r] = step + 1  # the plan is drawn and the drafts are not sure enough to go on
        if not any(drafted[r] == step + 1 and step + 1 < limits[r] for r in range(batch)):
            break
        logits = advance(token)
    steps = len(tokens)
    draft_tokens = torch.zeros(batch, width, dtype=torch.long)
    draft_probs = torch.zeros(batch, width, vocab_size, dtype=probs[0].dtype if probs else torch.float32)
    draft_conf = torch.zeros(batch, width)
    if steps:
        draft_tokens[:, :steps] = torch.stack(tokens, dim=1).cpu()
        stacked = torch.stack(probs, dim=1).cpu()  # [b, steps, K]
        if subset is None:
            draft_probs[:, :steps] = stacked
        else:  # back to vocabulary ids for the verifier
            draft_probs[:, :steps].index_copy_(-1, subset.cpu(), stacked)
        draft_conf[:, :steps] = torch.stack(confidence, dim=1).cpu()
    return Proposal(
        tokens=draft_tokens,
        probs=draft_probs,
        num_drafted=torch.tensor(drafted, dtype=torch.long),
        confidence=draft_conf,
    )


@dataclass(frozen=True)
class Abilities:
    """What a drafter can do beyond proposing and following its rows, as it declares it (`Drafter.abilities`); each
    ability promises the methods of its protocol below. The engine and gamma auto plan with these; a wrapper states
    those of the drafters it routes to."""

    scores_backlog: bool = False  # `BacklogScorer`: scores tokens committed without it (a draft model)
    looks_up: bool = False  # `PromptLookup`: offers prompt-lookup continuations (n-gram, suffix, hybrid)
    keeps_prefixes: bool = False  # `PrefixKeeper`: keeps a finished row's state for a request sharing its prefix
    copies_prefixes: bool = False  # `PrefixCopier`: starts a new row from another row's state of a shared prefix
    reads_features: bool = False  # `FeatureDrafter`: drafts from the target's hidden states (EAGLE)
    holds_suffix_cache: bool = False  # `SuffixCacheHolder`: reports a shared suffix cache
    chunks_prefill: bool = False  # `ChunkedPrefill`: does a new row's prefill work a part per round (a draft's cache)

    def __or__(self, other: Abilities) -> Abilities:
        """What either can do (drafters serving rows side by side)."""
        return Abilities(*(a or b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


@runtime_checkable
class Drafter(Protocol):
    """Proposes tokens for rows of a batch and follows what the verifier committed.

    Rows are identified by slot numbers the engine assigns; the drafter keeps its own state per slot.
    """

    @property
    def vocab_size(self) -> int | None:
        """Vocabulary the drafter's probabilities range over; None = any."""
        ...

    @property
    def abilities(self) -> Abilities:
        """What it can do beyond the methods below (read afresh each round: a wrapper's may change)."""
        ...

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


def check_vocabulary(draft_vocab_size: int | None, target_vocab_size: int) -> None:
    """Refuse a draft whose vocabulary differs from the target's (None: a drafter that works with any)."""
    if draft_vocab_size is not None and draft_vocab_size != target_vocab_size:
        raise ValueError(
            f"draft vocabulary ({draft_vocab_size}) differs from target vocabulary ({target_vocab_size}); pick a "
            "draft trained with the target's tokenizer, or draft by n-gram lookup (--draft ngram)"
        )


class BacklogScorer(Drafter, Protocol):
    """A drafter that can score, teacher-forced, tokens the target committed without it (plain rounds): gamma auto
    learns a request's acceptance in fallback from them instead of drafting."""

    def score_backlog(
        self, slots: Sequence[int], counts: Sequence[int], params: Sequence[SamplingParams]
    ) -> list[list[float]]:
        """Per row, the warped draft probability of each of its last `counts[i]` committed tokens (fewer where the
        drafter already fed them), oldest first; afterwards the row lacks only its last token."""
        ...


class PromptLookup(Drafter, Protocol):
    """A drafter that proposes prompt-lookup continuations (an n-gram drafter, the hybrid): gamma auto sizes those
    rounds by the lookups' own acceptance and cost, apart from a draft model's, and runs them even where it keeps
    the model from drafting. A request's `source_of(i)` LOOKUP sends row i to its lookup, MODEL away from it."""

    def lookup_lengths(self, slots: Sequence[int], max_tokens: Sequence[int]) -> list[int]:
        """Per row, how many tokens (up to `max_tokens[i]`) a prompt lookup offers now; 0 where it offers none."""
        ...

    def drafts_otherwise(self, slots: Sequence[int]) -> list[bool]:
        """Per row, whether it can draft without its lookup (with a draft model) when it declines one."""
        ...


class PrefixKeeper(Drafter, Protocol):
    """A drafter that keeps a finished row's state when asked, so that the next `add_rows` of that slot reuses what
    the new prompt shares with the row's tokens (its cache of that prefix) instead of starting afresh."""

    def park_rows(self, slots: Sequence[int]) -> None:
        """The rows finished; keep their state until `add_rows` reuses the slot or `release_rows` drops it."""
        ...


class PrefixCopier(Drafter, Protocol):
    """A drafter that can start a row from another's prefix: the target's cache of a shared prefix is copied from a
    running or kept row into a new row's slot, and the drafter's state of it must follow (a feature draft's must, since
    the target computes no features for positions it copies)."""

    def copy_prefix(self, source: int, slot: int, tokens: Sequence[int]) -> int:
        """Make `slot` a kept row (as `park_rows` leaves one) holding row `source`'s state of its first `len(tokens)`
        tokens, `tokens` (a running or kept row's; it is unchanged): the next `add_rows` of `slot` reuses what it
        can of them and starts the rest afresh. Return how many of `tokens` the target may copy for the row: all,
        unless the drafter needs the target's features of the last ones (the target computes none it copies)."""
        ...


class FeatureDrafter(Drafter, Protocol):
    """A drafter that drafts from the target's final hidden states (EAGLE): the engine hands it the target's feature
    of every position it commits. Per row, after each call the drafter knows the features of every committed token
    but the last (which the target scores next round)."""

    def add_features(self, slots: Sequence[int], features: Sequence[Tensor]) -> None:
        """Per row, the target's final hidden states `[n, hidden]` of the next `n` committed positions (after
        `add_rows`: the prompt's tokens but the last; after `commit`: the pending token and the accepted drafts)."""
        ...


class ChunkedPrefill(Drafter, Protocol):
    """A drafter whose new rows take work in proportion to their prompts (a draft model's cache to prefill, a lookup's
    index to fill): the engine starts a row as the target's prefill of its prompt begins and has it do that work a part
    per round, within the round's prefill budget (`specsample.prefill_budget`); `add_rows` then does what is left, if
    anything, and the row runs. Chunked or whole, a row ends in the state `add_rows` alone gives it."""

    def start_rows(self, slots: Sequence[int], prompts: Sequence[Sequence[int]]) -> list[int]:
        """Start rows for their prompts as `add_rows` does, without their prefill work: per row, the units of work
        (tokens to prefill or index) it has to do."""
        ...

    def prefill_rows(self, slots: Sequence[int], units: Sequence[int]) -> None:
        """Per started row, the next `units[i]` units of its work (at most what it has left)."""
        ...


def backlog_scorer(drafter: Drafter) -> BacklogScorer | None:
    """`drafter` where it declares that it scores backlogs (`Abilities.scores_backlog`), else None."""
    return cast(BacklogScorer, drafter) if drafter.abilities.scores_backlog else None


def prompt_lookup(drafter: Drafter) -> PromptLookup | None:
    """`drafter` where it declares prompt lookups (`Abilities.looks_up`), else None."""
    return cast(PromptLookup, drafter) if drafter.abilities.looks_up else None


def prefix_keeper(drafter: Drafter) -> PrefixKeeper | None:
    """`drafter` where it declares that it keeps finished rows (`Abilities.keeps_prefixes`), else None."""
    return cast(PrefixKeeper, drafter) if drafter.abilities.keeps_prefixes else None


def prefix_copier(drafter: Drafter) -> PrefixCopier | None:
    """`drafter` where it declares that it copies a row's prefix into another (`Abilities.copies_prefixes`), else
    None."""
    return cast(PrefixCopier, drafter) if drafter.abilities.copies_prefixes else None


def chunked_prefill(drafter: Drafter) -> ChunkedPrefill | None:
    """`drafter` where it declares that it prefills new rows a part per round (`Abilities.chunks_prefill`), else
    None."""
    return cast(ChunkedPrefill, drafter) if drafter.abilities.chunks_prefill else None


def finish_rows(
    drafter: ChunkedPrefill,
    pending: dict[int, list[int]],
    slots: Sequence[int],
    prompts: Sequence[Sequence[int]],
) -> None:
    """`add_rows` of a `ChunkedPrefill` that keeps each started row's work left, tokens in order, in `pending`: rows
    not started yet start now, every row does all it has left, and leaves `pending`."""
    fresh = [i for i, slot in enumerate(slots) if slot not in pending]
    if fresh:
        drafter.start_rows([slots[i] for i in fresh], [prompts[i] for i in fresh])
    drafter.prefill_rows(slots, [len(pending[slot]) for slot in slots])
    for slot in slots:
        del pending[slot]


def take_parts(pending: dict[int, list[int]], slots: Sequence[int], units: Sequence[int]) -> list[list[int]]:
    """Each row's next `units[i]` tokens of its work left in `pending` (`finish_rows`), taken off it."""
    parts = []
    for slot, count in zip(slots, units):
        rest = pending[slot]
        parts.append(rest[:count])
        pending[slot] = rest[count:]
    return parts


def feature_drafter(drafter: Drafter) -> FeatureDrafter | None:
    """`drafter` where it declares that it reads the target's features (`Abilities.reads_features`), else None."""
    return cast(FeatureDrafter, drafter) if drafter.abilities.reads_features else None


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
            probs[index, :width] = (
                part.probs.cpu().to(probs.dtype)
                if part.probs is not None
                else one_hot_like(part.tokens.cpu(), probs[index, :width])
            )
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
    return (
        list(rows) == list(range(batch))
        and proposal.tokens.shape == (batch, gamma)
        and (proposal.parents is None or proposal.parents.device.type == "cpu")
        and proposal.tokens.device.type == "cpu"
        and proposal.num_drafted.device.type == "cpu"
        and (proposal.confidence is None or proposal.confidence.device.type == "cpu")
        and (
            proposal.probs is None
            or (proposal.probs.device.type == "cpu" and proposal.probs.dtype in (torch.float32, torch.float64))
        )
    )


def best_tree(
    tokens: list[list[int]], parents: list[list[int]], scores: list[list[float]], budget: list[int]
) -> Proposal:
    """Per row the `budget[i]` nodes of highest cumulative probability (a tree: ancestors rank higher), in depth
    order, as a tree proposal of deterministic drafts."""
    batch = len(tokens)
    width = max(max(budget), 1)
    out_tokens = torch.zeros(batch, width, dtype=torch.long)
    out_parents = torch.full((batch, width), -1, dtype=torch.long)
    confidence = torch.zeros(batch, width)
    counts = []
    longest = max((len(row) for row in parents), default=0)
    padded = torch.tensor([row + [-1] * (longest - len(row)) for row in parents], dtype=torch.long)
    depths = tree_depths(padded.view(batch, longest)).tolist()
    for r in range(batch):
        kept = sorted(range(len(tokens[r])), key=lambda n: -scores[r][n])[: budget[r]]
        order = sorted(kept, key=lambda n: (depths[r][n], -scores[r][n]))  # parents before children, best first
        index = {node: i for i, node in enumerate(order)}
        for i, node in enumerate(order):
            out_tokens[r, i] = tokens[r][node]
            parent = parents[r][node]
            out_parents[r, i] = index[parent] if parent >= 0 else -1
            confidence[r, i] = float(torch.tensor(scores[r][node]).exp())
        counts.append(len(order))
    return Proposal(
        tokens=out_tokens,
        probs=None,
        num_drafted=torch.tensor(counts, dtype=torch.long),
        confidence=confidence,
        parents=out_parents,
    )


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def allocated(drafter: Drafter, slots: int, max_len: int) -> Drafter:
    """`drafter` with its state allocated for `slots` rows of `max_len` tokens; where that fails (out of memory, CPU
    or GPU), a drafter that proposes nothing, loudly: requests never fail for it."""
    try:
        drafter.allocate(slots, max_len)
    except (RuntimeError, MemoryError) as exc:
        log.warning("draft cache could not be allocated (%s): decoding WITHOUT speculation", exc)
        return NoDrafter()
    return drafter


class NoDrafter:
    """The drafter of plain decoding: it proposes nothing and keeps nothing, so an engine without a draft runs the same
    round as one with."""

    vocab_size = None
    abilities = Abilities(keeps_prefixes=True, copies_prefixes=True)

    def allocate(self, num_slots: int, max_len: int) -> None:
        return None

    def add_rows(self, slots: Sequence[int], prompts: Sequence[Sequence[int]]) -> None:
        return None

    def release_rows(self, slots: Sequence[int]) -> None:
        return None

    def park_rows(self, slots: Sequence[int]) -> None:
        return None

    def copy_prefix(self, source: int, slot: int, tokens: Sequence[int]) -> int:
        return len(tokens)

    def commit(self, slots: Sequence[int], committed: Sequence[Sequence[int]]) -> None:
        return None

    def propose(self, request: DraftRequest) -> Proposal:
        batch = len(request.rows)
        return Proposal(torch.zeros(batch, 0, dtype=torch.long), None, torch.zeros(batch, dtype=torch.long))
