"""How often drafts are accepted: per request, pooled over requests, per confidence bin, for the draft model
and for prompt lookups apart.

A request's estimate is its own decayed trials behind PRIOR_WEIGHT pseudo-trials at a prior centre: the
acceptance its drafts' confidences predict, or the pool of earlier requests before that exists. Trials count
per draft position reached; where the verifier's acceptance probability at a position is known (sum of
min(target, draft)), it counts in place of the coin: the same trials with the coin's noise taken out.
"""

from __future__ import annotations

from dataclasses import dataclass

DECAY = 0.96  # forgetting per observed draft trial (a memory of about 25 trials)
PRIOR_ALPHA = 0.5  # a new request's prior before the pool holds POOL_MIN_TRIALS trials
PRIOR_WEIGHT = 8.0  # pseudo-trials at the prior centre behind every request's estimate
POOL_DECAY = 0.99  # forgetting of the pooled acceptance per trial...
POOL_ROUND_DECAY = 0.995  # ...and per round planned, so a pool set low when every request fell back is forgotten
POOL_MIN_TRIALS = 10.0  # pooled trials from which the pool, not PRIOR_ALPHA, sets a new request's prior
CONFIDENCE_WEIGHT = 2.0  # pseudo-trials at the pooled acceptance behind what a request's confidences predict
BINS = 10  # confidence bins
BIN_MIN_TRIALS = 10  # drafts a bin needs before its acceptance is read
CALIBRATED = 200  # drafts binned by confidence before the bins are read (the gate, the confidence prior)


@dataclass
class RequestAcceptance:
    """One request's decayed trials."""

    successes: float = 0.0  # its accepted drafts
    failures: float = 0.0  # ...and rounds ended by a rejection
    squares: float = 0.0  # ...and the sum of its trials' squared outcomes: their spread, for the margin
    predicted: float = 0.0  # acceptance its drafts' confidences predict, summed over its trials...
    predicted_trials: float = 0.0  # ...over this many of them (those with a confidence in a calibrated bin)
    lookup_successes: float = 0.0  # its prompt-lookup drafts accepted, apart from the draft model's...
    lookup_failures: float = 0.0  # ...and its lookup rounds ended by a rejection


