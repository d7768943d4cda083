"""Replay: compare gamma policies on the same sampled texts, so what differs is only the policy.

At temperature > 0 every system samples its own text, and with a few prompts per category the
difference between two policies is mostly the difference between their texts. But given the text,
speculative sampling's rounds are coins with known biases: a draft drawn from q at a position whose
output is token x was accepted with probability min(p(x), q(x)) / p(x) = min(1, q(x) / p(x)), and
these events are independent between positions (each draft is drawn from the same context, the text
so far). Because every lossless system outputs texts from the same distribution p, one set of texts
sampled once from the target stands for all of them, and every policy replays its rounds on it with
the same coins (common random numbers): per position one uniform, accepted when below that bias.

A replayed round drafts what the policy asks for (the real `GammaController` for gamma auto, fed the
replayed acceptance and timings), and is charged a round cost by draft count and context length.
A drafting round whose draft model lacks more than `MERGED_BACKLOG` + 2 tokens (after a long stretch
of plain rounds) pays one more draft step, the forward that feeds the backlog, as the real drafter
does; drafts are clipped to the request's token budget, as the engine clips them, so near the end of
a reply that stopped at EOS a round may draft past the text. Approximations, and whom they favour:
- a draft after the round's first rejection (or past the text's end) is off the text, so its
  confidence is unknown and the confidence gate never stops the round there (against gamma auto), nor
  does a round draft past its plan from there (for gamma auto: its extension's next draft would be rejected);
- a draft past the text's end counts as rejected (a real verifier may accept it before the EOS cut);
- the controller's own Python work and the wider first draft forward that carries a short backlog
  (about 0.4 ms, benchmarks/round_costs.py) are not charged (both for gamma auto);
- batch 1, and round costs from one run's fit.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from specsample.bench.round_costs import CostModel
from specsample.config import SamplingParams
from specsample.controller import GammaController
from specsample.drafters.base import Extension
from specsample.drafters.model import MERGED_BACKLOG, DraftWindow
from specsample.models.base import CausalLM
from specsample.sampling import warp_probs


@dataclass(frozen=True)
class Trace:
    """One reply sampled from the target, with what a draft would have done at each of its tokens."""

    category: str
    prompt_tokens: int
    accept: tuple[float, ...]  # per reply token: P(a draft there was accepted | the text) = min(1, q(x) / p(x))
    confidence: tuple[float, ...]  # the draft's temperature-1 probability of the reply token (an accepted draft's)
    rejected_confidence: tuple[float, ...]  # ...of a draft drawn as rejected, from max(0, q - p) (NaN: never)
    max_new_tokens: int | None = None  # the request's token budget (None: the reply's length)

    def __post_init__(self) -> None:
        if not len(self.accept) == len(self.confidence) == len(self.rejected_confidence):
            raise ValueError("accept, confidence and rejected_confidence need one value per reply token, got "
                             f"{len(self.accept)}, {len(self.confidence)}, {len(self.rejected_confidence)}")
        if not self.accept:
            raise ValueError("a trace needs at least one reply token")
        if any(not 0.0 <= a <= 1.0 for a in self.accept):
            raise ValueError("accept values are probabilities and must lie in [0, 1]")
        if self.max_new_tokens is not None and self.max_new_tokens < len(self.accept):
            raise ValueError(f"max_new_tokens {self.max_new_tokens} is shorter than the reply ({len(self.accept)})")


def reply_logits(model: CausalLM, prompt: Sequence[int], reply: Sequence[int],
                 window: DraftWindow | None = None) -> Tensor:
    """Logits `[len(reply), vocab]` the model gives each reply token, teacher-forced (one forward per
    window: with a `DraftWindow` the model sees the window's view of the context, as a windowed
    `ModelDrafter` does, re-windowed whenever its positions reach the limit; the drafter re-windows a
    round or so earlier, which this does not follow)."""
    if not prompt or not reply:
        raise ValueError("need a non-empty prompt and reply")
    slots, parts, done = torch.tensor([0]), [], 0
    while done < len(reply):
        context = [*prompt, *reply[:done]]
        kept = window.view(context[:-1])[0] if window is not None else context[:-1]
        take = len(reply) - done if window is None else min(len(reply) - done, window.limit - len(kept))
        cache = model.new_cache(1, len(kept) + take + 1)
        if kept:
            model.prefill(torch.tensor([kept], device=model.device), cache, slots)
        tokens = torch.tensor([[context[-1], *reply[done:done + take - 1]]], device=model.device)
        parts.append(model.forward_cached(tokens, cache, slots)[0].float().cpu())
        done += take
    return torch.cat(parts)


def trace_from_logits(category: str, prompt_tokens: int, reply: Sequence[int], target_logits: Tensor,
                      draft_logits: Tensor, params: SamplingParams, generator: torch.Generator) -> Trace:
    """A trace from the target's and the draft's logits over the reply (`[len(reply), vocab]` each)."""
    tokens = torch.tensor(list(reply)).unsqueeze(-1)  # [n, 1]
    target_probs = warp_probs(target_logits, params)  # [n, vocab]
    draft_probs = warp_probs(draft_logits, params)  # [n, vocab]
    p_token = target_probs.gather(-1, tokens).squeeze(-1)  # [n]
    q_token = draft_probs.gather(-1, tokens).squeeze(-1)  # [n]
    # p(x) = 0 only where one batched forward's last bits disagree with incremental greedy decoding
    accept = torch.where(p_token > 0, torch.clamp(q_token / p_token.clamp_min(1e-30), max=1.0), (q_token > 0).float())
    own = torch.softmax(draft_logits.float(), dim=-1)  # [n, vocab]: the gate's confidence is at temperature 1
    residual = torch.clamp(draft_probs - target_probs, min=0.0)  # [n, vocab]: where rejected drafts come from
    mass = residual.sum(-1)  # [n]
    drawn = torch.multinomial(torch.where(mass.unsqueeze(-1) > 1e-12, residual, torch.ones_like(residual)), 1,
                              generator=generator)  # [n, 1]
    rejected = torch.where(mass > 1e-12, own.gather(-1, drawn).squeeze(-1), torch.tensor(float("nan")))
    return Trace(category, prompt_tokens, tuple(accept.tolist()), tuple(own.gather(-1, tokens).squeeze(-1).tolist()),
                 tuple(rejected.tolist()), params.max_new_tokens)


@dataclass(frozen=True)
class DraftPrefill:
    """The draft model's own prefill, timed apart (benchmarks/draft_window.py): seconds by tokens fed, and how
    many of a prompt's tokens the drafter feeds it (sink + recent of its window; None: all but the last)."""

    seconds: tuple[tuple[int, float], ...]  # (tokens, seconds), by tokens ascending
    keeps: int | None = None

    def __post_init__(self) -> None:
        if len(self.seconds) < 2 or [n for n, _ in self.seconds] != sorted({n for n, _ in self.seconds}):
            raise ValueError("need draft prefill times at two or more distinct token counts, ascending")

    def __call__(self, prompt_tokens: int) -> float:
        """Seconds to prefill what the drafter feeds of a prompt (linear between the timed counts and past them)."""
        fed = prompt_tokens - 1 if self.keeps is None else min(prompt_tokens - 1, self.keeps)
        if fed <= 0:
            return 0.0
        points = self.seconds
        i = next((k for k in range(1, len(points) - 1) if fed <= points[k][0]), len(points) - 1)
        (n0, s0), (n1, s1) = points[i - 1], points[i]
        return max(s0 + (s1 - s0) * (fed - n0) / (n1 - n0), 0.0)


