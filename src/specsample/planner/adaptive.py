"""Gamma auto: each round, plain decoding or speculation for the whole batch by the committed tokens per second it is
expected to produce (`goodput.py`), then per row the gamma that maximises its predicted speedup (`chain.py`), a prompt
lookup where one is predicted faster (`lookups.py`), fallback to plain decoding where drafting does not pay
(`fallback.py`), a token tree where trees measure faster (`trees.py`), and the confidence gate and extension.

`plan()` reads the planner's state and changes none of it: what a plan decided that later rounds build on (each
request's choice, the tree and goodput memories, the round count) travels in the plan (`PlanUpdate`) and is kept when
the round is learnt. Every decision depends only on the past (acceptance and timings of earlier rounds, and the
draft's own probability of a token it already drew), so the verifier's guarantee still holds: the output is
distributed exactly as sampling from the target.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from specsample.config import TreeShape
from specsample.planner import fallback
from specsample.planner.acceptance import Acceptance
from specsample.planner.base import (
    BatchState,
    DraftSource,
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
from specsample.planner.chain import EXPLORE_EVERY, HYSTERESIS, ChainPolicy
from specsample.planner.costs import CostModel, RoundKind
from specsample.planner.fallback import FallbackPolicy, RequestChoice
from specsample.planner.goodput import (
    BatchChoice,
    BatchSizeSummary,
    Drafting,
    GoodputMemory,
    GoodputPolicy,
    summarise,
)
from specsample.planner.lookups import LookupPolicy
from specsample.planner.profile import SAVE_EVERY, ProfileStore
from specsample.planner.trees import TreeMemory, TreePolicy

__all__ = ["EXPLORE_EVERY", "HYSTERESIS", "GammaController", "PlanUpdate"]

log = logging.getLogger("specsample.controller")

BACKLOG_KEPT = 64  # most plain-round tokens kept per request for its draft to score (acceptance remembers ~25 trials)


@dataclass(frozen=True)
class PlanUpdate:
    """What a plan decided that later plans build on, kept when its round is learnt."""

    round: int  # rounds planned with a row to choose for, this one included
    choices: tuple[tuple[str, RequestChoice], ...] = ()  # the chosen rows' choices after this plan
    switches: tuple[tuple[str, str, float, float], ...] = ()  # (request, "off" | "on", alpha, predicted speedup)
    calibrating: bool = False  # a plain round planned to time plain decoding
    lookup_rows: int = 0  # rows sent to a prompt lookup
    trees: TreeMemory | None = None
    batch: BatchChoice | None = None  # the goodput policy's choice (None: it had nothing to choose)
    goodput: GoodputMemory | None = None


class GammaController:
    """Plans each round under gamma auto and learns from every round (see the module docstring)."""

    chain_policy: type[ChainPolicy] = ChainPolicy  # prices chains, gates and extensions (a subclass may pin them)

    def __init__(self, max_gamma: int = 8, tree: TreeShape | None = None, profile: ProfileStore | None = None) -> None:
        """`tree`: the largest token tree a round may draft (`trees.budgets`); None: chains only. `profile`: where
        costs and acceptance priors are loaded from now and saved to (`save`, and every SAVE_EVERY rounds learnt)."""
        if isinstance(max_gamma, bool) or not isinstance(max_gamma, int) or max_gamma < 1:
            raise ValueError(f"max_gamma must be an integer >= 1, got {max_gamma!r}")
        self.max_gamma = max_gamma
        self.tree = tree
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
        self.profile = profile
        self.profile_loaded = profile is not None and profile.load(self.costs, self.acceptance)
        self._policies()

    def save(self) -> None:
        """Save measured costs and acceptance priors to the profile (nothing without one)."""
        if self.profile is not None:
            self.profile.save(self.costs, self.acceptance)

    def _policies(self) -> None:
        """The policies, over this controller's acceptance and costs (again after either is replaced)."""
        self._bound = (self.acceptance, self.costs)
        self.chain = self.chain_policy(self.max_gamma, self.acceptance, self.costs)
        self.fallback_policy = FallbackPolicy(self.chain, self.acceptance, self.costs)
        self.lookup_policy = LookupPolicy(self.max_gamma, self.chain, self.acceptance, self.costs)
        trees = getattr(self, "trees_policy", None)
        self.trees_policy = TreePolicy(self.tree, self.chain, self.acceptance, self.costs)
        if trees is not None:
            self.trees_policy.yields, self.trees_policy.memory = trees.yields, trees.memory
        goodput = getattr(self, "goodput", None)
        self.goodput = GoodputPolicy(self.costs)
        if goodput is not None:
            self.goodput.memory, self.goodput.reports = goodput.memory, goodput.reports

    def _fresh(self) -> None:
        if self._bound != (self.acceptance, self.costs):
            self._policies()

    @property
    def most_drafts(self) -> int:
        return most_drafts(self.max_gamma, self.tree)

    @property
    def trees(self) -> tuple[TreeShape, ...]:
        return self.trees_policy.trees

    # ----- prices ---------------------------------------------------------------------------

    def speedup(self, alpha: float, gamma: int, batch_size: int) -> float:
        self._fresh()
        return self.chain.speedup(alpha, gamma, batch_size)

    def best_gamma(self, alpha: float, batch_size: int) -> tuple[int, float]:
        self._fresh()
        return self.chain.best_gamma(alpha, batch_size)

    def lookup_length(self, request_id: str, available: int, batch_size: int) -> tuple[int, float]:
        self._fresh()
        return self.lookup_policy.length(request_id, available, batch_size)

    def in_fallback(self, request_id: str) -> bool:
        return self.choices.get(request_id, RequestChoice()).fallback

    def speculating(self, batch_size: int) -> bool:
        """Whether the goodput policy lets the batch speculate at this batch size."""
        return self.goodput.speculating(batch_size)

    def summary(self) -> tuple[BatchSizeSummary, ...]:
        """Per batch size seen: speculation on or off, rounds by kind, goodput expected and measured, costs."""
        return summarise(self.goodput, self.costs)

    # ----- plan -----------------------------------------------------------------------------

    def plan(self, batch: BatchState) -> RoundPlan:
        """Drafts per row: the batch's goodput choice, then the chosen gamma (a neighbour now and then, to time it), 0
        in fallback but for probes or backlog scorings, or a prompt lookup where one is predicted faster; rows with a
        gamma of their own draft it. Then the round's gate and extension, or its tree, if any row drafts."""
        self._fresh()
        size = len(batch)
        rows = [RowPlan(drafts=d, reach=d) for d in (fixed_drafts(r, self.max_gamma) for r in batch.rows)]
        chosen = [i for i, r in enumerate(batch.rows) if r.chosen]
        update = PlanUpdate(round=self.round)
        facts: dict = {}
        if chosen:
            chosen_rows, facts, update = self._choose([batch.rows[i] for i in chosen], batch, size)
            for i, row_plan in zip(chosen, chosen_rows):
                rows[i] = row_plan
        thresholds: Sequence[float] = ()
        extension: Extension | None = None
        if max((r.drafts for r in rows), default=0) > 0:
            thresholds, extension = self.chain.gate(size, facts.get("exploring", False))
        tree = None
        if chosen and self.trees and batch.can_tree:
            model_rows = [i for i in chosen if rows[i].drafts > 0 and rows[i].source is not DraftSource.LOOKUP]
            tree, memory = self.trees_policy.choose(
                [batch.rows[i].request_id for i in model_rows], [rows[i].drafts for i in model_rows], size, update.round
            )
            update = dataclasses.replace(update, trees=memory)
        if tree is not None:  # the model's rows draft the tree, the others their chains as trees; no gate or extension
            rows = [
                dataclasses.replace(
                    tree_row(state, tree)
                    if state.chosen and r.source is not DraftSource.LOOKUP
                    else RowPlan(r.drafts, r.drafts),
                    source=r.source,
                    score_backlog=r.score_backlog,
                    fallback=r.fallback,
                )
                if r.drafts > 0
                else r
                for r, state in zip(rows, batch.rows)
            ]
            thresholds, extension = (), None
        if extension is not None:
            rows = [
                dataclasses.replace(r, reach=max(r.drafts, min(self.max_gamma, state.remaining - 1)))
                if state.chosen and r.drafts > 0 and r.source is not DraftSource.LOOKUP
                else r
                for r, state in zip(rows, batch.rows)
            ]
            if all(r.reach == r.drafts for r in rows):
                extension = None
        # lookups may branch only where every drafting row is a lookup's: one row's tree makes the round a tree round
        # for every row, which the model's chains are not priced as
        drafting = [r for r in rows if r.drafts > 0]
        lookup_trees = (
            batch.can_tree and tree is None and bool(drafting) and all(r.source is DraftSource.LOOKUP for r in drafting)
        )
        return RoundPlan(
            rows=tuple(rows),
            stop_thresholds=tuple(thresholds),
            extension=extension,
            chosen_ids=tuple(batch.rows[i].request_id for i in chosen),
            tree=tree,
            lookup_trees=lookup_trees,
            update=update,
            **facts,
        )

    def _choose(self, rows: list[RowState], batch: BatchState, size: int) -> tuple[list[RowPlan], dict, PlanUpdate]:
        """Plans for the rows gamma auto chooses for (see `plan`), the round's facts for learning, and the update."""
        round_index = self.round + 1
        choices = {r.request_id: copy.copy(self.choices.get(r.request_id, RequestChoice())) for r in rows}
        if self.costs.calibration_due(size, round_index):
            # time one round without drafts (needed for c); a choice from the past alone, so still exact
            plans, facts = self._planned(rows, choices, [0] * len(rows), {}, {}, False, batch.offers_lookups)
            return plans, facts, PlanUpdate(round_index, tuple(choices.items()), calibrating=True)
        exploring = round_index % EXPLORE_EVERY == 0 and self.costs.timed_drafting(size)
        explored = False
        scores: dict[str, int] = {}
        switches = []
        out = []
        for row in rows:
            rid, choice = row.request_id, choices[row.request_id]
            drafts, scoring, switch = self.fallback_policy.decide(
                rid, choice, row.remaining, self._backlog(row), batch.can_score, size, exploring
            )
            if switch is not None:
                alpha = self.acceptance.alpha(rid)
                switches.append((rid, switch, alpha, self.chain.best_gamma(alpha, size)[1]))
            if scoring:
                scores[rid] = self._backlog(row)
            explored |= exploring and not choice.fallback
            out.append(drafts)
        lookups: dict[str, int] = {}
        if batch.offers_lookups:
            out, lookups = self.lookup_policy.assign(rows, out, size)
        out, lookups, batch_choice, goodput = self._goodput(rows, out, lookups, batch, size, round_index, explored)
        plans, facts = self._planned(rows, choices, out, scores, lookups, explored, batch.offers_lookups)
        update = PlanUpdate(
            round_index,
            tuple(choices.items()),
            tuple(switches),
            lookup_rows=len(lookups),
            batch=batch_choice,
            goodput=goodput,
        )
        return plans, facts, update

    def _goodput(
        self,
        rows: list[RowState],
        out: list[int],
        lookups: dict[str, int],
        batch: BatchState,
        size: int,
        round_index: int,
        exploring: bool,
    ) -> tuple[list[int], dict[str, int], BatchChoice | None, GoodputMemory | None]:
        """The rows' drafts under the batch's goodput choice: none where the batch decodes plainly, at most the best
        width where it drafts (not in an exploring round, which times its gamma in full). The batch's rows with a
        gamma of their own draft it whatever the choice: the policy then leaves the plan as it is."""
        if any(not r.chosen and fixed_drafts(r, self.max_gamma) > 0 for r in batch.rows):
            return out, lookups, None, None
        pricing = [
            Drafting(n, self.acceptance.lookup_alpha(row.request_id), lookup=True)
            if row.request_id in lookups
            else Drafting(
                n,
                self.acceptance.alpha(row.request_id),
                generous=self.acceptance.alpha_upper(row.request_id, fallback.MARGIN),
            )
            for row, n in zip(rows, out)
            if n > 0
        ]
        choice, memory = self.goodput.choose(size, pricing, round_index)
        if choice.width == 0:
            return [0] * len(out), {}, choice, memory
        if not exploring:
            out = [min(n, choice.width) for n in out]
            lookups = {rid: min(n, choice.width) for rid, n in lookups.items()}
        return out, lookups, choice, memory

    def _planned(
        self,
        rows: list[RowState],
        choices: dict[str, RequestChoice],
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
            choice = choices[row.request_id]
            lookup = row.request_id in lookups
            if lookup:  # the draft model sits this round out: its next round catches up
                choice.planned = 0
            else:
                catching_up |= n > 0 and choice.planned == 0
                model_drafting |= n > 0
                choice.planned = n
            drafts = max(0, min(n, self.max_gamma, row.remaining - 1))
            source = DraftSource.EITHER
            if offers_lookups:
                source = DraftSource.LOOKUP if lookup else DraftSource.MODEL
            plans.append(
                RowPlan(
                    drafts=drafts,
                    reach=drafts,
                    source=source,
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
        self._fresh()
        return self.chain.neighbour(gamma, size)

    # ----- learn ----------------------------------------------------------------------------

    def learn(self, plan: RoundPlan, outcome: RoundOutcome) -> None:
        """What the plan decided, backlog scores, each drafting row's trials, the round's timing; then forget the
        finished requests."""
        self._fresh()
        self._keep(plan, outcome)
        rows = self.read_outcome(plan, outcome)
        for row in rows:
            if row.backlog_scores is not None:
                self.acceptance.observe_scores(row.request_id, row.backlog_scores)
                self.scored += 1
        for row, row_plan in zip(rows, plan.rows):
            if row.num_drafted > 0 and plan.tree is not None:  # a tree's yield, not a chain's acceptance
                if row_plan.source is not DraftSource.LOOKUP:
                    self.trees_policy.yields.observe(row.request_id, plan.tree.nodes, row.num_accepted + 1)
            elif row.num_drafted > 0:
                self.acceptance.observe(
                    row.request_id,
                    row.num_drafted,
                    row.num_accepted,
                    row_plan.source is DraftSource.LOOKUP,
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
        seconds = outcome.draft_seconds + outcome.target_seconds + outcome.verify_seconds
        self.costs.record(
            len(outcome.rows),
            kind,
            plan.chosen_ids,
            self.round,
            outcome.draft_seconds,
            outcome.target_seconds,
            outcome.verify_seconds,
        )
        update = plan.update if isinstance(plan.update, PlanUpdate) else None
        if update is not None and update.goodput is not None:
            committed = sum(r.num_accepted + 1 for r in outcome.rows if not r.failed)
            self.goodput.learn(len(outcome.rows), update.batch, update.goodput, committed, seconds)
        for request_id in outcome.finished:
            self.forget(request_id)
        if self.profile is not None and update is not None and update.round % SAVE_EVERY == 0 and update.round:
            self.save()

    def _keep(self, plan: RoundPlan, outcome: RoundOutcome) -> None:
        """Keep what the plan decided for later rounds (a plan from another planner carries nothing)."""
        update = plan.update if isinstance(plan.update, PlanUpdate) else None
        if update is None or update.round == self.round and not update.choices:
            return
        if update.round > self.round:
            self.acceptance.age_pools()
        self.round = update.round
        finished = set(outcome.finished)
        self.choices.update((rid, choice) for rid, choice in update.choices if rid not in finished)
        if update.calibrating:
            self.costs.calibrating(len(outcome.rows), update.round)
        if update.trees is not None:
            self.trees_policy.memory = update.trees
        self.lookup_rounds += update.lookup_rows
        for rid, to, alpha, speedup in update.switches:
            self._switch(rid, to, alpha, len(outcome.rows), speedup)
        batch = update.batch
        if batch is not None and batch.switch is not None:
            log.info(
                "batch of %d: speculation %s (predicted goodput %.2fx plain)",
                len(outcome.rows),
                batch.switch,
                batch.ratio,
            )

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
        self.trees_policy.yields.forget(request_id)

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
