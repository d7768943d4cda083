"""Gamma auto: per request, the gamma that maximises the predicted speedup E(alpha, gamma) / R(gamma), from
measured acceptance (`acceptance.py`) and measured round costs (`costs.py`); fallback to plain decoding where
drafting does not pay (`fallback.py`); prompt lookups priced against the model; a confidence gate that stops a
round early and an extension that drafts past the plan on confident drafts.

Every decision depends only on the past (acceptance and timings of earlier rounds, and the draft's own
probability of a token it already drew), so the verifier's guarantee still holds: the output is distributed
exactly as sampling from the target.
"""

from __future__ import annotations

import dataclasses
import logging

import specsample.planner.fallback as fallback
from specsample.config import TreeShape
from specsample.planner.acceptance import BINS, Acceptance
from specsample.planner.base import (
    BatchState,
    Extension,
    RoundOutcome,
    RoundPlan,
    RowOutcome,
    RowPlan,
    RowState,
    fixed_drafts,
    most_drafts,
    tree_row,
)
from specsample.planner.costs import CostModel, RoundKind
from specsample.planner.fallback import RequestChoice
from specsample.planner.trees import TreeYields, budgets
from specsample.theory import expected_tokens_per_round

log = logging.getLogger("specsample.controller")

HYSTERESIS = 0.03  # switch a request's gamma only for a > 3% better predicted speedup
EXPLORE_EVERY = 16  # rounds between tries of a neighbouring gamma, so round costs are measured
TREE_WARMUP = 4  # tries of each tree budget (and of chains) before trees are explored only every EXPLORE_EVERY...
TREE_WARMUP_EVERY = 4  # ...rounds, rather than every this many


BACKLOG_KEPT = 64  # most plain-round tokens kept per request for its draft to score (acceptance remembers ~25 trials)