@dataclass(frozen=True)
class RoundCostTable:
    """Mean seconds of a round by draft count (each from the run of the system that drafted that many)."""

    models: dict[int, CostModel]  # draft count -> the cost model to price such rounds (and prefills) with
    draft_step: float  # seconds of one draft step: splits a round's time for the controller
    draft_prefill: DraftPrefill | None = None  # None: a drafting prefill at fixed gamma 1's fit
    scoring: float | None = None  # seconds a backlog scoring adds to a plain round (None: one draft step)
    controller: float = 0.0  # seconds gamma auto's own work (controller, backlog bookkeeping) adds to each round

    @classmethod
    def from_fits(cls, fits: dict[str, dict], max_gamma: int = 8, draft_prefill: DraftPrefill | None = None,
                  scoring: float | None = None, controller: float = 0.0) -> RoundCostTable:
        """From a benchmarks/adaptive.py run's `model_fit` (one temperature): plain rounds at target-only's
        costs, rounds of d drafts at fixed gamma d's (the real run's time, stalls left out); a backlog
        scoring at `scoring` plain rounds, else at gamma auto's fitted cost of one where the run has it, else
        at a draft step; gamma auto's own work at `controller` plain rounds a round (the fixed systems' fits
        hold none of it; benchmarks/plain_round_overhead.py measures it)."""
        if controller < 0:
            raise ValueError(f"controller overhead must be >= 0 plain rounds, got {controller}")
        if max_gamma < 3:
            raise ValueError(f"max_gamma must be >= 3 (the draft step is read off gamma 2 to max_gamma), got {max_gamma}")
        names = {0: "target-only", **{d: f"gamma={d}" for d in range(1, max_gamma + 1)}}
        missing = [n for n in names.values() if n not in fits]
        if missing:
            raise ValueError(f"the fits lack systems {missing}")
        models = {d: CostModel.from_dict(fits[n]["cost_model"])
                  for d, n in names.items()}
        context = 300
        step = (models[max_gamma].round_seconds(max_gamma, context) - models[2].round_seconds(2, context)) / (max_gamma - 2)
        plain = models[0].round_seconds(0, context)
        fitted = CostModel.from_dict(fits["gamma=auto"]["cost_model"]).scored_coef if "gamma=auto" in fits else 0.0
        seconds = scoring * plain if scoring is not None else (fitted or None)
        return cls(models, max(step, 0.0), draft_prefill, seconds, controller * plain)

    @property
    def scoring_seconds(self) -> float:
        """What a backlog scoring adds to a round."""
        return self.scoring if self.scoring is not None else self.draft_step

    def round_seconds(self, drafts: int, context: int) -> float:
        return self.models[drafts].round_seconds(drafts, context)

    def prefill_seconds(self, prompt_tokens: int, drafting: bool) -> float:
        """A prompt's prefill: the target's alone (target-only's fit), or with the draft's: target-only's plus
        the draft's timed prefill of what it is fed when `draft_prefill` is set, else fixed gamma 1's fit (a
        line in the prompt's length, which charges a windowed draft, fed at most sink + recent tokens, for
        the whole prompt)."""
        if drafting and self.draft_prefill is not None:
            a, b = self.models[0].prefill_coef
            return a + b * prompt_tokens + self.draft_prefill(prompt_tokens)
        a, b = self.models[1 if drafting else 0].prefill_coef
        return a + b * prompt_tokens


