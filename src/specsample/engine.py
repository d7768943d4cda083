"""The engine loop, one round per `step()`: plan -> propose -> score -> verify -> commit -> learn.

The planner (fixed gamma, or gamma auto) hands back a plan per round; the drafter proposes up to that many
tokens per row; the target scores every row's pending token and drafts in one forward; the verifier accepts a
prefix and draws the recovered or bonus token; the caches keep the accepted prefix; the planner learns from
what happened. Plain decoding is the same loop with a drafter that proposes nothing. Which request runs in which
row, and which finished row a new request reuses, is the scheduler's. The CLI, the server, Ray and the benchmarks
all drive this one loop.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
from torch import Tensor

from specsample.config import SamplingParams, SettingError, SpecConfig
from specsample.drafters.base import (
    ChunkedPrefill,
    Drafter,
    DraftRequest,
    DraftRow,
    NoDrafter,
    Proposal,
    allocated,
    backlog_scorer,
    check_vocabulary,
    chunked_prefill,
    feature_drafter,
    prompt_lookup,
)
from specsample.grammar import GrammarCompiler
from specsample.models import compile_events
from specsample.models.base import CausalLM, FeatureLM, TreeLM, prefill_ragged
from specsample.models.fused import torch_ops_alone
from specsample.models.row_padding import score_padded
from specsample.planner import FixedGamma, Planner
from specsample.planner.base import BatchState, RoundPlan, RowState
from specsample.prefill_budget import PrefillPacer, RoundBudget
from specsample.processors import RowProcessors, Shaper, token_logprobs
from specsample.rounds import RoundResult, RoundStats, RowUpdate, TokenLogprob, round_outcome, round_stats
from specsample.scheduler import Admission, Request, Scheduler
from specsample.token_tree import block_parents
from specsample.verification.chain import Verdict
from specsample.verification.coupled import DraftNoise, NoiseStream
from specsample.verification.verifier import Verifier

__all__ = ["Engine", "RoundResult", "RoundStats", "RowUpdate", "TokenLogprob"]

log = logging.getLogger("specsample.engine")


class Engine:
    """Runs a batch of requests through speculative (or plain) decoding, one round per `step()`.

    Requests may be added and cancelled between rounds from other threads; each keeps its own
    slot in the target's and the drafter's caches and its own seeded generator, so no request sees
    another's tokens. With coupled sampling (`SpecConfig.coupled`, specsample.verification.coupled) a seeded request
    gives the tokens plain decoding with that seed gives, whatever the plan and the batch (up to the rounding of the
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
        """`drafter` None decodes plainly; `planner` defaults to a fixed gamma (`FixedGamma`): pass gamma auto
        (`GammaController`), or one that keeps what it learnt across engines. `clock` times the rounds the planner
        learns costs from. `grammars` compiles the requests' grammars for the target's tokenizer (None: requests with
        a grammar are refused)."""
        drafter = NoDrafter() if drafter is None else drafter
        check_vocabulary(drafter.vocab_size, target.vocab_size)
        if drafter.abilities.reads_features and not isinstance(target, FeatureLM):
            raise ValueError(
                f"the draft reads the target's hidden states, which the target's runtime "
                f"({type(target).__name__}) does not return; use our Llama-family runtime"
            )
        self.planner = planner if planner is not None else FixedGamma()
        self.target, self.config, self.clock, self.grammars = target, config, clock, grammars
        self.verifier = Verifier(config.coupled)
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.max_seq_len = min(config.max_seq_len or target.max_seq_len, target.max_seq_len)
        room = self.planner.most_drafts  # the most drafts a round holds per row
        # slack past max_seq_len: padded positions of a round may be written (never read) beyond it
        widest = max(room + 1, max(config.target_widths, default=0))
        slots = config.max_batch_size + config.prefix_cache_rows  # running rows, and finished ones kept for reuse
        self.cache = target.new_cache(slots, self.max_seq_len + widest + 1)
        self.drafter = allocated(drafter, slots, self.max_seq_len + room + 2)
        self.scheduler = Scheduler(
            self.cache, self.drafter, config.max_batch_size, config.prefix_cache_rows, config.prefix_cache_tokens
        )
        # how much prompt prefilling a round does while others decode, from what decoding and prefilling cost here
        self.pacer = PrefillPacer(config.prefill_chunk_tokens, config.prefill_time_ratio)
        # the target scores token trees where it can (checked once: a runtime protocol check inspects every member)
        self._tree_target: TreeLM | None = target if isinstance(target, TreeLM) else None
        # the width of the target's features (0: it returns none): a feature draft's row copied whole gets [0, width]
        self._feature_size = target.feature_size if isinstance(target, FeatureLM) else 0

    # ----- requests -------------------------------------------------------------------------

    def add_request(
        self,
        prompt: Sequence[int],
        params: SamplingParams = SamplingParams(),
        request_id: str | None = None,
        speculative: bool = True,
        gamma: int | None = None,
        cache_scope: str = "",
    ) -> str:
        """Queue a request; it joins the running batch once it has a slot and its prompt is prefilled. It starts from
        the cache of another request sharing its prefix (running or finished and kept) only where both have the same
        `cache_scope` (a tenant, say)."""
        prompt = [int(t) for t in prompt]
        self.check_request(prompt, params, gamma)
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        request = Request(
            request_id=request_id or self.scheduler.new_id(),
            prompt=prompt,
            params=params,
            seed=seed,
            generator=torch.Generator().manual_seed(seed),
            speculative=speculative and self.config.speculative and not isinstance(self.drafter, NoDrafter),
            gamma=gamma,
            cache_scope=cache_scope,
            noise=NoiseStream(seed, self.target.vocab_size) if self.config.coupled and not params.greedy else None,
            processors=(
                RowProcessors(params, prompt, self.target.vocab_size, self.grammars, self.eos_token_ids)
                if params.processed
                else None
            ),
        )
        self.scheduler.add(request)
        return request.request_id

    def check_request(self, prompt: Sequence[int], params: SamplingParams, gamma: int | None = None) -> None:
        """Raise `ValueError` naming the problem if this request cannot run."""
        if len(prompt) == 0:
            raise ValueError("prompt is empty: give at least one token")
        bad = [t for t in prompt if not 0 <= t < self.target.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary (size {self.target.vocab_size})")
        if len(prompt) + params.max_new_tokens > self.max_seq_len:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds the "
                f"context window ({self.max_seq_len} tokens)"
            )
        if gamma is not None and not 1 <= gamma <= self.planner.max_gamma:
            raise ValueError(f"gamma must be in 1..{self.planner.max_gamma} (the engine's maximum), got {gamma}")
        outside = [t for t, _ in params.logit_bias if t >= self.target.vocab_size]
        if outside:
            raise SettingError(
                "logit_bias",
                f"logit_bias names token id {outside[0]}, outside the vocabulary (size {self.target.vocab_size})",
            )
        if params.grammar is not None:
            if self.grammars is None:
                raise SettingError(
                    "grammar",
                    "this engine has no grammar compiler: a grammar needs the target's "
                    "tokenizer (specsample.grammar.GrammarCompiler)",
                )
            self.grammars.compile(params.grammar)  # raises SettingError for a grammar the compiler refuses

    def cancel(self, request_id: str) -> None:
        """Stop a request; its slot is freed at the next round."""
        self.scheduler.cancel(request_id)

    def waiting_ids(self) -> set[str]:
        """The requests queued for a slot (not yet admitted)."""
        return self.scheduler.waiting_ids()

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    def has_work(self) -> bool:
        """True while any request is running or waiting."""
        return self.scheduler.has_work()

    # ----- the loop -------------------------------------------------------------------------

    def stream(self) -> Iterator[RoundResult]:
        """Step until every request has finished, yielding each round's result."""
        while self.has_work():
            yield self.step()

    def step(self) -> RoundResult:
        """Run one round for every running request (admitting waiting ones first)."""
        with torch_ops_alone(self.target):
            return self._round()

    @torch.inference_mode()
    def _round(self) -> RoundResult:
        cancelled = self._cancel()
        compiled = compile_events.counts()  # what compiled models do this round
        start = self.clock()
        admission = self._admit()  # waiting requests get rows; their prompts are prefilled
        prefill_done = self._now()
        rows = self.scheduler.running()
        if not rows:
            stats = RoundStats(0, 0, 0, 0, 0, (), (), prefill_done - start, 0.0, 0.0, 0.0, **admission.counters())
            return RoundResult(tuple(cancelled), stats, self.clock())
        plan = self.planner.plan(self._batch_state(rows))  # drafts per row, the gate: a value
        backlog = self._score_backlogs(rows, plan)  # row -> the draft's probabilities of tokens plain rounds committed
        shaper = self._shaper(rows)  # the rows' processors, for the draft's steps and the target's positions alike
        proposal = self._propose(rows, plan, shaper)  # [b, gamma] drafts, on the target's device
        draft_done = self._now()
        block = self._block(rows, proposal)  # [b, gamma + 1]: each row's pending token, then its drafts
        target_logits, features = self._score(rows, block, proposal)  # [b, gamma + 1, vocab], one forward
        target_done = self._now()
        if shaper is not None:  # each position processed with the drafts on the path to it
            target_logits = shaper.block_logits(
                target_logits,
                [r.slot for r in rows],
                block,
                None if proposal.parents is None else block_parents(proposal.parents, proposal.num_drafted),
            )
        verdict, target_probs = self.verifier(
            block, proposal, target_logits, [r.params for r in rows], [r.generator for r in rows], self._noise(rows)
        )
        updates = self._commit(rows, proposal, verdict, features, target_logits)  # caches keep the accepted prefix
        verify_done = self._now()
        self.pacer.learn_decoding(verify_done - prefill_done)
        finished = [(r, u) for r, u in zip(rows, updates) if u.finish_reason is not None]
        # learning comes last: the round's time it learns from includes the commit
        self.planner.learn(
            plan,
            round_outcome(
                rows,
                updates,
                proposal,
                verdict,
                target_probs,
                backlog,
                self.config.coupled,
                (draft_done - prefill_done, target_done - draft_done, verify_done - target_done),
            ),
        )
        self.scheduler.finish(
            [r for r, _ in finished], keep={r.request_id for r, u in finished if u.finish_reason in ("stop", "length")}
        )
        stats = round_stats(
            plan,
            proposal,
            verdict,
            updates,
            len(backlog),
            (prefill_done - start, draft_done - prefill_done, target_done - draft_done, verify_done - target_done),
            admission.counters(),
            compile_events.since(compiled),
        )
        return RoundResult(tuple(cancelled + updates), stats, self.clock())

    # ----- the round's parts ----------------------------------------------------------------

    def _batch_state(self, rows: list[Request]) -> BatchState:
        """What the planner sees of the running rows, with what prompt lookup offers each (it depends on the past
        only) where the drafter looks up; what the drafter can do as it declares it now (a server's may change)."""
        abilities = self.drafter.abilities
        lookup = prompt_lookup(self.drafter)
        lookups: dict[int, tuple[int, bool]] = {}
        chosen = [r for r in rows if r.speculative and r.gamma is None]
        if lookup is not None and chosen:
            slots = [r.slot for r in chosen]
            lengths = lookup.lookup_lengths(
                slots, [max(0, min(self.planner.max_gamma, r.remaining - 1)) for r in chosen]
            )
            lookups = dict(zip(slots, zip(lengths, lookup.drafts_otherwise(slots))))
        states = tuple(
            RowState(
                r.request_id,
                r.remaining,
                r.gamma,
                r.speculative,
                lookup=lookups.get(r.slot, (0, True))[0],
                drafts_otherwise=lookups.get(r.slot, (0, True))[1],
            )
            for r in rows
        )
        return BatchState(
            states,
            can_score=abilities.scores_backlog,
            offers_lookups=abilities.looks_up,
            can_tree=self._tree_target is not None,
        )

    def _wants_features(self) -> bool:
        """Whether the drafter drafts from the target's hidden states."""
        return self.drafter.abilities.reads_features

    def _score_backlogs(self, rows: list[Request], plan: RoundPlan) -> dict[int, tuple[float, ...]]:
        """The draft's probabilities of the tokens plain rounds committed, teacher-forced, for the rows the plan asks
        (the planner pairs them with the target's). Only the past is read, so sampling stays exact."""
        chosen = [i for i, r in enumerate(rows) if plan.rows[i].score_backlog > 0]
        scorer = backlog_scorer(self.drafter)
        if not chosen or scorer is None:
            return {}
        scored = scorer.score_backlog(
            [rows[i].slot for i in chosen],
            [plan.rows[i].score_backlog for i in chosen],
            [rows[i].params for i in chosen],
        )
        return {i: tuple(probs) for i, probs in zip(chosen, scored)}

    @staticmethod
    def _shaper(rows: list[Request]) -> Shaper | None:
        """The round's processors by slot; None when no row has any (nothing to do)."""
        processed = {r.slot: r.processors for r in rows if r.processors is not None}
        return Shaper(processed) if processed else None

    @staticmethod
    def _block(rows: list[Request], proposal: Proposal) -> Tensor:
        """`[b, gamma + 1]` the block the target scores: each row's pending token, then its drafts."""
        pending = torch.tensor([[r.last_token] for r in rows], dtype=torch.long, device=proposal.tokens.device)
        return torch.cat([pending, proposal.tokens], dim=1)

    def _propose(self, rows: list[Request], plan: RoundPlan, shaper: Shaper | None = None) -> Proposal:
        """The drafter's proposal for the plan, its columns no row used dropped, its tokens on the target's device."""
        device = self.target.device
        if plan.width == 0:
            empty = torch.zeros(len(rows), 0, dtype=torch.long)
            return Proposal(empty.to(device), None, torch.zeros(len(rows), dtype=torch.long))
        if plan.width > self.planner.most_drafts:
            raise ValueError(
                f"the planner planned {plan.width} drafts for a row, more than the engine's caches hold "
                f"({self.planner.most_drafts})"
            )
        noise = self._noise(rows)
        proposal = self.drafter.propose(
            DraftRequest(
                tuple(
                    DraftRow(r.slot, p.drafts, p.reach, r.params, r.generator, p.source, noise[i] if noise else None)
                    for i, (r, p) in enumerate(zip(rows, plan.rows))
                ),
                plan.stop_thresholds,
                plan.extension,
                tree=plan.tree,
                shaper=shaper,
                coupled=self.config.coupled,
                lookup_trees=plan.lookup_trees,
            )
        )
        num_drafted = torch.minimum(proposal.num_drafted.cpu(), torch.tensor([p.reach for p in plan.rows]))
        used = int(num_drafted.max())  # the drafter may have stopped every row early
        return Proposal(
            proposal.tokens[:, :used].to(device),
            proposal.probs[:, :used] if proposal.probs is not None else None,
            num_drafted,
            proposal.confidence[:, :used] if proposal.confidence is not None else None,
            proposal.parents[:, :used] if proposal.parents is not None else None,
        )

    def _score(self, rows: list[Request], block: Tensor, proposal: Proposal) -> tuple[Tensor, Tensor | None]:
        """Target logits `[b, gamma + 1, vocab]` at each row's pending token and drafts, in one forward (at the
        width the target runs fastest, measured; the commit rolls the padding back), and the target's features
        there where the drafter reads them (else None)."""
        tokens = block.to(self.target.device)
        slots = torch.tensor([r.slot for r in rows], dtype=torch.long)
        if proposal.parents is not None:  # a token tree per row: every node in the same forward
            if self._tree_target is None:
                raise ValueError(f"the target's runtime ({type(self.target).__name__}) scores no token trees")
            parents = block_parents(proposal.parents, proposal.num_drafted)
            logits, hidden = self._tree_target.forward_cached_tree(tokens, self.cache, slots, parents)
            return logits, hidden if self._wants_features() else None
        width = (
            self.config.target_widths[tokens.shape[1] - 1]
            if (len(rows) == 1 and tokens.shape[1] <= len(self.config.target_widths))
            else tokens.shape[1]
        )
        return score_padded(self.target, tokens, self.cache, slots, width, features=self._wants_features())

    def _noise(self, rows: list[Request]) -> tuple[DraftNoise | None, ...]:
        """Each row's coupled noise for this round (None: a greedy row); empty unless sampling is coupled."""
        if not self.config.coupled:
            return ()
        return tuple(None if r.noise is None else DraftNoise(r.noise, len(r.output)) for r in rows)

    def _commit(
        self,
        rows: list[Request],
        proposal: Proposal,
        verdict: Verdict,
        features: Tensor | None = None,
        target_logits: Tensor | None = None,
    ) -> list[RowUpdate]:
        """Each row's new tokens (its accepted drafts and the next token, cut at EOS or its budget); the target's
        cache keeps the prompt, earlier output and the accepted drafts, the drafter follows (with the target's
        features of the committed positions, where it reads them). A failed row commits nothing and ends with
        "error"; its caches are reset when it is released. What the round decided crosses to the host once."""
        device = verdict.next_token.device
        failed = torch.zeros_like(verdict.next_token) if verdict.failed is None else verdict.failed
        decided = torch.stack(
            [verdict.num_accepted.to(device, torch.long), verdict.next_token.long(), failed.to(device, torch.long)],
            dim=1,
        )  # [b, 3]
        if verdict.paths is not None:
            decided = torch.cat([decided, verdict.paths.to(device)], dim=1)  # [b, 3 + depth]
        decided_rows: list[list[int]] = decided.cpu().tolist()  # the round's one read back to the host
        drafts = proposal.tokens.cpu().tolist()
        updates, kept, committed, target_lengths, paths = [], [], [], [], []
        for i, (row, (accepted, nxt, bad, *tree_path), drafted_row, n_drafted) in enumerate(
            zip(rows, decided_rows, drafts, proposal.num_drafted.tolist())
        ):
            if bad:
                log.error(
                    "request %s: its distributions are not usable (NaN, infinite or no mass): it ends with an error",
                    row.request_id,
                )
                updates.append(RowUpdate(row.request_id, (), n_drafted, 0, "error"))
                continue
            path = [node for node in tree_path if node >= 0] if verdict.paths is not None else list(range(accepted))
            new = [drafted_row[node] for node in path] + [nxt]
            if verdict.paths is not None:  # the accepted nodes' cache entries follow the pending token's
                start = len(row.prompt) + len(row.output) - 1
                self.cache.keep_path(row.slot, start, [0] + [1 + node for node in path])
            target_lengths.append(len(row.prompt) + len(row.output) + accepted)
            new, reason = row.cut(new, self.eos_token_ids)
            row.output.extend(new)
            if row.noise is not None:
                row.noise.forget_before(len(row.output))
            kept.append(i)
            committed.append(new)
            paths.append(path)
            logprobs = None
            if row.params.logprobs is not None and target_logits is not None:  # the target's positions of the path
                positions = [0] + [1 + node for node in path]
                logprobs = tuple(
                    TokenLogprob(token, lp, top)
                    for token, (lp, top) in zip(
                        new, token_logprobs(target_logits[i, positions[: len(new)]], new, row.params.logprobs)
                    )
                )
            if row.processors is not None and not row.processors.commit(new):
                log.error("request %s: its grammar disallows a committed token: it ends with an error", row.request_id)
                reason = "error"
            updates.append(RowUpdate(row.request_id, tuple(new), n_drafted, accepted, reason, logprobs))
        slots = [rows[i].slot for i in kept]
        if not slots:
            return updates
        self.cache.truncate(torch.tensor(slots, dtype=torch.long), torch.tensor(target_lengths, dtype=torch.long))
        self.drafter.commit(slots, committed)
        reader = feature_drafter(self.drafter)
        if features is not None and reader is not None:  # the pending token's position and each accepted draft's
            reader.add_features(
                slots,
                [
                    features[i, [0] + [1 + node for node in path]][: len(new)]
                    for i, path, new in zip(kept, paths, committed)
                ],
            )
        return updates

    # ----- rows -----------------------------------------------------------------------------

    def _admit(self) -> Admission:
        """Rows for waiting requests (the scheduler's choice, each starting from the longest prefix another row holds),
        then their prompts but the last token prefilled where their rows do not hold them yet: all of them, or while
        other rows decode, within the round's budget (`specsample.prefill_budget`: in tokens, and in time beside the
        decoding), oldest first, the drafter's work (`ChunkedPrefill`) in the same budget. A row waiting for another's
        prefix copies it as soon as that row's prefill gets past it, this round included. A row whose prompt is in its
        cache runs from this round on, or, prefilled over several rounds beside decoding ones, from the next (so its
        first decode is not a prefill's round too); the drafter follows it then (with the target's features of its
        prefilled positions, where it reads them)."""
        self.scheduler.admit()
        budget = self.pacer.round() if self.scheduler.num_running and self.pacer.bounded else None
        chunked = chunked_prefill(self.drafter) if budget is not None else None
        reader = feature_drafter(self.drafter)
        seen: set[int] = set()
        touched: list[Request] = []
        worked: set[int] = set()  # rows prefilled this round
        spent = 0
        try:
            while True:  # again for rows that copied a prefix the pass before prefilled
                rows = [r for r in self.scheduler.prefilling() if r.donor is None and id(r) not in seen]
                if not rows:
                    break
                seen.update(id(r) for r in rows)
                touched += rows
                if chunked is not None and budget is not None:
                    worked.update(self._prefill_drafts(chunked, rows, budget))
                work: list[tuple[Request, int]] = []
                for request in rows:
                    rest = len(request.prompt) - 1 - request.prefilled
                    n = rest if budget is None else budget.grant("target", rest)
                    if n > 0:
                        work.append((request, n))
                if not work:
                    continue
                started = self.clock()
                features = prefill_ragged(
                    self.target,
                    self.cache,
                    torch.tensor([r.slot for r, _ in work], dtype=torch.long),
                    [r.prompt[r.prefilled : r.prefilled + n] for r, n in work],
                    reader is not None,
                )
                tokens = sum(n for _, n in work)
                if budget is not None:
                    budget.spend("target", tokens, self._now() - started)
                spent += tokens
                for i, (request, n) in enumerate(work):
                    request.prefilled += n
                    worked.add(id(request))
                    if features is not None:
                        request.features.append(features[i])
            for request in touched:
                request.prefill_rounds += id(request) in worked
            done = [r for r in touched if self._prefilled(r, budget, id(r) in worked)]
            if done:
                self.drafter.add_rows([r.slot for r in done], [r.prompt for r in done])
                if reader is not None:
                    reader.add_features(
                        [r.slot for r in done],
                        [
                            torch.cat(r.features, dim=0) if r.features else torch.zeros(0, self._feature_size)
                            for r in done
                        ],
                    )
        except Exception:  # e.g. out of memory on a long prompt: give the slots back, then report
            self.scheduler.unwind(touched)
            raise
        self.scheduler.started(done)
        return Admission(tuple(done), tuple(r.reused for r in done), spent)

    def _prefill_drafts(self, drafter: ChunkedPrefill, rows: list[Request], budget: RoundBudget) -> set[int]:
        """The drafter's prefill work of rows being prefilled, within the round's budget, oldest first (rows start
        as the first round prefilling them begins); the ids of the rows that did some."""
        fresh = [r for r in rows if r.draft_work is None]
        if fresh:
            for request, work in zip(fresh, drafter.start_rows([r.slot for r in fresh], [r.prompt for r in fresh])):
                request.draft_work = work
        parts = [(r, budget.grant("draft", r.draft_work or 0)) for r in rows]
        parts = [(r, n) for r, n in parts if n > 0]
        if not parts:
            return set()
        started = self.clock()
        drafter.prefill_rows([r.slot for r, _ in parts], [n for _, n in parts])
        budget.spend("draft", sum(n for _, n in parts), self._now() - started)
        for request, n in parts:
            request.draft_work = (request.draft_work or 0) - n
        return {id(r) for r, _ in parts}

    @staticmethod
    def _prefilled(request: Request, budget: RoundBudget | None, worked: bool) -> bool:
        """Whether a row being prefilled runs from this round: its prompt (but the last token) is in its cache and,
        within a budget, the drafter's work is done and the prefill did not take several rounds ending in this one."""
        if request.prefilled < len(request.prompt) - 1:
            return False
        return budget is None or (not request.draft_work and not (worked and request.prefill_rounds > 1))

    def _cancel(self) -> list[RowUpdate]:
        """End the cancelled requests (a cancelled row's caches are consistent: they are kept for reuse)."""
        waiting, running = self.scheduler.take_cancelled()
        self.scheduler.finish(running, keep={r.request_id for r in running})
        for request in running:
            self.planner.forget(request.request_id)
        return [RowUpdate(r.request_id, (), 0, 0, "cancelled") for r in waiting + running]

    def _now(self) -> float:
        if self.target.device.type == "cuda":
            torch.cuda.synchronize(self.target.device)  # timings must include queued GPU work
        return self.clock()
