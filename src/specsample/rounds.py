"""What a round hands back: per request its new tokens (and log-probabilities), and the round's counters and timings."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from specsample.drafters.base import Proposal
from specsample.planner.base import RoundEvidence, RoundOutcome, RoundPlan, RowOutcome
from specsample.token_tree import block_parents, tree_depths
from specsample.verification.chain import Verdict

if TYPE_CHECKING:
    from specsample.scheduler import Request


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability under the target's processed distribution (temperature 1, before
    top-k/top-p/min-p), and the `SamplingParams.logprobs` most likely tokens' (most likely first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class RowUpdate:
    """What one request got from one round."""

    request_id: str
    new_tokens: tuple[int, ...]  # committed this round (after EOS / length truncation)
    num_drafted: int
    num_accepted: int
    # "stop" (EOS), "length", "cancelled", or "error" (the row's distributions were unusable: it ends alone, the
    # other rows of its round go on as without it); None while running
    finish_reason: str | None
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per new token, where the request asked for them


@dataclass(frozen=True)
class RoundStats:
    """Counters and timings of one round over the whole batch."""

    batch_size: int
    gamma: int  # drafts per row this round (0 = plain decoding)
    drafted: int
    accepted: int
    emitted: int
    drafted_per_position: tuple[int, ...]  # rows that drafted at position i
    accepted_per_position: tuple[int, ...]  # rows whose draft at position i was accepted
    prefill_seconds: float
    draft_seconds: float
    target_seconds: float
    verify_seconds: float
    fallback_rows: int = 0  # rows gamma auto kept from drafting this round
    scored_rows: int = 0  # rows whose draft scored the tokens it missed (gamma auto's probes in fallback)
    lookup_rows: int = 0  # rows gamma auto had propose a prompt lookup instead of drafting with a model
    extended_rows: int = 0  # rows that drafted past the gamma planned (confident drafts)
    tree_rows: int = 0  # rows that drafted a token tree (their drafts and accepted tokens count its nodes and path)
    tree_nodes: int = 0  # the round's tree budget (0: chains)
    admitted: int = 0  # requests admitted this round
    admitted_tokens: int = 0  # their prompt tokens the target's cache takes (all but the last of each)
    prefix_hits: int = 0  # admitted requests that reused a finished request's cached prefix
    reused_tokens: int = 0  # prompt tokens they took from cache instead of prefilling
    prefilled_tokens: int = 0  # prompt tokens the target prefilled this round (whole prompts or chunks)
    # compiled models (models/compile_events.py): graphs compiled during the round, all past the start-up warm-up
    # (a recompile: a shape or guard the warm-up did not cover), and cached forwards they ran eagerly (token trees,
    # blocks past MAX_BLOCK tokens per row; prefill aside)
    recompiles: int = 0
    eager_fallbacks: int = 0


@dataclass(frozen=True)
class RoundResult:
    """One engine step: per-request updates and batch statistics."""

    rows: tuple[RowUpdate, ...]
    stats: RoundStats
    finished_at: float  # time.perf_counter() when the round committed


def _depths(parents: Tensor, num_drafted: Tensor) -> Tensor:
    """`[b, nodes]` each node's depth in a proposal's trees (`parents [b, nodes]`; 1 for the pending token's
    children)."""
    return tree_depths(block_parents(parents, num_drafted))[:, 1:]


def round_stats(
    plan: RoundPlan,
    proposal: Proposal,
    verdict: Verdict,
    updates: list[RowUpdate],
    scored_rows: int,
    seconds: tuple[float, float, float, float],
    admitted: dict[str, int],
    compiled: tuple[int, int] = (0, 0),
) -> RoundStats:
    """Counters of the round; `seconds`: its prefill, draft, target and verify-and-commit time; `admitted`: the
    admission's counters (RoundStats' admitted, admitted_tokens, prefix_hits, reused_tokens, prefilled_tokens);
    `compiled`: the graphs compiled and eager fallbacks of compiled models during the round (`compile_events.since`)."""
    gamma = proposal.tokens.shape[1]
    num_drafted, num_accepted = proposal.num_drafted, verdict.num_accepted.cpu()
    positions = torch.arange(gamma).unsqueeze(0)  # [1, gamma]; in a tree round, depths 1..
    drafted_at = (positions < num_drafted.unsqueeze(1)).sum(dim=0)
    if proposal.parents is not None and gamma > 0:  # rows whose tree reaches each depth
        depths = _depths(proposal.parents, num_drafted)
        deepest = int(torch.where(positions < num_drafted.unsqueeze(1), depths, 0).max())
        positions = positions[:, :deepest]
        drafted_at = (
            torch.stack(
                [
                    ((depths > d) & (torch.arange(gamma) < num_drafted.unsqueeze(1))).any(dim=1).sum()
                    for d in range(deepest)
                ]
            )
            if deepest
            else positions.sum(dim=0)
        )
    accepted_at = (positions < num_accepted.unsqueeze(1)).sum(dim=0)
    planned = torch.tensor([r.drafts for r in plan.rows])
    return RoundStats(
        batch_size=len(updates),
        gamma=gamma,
        drafted=int(num_drafted.sum()),
        accepted=int(num_accepted.sum()),
        emitted=sum(len(u.new_tokens) for u in updates),
        drafted_per_position=tuple(drafted_at.tolist()),
        accepted_per_position=tuple(accepted_at.tolist()),
        prefill_seconds=seconds[0],
        draft_seconds=seconds[1],
        target_seconds=seconds[2],
        verify_seconds=seconds[3],
        fallback_rows=sum(r.fallback for r in plan.rows),
        scored_rows=scored_rows,
        lookup_rows=plan.lookups,
        extended_rows=int((num_drafted > planned).sum()) if gamma else 0,
        tree_rows=int((num_drafted > 0).sum()) if proposal.parents is not None else 0,
        tree_nodes=plan.tree.nodes if plan.tree is not None and proposal.parents is not None else 0,
        recompiles=compiled[0],
        eager_fallbacks=compiled[1],
        **admitted,
    )


def round_outcome(
    requests: Sequence[Request],
    updates: list[RowUpdate],
    proposal: Proposal,
    verdict: Verdict,
    target_probs: Tensor | None,
    backlog: dict[int, tuple[float, ...]],
    coupled: bool,
    seconds: tuple[float, float, float],
) -> RoundOutcome:
    """What the round teaches its planner: per row its drafts and accepted count, the draft's temperature-1 probability
    of each token it drew and its backlog's draft probabilities (a failed row teaches nothing); the finished requests;
    `seconds` of drafting, scoring and verify-and-commit; and the round's tensors as evidence (`RoundEvidence`)."""
    rows = []
    for i, (request, update) in enumerate(zip(requests, updates)):
        if update.finish_reason == "error":
            rows.append(RowOutcome(request.request_id, 0, 0, failed=True))
            continue
        drafted = update.num_drafted
        confidence = (
            tuple(proposal.confidence[i, :drafted].tolist()) if proposal.confidence is not None and drafted else None
        )
        rows.append(
            RowOutcome(
                request.request_id,
                drafted,
                update.num_accepted,
                confidence,
                backlog_draft_probs=backlog.get(i),
                greedy=request.params.greedy,
            )
        )
    finished = tuple(u.request_id for u in updates if u.finish_reason is not None)
    evidence = RoundEvidence(
        proposal.tokens, proposal.probs, target_probs, verdict.next_token, coupled, proposal.parents is not None
    )
    return RoundOutcome(tuple(rows), proposal.tokens.shape[1], *seconds, finished, evidence)