Policy = int | str  # a fixed number of drafts per round (0: target-only), or "auto"


@dataclass(frozen=True)
class Replayed:
    tokens: int
    seconds: float  # modelled: rounds at their mean cost
    rounds: int
    drafted: int
    probes: int = 0  # drafting rounds gamma auto ran from fallback
    scorings: int = 0  # backlog scorings gamma auto ran in fallback (a draft forward, no drafts)
    draft_prefill: float = 0.0  # seconds the draft's prefill added to the target's


def replay(trace: Trace, policy: Policy, uniforms: Sequence[float], costs: RoundCostTable,
           noise: Callable[[], float], controller: GammaController | None = None, request_id: str = "replay",
           max_gamma: int = 8) -> Replayed:
    """Decode `trace` once under `policy`; a draft at reply position i is accepted iff uniforms[i] < accept[i].

    `noise()` multiplies the timings the controller sees (the charged time is the mean cost).
    """
    if policy == "auto" and controller is None:
        raise ValueError("policy 'auto' needs a controller")
    if policy != "auto" and not (isinstance(policy, int) and policy >= 0):
        raise ValueError(f"policy must be 'auto' or a number of drafts >= 0, got {policy!r}")
    total = len(trace.accept)
    budget = trace.max_new_tokens or total
    if len(uniforms) < total:
        raise ValueError(f"need a uniform per reply token ({total}), got {len(uniforms)}")
    seconds, pos, rounds, drafted_total, probes = costs.prefill_seconds(trace.prompt_tokens, policy != 0), 0, 0, 0, 0
    draft_prefill = seconds - costs.prefill_seconds(trace.prompt_tokens, False)
    missing = 1  # tokens the draft model has not fed yet (the prompt's last)
    plain_run: list[int] = []  # reply positions plain rounds committed since the draft last fed
    scorings = 0
    while pos < total:
        wanted = controller.plan([request_id], 1, [budget - pos], [len(plain_run)])[0] if policy == "auto" else policy
        scoring = controller.scores_planned().get(request_id, 0) if policy == "auto" else 0
        scored = bool(scoring and plain_run)
        if scored:
            # the draft scores the tokens it missed in one forward: each position's acceptance probability
            # (the engine estimates it unbiasedly by min(1, q / p) of the committed token; here its mean)
            controller.observe_scores(request_id, [trace.accept[i] for i in plain_run[-scoring:]])
            scorings, missing, plain_run = scorings + 1, 1, []
        reach = max(0, min(max_gamma, budget - pos - 1))  # the engine's clip: the budget, not the text
        drafts = min(wanted, reach)
        probes += int(drafts > 0 and controller is not None and controller.in_fallback(request_id))
        thresholds, rule = controller.gate(1) if policy == "auto" and drafts > 0 else ([], None)
        extension = Extension((drafts,), *rule) if rule is not None else None
        drafted, accepted, rejected, confidences = 0, 0, False, []
        for j in range(reach if extension is not None else drafts):
            i = pos + j
            drafted += 1
            if rejected or i >= total:
                rejected, confidence = True, math.nan  # off the text: unknown, so the gate cannot stop here
            elif uniforms[i] < trace.accept[i]:
                accepted, confidence = accepted + 1, trace.confidence[i]
            else:
                rejected, confidence = True, trace.rejected_confidence[i]
            confidences.append(confidence)
            if j + 1 < drafts:
                if j < len(thresholds) and confidence < thresholds[j]:
                    break  # NaN compares False: never stops off the text
            elif extension is None or not extension.draws_on(0, confidences):
                break  # the plan is drawn (NaN never extends: off the text the draft's confidence is unknown)
        context = trace.prompt_tokens + pos
        backlog_forward = drafted > 0 and missing - 2 > MERGED_BACKLOG
        round_seconds = (costs.round_seconds(drafted, context) + (costs.draft_step if backlog_forward else 0.0)
                         + (costs.scoring_seconds if scored else 0.0)
                         + (costs.controller if policy == "auto" else 0.0))  # the controller times the whole round
        if controller is not None:
            reached = min(accepted + 1, drafted)  # positions past the text's end (no probability) count as rejections
            expected = [trace.accept[pos + j] if pos + j < total else 0.0 for j in range(reached)]
            controller.observe(request_id, drafted, accepted, confidences, expected)
            factor = noise()
            draft_seconds = drafted * costs.draft_step * factor
            controller.observe_timing(1, drafted, draft_seconds, round_seconds * factor - draft_seconds)
        seconds += round_seconds
        plain_run = plain_run + [pos] if drafted == 0 else []
        pos += min(accepted + 1, total - pos)  # a round that reaches the text's last token (its EOS) ends it
        rounds += 1
        drafted_total += drafted
        # a drafting round leaves the draft lacking the next token (and the last draft, when all passed)
        missing = missing + 1 if drafted == 0 else 1 + (accepted == drafted)
    if controller is not None:
        controller.release(request_id)
    return Replayed(total, seconds, rounds, drafted_total, probes, scorings, draft_prefill)


