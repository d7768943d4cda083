"""The engine loop: prefill -> draft gamma tokens -> one target forward over gamma + 1 positions ->
verify -> commit / roll back -> repeat, as one `step()` that the CLI, the server and the benchmarks
all drive. Plain autoregressive decoding is the same loop with gamma = 0.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from specsample.config import SamplingParams, SpecConfig
from specsample.controller import ControllerConfig, GammaController
from specsample.drafters.base import BacklogScorer, Drafter, Extension, PromptLookup
from specsample.models.base import CausalLM, prefill_ragged
from specsample.models.row_padding import score_padded
from specsample.sampling import warp_rows
from specsample.verify import Verdict, acceptance_probabilities, verify, verify_greedy

log = logging.getLogger("specsample.engine")

BACKLOG_KEPT = 64  # most plain-round tokens a row keeps for its draft to score (the controller remembers ~25 trials)


@dataclass(frozen=True)
class RowUpdate:
    """What one request got from one round."""

    request_id: str
    new_tokens: tuple[int, ...]  # committed this round (after EOS / length truncation)
    num_drafted: int
    num_accepted: int
    finish_reason: str | None  # "stop" (EOS), "length", "cancelled"; None while running


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
    fallback_rows: int = 0  # rows the gamma controller kept from drafting this round
    scored_rows: int = 0  # rows whose draft scored the tokens it missed (the controller's probes in fallback)
    lookup_rows: int = 0  # rows the gamma controller had propose a prompt lookup instead of drafting with a model
    extended_rows: int = 0  # rows that drafted past the gamma the controller planned (confident drafts)


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


class Engine:
    """Runs a batch of requests through speculative (or plain) decoding, one round per `step()`.

    Requests may be added and cancelled between rounds from other threads; each keeps its own
    slot in the target's and the drafter's caches and its own seeded generator, so no request sees
    another's tokens and a seeded request gives the same output in any batch.
    """

    def __init__(
        self,
        target: CausalLM,
        drafter: Drafter | None = None,
        config: SpecConfig = SpecConfig(),
        eos_token_ids: Iterable[int] = (),
        controller: GammaController | None = None,
    ) -> None:
        """`controller` overrides the gamma controller an adaptive config would create."""
        if drafter is not None and drafter.vocab_size is not None and drafter.vocab_size != target.vocab_size:
            raise ValueError(
                f"draft vocabulary ({drafter.vocab_size}) differs from target vocabulary "
                f"({target.vocab_size}); pick a draft trained with the target's tokenizer, or use an "
                "n-gram drafter"
            )
        self.target = target
        self.config = config
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.max_len = min(config.max_seq_len or target.max_seq_len, target.max_seq_len)
        # slack past max_len: padded positions of a round may be written (never read) beyond it
        widest = max(config.gamma + 1, max(config.target_widths, default=0))
        self.cache = target.new_cache(config.max_batch_size, self.max_len + widest + 1)
        self.drafter = _allocate_or_drop(drafter, config.max_batch_size, self.max_len + config.gamma + 2)
        self._abilities: tuple[Drafter | None, bool, bool] = (None, False, False)  # see _can_score, _can_look_up
        self._use_lookup: list[bool | None] | None = None  # this round, per row: its lookup chosen (see _plan)
        if controller is None and config.adaptive:
            controller = GammaController(ControllerConfig(max_gamma=config.gamma))
        self.controller = controller
        self._free_slots = list(range(config.max_batch_size))
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

    def cancel(self, request_id: str) -> None:
        """Stop a request; its slot is freed at the next round."""
        with self._lock:
            self._cancelled.add(request_id)

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
        cancelled_updates = self._apply_cancellations()
        start = time.perf_counter()
        self._admit()
        prefill_done = self._now()
        rows = [self._running[s] for s in sorted(self._running)]
        if not rows:
            stats = RoundStats(0, 0, 0, 0, 0, (), (), prefill_done - start, 0.0, 0.0, 0.0)
            return RoundResult(tuple(cancelled_updates), stats, time.perf_counter())
        gamma, max_drafts, fallback_rows, lookup_rows = self._plan(rows)
        slots = [r.slot for r in rows]
        scored_rows = self._score_backlogs(rows)
        draft_tokens, draft_probs, num_drafted, confidence = self._draft(rows, slots, gamma, max_drafts)
        gamma = draft_tokens.shape[1]  # the drafter may have stopped every row early
        draft_done = self._now()
        device = self.target.device
        slot_tensor = torch.tensor(slots, dtype=torch.long)
        pending = torch.tensor([[r.last_token] for r in rows], dtype=torch.long, device=device)
        device_tokens = draft_tokens.to(device)  # one copy for the scoring, the verdict and the acceptance estimate
        target_input = torch.cat([pending, device_tokens], dim=1)  # [b, gamma + 1]
        # scored at the width the target runs fastest (measured); the commit rolls the padding back
        width = self._scoring_width(len(rows), target_input.shape[1])
        target_logits = score_padded(self.target, target_input, self.cache, slot_tensor, width)  # [b, gamma + 1, vocab]
        target_done = self._now()
        verdict, target_probs = self._verify(rows, device_tokens, draft_probs, target_logits, num_drafted.to(device))
        num_accepted = verdict.num_accepted.cpu()  # [b]; one device-to-host copy per round
        self._note_plain_tokens(rows, num_drafted, verdict, target_probs)
        self._observe(rows, num_drafted, num_accepted, confidence,
                      self._acceptance(device_tokens, draft_probs, target_probs))
        updates = self._commit(rows, slot_tensor, draft_tokens, verdict, num_drafted, num_accepted)
        verify_done = self._now()
        if self.controller is not None:  # whole rounds: scoring and verifying drafts cost too, not only drafting
            self.controller.observe_timing(len(rows), gamma, draft_done - prefill_done, target_done - draft_done,
                                           verify_done - target_done)
        stats = _round_stats(len(rows), gamma, num_drafted, num_accepted, updates,
                             prefill_done - start, draft_done - prefill_done, target_done - draft_done,
                             verify_done - target_done, fallback_rows, scored_rows, lookup_rows,
                             int((num_drafted > torch.tensor(max_drafts)).sum()) if gamma else 0)
        return RoundResult(tuple(cancelled_updates + updates), stats, time.perf_counter())

    def _scoring_width(self, batch_size: int, tokens: int) -> int:
        """Tokens to score for `tokens` asked: `config.target_widths` was measured at batch 1."""
        widths = self.config.target_widths
        return widths[tokens - 1] if batch_size == 1 and tokens <= len(widths) else tokens

    def _plan(self, rows: list[_Row]) -> tuple[int, list[int], int, int]:
        """Drafts per row: fixed or chosen by the controller, never more than a row can use; the largest, and
        how many rows the controller kept from drafting and how many it had propose a prompt lookup."""
        adaptive = [r for r in rows if r.speculative and r.gamma is None and self.controller is not None]
        scorable = [len(r.plain_probs) for r in adaptive] if self._can_score() else None
        lookup = otherwise = None
        if adaptive and self._can_look_up():  # what prompt lookup offers each row now (it depends on the past only)
            slots = [r.slot for r in adaptive]
            lookup = self.drafter.lookup_lengths(slots, [max(0, min(self.config.gamma, r.remaining - 1))
                                                         for r in adaptive])
            otherwise = self.drafter.drafts_otherwise(slots)
        chosen = dict(zip((r.request_id for r in adaptive),
                          self.controller.plan([r.request_id for r in adaptive], len(rows), [r.remaining for r in adaptive],
                                               scorable, lookup, otherwise) if adaptive else []))
        max_drafts = []
        for row in rows:
            wanted = 0 if not row.speculative else chosen.get(row.request_id, row.gamma or self.config.gamma)
            # the draft's cache holds gamma + 2 positions of slack: never draft past config.gamma
            max_drafts.append(max(0, min(wanted, self.config.gamma, row.remaining - 1)))
        fallback = sum(1 for r in adaptive if chosen[r.request_id] == 0)
        planned = self.controller.lookups_planned() if lookup is not None else {}
        # the controller chose per adaptive row between its lookup and the model; other rows keep the drafter's rule
        adaptive_ids = {r.request_id for r in adaptive}
        self._use_lookup = ([(r.request_id in planned) if r.request_id in adaptive_ids else None for r in rows]
                            if lookup is not None else None)
        return max(max_drafts), max_drafts, fallback, len(planned)

    def _can_score(self) -> bool:
        """Whether the drafter scores backlogs (see `_abilities_of`)."""
        return self._abilities_of()[1]

    def _can_look_up(self) -> bool:
        """Whether the drafter says what prompt lookup would propose (see `_abilities_of`)."""
        return self._abilities_of()[2]

    def _abilities_of(self) -> tuple[Drafter | None, bool, bool]:
        """The drafter, whether it scores backlogs, whether it looks up prompts: a runtime protocol check inspects
        every member, a visible part of a plain round's own work, so it runs once per drafter (the engine's
        drafter may be replaced)."""
        if self._abilities[0] is not self.drafter:
            self._abilities = (self.drafter, isinstance(self.drafter, BacklogScorer),
                               isinstance(self.drafter, PromptLookup))
        return self._abilities

    def _score_backlogs(self, rows: list[_Row]) -> int:
        """Rows in fallback whose scoring the controller planned: the draft scores the tokens plain rounds
        committed, teacher-forced, and the controller learns from min(1, q / p) of each: what drafting there
        would have been accepted with, without drafting. Only the past is read, so sampling stays exact."""
        wanted = self.controller.scores_planned() if self.controller is not None else {}
        chosen = [r for r in rows if wanted.get(r.request_id, 0) > 0 and r.plain_probs]
        if not chosen or not self._can_score():
            return 0
        counts = [min(wanted[r.request_id], len(r.plain_probs)) for r in chosen]
        scored = self.drafter.score_backlog([r.slot for r in chosen], counts, [r.params for r in chosen])
        for row, draft_probs in zip(chosen, scored):
            target_probs = row.plain_probs[len(row.plain_probs) - len(draft_probs):]
            self.controller.observe_scores(
                row.request_id, [min(1.0, q / p) if p > 0 else 0.0 for q, p in zip(draft_probs, target_probs)])
            row.plain_probs.clear()
        return len(chosen)

    def _note_plain_tokens(self, rows: list[_Row], num_drafted: Tensor, verdict: Verdict,
                           target_probs: Tensor | None) -> None:
        """Keep, for adaptive rows decoded plain this round, the target's probability of the token it
        committed (1 under greedy); a row that drafted has fed its draft everything before."""
        if self.controller is None or not self._can_score():
            return
        drafted = num_drafted.tolist()
        plain = [i for i, r in enumerate(rows) if drafted[i] == 0 and r.speculative and r.gamma is None]
        for i, row in enumerate(rows):
            if drafted[i] > 0:
                row.plain_probs.clear()
        if not plain:
            return
        if target_probs is None:  # every row greedy: the target's token had probability 1
            chosen = [1.0] * len(plain)
        else:  # every row's in one gather and one copy (a plain round's few extra ops are ~0.5% of it)
            every = target_probs[:, 0].gather(-1, verdict.next_token.unsqueeze(-1)).squeeze(-1).tolist()  # [b]
            chosen = [every[i] for i in plain]
        for i, p in zip(plain, chosen):
            row = rows[i]
            row.plain_probs.append(p)
            del row.plain_probs[:-BACKLOG_KEPT]

    def _draft(self, rows: list[_Row], slots: list[int], gamma: int,
               max_drafts: list[int]) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None]:
        """Tokens `[b, g]` (g <= gamma: trailing columns no row used are dropped), probs, counts, confidence."""
        if gamma == 0 or self.drafter is None:
            empty = torch.zeros(len(rows), 0, dtype=torch.long)
            return empty, None, torch.zeros(len(rows), dtype=torch.long), None
        thresholds, rule = self.controller.gate(len(rows)) if self.controller is not None else ([], None)
        extension, reach = self._extension(rows, max_drafts, rule)
        gamma = max(reach)
        params, generators = [r.params for r in rows], [r.generator for r in rows]
        if self._use_lookup is not None:
            proposal = self.drafter.propose_chosen(slots, gamma, reach, params, generators, thresholds,
                                                   self._use_lookup, extension)
        else:
            proposal = self.drafter.propose(slots, gamma, reach, params, generators, thresholds, extension)
        num_drafted = torch.minimum(proposal.num_drafted.cpu(), torch.tensor(reach))
        used = int(num_drafted.max())
        probs = proposal.probs[:, :used] if proposal.probs is not None else None
        confidence = proposal.confidence[:, :used] if proposal.confidence is not None else None
        return proposal.tokens[:, :used], probs, num_drafted, confidence

    def _extension(self, rows: list[_Row], max_drafts: list[int],
                   rule: tuple[tuple[float, ...], tuple[float, ...]] | None) -> tuple[Extension | None, list[int]]:
        """The controller's extension for this round (`GammaController.gate`), and each row's reach: rows gamma
        auto has drafting with the draft model may draw past their plan, up to what the draft cache and the row's
        budget allow; any other row's reach is its plan."""
        if rule is None:
            return None, max_drafts
        limit = min(self.config.gamma, self.controller.config.max_gamma)
        reach = [max(planned, min(limit, row.remaining - 1))
                 if planned > 0 and row.speculative and row.gamma is None
                 and (self._use_lookup is None or self._use_lookup[i] is False) else planned
                 for i, (row, planned) in enumerate(zip(rows, max_drafts))]
        if reach == max_drafts:
            return None, max_drafts
        return Extension(tuple(max_drafts), *rule), reach

    def _acceptance(self, draft_tokens: Tensor, draft_probs: Tensor | None,
                    target_probs: Tensor | None) -> list[list[float]] | None:
        """Per row, the acceptance probability at each draft position (`acceptance_probabilities`) for the
        controller to learn from in place of the coins; None where it does not (greedy rows' coins are exact)."""
        if (self.controller is None or not self.controller.config.expected_acceptance or target_probs is None
                or draft_tokens.shape[1] == 0):
            return None
        return acceptance_probabilities(draft_tokens, draft_probs, target_probs).cpu().tolist()  # [b, gamma]

    def _observe(self, rows: list[_Row], num_drafted: Tensor, num_accepted: Tensor, confidence: Tensor | None,
                 acceptance: list[list[float]] | None = None) -> None:
        if self.controller is None:
            return
        drafted, accepted = num_drafted.tolist(), num_accepted.tolist()  # one copy each, not one per row
        for i, row in enumerate(rows):
            if drafted[i] == 0:
                continue  # nothing to observe: a plain round
            conf = confidence[i, : drafted[i]].tolist() if confidence is not None else None
            # positions reached: the accepted drafts and the first rejected one
            expected = (acceptance[i][: min(accepted[i] + 1, drafted[i])]
                        if acceptance is not None and not row.params.greedy else None)
            self.controller.observe(row.request_id, drafted[i], accepted[i], conf, expected)

    def _verify(self, rows: list[_Row], draft_tokens: Tensor, draft_probs: Tensor | None,
                target_logits: Tensor, num_drafted: Tensor) -> tuple[Verdict, Tensor | None]:
        """The verdict, and the warped target probabilities it sampled from (None: every row greedy)."""
        params = [r.params for r in rows]
        if all(p.greedy for p in params):
            return verify_greedy(draft_tokens, target_logits, num_drafted), None
        target_probs = warp_rows(target_logits, params)  # [b, gamma + 1, vocab]
        verdict = verify(draft_tokens, draft_probs, target_probs, [r.generator for r in rows], num_drafted)
        return verdict, target_probs

    def _commit(self, rows: list[_Row], slot_tensor: Tensor, draft_tokens: Tensor, verdict: Verdict,
                num_drafted: Tensor, num_accepted: Tensor) -> list[RowUpdate]:
        next_tokens = verdict.next_token.cpu().tolist()
        drafts = draft_tokens.cpu().tolist()
        updates, committed, finished = [], [], []
        target_lengths = []
        for row, accepted, nxt, drafted_row, n_drafted in zip(
            rows, num_accepted.tolist(), next_tokens, drafts, num_drafted.tolist()
        ):
            new = drafted_row[:accepted] + [nxt]
            # the target cache keeps the prompt, earlier output and the accepted drafts
            target_lengths.append(len(row.prompt) + len(row.output) + accepted)
            new, reason = self._apply_stops(row, new)
            row.output.extend(new)
            committed.append(new)
            updates.append(RowUpdate(row.request_id, tuple(new), n_drafted, accepted, reason))
            if reason is not None:
                finished.append(row)
        self.cache.truncate(slot_tensor, torch.tensor(target_lengths, dtype=torch.long))
        if self.drafter is not None:
            self.drafter.commit([r.slot for r in rows], committed)
        self._release(finished)
        return updates

    def _apply_stops(self, row: _Row, new: list[int]) -> tuple[list[int], str | None]:
        for i, token in enumerate(new):
            if token in self.eos_token_ids:
                return new[: i + 1], "stop"
        if len(new) >= row.remaining:
            return new[: row.remaining], "length"
        return new, None

    # ----- slots ----------------------------------------------------------------------------

    def _admit(self) -> None:
        with self._lock:
            admitted = []
            while self._waiting and self._free_slots:
                row = self._waiting.popleft()
                row.slot = self._free_slots.pop(0)
                admitted.append(row)
        if not admitted:
            return
        slots = torch.tensor([r.slot for r in admitted], dtype=torch.long)
        self.cache.reset(slots)
        try:
            prefill_ragged(self.target, self.cache, slots, [r.prompt[:-1] for r in admitted])
            if self.drafter is not None:
                self.drafter.add_rows([r.slot for r in admitted], [r.prompt for r in admitted])
        except Exception:  # e.g. out of memory on a long prompt: give the slots back, then report
            self.cache.reset(slots)
            if self.drafter is not None:
                self.drafter.release_rows([r.slot for r in admitted])
            with self._lock:
                self._free_slots = sorted(self._free_slots + [r.slot for r in admitted])
            raise
        for row in admitted:
            self._running[row.slot] = row

    def _apply_cancellations(self) -> list[RowUpdate]:
        with self._lock:
            cancelled, self._cancelled = self._cancelled, set()
            waiting = [r for r in self._waiting if r.request_id in cancelled]
            for row in waiting:
                self._waiting.remove(row)
        running = [r for r in self._running.values() if r.request_id in cancelled]
        self._release(running)
        return [RowUpdate(r.request_id, (), 0, 0, "cancelled") for r in waiting + running]

    def _release(self, rows: list[_Row]) -> None:
        if not rows:
            return
        slots = [r.slot for r in rows]
        self.cache.reset(torch.tensor(slots, dtype=torch.long))
        if self.drafter is not None:
            self.drafter.release_rows(slots)
        if self.controller is not None:
            for row in rows:
                self.controller.release(row.request_id)
        with self._lock:
            for row in rows:
                del self._running[row.slot]
                self._free_slots.append(row.slot)
            self._free_slots.sort()

    def _now(self) -> float:
        if self.target.device.type == "cuda":
            torch.cuda.synchronize(self.target.device)  # timings must include queued GPU work
        return time.perf_counter()


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


def _round_stats(batch: int, gamma: int, num_drafted: Tensor, num_accepted: Tensor, updates: list[RowUpdate],
                 prefill_s: float, draft_s: float, target_s: float, verify_s: float,
                 fallback_rows: int, scored_rows: int = 0, lookup_rows: int = 0, extended_rows: int = 0) -> RoundStats:
    positions = torch.arange(gamma).unsqueeze(0)  # [1, gamma]
    drafted_at = (positions < num_drafted.unsqueeze(1)).sum(dim=0)
    accepted_at = (positions < num_accepted.unsqueeze(1)).sum(dim=0)
    return RoundStats(
        batch_size=batch, gamma=gamma,
        drafted=int(num_drafted.sum()), accepted=int(num_accepted.sum()),
        emitted=sum(len(u.new_tokens) for u in updates),
        drafted_per_position=tuple(drafted_at.tolist()), accepted_per_position=tuple(accepted_at.tolist()),
        prefill_seconds=prefill_s, draft_seconds=draft_s, target_seconds=target_s, verify_seconds=verify_s,
        fallback_rows=fallback_rows, scored_rows=scored_rows, lookup_rows=lookup_rows, extended_rows=extended_rows,
    )
