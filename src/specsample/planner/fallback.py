"""When a request that stopped drafting checks whether drafting would pay again.

A request falls back to plain decoding when even a generous acceptance estimate predicts a loss. From then on
it learns its acceptance either by probes (a drafting round now and then) or, where its draft model can score
what plain rounds committed, by backlog scorings (one teacher-forced draft forward, no drafts). Both are spaced
so their expected cost stays within PROBE_BUDGET of decode time.
"""

from __future__ import annotations

from dataclasses import dataclass

from specsample.theory import expected_tokens_per_round

FALLBACK_BELOW = 1.0  # predicted speedup under which a request stops drafting...
MARGIN = 1.0  # ...even at alpha this many standard errors above its estimate...
RESUME_ABOVE = 1.02  # ...and over which it drafts again (a gap against thrashing)
PROBE_EVERY = 4  # fewest rounds between probes or scorings in fallback
MAX_PROBE_EVERY = 256  # most rounds between them (how late a recovery can be noticed)
PROBE_BUDGET = 0.01  # share of decode time the expected loss of probing may cost
PROBE_HORIZON = 32  # no probes with fewer tokens left: a recovery then cannot pay for them
SCORE_MIN_TOKENS = 4  # backlog tokens a scoring waits for


@dataclass
class RequestChoice:
    """What gamma auto chose for one request, and where it stands in fallback."""

    gamma: int = 0  # the gamma it drafts at (0: not chosen yet)
    fallback: bool = False
    rounds_since_probe: int = 0
    scorings: int = 0  # backlog scorings since it last fell back
    planned: int | None = None  # drafts planned last round (None: none planned yet)


def probe_interval(alpha: float, gamma: int, round_cost: float) -> int:
    """Rounds between fallback probes: sparse enough that their expected loss stays within PROBE_BUDGET of decode
    time, within [PROBE_EVERY, MAX_PROBE_EVERY]. A probe takes `round_cost` plain rounds for E(alpha, gamma)
    tokens; priced at a generous alpha, near break-even it costs nothing and runs often."""
    loss = max(round_cost - expected_tokens_per_round(alpha, max(gamma, 1)), 0.0)  # in plain rounds' time
    interval = int(loss / PROBE_BUDGET) + 1
    return int(min(max(interval, PROBE_EVERY), MAX_PROBE_EVERY))


def score_interval(cost: float, done: int, remaining: int | None) -> int:
    """Rounds between backlog scorings that add `cost` plain rounds each: within PROBE_BUDGET of decode time, within
    [PROBE_EVERY, MAX_PROBE_EVERY]; the first (`done` 0) after at most 2 PROBE_EVERY rounds where it costs within
    PROBE_BUDGET of the `remaining` tokens (None: unknown). A request falls back on a few rounds' evidence, so the
    first scoring comes early; where a scoring is dear, that one early scoring is paid from the same budget."""
    interval = int(cost / PROBE_BUDGET) + 1
    if done == 0 and (remaining is None or cost <= PROBE_BUDGET * remaining):
        interval = min(interval, 2 * PROBE_EVERY)
    return min(max(interval, PROBE_EVERY), MAX_PROBE_EVERY)


def worth_probing(remaining: int | None) -> bool:
    """Whether a request with `remaining` tokens left may still probe: a recovery noticed with fewer than
    PROBE_HORIZON tokens left comes too late to repay its probes."""
    return remaining is None or remaining >= PROBE_HORIZON