def timing_noise(rng: random.Random, sd: float = 0.05, stall_rate: float = 0.02) -> Callable[[], float]:
    """Multiplicative timing noise like this box's: lognormal, and now and then a round at half speed."""
    return lambda: math.exp(rng.gauss(0.0, sd)) * (2.0 if rng.random() < stall_rate else 1.0)


ORDERS = ("shuffled", "given")  # the order gamma auto's shared controller sees the traces in


def compare(traces: Sequence[Trace], costs: RoundCostTable, replicates: int, seed: int = 0,
            fixed: Sequence[int] = tuple(range(1, 9)),
            new_controller: Callable[[], GammaController] = GammaController,
            progress: Callable[[int], None] | None = None,
            probes: dict[str, float] | None = None, order: str = "shuffled",
            breakdown: dict[str, dict[str, float]] | None = None,
            drafts: dict[str, float] | None = None) -> dict[str, dict[str, float]]:
    """Tokens per modelled second per system and category (and "overall"), summed over `replicates`
    replays of every trace. Every system sees the same coins per replicate and trace. "gamma=auto" keeps
    one controller through a replicate, the traces in `order`: "shuffled" (as a server sees requests) or
    "given" (as listed: benchmarks/adaptive.py runs Spec-Bench category by category, so a category's
    requests start from acceptance pooled over the categories before it); "gamma=auto fresh" gets a new
    one per trace. `probes`, if given, receives gamma auto's mean number
    of fallback probes per reply, per category, and `drafts` its drafts per reply. `breakdown`, if given, receives per category where gamma
    auto's time beyond target-only's went, as shares of target-only's time: "prefill" (the draft's),
    "scoring" (backlog scorings), "controller" (its own work in every round, `RoundCostTable.controller`) and
    "drafting" (the rest: drafting rounds' cost less the rounds they saved)."""
    if replicates < 1:
        raise ValueError(f"replicates must be >= 1, got {replicates}")
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    systems: dict[str, Policy] = {"target-only": 0, **{f"gamma={g}": g for g in fixed},
                                  "gamma=auto": "auto", "gamma=auto fresh": "auto"}
    sums: dict[str, dict[str, list[float]]] = {s: defaultdict(lambda: [0.0, 0.0]) for s in systems}
    probed: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])  # category -> replies, probes, drafts (gamma auto)
    spent: dict[str, list[float]] = defaultdict(lambda: [0.0] * 5)  # category -> target-only, extra, prefill, scoring,
    # controller
    for rep in range(replicates):
        sequence = list(range(len(traces)))
        if order == "shuffled":
            random.Random(seed * 7919 + rep).shuffle(sequence)
        shared = new_controller()
        for i in sequence:
            trace = traces[i]
            coins = random.Random(f"{seed}/{rep}/{i}")
            uniforms = [coins.random() for _ in trace.accept]
            for name, policy in systems.items():
                controller = None if policy != "auto" else (shared if name == "gamma=auto" else new_controller())
                noise = timing_noise(random.Random(f"{seed}/{rep}/{i}/noise"))
                result = replay(trace, policy, uniforms, costs, noise, controller, f"{rep}-{i}")
                if name == "target-only":
                    baseline = result.seconds
                for cat in (trace.category, "overall"):
                    sums[name][cat][0] += result.tokens
                    sums[name][cat][1] += result.seconds
                    if name == "gamma=auto":
                        probed[cat][0] += 1
                        probed[cat][1] += result.probes
                        probed[cat][2] += result.drafted
                        totals = spent[cat]
                        totals[0] += baseline
                        totals[1] += result.seconds - baseline
                        totals[2] += result.draft_prefill
                        totals[3] += result.scorings * costs.scoring_seconds
                        totals[4] += result.rounds * costs.controller
            if progress is not None:
                progress(1)
    if probes is not None:
        probes.update({cat: n / replies for cat, (replies, n, _) in probed.items()})
    if drafts is not None:
        drafts.update({cat: n / replies for cat, (replies, _, n) in probed.items()})
    if breakdown is not None:
        breakdown.update({cat: {"prefill": prefill / base, "scoring": scoring / base, "controller": own / base,
                                "drafting": (extra - prefill - scoring - own) / base}
                          for cat, (base, extra, prefill, scoring, own) in spent.items()})
    return {name: {cat: tok / sec for cat, (tok, sec) in cats.items()} for name, cats in sums.items()}