class Acceptance:
    """Acceptance estimates for every running request, the pools new requests start from, and confidence bins."""

    def __init__(self) -> None:
        self.requests: dict[str, RequestAcceptance] = {}
        self.pooled = [0.0, 0.0]  # the draft model's successes, failures over all requests (decayed)
        self.lookup_pooled = [0.0, 0.0]  # prompt lookups' successes, failures over all requests
        self.bin_trials = [0] * BINS
        self.bin_accepts = [0] * BINS

    def read(self, request_id: str) -> RequestAcceptance:
        """The request's trials (none yet: empty ones, not kept)."""
        return self.requests.get(request_id) or RequestAcceptance()

    def of(self, request_id: str) -> RequestAcceptance:
        """The request's trials, to add to."""
        if request_id not in self.requests:
            self.requests[request_id] = RequestAcceptance()
        return self.requests[request_id]

    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    # ----- estimates ------------------------------------------------------------------------

    def alpha(self, request_id: str) -> float:
        """The request's acceptance estimate (the prior stays: on its own, ~25 remembered trials near break-even
        are noisy enough to send requests that gain by drafting into fallback)."""
        state = self.read(request_id)
        return (state.successes + PRIOR_WEIGHT * self.prior_centre(state)) / (
            state.successes + state.failures + PRIOR_WEIGHT
        )

    def alpha_upper(self, request_id: str, margin: float) -> float:
        """Alpha `margin` standard errors above the estimate (its trials are its sample size)."""
        state, alpha = self.read(request_id), self.alpha(request_id)
        trials = state.successes + state.failures + PRIOR_WEIGHT
        # the prior's pseudo-trials count as coins (second moment = mean); acceptance probabilities spread less
        second = (state.squares + PRIOR_WEIGHT * self.prior_centre(state)) / trials
        variance = max(second - alpha * alpha, 0.0)
        return min(alpha + margin * (variance / trials) ** 0.5, 1.0)

    def lookup_alpha(self, request_id: str) -> float:
        """The request's prompt-lookup acceptance: kept apart from the draft model's, as a copied span is accepted
        wholesale or not at all, and mixing the two made the model look good where only lookups were."""
        state = self.read(request_id)
        centre = self.pooled_alpha(self.lookup_pooled)
        return (state.lookup_successes + PRIOR_WEIGHT * centre) / (
            state.lookup_successes + state.lookup_failures + PRIOR_WEIGHT
        )

    def prior_centre(self, state: RequestAcceptance) -> float:
        """What a request's drafts' confidences predict (each draft's bin's past acceptance), behind
        CONFIDENCE_WEIGHT pseudo-trials at the pool, and never above the pool: a draft lost on a request is unsure
        of its own tokens, and confidences arrive with every draft, accepted or not."""
        pooled = self.pooled_alpha()
        return min(
            (state.predicted + CONFIDENCE_WEIGHT * pooled) / (state.predicted_trials + CONFIDENCE_WEIGHT), pooled
        )

    def pooled_alpha(self, pooled: list[float] | None = None) -> float:
        """Acceptance over earlier requests (the draft model's, or `pooled`), or PRIOR_ALPHA while the pool holds
        fewer than POOL_MIN_TRIALS trials."""
        successes, failures = self.pooled if pooled is None else pooled
        if successes + failures >= POOL_MIN_TRIALS:
            return min(max(successes / (successes + failures), 0.01), 0.99)
        return PRIOR_ALPHA

    def calibrated(self) -> bool:
        """Enough drafts binned by confidence for the gate and the confidence prior."""
        return sum(self.bin_trials) >= CALIBRATED

    def bin_acceptance(self, b: int) -> float | None:
        """Past acceptance of drafts in confidence bin `b`, once it holds BIN_MIN_TRIALS of them."""
        trials = self.bin_trials[b]
        return self.bin_accepts[b] / trials if trials >= BIN_MIN_TRIALS else None

    def mean_bin_acceptance(self) -> float:
        return sum(self.bin_accepts) / sum(self.bin_trials)

    # ----- observations ---------------------------------------------------------------------

    def age_pools(self) -> None:
        """Age both pools by one round: they learn only from drafting, and a pool set low by a few bad rounds would
        otherwise keep every new request's prior low while every request is in fallback."""
        self.pooled = [POOL_ROUND_DECAY * x for x in self.pooled]
        self.lookup_pooled = [POOL_ROUND_DECAY * x for x in self.lookup_pooled]

    def observe(
        self,
        request_id: str,
        num_drafted: int,
        num_accepted: int,
        lookup: bool,
        confidences: tuple[float, ...] | None = None,
        expected: tuple[float, ...] | None = None,
    ) -> None:
        """One drafting round of a request: counts, the confidence of each drafted token, and per position reached
        (its accepted drafts and the first rejected one) the probability a draft there is accepted (`expected`,
        counted in place of the coins)."""
        if num_drafted <= 0:
            return
        if not 0 <= num_accepted <= num_drafted:
            raise ValueError(f"num_accepted must be in 0..num_drafted ({num_drafted}), got {num_accepted}")
        state = self.of(request_id)
        reached = min(num_accepted + 1, num_drafted)
        if expected is not None and len(expected) != reached:
            raise ValueError(f"expected holds one probability per position reached ({reached}), got {len(expected)}")
        outcomes = (
            [min(max(float(b), 0.0), 1.0) for b in expected]
            if expected is not None
            else [1.0] * num_accepted + [0.0] * (reached - num_accepted)
        )
        successes, failures = sum(outcomes), reached - sum(outcomes)
        factor = DECAY**reached  # forget per trial, not per round: a long round must not outweigh many short ones
        pool = POOL_DECAY**reached
        if lookup:
            state.lookup_successes = factor * state.lookup_successes + successes
            state.lookup_failures = factor * state.lookup_failures + failures
            self.lookup_pooled = [pool * self.lookup_pooled[0] + successes, pool * self.lookup_pooled[1] + failures]
            return
        state.successes = factor * state.successes + successes
        state.squares = factor * state.squares + sum(x * x for x in outcomes)
        state.failures = factor * state.failures + failures
        self.pooled = [pool * self.pooled[0] + successes, pool * self.pooled[1] + failures]
        state.predicted *= factor
        state.predicted_trials *= factor
        calibrated = self.calibrated()
        for i, q in enumerate((confidences or ())[:reached]):
            if q != q:  # NaN: a deterministic (n-gram) draft has no confidence to calibrate on
                continue
            b = min(int(q * BINS), BINS - 1)
            accepted = self.bin_acceptance(b) if calibrated else None
            if accepted is not None:
                state.predicted += accepted
                state.predicted_trials += 1
            self.bin_trials[b] += 1
            self.bin_accepts[b] += int(i < num_accepted)

    def observe_scores(self, request_id: str, acceptance: tuple[float, ...]) -> None:
        """A backlog scoring: per token plain rounds committed, the probability that a draft there would have been
        accepted (min(1, q / p) of the committed token: unbiased for it, since the token was drawn from p). The
        request's own trials, not the pool's: they are ungated and come from requests in fallback."""
        state = self.of(request_id)
        for accepted in acceptance:  # forget per trial, as `observe` does
            accepted = min(max(float(accepted), 0.0), 1.0)
            state.successes = DECAY * state.successes + accepted
            state.squares = DECAY * state.squares + accepted * accepted
            state.failures = DECAY * state.failures + 1.0 - accepted
        factor = DECAY ** len(acceptance)
        state.predicted *= factor
        state.predicted_trials *= factor