class GammaController:
    """Plans each row's drafts under gamma auto and learns from every round (see the module docstring)."""

    def __init__(self, max_gamma: int = 8, tree: TreeShape | None = None) -> None:
        """`tree`: the largest token tree a round may draft (`trees.budgets`); None: chains only."""
        if isinstance(max_gamma, bool) or not isinstance(max_gamma, int) or max_gamma < 1:
            raise ValueError(f"max_gamma must be an integer >= 1, got {max_gamma!r}")
        self.max_gamma = max_gamma
        self.tree = tree
        self.trees = budgets(tree) if tree is not None else ()
        self.tree_yields = TreeYields()
        self.tree_tried: dict[int, int] = {}  # node budget (0: a chain) -> round last drafted with it
        self.tree_tries: dict[int, int] = {}  # node budget (0: a chain) -> rounds planned with it, where trees could be
        self.tree_choice: TreeShape | None = None  # the tree rounds draft outside explorations (None: chains)
        self.acceptance = Acceptance()
        self.costs = CostModel()
        self.choices: dict[str, RequestChoice] = {}
        self.round = 0  # rounds planned with at least one row to choose for
        self.switches: list[tuple[str, str]] = []  # (request id, "off" | "on"): fallback switches, for stats
        self.scored = 0  # backlog scorings learnt from
        self.lookup_rounds = 0  # row-rounds sent to a prompt lookup
        # per request, the target's probability of each token plain rounds committed since it last drafted (newest
        # last, at most BACKLOG_KEPT): with its draft's, what a draft there would have been accepted with
        self.plain_probs: dict[str, list[float]] = {}

    @property
    def most_drafts(self) -> int:
        return most_drafts(self.max_gamma, self.tree)

    # ----- prices ---------------------------------------------------------------------------

    def speedup(self, alpha: float, gamma: int, batch_size: int) -> float:
        """Predicted speedup over plain decoding: E(alpha, gamma) tokens per round over the round's cost."""
        return expected_tokens_per_round(alpha, gamma) / self.costs.round_cost(batch_size, gamma)

    def best_gamma(self, alpha: float, batch_size: int) -> tuple[int, float]:
        """The gamma in 1..max_gamma maximising the predicted speedup (the shorter on ties), and that speedup."""
        best, best_speedup = 1, -1.0
        for gamma in range(1, self.max_gamma + 1):
            speedup = self.speedup(alpha, gamma, batch_size)
            if speedup > best_speedup:
                best, best_speedup = gamma, speedup
        return best, best_speedup

    def lookup_length(self, request_id: str, available: int, batch_size: int) -> tuple[int, float]:
        """Lookup tokens to propose out of `available` and the predicted speedup: the count maximising E(alpha, n)
        over the round's cost at the request's lookup acceptance (0 and 1.0 when none beats a plain round)."""
        alpha, best, best_speedup = self.acceptance.lookup_alpha(request_id), 0, 1.0
        for tokens in range(1, min(available, self.max_gamma) + 1):
            speedup = expected_tokens_per_round(alpha, tokens) / self.costs.lookup_cost(batch_size, tokens)
            if speedup > best_speedup:
                best, best_speedup = tokens, speedup
        return best, best_speedup

    def in_fallback(self, request_id: str) -> bool:
        return self._choice(request_id).fallback

    def _choice(self, request_id: str) -> RequestChoice:
        if request_id not in self.choices:
            self.choices[request_id] = RequestChoice()
        return self.choices[request_id]

    # ----- plan -----------------------------------------------------------------------------

    def plan(self, batch: BatchState) -> RoundPlan:
        """Drafts per row: the chosen gamma (a neighbour now and then, to time it), 0 in fallback but for probes
        or backlog scorings, or a prompt lookup where one is predicted faster; rows with a gamma of their own
        draft it. Then the round's gate and extension, if any row drafts."""
        size = len(batch)
        rows = [RowPlan(drafts=d, reach=d) for d in (fixed_drafts(r, self.max_gamma) for r in batch.rows)]
        chosen = [i for i, r in enumerate(batch.rows) if r.chosen]
        facts = {}
        if chosen:
            chosen_rows, facts = self._choose([batch.rows[i] for i in chosen], batch, size)
            for i, row_plan in zip(chosen, chosen_rows):
                rows[i] = row_plan
        thresholds, extension = (), None
        if max((r.drafts for r in rows), default=0) > 0:
            thresholds, extension = self._gate(size, facts.get("exploring", False))
        tree = self._tree(batch, rows, chosen, size) if chosen and self.trees and batch.can_tree else None
        if tree is not None:  # the model's rows draft the tree, the others their chains as trees; no gate or extension
            rows = [
                dataclasses.replace(
                    tree_row(state, tree) if state.chosen and r.source is not True else RowPlan(r.drafts, r.drafts),
                    source=r.source,
                    score_backlog=r.score_backlog,
                    fallback=r.fallback,
                )
                if r.drafts > 0
                else r
                for r, state in zip(rows, batch.rows)
            ]
            thresholds, extension = [], None
        if extension is not None:
            rows = [
                RowPlan(
                    r.drafts,
                    max(r.drafts, min(self.max_gamma, state.remaining - 1)),
                    r.source,
                    r.score_backlog,
                    r.fallback,
                )
                if state.chosen and r.drafts > 0 and r.source is not True
                else r
                for r, state in zip(rows, batch.rows)
            ]
            if all(r.reach == r.drafts for r in rows):
                extension = None
        # lookups may branch only where every drafting row is a lookup's: one row's tree makes the round a tree round
        # for every row, which the model's chains are not priced as
        lookup_trees = (
            batch.can_tree
            and tree is None
            and any(r.source is True and r.drafts > 0 for r in rows)
            and all(r.source is True for r in rows if r.drafts > 0)
        )
        return RoundPlan(
            rows=tuple(rows),
            stop_thresholds=tuple(thresholds),
            extension=extension,
            chosen_ids=tuple(batch.rows[i].request_id for i in chosen),
            tree=tree,
            lookup_trees=lookup_trees,
            **facts,
        )

    def _tree(self, batch: BatchState, rows: list[RowPlan], chosen: list[int], size: int) -> TreeShape | None:
        """The tree this round drafts (None: chains), see `trees`: the fastest predicted for the rows the model drafts
        for (chains or a tree budget), switched to only for a HYSTERESIS gain; every EXPLORE_EVERY rounds, half-way
        between gamma's explorations (every TREE_WARMUP_EVERY until each was tried TREE_WARMUP times), the alternative
        tried least recently."""
        drafting = [i for i in chosen if rows[i].drafts > 0 and rows[i].source is not True]
        if not drafting or not self.costs.timed_drafting(size):
            return None  # chains are timed first: a tree's prior prices it from them

        def speedup(shape: TreeShape | None) -> float:
            total = 0.0
            for i in drafting:
                rid = batch.rows[i].request_id
                alpha = self.acceptance.alpha(rid)
                if shape is None:
                    total += self.speedup(alpha, rows[i].drafts, size)
                else:
                    total += self.tree_yields.tokens(rid, shape, alpha) / self.costs.tree_cost(
                        size, shape.nodes, shape.depth
                    )
            return total / len(drafting)

        options: list[TreeShape | None] = [None, *self.trees]
        tries = [self.tree_tries.get(shape.nodes if shape else 0, 0) for shape in options]
        every = TREE_WARMUP_EVERY if min(tries) < TREE_WARMUP else EXPLORE_EVERY
        if self.round % every == every // 2:
            choice = min(options, key=lambda shape: self.tree_tried.get(shape.nodes if shape else 0, -1))
        else:
            best = max(options, key=speedup)
            if speedup(best) > speedup(self.tree_choice) * (1 + HYSTERESIS):
                self.tree_choice = best
            choice = self.tree_choice
        key = choice.nodes if choice else 0
        self.tree_tried[key] = self.round
        self.tree_tries[key] = self.tree_tries.get(key, 0) + 1
        return choice

    def _choose(self, rows: list[RowState], batch: BatchState, size: int) -> tuple[list[RowPlan], dict]:
        """Plans for the rows gamma auto chooses for (see `plan`), and the round's facts for learning."""
        self.round += 1
        self.acceptance.age_pools()
        if self.costs.calibration_due(size, self.round):
            # time one round without drafts (needed for c); a choice from the past alone, so still exact
            self.costs.calibrating(size, self.round)
            return self._planned(rows, [0] * len(rows), {}, {}, False, batch.offers_lookups)
        exploring = self.round % EXPLORE_EVERY == 0 and self.costs.timed_drafting(size)
        explored = False
        scores: dict[str, int] = {}
        out = []
        for row in rows:
            drafts, probe_scores = self._decide(row, batch.can_score, size, exploring)
            if probe_scores:
                scores[row.request_id] = self._backlog(row)
            explored |= exploring and not self._choice(row.request_id).fallback
            out.append(drafts)
        lookups: dict[str, int] = {}
        if batch.offers_lookups:
            for i, row in enumerate(rows):
                if row.lookup <= 0:
                    if not row.drafts_otherwise:  # no lookup and no model to draft with: a plain round
                        out[i] = 0
                    continue
                tokens, speedup = self.lookup_length(row.request_id, row.lookup, size)
                # the model's plan at its own estimate: a plain round (1) in fallback or calibration
                planned = self.speedup(self.acceptance.alpha(row.request_id), out[i], size) if out[i] > 0 else 1.0
                if not row.drafts_otherwise or (tokens > 0 and speedup >= planned):
                    out[i] = tokens
                    if tokens > 0:
                        lookups[row.request_id] = tokens
            self.lookup_rounds += len(lookups)
        return self._planned(rows, out, scores, lookups, explored, batch.offers_lookups)

    def _decide(self, row: RowState, can_score: bool, size: int, exploring: bool) -> tuple[int, bool]:
        """One row's drafts from the model (before lookups), and whether its draft scores its backlog."""
        rid, choice = row.request_id, self._choice(row.request_id)
        alpha = self.acceptance.alpha(rid)
        best, speedup = self.best_gamma(alpha, size)
        # a new request starts at the best gamma for its prior; later, switch only for a clear gain
        if not choice.gamma or speedup > self.speedup(alpha, choice.gamma, size) * (1 + HYSTERESIS):
            choice.gamma = best
        # stop drafting only when even a generous alpha predicts a loss: at the ~25 trials the estimate remembers,
        # its noise near break-even sent requests that gained by drafting into fallback
        if (
            not choice.fallback
            and speedup < fallback.FALLBACK_BELOW
            and not self.costs.settling(size)
            and self.best_gamma(self.acceptance.alpha_upper(rid, fallback.MARGIN), size)[1] < fallback.FALLBACK_BELOW
        ):
            choice.fallback, choice.rounds_since_probe, choice.scorings = True, 0, 0
            self._switch(rid, "off", alpha, size, speedup)
        elif choice.fallback and speedup > fallback.RESUME_ABOVE:
            choice.fallback = False
            self._switch(rid, "on", alpha, size, speedup)
        if not choice.fallback:
            return (self._neighbour(choice.gamma, size) if exploring else choice.gamma), False
        choice.rounds_since_probe += 1
        if can_score:  # the draft scores its backlog (once it holds SCORE_MIN_TOKENS) instead of drafting
            cost = self.costs.scoring_cost(size)
            interval = fallback.score_interval(cost, choice.scorings, row.remaining)
            # while a generous alpha says drafting may pay, keep the first scoring's cadence: the next scoring may
            # end a fallback that a slow start began
            first = fallback.score_interval(cost, 0, row.remaining)
            if (
                first <= choice.rounds_since_probe < interval
                and self.best_gamma(self.acceptance.alpha_upper(rid, fallback.MARGIN), size)[1] > fallback.RESUME_ABOVE
            ):
                interval = first
            if self._backlog(row) < fallback.SCORE_MIN_TOKENS:
                interval = max(interval, choice.rounds_since_probe + 1)  # not yet: wait for a backlog
        else:  # probes are priced at the generous alpha too: while alpha is uncertain they are worth running
            interval = fallback.probe_interval(
                self.acceptance.alpha_upper(rid, fallback.MARGIN),
                choice.gamma,
                self.costs.round_cost(size, choice.gamma),
            )
        if choice.rounds_since_probe < interval or not fallback.worth_probing(row.remaining):
            return 0, False
        choice.rounds_since_probe = 0
        if can_score:
            choice.scorings += 1
            return 0, True
        return choice.gamma, False  # a probe drafts the gamma the formula picks for the current alpha

    def _planned(
        self,
        rows: list[RowState],
        out: list[int],
        scores: dict[str, int],
        lookups: dict[str, int],
        exploring: bool,
        offers_lookups: bool,
    ) -> tuple[list[RowPlan], dict]:
        """Row plans from the choices (each row is sent to its lookup or its model where the drafter offers
        lookups); notes which rows draft right after a plain round: a model draft then first feeds itself the
        tokens it missed, a cost of the plain rounds, not of drafting."""
        catching_up = model_drafting = False
        plans = []
        for row, n in zip(rows, out):
            choice = self._choice(row.request_id)
            lookup = row.request_id in lookups
            if lookup:  # the draft model sits this round out: its next round catches up
                choice.planned = 0
            else:
                catching_up |= n > 0 and choice.planned == 0
                model_drafting |= n > 0
                choice.planned = n
            drafts = max(0, min(n, self.max_gamma, row.remaining - 1))
            plans.append(
                RowPlan(
                    drafts=drafts,
                    reach=drafts,
                    source=lookup if offers_lookups else None,
                    score_backlog=scores.get(row.request_id, 0),
                    fallback=n == 0,
                )
            )
        return plans, {"exploring": exploring, "catching_up": catching_up, "model_drafting": model_drafting}

    def _backlog(self, row: RowState) -> int:
        """Tokens plain rounds committed for the row that its draft could score: as a simulation gives them, else
        as many as this planner kept the target's probabilities of."""
        return row.backlog or len(self.plain_probs.get(row.request_id, ()))

    def _neighbour(self, gamma: int, size: int) -> int:
        """The gamma next to `gamma` timed least recently (one more on ties): an exploring round measures it, so a
        cost the affine model overstates is found, and both neighbours stay fresh."""
        options = [g for g in (gamma + 1, gamma - 1) if 1 <= g <= self.max_gamma]
        return self.costs.least_recent(options, size) if options else gamma

    def _gate(self, size: int, exploring: bool) -> tuple[list[float], Extension | None]:
        """The round's confidence gate and extension; an exploring round has neither (it times its gamma in full).

        A draft drawn with confidence q is accepted with probability a(q), estimated per bin. One more draft adds
        about a(q) a_mean tokens for R(j + 1) - R(j) plain rounds' time; worth it while that beats the S tokens per
        plain round drafting makes anyway (S: the best predicted speedup at the pooled alpha, at least 1). So the
        bar at position j is S (R(j + 1) - R(j)) / a_mean; the gate stops after the j-th draft below the top of the
        highest bin whose a(q) is under it, and past the plan a round draws draft j + 1 while a(q_1) ... a(q_j)
        reaches it, as one more draft adds tokens only if every draft so far is accepted."""
        acceptance = self.acceptance
        if not acceptance.calibrated() or exploring:
            return [], None
        mean = acceptance.mean_bin_acceptance()
        if mean <= 0:
            return [], None
        rate = max(self.best_gamma(acceptance.pooled_alpha(), size)[1], 1.0)
        bars = [rate * self.costs.one_more_draft(size, j) / mean for j in range(1, self.max_gamma)]
        thresholds = [self._threshold(bar) for bar in bars]
        # a bin not yet read counts as never accepted: no extension on a confidence without a past
        bins = tuple(acceptance.bin_acceptance(b) or 0.0 for b in range(BINS))
        return thresholds, Extension(bins, tuple(bars))

    def _threshold(self, bar: float) -> float:
        """Top of the highest confidence bin, counting up, whose acceptance stays under `bar`."""
        threshold = 0.0
        for b in range(BINS):
            accepted = self.acceptance.bin_acceptance(b)
            if accepted is not None:
                if accepted < bar:
                    threshold = (b + 1) / BINS
                else:
                    break
        return threshold

    # ----- learn ----------------------------------------------------------------------------

    def learn(self, plan: RoundPlan, outcome: RoundOutcome) -> None:
        """Backlog scores, each drafting row's trials, the round's timing; then forget the finished requests."""
        rows = self.read_outcome(plan, outcome)
        for row in rows:
            if row.backlog_scores is not None:
                self.acceptance.observe_scores(row.request_id, row.backlog_scores)
                self.scored += 1
        for row, row_plan in zip(rows, plan.rows):
            if row.num_drafted > 0 and plan.tree is not None:  # a tree's yield, not a chain's acceptance
                if row_plan.source is not True:
                    self.tree_yields.observe(row.request_id, plan.tree.nodes, row.num_accepted + 1)
            elif row.num_drafted > 0:
                self.acceptance.observe(
                    row.request_id,
                    row.num_drafted,
                    row.num_accepted,
                    row_plan.source is True,
                    row.confidence,
                    row.acceptance,
                )
        kind = RoundKind(
            drafts=outcome.width,
            lookups=plan.lookups > 0,
            scoring=plan.scoring > 0,
            model_drafting=plan.model_drafting,
            catching_up=plan.catching_up,
            tree=plan.tree.nodes if plan.tree is not None else 0,
        )
        self.costs.record(
            len(outcome.rows),
            kind,
            plan.chosen_ids,
            self.round,
            outcome.draft_seconds,
            outcome.target_seconds,
            outcome.verify_seconds,
        )
        for request_id in outcome.finished:
            self.forget(request_id)

    def read_outcome(self, plan: RoundPlan, outcome: RoundOutcome) -> list[RowOutcome]:
        """The rows' outcomes with what the round's evidence says (where a simulation did not give it): each drafting
        row's acceptance probability at the positions it reached (sum of min(target, draft); not under coupled
        sampling, which learns from its accepted counts, nor for a greedy row), and each scored backlog's min(1, q/p)
        from the draft's probabilities and the target's this planner kept from the row's plain rounds; and keeps the
        target's probability of each token a plain round committed for a row it chose."""
        evidence = outcome.evidence
        rows = list(outcome.rows)
        chosen = set(plan.chosen_ids)
        plain = [i for i, r in enumerate(rows) if r.num_drafted == 0 and not r.failed and r.request_id in chosen]
        kept = {}
        if evidence is not None and plain:
            if evidence.target_probs is None:  # every row greedy: the target's token had probability 1
                kept = {i: 1.0 for i in plain}
            else:  # every row's in one gather and one copy
                every = evidence.target_probs[:, 0].gather(-1, evidence.next_tokens.unsqueeze(-1)).squeeze(-1)
                values = every.tolist()
                kept = {i: values[i] for i in plain}
        acceptance = None
        if (
            evidence is not None
            and evidence.target_probs is not None
            and not evidence.coupled
            and not evidence.tree
            and evidence.draft_tokens.shape[1] > 0
        ):
            from specsample.verification.chain import acceptance_probabilities

            acceptance = (
                acceptance_probabilities(evidence.draft_tokens, evidence.draft_probs, evidence.target_probs)
                .cpu()
                .tolist()
            )  # [b, gamma]
        out = []
        for i, row in enumerate(rows):
            history = self.plain_probs.setdefault(row.request_id, [])
            scores = row.backlog_scores
            if scores is None and row.backlog_draft_probs is not None:
                targets = history[len(history) - len(row.backlog_draft_probs) :]
                scores = tuple(min(1.0, q / p) if p > 0 else 0.0 for q, p in zip(row.backlog_draft_probs, targets))
                history.clear()
            if row.num_drafted > 0:
                history.clear()
            elif i in kept:
                history.append(kept[i])
                del history[:-BACKLOG_KEPT]
            reached = min(row.num_accepted + 1, row.num_drafted)  # the accepted drafts and the first rejected one
            probs = row.acceptance
            if probs is None and acceptance is not None and row.num_drafted and not row.failed and not row.greedy:
                probs = tuple(acceptance[i][:reached])
            out.append(dataclasses.replace(row, acceptance=probs, backlog_scores=scores))
        return out

    def forget(self, request_id: str) -> None:
        """Drop a finished request's state."""
        self.choices.pop(request_id, None)
        self.plain_probs.pop(request_id, None)
        self.acceptance.forget(request_id)
        self.tree_yields.forget(request_id)

    def _switch(self, rid: str, to: str, alpha: float, size: int, speedup: float) -> None:
        self.switches.append((rid, to))
        log.info(
            "request %s: speculation %s (alpha %.2f, cost ratio %.3f, overhead %.3f, predicted speedup %.2f)",
            rid,
            to,
            alpha,
            self.costs.cost_ratio(size),
            self.costs.overhead(size),
            speedup,
        )
