"""How hard a decoded text is for the draft, and benchmark times adjusted for it (a control variate).

At temperature > 0 every system samples texts of its own, so on one prompt a fixed gamma may happen to write an
easy reply and gamma auto a hard one, and its tokens per round follow. The text's difficulty for the draft is a
function of the text only, and every lossless system samples its texts from the same distribution, so its
expectation is the same for every system: adjusting each reply's time for how far its text's difficulty sits from
the prompt's mean takes that noise out without moving any system's expected time (regression adjustment with a
control variate; "CUPED" in A/B testing). The adjustment goes through the rounds a text took, which the box's
timing noise does not touch.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

import torch

from specsample.bench.goals import Reply
from specsample.config import SamplingParams
from specsample.sampling import warp_probs
from specsample.verify import acceptance_probabilities


@torch.inference_mode()
def text_acceptance(target, draft, prompt_ids: Sequence[int], reply_ids: Sequence[int],
                    params: SamplingParams) -> float:
    """Mean over a reply's tokens of the probability that a draft there is accepted, teacher-forced on the
    text: `verify.acceptance_probabilities` (sum over the vocabulary of min(target, draft) under `params`); a
    draft with an output subset (FR-Spec) has logits only there, as when it drafts. NaN for an empty reply."""
    if not reply_ids:
        return float("nan")
    if not prompt_ids:
        raise ValueError("text_acceptance needs the prompt: the first reply token is predicted from it")
    tokens = torch.tensor([list(prompt_ids) + list(reply_ids)], device=target.device)
    span = slice(len(prompt_ids) - 1, len(prompt_ids) + len(reply_ids) - 1)  # the positions predicting the reply
    target_probs = warp_probs(target.forward(tokens)[:, span], params)  # [1, reply, vocab]
    draft_probs = warp_probs(draft.forward(tokens)[:, span], params)  # [1, reply, vocab]
    return float(acceptance_probabilities(tokens[:, span.start + 1:], draft_probs, target_probs).mean())


Rounds = dict[str, dict[int, tuple[int, float]]]  # system -> reply key -> (rounds, seconds spent in them)


def fittable(replies: dict[str, list[Reply]], prompts: int) -> bool:
    """Whether `adjust_for_difficulty` has anything to fit: some system with two replies on one prompt (with one
    reply per prompt every slope is 0 and every within-prompt spread NaN)."""
    return any(len(keys) > len(set(keys)) for keys in ([key % prompts for key, *_ in rows] for rows in replies.values()))


def adjust_for_difficulty(replies: dict[str, list[Reply]], difficulty: dict[str, dict[int, float]], prompts: int,
                          rounds: Rounds) -> tuple[dict[str, list[Reply]], dict[str, float]]:
    """Each reply's seconds with its text's luck taken out. Per system, rounds per token are regressed on the
    text's acceptance within prompts (slope `beta`, pooled over the prompts): a timing-free fit, as a reply's
    rounds follow its text and its system's choices, not the box. Each reply is then charged, at its own price
    per round, the rounds its text's distance from the prompt's centre predicts it saved or cost:
    seconds - (round seconds / rounds) x tokens x beta x (acceptance - centre). The centre is the mean over every
    system's texts on the prompt, weighted by their tokens.

    Every system's texts come from one distribution, so the adjustment has mean zero for each system (the box's
    noise untouched: a regression of time on acceptance took in its stalls and moved some systems the wrong way).
    `difficulty[name][key]` is `text_acceptance` of that reply, `rounds[name][key]` its rounds and their seconds;
    a reply without either, or with a NaN acceptance, is left as it is. Returns the adjusted replies and each
    system's beta (rounds per token per unit of acceptance; 0 where it cannot be fitted)."""
    if prompts < 1:
        raise ValueError(f"prompts must be >= 1, got {prompts}")
    known = {name: {k: x for k, x in difficulty.get(name, {}).items()
                    if x == x and rounds.get(name, {}).get(k, (0, 0.0))[0] > 0} for name in replies}
    # a prompt's centre weighs each text by its tokens, as each reply's adjustment does: then the adjustments of
    # every system's replies there sum to zero even where short replies (an early EOS) run easier or harder
    by_prompt: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0])  # prompt -> [sum of tokens x, tokens]
    for name, rows in replies.items():
        for key, _, tokens, _ in rows:
            if key in known[name] and tokens > 0:
                by_prompt[key % prompts][0] += tokens * known[name][key]
                by_prompt[key % prompts][1] += tokens
    centre = {p: weighted / tokens for p, (weighted, tokens) in by_prompt.items()}
    adjusted: dict[str, list[Reply]] = {}
    betas: dict[str, float] = {}
    for name, rows in replies.items():
        points = defaultdict(list)  # prompt -> [(acceptance, rounds per token)] of this system
        for key, _, tokens, _ in rows:
            if key in known[name] and tokens > 0:
                points[key % prompts].append((known[name][key], rounds[name][key][0] / tokens))
        sxy = sxx = 0.0
        for group in points.values():  # within prompts: the text moves a reply's rounds, the prompt its context
            mx = sum(x for x, _ in group) / len(group)
            my = sum(y for _, y in group) / len(group)
            sxy += sum((x - mx) * (y - my) for x, y in group)
            sxx += sum((x - mx) ** 2 for x, _ in group)
        beta = sxy / sxx if sxx > 0 else 0.0
        betas[name] = beta

        def moved(key: int, tokens: int, seconds: float) -> float:
            if key not in known[name] or tokens <= 0:
                return seconds
            count, spent = rounds[name][key]
            return seconds - spent / count * tokens * beta * (known[name][key] - centre[key % prompts])

        adjusted[name] = [(key, cat, tokens, moved(key, tokens, seconds)) for key, cat, tokens, seconds in rows]
    return adjusted, betas


def within_prompt_spread(replies: dict[str, list[Reply]], prompts: int) -> dict[str, float]:
    """Per system, the standard deviation of log(time per token) around its prompt's mean (pooled over prompts
    with two or more replies): how far one reply's speed strays on a prompt, before or after the adjustment."""
    if prompts < 1:
        raise ValueError(f"prompts must be >= 1, got {prompts}")
    out = {}
    for name, rows in replies.items():
        groups: dict[int, list[float]] = defaultdict(list)
        for key, _, tokens, seconds in rows:
            if tokens > 0 and seconds > 0:
                groups[key % prompts].append(math.log(seconds / tokens))
        squares = dof = 0.0
        for logs in groups.values():
            if len(logs) > 1:
                mean = sum(logs) / len(logs)
                squares += sum((x - mean) ** 2 for x in logs)
                dof += len(logs) - 1
        out[name] = math.sqrt(squares / dof) if dof else float("nan")
    return out
