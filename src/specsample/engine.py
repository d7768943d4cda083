"""The engine loop, one round per `step()`: plan -> propose -> score -> verify -> commit -> learn.

The planner (fixed gamma, or gamma auto) hands back a plan per round; the drafter proposes up to that many
tokens per row; the target scores every row's pending token and drafts in one forward; the verifier accepts a
prefix and draws the recovered or bonus token; the caches keep the accepted prefix; the planner learns from
what happened. Plain decoding is the same loop with no drafts. The CLI, the server, Ray and the benchmarks all
drive this one loop.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from specsample.config import SamplingParams, SettingError, SpecConfig
from specsample.coupling import DraftNoise, NoiseStream, verify_coupled, verify_tree_coupled
from specsample.drafters.base import (BacklogScorer, Drafter, DraftRequest, FeatureDrafter, PrefixKeeper, PromptLookup,
                                       Proposal)
from specsample.grammar import GrammarCompiler
from specsample.models.base import CausalLM, FeatureLM, TreeLM, prefill_ragged
from specsample.models.row_padding import score_padded
from specsample.planner import FixedGamma, GammaController, Planner
from specsample.planner.base import BatchState, RoundOutcome, RoundPlan, RowOutcome, RowState
from specsample.processors import RowProcessors, Shaper, token_logprobs
from specsample.sampling import usable_rows, warp_rows
from specsample.verify import Verdict, acceptance_probabilities, verify, verify_greedy
from specsample.verify_tree import verify_tree, verify_tree_greedy

log = logging.getLogger("specsample.engine")

BACKLOG_KEPT = 64  # most plain-round tokens a row keeps for its draft to score (the controller remembers ~25 trials)
MIN_REUSED = 16  # a kept row is taken over by a request sharing at least this many leading tokens with it


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


@dataclass(frozen=True)
class RoundResult:
    """One engine step: per-request updates and batch statistics."""

    rows: tuple[RowUpdate, ...]
    stats: RoundStats
    finished_at: float  # time.perf_counter() when the round committed


@dataclass
class _Row:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    seed: int
    generator: torch.Generator
    speculative: bool
    gamma: int | None
    noise: NoiseStream | None = None  # coupled sampling (SpecConfig.coupled), not greedy: its per-position noise
    processors: RowProcessors | None = None  # penalties, logit bias, grammar: None when the params have none
    slot: int = -1
    output: list[int] = field(default_factory=list)
    # the target's probability of each token plain rounds committed since the row last drafted (newest
    # last, at most BACKLOG_KEPT): with the draft's, what a draft there would have been accepted with
    plain_probs: list[float] = field(default_factory=list)

    @property
    def remaining(self) -> int:
        return self.params.max_new_tokens - len(self.output)

    @property
    def last_token(self) -> int:
        return self.output[-1] if self.output else self.prompt[-1]


def default_planner(config: SpecConfig) -> Planner:
    """Gamma auto up to `config.gamma` (and trees up to `config.tree`) when the config is adaptive, else that gamma
    (or that tree) for every row."""
    return GammaController(config.gamma, config.tree) if config.adaptive else FixedGamma(config.gamma, config.tree)


class Engine:
    """Runs a batch of requests through speculative (or plain) decoding, one round per `step()`.

    Requests may be added and cancelled between rounds from other threads; each keeps its own
    slot in the target's and the drafter's caches and its own seeded generator, so no request sees
    another's tokens. With coupled sampling (`SpecConfig.coupled`, specsample.coupling) a seeded request gives
    the tokens plain decoding with that seed gives, whatever the plan and the batch (up to the rounding of the
    target's logits, which deterministic mode removes: models/invariant.py).
    """

    def __init__(
        self,
        target: CausalLM,
        drafter: Drafter | None = None,
        config: SpecConfig = SpecConfig(),
        eos_token_ids: Iterable[int] = (),
        planner: Planner | None = None,
        clock: Callable[[], float] = time.perf_counter,
        grammars: GrammarCompiler | None = None,
    ) -> None:
        """`planner` defaults to `default_planner(config)`; pass one to keep what gamma auto learnt across
        engines. `clock` times the rounds the planner learns costs from. `grammars` compiles the requests'
        grammars for the target's tokenizer (None: requests with a grammar are refused)."""
        if drafter is not None and drafter.vocab_size is not None and drafter.vocab_size != target.vocab_size:
            raise ValueError(
                f"draft vocabulary ({drafter.vocab_size}) differs from target vocabulary "
                f"({target.vocab_size}); pick a draft trained with the target's tokenizer, or use an "
                "n-gram drafter"
            )
        self.planner = planner if planner is not None else default_planner(config)
        if self.planner.max_gamma > config.gamma:
            raise ValueError(f"the planner may plan {self.planner.max_gamma} drafts per round, but the engine's caches "
                             f"hold {config.gamma} (SpecConfig.gamma)")
        self.target = target
        self.config = config
        self.clock = clock
        self.grammars = grammars
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.max_len = min(config.max_seq_len or target.max_seq_len, target.max_seq_len)
        # slack past max_len: padded positions of a round may be written (never read) beyond it
        widest = max(config.most_drafts + 1, max(config.target_widths, default=0))
        slots = config.max_batch_size + config.prefix_cache_rows  # running rows, and finished ones kept for reuse
        self.cache = target.new_cache(slots, self.max_len + widest + 1)
        if isinstance(drafter, FeatureDrafter) and drafter.wants_features and not isinstance(target, FeatureLM):
            raise ValueError(f"the draft reads the target's hidden states, which the target's runtime "
                             f"({type(target).__name__}) does not return; use our Llama-family runtime")
        self.drafter = _allocate_or_drop(drafter, slots, self.max_len + config.most_drafts + 2)
        self._abilities: tuple[Drafter | None, bool, bool, bool] = (None, False, False, False)  # see _abilities_of
        self._free_slots = list(range(slots))
        # finished rows whose caches are kept for a request sharing their prefix: slot -> the tokens the target's
        # cache holds, least recently finished first
        self._kept: OrderedDict[int, list[int]] = OrderedDict()
        self._waiting: deque[_Row] = deque()
        self._running: dict[int, _Row] = {}  # slot -> row
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()
        self._ids = itertools.count()

    # ----- requests -------------------------------------------------------------------------

    def add_request(
        self,
        prompt: Sequence[int],
        params: SamplingParams = SamplingParams(),
        request_id: str | None = None,
        speculative: bool = True,
        gamma: int | None = None,
    ) -> str:
        """Queue a request; it joins the running batch at the next round with a free slot."""
        prompt = [int(t) for t in prompt]
        self.check_request(prompt, params, gamma)
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        row = _Row(
            request_id=request_id or f"req-{next(self._ids)}",
            prompt=prompt, params=params, seed=seed,
            generator=torch.Generator().manual_seed(seed),
            speculative=speculative and self.drafter is not None and self.config.speculative,
            gamma=gamma,
            noise=NoiseStream(seed, self.target.vocab_size) if self.config.coupled and not params.greedy else None,
            processors=(RowProcessors(params, prompt, self.target.vocab_size, self.grammars) if params.processed
                        else None),
        )
        with self._lock:
            self._waiting.append(row)
        return row.request_id

    def check_request(self, prompt: Sequence[int], params: SamplingParams, gamma: int | None = None) -> None:
        """Raise `ValueError` naming the problem if this request cannot run."""
        if len(prompt) == 0:
            raise ValueError("prompt is empty: give at least one token")
        bad = [t for t in prompt if not 0 <= t < self.target.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary (size {self.target.vocab_size})")
        if len(prompt) + params.max_new_tokens > self.max_len:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds the "
                f"context window ({self.max_len} tokens)"
            )
        if gamma is not None and not 1 <= gamma <= self.config.gamma:
            raise ValueError(f"gamma must be in 1..{self.config.gamma} (the engine's maximum), got {gamma}")
        outside = [t for t, _ in params.logit_bias if t >= self.target.vocab_size]
        if outside:
            raise SettingError("logit_bias", f"logit_bias names token id {outside[0]}, outside the vocabulary "
                                             f"(size {self.target.vocab_size})")
        if params.grammar is not None:
            if self.grammars is None:
                raise SettingError("grammar", "this engine has no grammar compiler: a grammar needs the target's "
                                              "tokenizer (specsample.grammar.GrammarCompiler)")
            self.grammars.compile(params.grammar)  # raises SettingError for a grammar the compiler refuses

    def cancel(self, request_id: str) -> None:
        """Stop a request; its slot is freed at the next round."""
        with self._lock:
            self._cancelled.add(request_id)

    def waiting_ids(self) -> set[str]:
        """The requests queued for a slot (not yet admitted)."""
        with self._lock:
            return {r.request_id for r in self._waiting}

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_work(self) -> bool:
        """True while any request is running or waiting."""
        return bool(self._running or self._waiting)

    # ----- the loop -------------------------------------------------------------------------

    def stream(self) -> Iterator[RoundResult]:
        """Step until every request has finished, yielding each round's result."""
        while self.has_work():
            yield self.step()

    @torch.inference_mode()
    def step(self) -> RoundResult:
        """Run one round for every running request (admitting waiting ones first)."""
        cancelled = self._apply_cancellations()
        start = self.clock()
        admitted = self._admit()  # (requests, prompt tokens cached, requests reusing a prefix, tokens reused)
        prefill_done = self._now()
        rows = [self._running[s] for s in sorted(self._running)]
        if not rows:
            stats = RoundStats(0, 0, 0, 0, 0, (), (), prefill_done - start, 0.0, 0.0, 0.0, *((0,) * 6), *admitted)
            return RoundResult(tuple(cancelled), stats, self.clock())
        plan = self.planner.plan(self._batch_state(rows))  # drafts per row, the gate: a value
        backlog = self._score_backlogs(rows, plan)  # row -> min(1, q / p) of tokens plain rounds committed
        shaper = self._shaper(rows)  # the rows' processors, for the draft's steps and the target's positions alike
        proposal = self._propose(rows, plan, shaper)  # [b, gamma] drafts, on the target's device
        draft_done = self._now()
        target_logits, features = self._score(rows, proposal)  # [b, gamma + 1, vocab], one forward
        target_done = self._now()
        if shaper is not None:  # each position processed with the drafts on the path to it
            target_logits = shaper.block_logits(target_logits, [r.slot for r in rows], self._block(rows, proposal),
                                                None if proposal.parents is None else _block_parents(proposal))
        verdict, target_probs = self._verify(rows, proposal, target_logits)
        learnt = self._row_outcomes(rows, proposal, verdict, target_probs, backlog)
        updates = self._commit(rows, proposal, verdict, features, target_logits)  # caches keep the accepted prefix
        verify_done = self._now()
        # learning comes last: the round's time it learns from includes the commit
        self.planner.learn(plan, RoundOutcome(learnt, proposal.tokens.shape[1], draft_done - prefill_done,
                                              target_done - draft_done, verify_done - target_done))
        self._release([r for r, u in zip(rows, updates) if u.finish_reason is not None],
                      keep={r.request_id for r, u in zip(rows, updates) if u.finish_reason in ("stop", "length")})
        stats = _round_stats(plan, proposal, verdict, updates, len(backlog),
                             (prefill_done - start, draft_done - prefill_done, target_done - draft_done,
                              verify_done - target_done), admitted)
        return RoundResult(tuple(cancelled + updates), stats, self.clock())

    def _batch_state(self, rows: list[_Row]) -> BatchState:
        """What the planner sees of the running rows; lookup offers and backlogs only for a planner that reads them
        (each costs a little every round)."""
        adaptive = self.planner.adaptive
        offers, can_score = adaptive and self._can_look_up(), adaptive and self._can_score()
        chosen = [r for r in rows if r.speculative and r.gamma is None]
        lookups: dict[int, tuple[int, bool]] = {}
        if offers and chosen:  # what prompt lookup offers each row now (it depends on the past only)
            slots = [r.slot for r in chosen]
            lengths = self.drafter.lookup_lengths(slots, [max(0, min(self.config.gamma, r.remaining - 1))
                                                          for r in chosen])
            lookups = dict(zip(slots, zip(lengths, self.drafter.drafts_otherwise(slots))))
        states = tuple(RowState(r.request_id, r.remaining, r.gamma, r.speculative,
                                backlog=len(r.plain_probs) if can_score else 0,
                                lookup=lookups.get(r.slot, (0, True))[0],
                                drafts_otherwise=lookups.get(r.slot, (0, True))[1]) for r in rows)
        return BatchState(states, can_score=can_score, offers_lookups=offers, can_tree=isinstance(self.target, TreeLM))

    def _scoring_width(self, batch_size: int, tokens: int) -> int:
        """Tokens to score for `tokens` asked: `config.target_widths` was measured at batch 1."""
        widths = self.config.target_widths
        return widths[tokens - 1] if batch_size == 1 and tokens <= len(widths) else tokens

    def _can_score(self) -> bool:
        """Whether the drafter scores backlogs (see `_abilities_of`)."""
        return self._abilities_of()[1]

    def _can_look_up(self) -> bool:
        """Whether the drafter says what prompt lookup would propose (see `_abilities_of`)."""
        return self._abilities_of()[2]

    def _wants_features(self) -> bool:
        """Whether the drafter drafts from the target's hidden states (see `_abilities_of`)."""
        return self._abilities_of()[3] and self.drafter.wants_features

    def _abilities_of(self) -> tuple[Drafter | None, bool, bool, bool]:
        """The drafter, whether it scores backlogs, looks up prompts, reads the target's features: a runtime protocol
        check inspects every member, a visible part of a plain round's own work, so it runs once per drafter (the
        engine's drafter may be replaced)."""
        if self._abilities[0] is not self.drafter:
            self._abilities = (self.drafter, isinstance(self.drafter, BacklogScorer),
                               isinstance(self.drafter, PromptLookup), isinstance(self.drafter, FeatureDrafter))
        return self._abilities

    def _score_backlogs(self, rows: list[_Row], plan: RoundPlan) -> dict[int, tuple[float, ...]]:
        """Rows whose scoring the plan asks for: the draft scores the tokens plain rounds committed, teacher-forced;
        per token, min(1, q / p) is what drafting there would have been accepted with. Only the past is read, so
        sampling stays exact."""
        chosen = [i for i, r in enumerate(rows) if plan.rows[i].score_backlog > 0 and r.plain_probs]
        if not chosen or not self._can_score():
            return {}
        counts = [min(plan.rows[i].score_backlog, len(rows[i].plain_probs)) for i in chosen]
        scored = self.drafter.score_backlog([rows[i].slot for i in chosen], counts, [rows[i].params for i in chosen])
        out = {}
        for i, draft_probs in zip(chosen, scored):
            row = rows[i]
            target_probs = row.plain_probs[len(row.plain_probs) - len(draft_probs):]
            out[i] = tuple(min(1.0, q / p) if p > 0 else 0.0 for q, p in zip(draft_probs, target_probs))
            row.plain_probs.clear()
        return out

    @staticmethod
    def _shaper(rows: list[_Row]) -> Shaper | None:
        """The round's processors by slot; None when no row has any (nothing to do)."""
        processed = {r.slot: r.processors for r in rows if r.processors is not None}
        return Shaper(processed) if processed else None

    @staticmethod
    def _block(rows: list[_Row], proposal: Proposal) -> Tensor:
        """`[b, gamma + 1]` the block the target scores: each row's pending token, then its drafts."""
        pending = torch.tensor([[r.last_token] for r in rows], dtype=torch.long, device=proposal.tokens.device)
        return torch.cat([pending, proposal.tokens], dim=1)

    def _propose(self, rows: list[_Row], plan: RoundPlan, shaper: Shaper | None = None) -> Proposal:
        """The drafter's proposal for the plan, its columns no row used dropped, its tokens on the target's device."""
        device = self.target.device
        if plan.width == 0 or self.drafter is None:
            empty = torch.zeros(len(rows), 0, dtype=torch.long)
            return Proposal(empty.to(device), None, torch.zeros(len(rows), dtype=torch.long))
        reach = tuple(r.reach for r in plan.rows)
        if plan.width > self.config.most_drafts:
            raise ValueError(f"the planner planned {plan.width} drafts for a row, more than the engine's caches hold "
                             f"({self.config.most_drafts})")
        proposal = self.drafter.propose(DraftRequest(
            tuple(r.slot for r in rows), tuple(r.drafts for r in plan.rows), reach, tuple(r.params for r in rows),
            tuple(r.generator for r in rows), tuple(r.source for r in plan.rows), plan.stop_thresholds,
            plan.extension, tree=plan.tree, shaper=shaper, noise=self._noise(rows), lookup_trees=plan.lookup_trees))
        num_drafted = torch.minimum(proposal.num_drafted.cpu(), torch.tensor(reach))
        used = int(num_drafted.max())  # the drafter may have stopped every row early
        return Proposal(proposal.tokens[:, :used].to(device),
                        proposal.probs[:, :used] if proposal.probs is not None else None, num_drafted,
                        proposal.confidence[:, :used] if proposal.confidence is not None else None,
                        proposal.parents[:, :used] if proposal.parents is not None else None)

    def _score(self, rows: list[_Row], proposal: Proposal) -> tuple[Tensor, Tensor | None]:
        """Target logits `[b, gamma + 1, vocab]` at each row's pending token and drafts, in one forward (at the
        width the target runs fastest, measured; the commit rolls the padding back), and the target's final hidden
        states there `[b, gamma + 1, hidden]` where the drafter reads them (else None)."""
        tokens = self._block(rows, proposal).to(self.target.device)  # [b, gamma + 1]
        slots = torch.tensor([r.slot for r in rows], dtype=torch.long)
        if proposal.parents is not None:  # a token tree per row: every node in the same forward
            logits, hidden = self.target.forward_cached_tree(tokens, self.cache, slots, _block_parents(proposal))
            return logits, hidden if self._wants_features() else None
        return score_padded(self.target, tokens, self.cache, slots, self._scoring_width(len(rows), tokens.shape[1]),
                            features=self._wants_features())

    def _verify(self, rows: list[_Row], proposal: Proposal, target_logits: Tensor) -> tuple[Verdict, Tensor | None]:
        """The verdict, and the warped target probabilities it sampled from (None: every row greedy)."""
        params = [r.params for r in rows]
        if proposal.parents is not None:
            return self._verify_tree(rows, proposal, target_logits)
        num_drafted = proposal.num_drafted.to(target_logits.device)
        if all(p.greedy for p in params):
            return verify_greedy(proposal.tokens, target_logits, num_drafted), None
        target_probs = warp_rows(target_logits, params)  # [b, gamma + 1, vocab]
        if self.config.coupled:
            return verify_coupled(proposal.tokens, target_probs, self._noise(rows), num_drafted), target_probs
        verdict = verify(proposal.tokens, proposal.probs, target_probs, [r.generator for r in rows], num_drafted)
        return verdict, target_probs

    def _noise(self, rows: list[_Row]) -> tuple[DraftNoise | None, ...]:
        """Each row's coupled noise for this round (None: a greedy row); empty unless sampling is coupled."""
        if not self.config.coupled:
            return ()
        return tuple(None if r.noise is None else DraftNoise(r.noise, len(r.output)) for r in rows)

    def _verify_tree(self, rows: list[_Row], proposal: Proposal,
                     target_logits: Tensor) -> tuple[Verdict, Tensor | None]:
        """A tree round's verdict (`verify_tree`: multi-candidate rejection sampling over each row's tree), and the
        warped target probabilities (None: every row greedy)."""
        tokens = self._block(rows, proposal)  # [b, nodes + 1]: the block the target scored
        parents, sizes = _block_parents(proposal), proposal.num_drafted + 1
        if all(r.params.greedy for r in rows):
            found, target_probs = verify_tree_greedy(tokens, parents, sizes, target_logits), None
        else:
            target_probs = warp_rows(target_logits, [r.params for r in rows])  # [b, nodes + 1, vocab]
            draft = (None if proposal.probs is None else
                     torch.cat([torch.zeros_like(proposal.probs[:, :1]), proposal.probs], dim=1))
            found = (verify_tree_coupled(tokens, parents, sizes, target_probs, self._noise(rows)) if self.config.coupled
                     else verify_tree(tokens, parents, sizes, draft, target_probs, [r.generator for r in rows]))
        paths = tuple(tuple(i - 1 for i in path) for path in found.paths)  # block indices -> proposal indices
        accepted = torch.zeros(proposal.tokens.shape, dtype=torch.bool)
        for row, path in enumerate(paths):
            accepted[row, list(path)] = True
        usable = usable_rows(target_logits.float().softmax(-1)) if target_probs is None else usable_rows(target_probs)
        failed = ~usable[:, 0]
        return Verdict(found.num_accepted, found.next_token, accepted,
                       failed if bool(failed.any()) else None, paths), target_probs

    def _row_outcomes(self, rows: list[_Row], proposal: Proposal, verdict: Verdict, target_probs: Tensor | None,
                      backlog: dict[int, tuple[float, ...]]) -> tuple[RowOutcome, ...]:
        """What each row's round teaches the planner (nothing for one that does not learn); keeps, for rows decoded
        plain, the target's probability of the token they committed, for their draft to be scored against."""
        if not self.planner.adaptive:
            return tuple(RowOutcome(r.request_id, 0, 0) for r in rows)
        drafted = proposal.num_drafted.tolist()
        accepted = verdict.num_accepted.cpu().tolist()  # one device-to-host copy per round
        failed = _failed_rows(verdict)
        self._note_plain_tokens(rows, drafted, verdict, target_probs)
        if verdict.paths is not None:  # a tree round: its nodes and its path teach its yield, not chain acceptance
            return tuple(RowOutcome(r.request_id, 0 if failed[i] else drafted[i], 0 if failed[i] else accepted[i],
                                    backlog_scores=backlog.get(i)) for i, r in enumerate(rows))
        # coupled sampling accepts less often than sum(min(p, q)): it learns from its accepted counts
        acceptance = (acceptance_probabilities(proposal.tokens, proposal.probs, target_probs).cpu().tolist()
                      if target_probs is not None and proposal.tokens.shape[1] > 0 and not self.config.coupled
                      else None)  # [b, gamma]
        confidence = proposal.confidence
        out = []
        for i, row in enumerate(rows):
            if failed[i]:  # nothing it did this round means anything: it teaches nothing
                out.append(RowOutcome(row.request_id, 0, 0))
                continue
            n, k = drafted[i], accepted[i]
            reached = min(k + 1, n)  # the accepted drafts and the first rejected one
            out.append(RowOutcome(
                row.request_id, n, k,
                confidence=tuple(confidence[i, :n].tolist()) if confidence is not None and n else None,
                acceptance=(tuple(acceptance[i][:reached]) if acceptance is not None and n and not row.params.greedy
                            else None),
                backlog_scores=backlog.get(i)))
        return tuple(out)

    def _note_plain_tokens(self, rows: list[_Row], drafted: list[int], verdict: Verdict,
                           target_probs: Tensor | None) -> None:
        """Keep, for rows gamma auto chose to decode plain this round, the target's probability of the token it
        committed (1 under greedy); a row that drafted has fed its draft everything before."""
        if not self._can_score():
            return
        plain = [i for i, r in enumerate(rows) if drafted[i] == 0 and r.speculative and r.gamma is None]
        for i, row in enumerate(rows):
            if drafted[i] > 0:
                row.plain_probs.clear()
        if not plain:
            return
        if target_probs is None:  # every row greedy: the target's token had probability 1
            chosen = [1.0] * len(plain)
        else:  # every row's in one gather and one copy
            every = target_probs[:, 0].gather(-1, verdict.next_token.unsqueeze(-1)).squeeze(-1).tolist()  # [b]
            chosen = [every[i] for i in plain]
        for i, p in zip(plain, chosen):
            row = rows[i]
            row.plain_probs.append(p)
            del row.plain_probs[:-BACKLOG_KEPT]

    def _commit(self, rows: list[_Row], proposal: Proposal, verdict: Verdict,
                features: Tensor | None = None, target_logits: Tensor | None = None) -> list[RowUpdate]:
        """Each row's new tokens (its accepted drafts and the next token, cut at EOS or its budget); the target's
        cache keeps the prompt, earlier output and the accepted drafts, the drafter follows (with the target's
        features of the committed positions, where it reads them). A failed row commits nothing and ends with
        "error"; its caches are reset when it is released."""
        next_tokens = verdict.next_token.cpu().tolist()
        drafts = proposal.tokens.cpu().tolist()
        failed = _failed_rows(verdict)
        updates, kept, committed, target_lengths = [], [], [], []
        for i, (row, accepted, nxt, drafted_row, n_drafted) in enumerate(zip(
            rows, verdict.num_accepted.cpu().tolist(), next_tokens, drafts, proposal.num_drafted.tolist()
        )):
            if failed[i]:
                log.error("request %s: its distributions are not usable (NaN, infinite or no mass): it ends with "
                          "an error", row.request_id)
                updates.append(RowUpdate(row.request_id, (), n_drafted, 0, "error"))
                continue
            path = range(accepted) if verdict.paths is None else verdict.paths[i]
            new = [drafted_row[node] for node in path] + [nxt]
            if verdict.paths is not None:  # the accepted nodes' cache entries follow the pending token's
                start = len(row.prompt) + len(row.output) - 1
                self.cache.keep_path(row.slot, start, [0] + [1 + node for node in path])
            target_lengths.append(len(row.prompt) + len(row.output) + accepted)
            new, reason = self._apply_stops(row, new)
            row.output.extend(new)
            if row.noise is not None:
                row.noise.forget_before(len(row.output))
            kept.append(i)
            committed.append(new)
            logprobs = None
            if row.params.logprobs is not None and target_logits is not None:  # the target's positions of the path
                positions = [0] + [1 + node for node in path]
                logprobs = tuple(TokenLogprob(token, lp, top) for token, (lp, top) in zip(
                    new, token_logprobs(target_logits[i, positions[: len(new)]], new, row.params.logprobs)))
            if row.processors is not None and not row.processors.commit(new):
                log.error("request %s: its grammar disallows a committed token: it ends with an error", row.request_id)
                reason = "error"
            updates.append(RowUpdate(row.request_id, tuple(new), n_drafted, accepted, reason, logprobs))
        slots = [rows[i].slot for i in kept]
        if not slots:
            return updates
        self.cache.truncate(torch.tensor(slots, dtype=torch.long), torch.tensor(target_lengths, dtype=torch.long))
        if self.drafter is not None:
            self.drafter.commit(slots, committed)
            if features is not None:  # the pending token's position and each accepted draft's
                self.drafter.add_features(slots, [_path_features(features, i, verdict)[: len(new)]
                                                  for i, new in zip(kept, committed)])
        return updates

    def _apply_stops(self, row: _Row, new: list[int]) -> tuple[list[int], str | None]:
        for i, token in enumerate(new):
            if token in self.eos_token_ids:
                return new[: i + 1], "stop"
        if len(new) >= row.remaining:
            return new[: row.remaining], "length"
        return new, None

    # ----- slots ----------------------------------------------------------------------------

    def _admit(self) -> tuple[int, int, int, int]:
        """Give waiting requests rows, up to `max_batch_size` running, and prefill their prompts but the last token;
        a request whose prompt starts with what a kept row's cache holds takes that row and prefills only the rest.
        Returns (requests admitted, prompt tokens cached, requests that reused a prefix, tokens reused)."""
        with self._lock:
            admitted = []
            while self._waiting and len(self._running) + len(admitted) < self.config.max_batch_size:
                admitted.append(self._waiting.popleft())
        if not admitted:
            return 0, 0, 0, 0
        reused = [self._take_slot(row) for row in admitted]
        slots = torch.tensor([r.slot for r in admitted], dtype=torch.long)
        self.cache.reset(slots[torch.tensor([n == 0 for n in reused])])
        if any(reused):
            self.cache.truncate(slots, torch.tensor(reused, dtype=torch.long))  # the shared prefix stays
        try:
            wants = self._wants_features()
            features = prefill_ragged(self.target, self.cache, slots, [r.prompt[n:-1] for r, n in zip(admitted, reused)],
                                      wants)
            if self.drafter is not None:
                self.drafter.add_rows([r.slot for r in admitted], [r.prompt for r in admitted])
                if wants:
                    self.drafter.add_features([r.slot for r in admitted], features)
        except Exception:  # e.g. out of memory on a long prompt: give the slots back, then report
            self.cache.reset(slots)
            if self.drafter is not None:
                self.drafter.release_rows([r.slot for r in admitted])
            with self._lock:
                self._free_slots = sorted(self._free_slots + [r.slot for r in admitted])
            raise
        for row in admitted:
            self._running[row.slot] = row
        return (len(admitted), sum(len(r.prompt) - 1 for r in admitted), sum(n > 0 for n in reused), sum(reused))

    def _take_slot(self, row: _Row) -> int:
        """Give `row` a slot; return how many leading prompt tokens that slot's target cache already holds. The kept
        row sharing the longest prefix with its prompt (at least MIN_REUSED tokens) is taken; else a free slot; else
        the least recently kept row is dropped for it."""
        cacheable = row.prompt[:-1]  # the last prompt token is scored in the first round
        best, shared = None, 0
        for slot, tokens in self._kept.items():
            n = _common_prefix(tokens, cacheable)
            if n > shared:
                best, shared = slot, n
        if best is not None and shared >= MIN_REUSED:
            del self._kept[best]
            row.slot = best
            return shared
        with self._lock:
            free = self._free_slots.pop(0) if self._free_slots else None
        if free is None:
            free, _ = self._kept.popitem(last=False)
            self._forget(free)
        row.slot = free
        return 0

    def _forget(self, slot: int) -> None:
        """Empty a row's caches (the target's and the drafter's)."""
        self.cache.reset(torch.tensor([slot], dtype=torch.long))
        if self.drafter is not None:
            self.drafter.release_rows([slot])

    def _apply_cancellations(self) -> list[RowUpdate]:
        with self._lock:
            cancelled, self._cancelled = self._cancelled, set()
            waiting = [r for r in self._waiting if r.request_id in cancelled]
            for row in waiting:
                self._waiting.remove(row)
        running = [r for r in self._running.values() if r.request_id in cancelled]
        self._release(running, keep={r.request_id for r in running})  # a cancelled row's caches are consistent
        return [RowUpdate(r.request_id, (), 0, 0, "cancelled") for r in waiting + running]

    def _release(self, rows: list[_Row], keep: set[str] = frozenset()) -> None:
        """Free finished or cancelled rows. Rows named in `keep` (requests that ended well) keep their caches for a
        later request sharing their prefix, the least recently finished dropped beyond `config.prefix_cache_rows`;
        kept only where the drafter can keep its own state too (a feature draft cannot: it needs the target's
        features of every prompt position)."""
        if not rows:
            return
        keeping = (self.config.prefix_cache_rows > 0 and not self._wants_features()
                   and (self.drafter is None or isinstance(self.drafter, PrefixKeeper)))
        kept = [r for r in rows if keeping and r.request_id in keep]
        dropped = [r for r in rows if r not in kept]
        if dropped:
            slots = [r.slot for r in dropped]
            self.cache.reset(torch.tensor(slots, dtype=torch.long))
            if self.drafter is not None:
                self.drafter.release_rows(slots)
        if kept:
            if self.drafter is not None:
                self.drafter.park_rows([r.slot for r in kept])
            for row in kept:
                tokens = row.prompt + row.output
                held = min(int(self.cache.lengths[row.slot]), len(tokens))  # entries past an EOS cut are dropped
                self.cache.truncate(torch.tensor([row.slot]), torch.tensor([held]))
                self._kept[row.slot] = tokens[:held]
            while len(self._kept) > self.config.prefix_cache_rows:
                slot, _ = self._kept.popitem(last=False)
                self._forget(slot)
                with self._lock:
                    self._free_slots.append(slot)
        for row in rows:
            self.planner.forget(row.request_id)
        with self._lock:
            for row in rows:
                del self._running[row.slot]
            self._free_slots.extend(r.slot for r in dropped)
            self._free_slots.sort()

    def _now(self) -> float:
        if self.target.device.type == "cuda":
            torch.cuda.synchronize(self.target.device)  # timings must include queued GPU work
        return self.clock()


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _block_parents(proposal: Proposal) -> Tensor:
    """`[b, nodes + 1]` parents in the scored block: the pending token first (-1), then the proposal's nodes (their
    parents shifted by one, the pending token at 0); nodes past a row's count hang from the pending token."""
    parents = proposal.parents + 1
    real = torch.arange(parents.shape[1]).unsqueeze(0) < proposal.num_drafted.unsqueeze(1)
    parents = torch.where(real, parents, torch.zeros_like(parents))
    return torch.cat([torch.full((parents.shape[0], 1), -1, dtype=torch.long), parents], dim=1)


def _path_features(features: Tensor, row: int, verdict: Verdict) -> Tensor:
    """The target's features of row `row`'s committed positions: the pending token's, then each accepted draft's."""
    if verdict.paths is None:
        return features[row]
    return features[row, [0] + [1 + node for node in verdict.paths[row]]]


def _depths(proposal: Proposal) -> Tensor:
    """`[b, nodes]` each proposal node's depth (1 for the pending token's children)."""
    from specsample.models.llama import tree_ancestors

    return tree_ancestors(_block_parents(proposal))[1][:, 1:]


def _failed_rows(verdict: Verdict) -> list[bool]:
    """Per row, whether the verifier found its distributions unusable."""
    rows = verdict.num_accepted.shape[0]
    return [False] * rows if verdict.failed is None else verdict.failed.cpu().tolist()


def _allocate_or_drop(drafter: Drafter | None, slots: int, max_len: int) -> Drafter | None:
    """Give the drafter its caches; if they cannot be allocated, decode without drafting (loudly)."""
    if drafter is None:
        return None
    try:
        drafter.allocate(slots, max_len)
    except (RuntimeError, MemoryError) as exc:  # out of memory (CPU or GPU): never fail requests for it
        log.warning("draft cache could not be allocated (%s): decoding WITHOUT speculation", exc)
        return None
    return drafter


def _round_stats(plan: RoundPlan, proposal: Proposal, verdict: Verdict, updates: list[RowUpdate], scored_rows: int,
                 seconds: tuple[float, float, float, float], admitted: tuple[int, int, int, int]) -> RoundStats:
    """Counters of the round; `seconds`: its prefill, draft, target and verify-and-commit time; `admitted`: requests
    admitted, their prompt tokens cached, those that reused a prefix and the tokens reused."""
    gamma = proposal.tokens.shape[1]
    num_drafted, num_accepted = proposal.num_drafted, verdict.num_accepted.cpu()
    positions = torch.arange(gamma).unsqueeze(0)  # [1, gamma]; in a tree round, depths 1..
    drafted_at = (positions < num_drafted.unsqueeze(1)).sum(dim=0)
    if proposal.parents is not None and gamma > 0:  # rows whose tree reaches each depth
        depths = _depths(proposal)
        deepest = int(torch.where(positions < num_drafted.unsqueeze(1), depths, 0).max())
        positions = positions[:, :deepest]
        drafted_at = torch.stack([((depths > d) & (torch.arange(gamma) < num_drafted.unsqueeze(1))).any(dim=1).sum()
                                  for d in range(deepest)]) if deepest else positions.sum(dim=0)
    accepted_at = (positions < num_accepted.unsqueeze(1)).sum(dim=0)
    planned = torch.tensor([r.drafts for r in plan.rows])
    return RoundStats(
        batch_size=len(updates), gamma=gamma,
        drafted=int(num_drafted.sum()), accepted=int(num_accepted.sum()),
        emitted=sum(len(u.new_tokens) for u in updates),
        drafted_per_position=tuple(drafted_at.tolist()), accepted_per_position=tuple(accepted_at.tolist()),
        prefill_seconds=seconds[0], draft_seconds=seconds[1], target_seconds=seconds[2], verify_seconds=seconds[3],
        fallback_rows=sum(r.fallback for r in plan.rows), scored_rows=scored_rows, lookup_rows=plan.lookups,
        extended_rows=int((num_drafted > planned).sum()) if gamma else 0,
        tree_rows=int((num_drafted > 0).sum()) if proposal.parents is not None else 0,
        tree_nodes=plan.tree.nodes if plan.tree is not None and proposal.parents is not None else 0,
        admitted=admitted[0], admitted_tokens=admitted[1], prefix_hits=admitted[2], reused_tokens=admitted[3],
    )
