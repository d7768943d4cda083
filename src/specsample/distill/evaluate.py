"""Evaluate a draft against its target on held-out prompts, with the target's own continuations.

For each prompt the target writes a greedy continuation; both models then score it teacher-forced.
Per position: greedy agreement (same argmax) and acceptance alpha = sum(min(p, q)) of the two
distributions warped at each temperature. The cost ratio c is a draft step (forward + sampling)
over a target step at batch 1; the theory module turns (alpha, c) into the best gamma and the
predicted speedup.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
from tqdm import tqdm

from specsample.config import SamplingParams, SpecConfig
from specsample.datasets import Prompt
from specsample.engine import Engine
from specsample.sampling import sample, warp_probs
from specsample.theory import expected_speedup, optimal_gamma
from specsample.tokenizer import Tokenizer
from specsample.verification.chain import acceptance_probabilities

TEMPERATURES = (0.7, 1.0)


def target_continuations(
    target,
    tokenizer: Tokenizer,
    prompts: Sequence[Prompt],
    max_new_tokens: int,
    batch_size: int = 8,
    progress: bool = True,
) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy continuation ids) per prompt, from the target alone."""
    out = []
    bar = tqdm(total=len(prompts), desc="target continuations", unit="prompt", disable=not progress)
    for begin in range(0, len(prompts), batch_size):
        group = prompts[begin : begin + batch_size]
        ids = [tokenizer.encode(p.turns[0], chat=tokenizer.has_chat_template) for p in group]
        # a prompt that leaves no room for the continuation is skipped (an empty continuation)
        ids = [i if len(i) + max_new_tokens <= target.max_seq_len else [] for i in ids]
        longest = max(len(i) for i in ids) + max_new_tokens + 8
        engine = Engine(
            target,
            None,
            SpecConfig(speculative=False, max_batch_size=len(group), max_seq_len=longest),
            tokenizer.eos_token_ids,
        )
        rids = [
            engine.add_request(i, SamplingParams(temperature=0, max_new_tokens=max_new_tokens)) if i else None
            for i in ids
        ]
        conts: dict[str | None, list[int]] = {r: [] for r in rids}
        for result in engine.stream():
            for update in result.rows:
                conts[update.request_id].extend(update.new_tokens)
        out += [(i, conts[r] if r else []) for i, r in zip(ids, rids)]
        bar.update(len(group))
    bar.close()
    return out


@torch.inference_mode()
def position_metrics(target, draft, prompt_ids: list[int], continuation: list[int]) -> dict[str, list[float]]:
    """Per continuation position: agreement and alpha at each temperature."""
    tokens = torch.tensor([prompt_ids + continuation])
    span = slice(len(prompt_ids) - 1, len(prompt_ids) + len(continuation) - 1)  # predicts each continuation token
    p_logits = target(tokens)[0, span].float()
    q_logits = draft(tokens)[0, span].float()
    out = {"agree": (p_logits.argmax(-1) == q_logits.argmax(-1)).float().tolist()}
    for t in TEMPERATURES:
        params = SamplingParams(temperature=t)
        p, q = warp_probs(p_logits, params), warp_probs(q_logits, params)  # [n, vocab]
        out[f"alpha_{t}"] = acceptance_probabilities(tokens[:, span.start + 1 :], q[None], p[None])[0].tolist()
    return out


@torch.inference_mode()
def cost_ratio(target, draft, repeats: int = 30, context: int = 128) -> dict[str, float]:
    """Median seconds of a target decode step and of a draft step (forward + sampling), batch 1."""

    def steps(model, sampled: bool) -> list[float]:
        cache = model.new_cache(1, context + repeats + 4)
        slot = torch.tensor([0])
        model.prefill(torch.randint(0, min(1000, model.vocab_size), (1, context)), cache, slot)
        generator = torch.Generator().manual_seed(0)
        token = torch.tensor([[5]])
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            logits = model.forward_cached(token, cache, slot)[:, -1]
            if sampled:
                sample(warp_probs(logits, SamplingParams(temperature=0.7)), generator)
            times.append(time.perf_counter() - start)
        return times

    target_times, draft_times = [], []
    for _ in range(3):  # interleaved: drift hits both
        target_times += steps(target, sampled=False)
        draft_times += steps(draft, sampled=True)
    t, d = statistics.median(target_times), statistics.median(draft_times)
    return {"target_step_ms": 1000 * t, "draft_step_ms": 1000 * d, "c": d / t}


def evaluate(
    target,
    draft,
    tokenizer: Tokenizer,
    prompts: Sequence[Prompt],
    max_new_tokens: int = 64,
    progress: bool = True,
    measure_cost: bool = True,
) -> dict[str, Any]:
    """Agreement and alpha per category and overall; cost ratio; predicted speedup and best gamma."""
    conts = target_continuations(target, tokenizer, prompts, max_new_tokens, progress=progress)
    per_cat: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for prompt, (ids, cont) in tqdm(list(zip(prompts, conts)), desc="scoring", disable=not progress):
        if not cont:
            continue
        for key, values in position_metrics(target, draft, ids, cont).items():
            per_cat[prompt.category][key] += values
            per_cat["overall"][key] += values
    skipped = sum(1 for _, cont in conts if not cont)
    result: dict[str, Any] = {
        "prompts": len(prompts) - skipped,
        "skipped_too_long": skipped,
        "max_new_tokens": max_new_tokens,
        "categories": {},
    }
    for cat, values in per_cat.items():
        result["categories"][cat] = {k: statistics.fmean(v) for k, v in values.items()} | {
            "positions": len(values["agree"])
        }
    if measure_cost:
        cost = cost_ratio(target, draft)
        result["cost"] = cost
        overall = result["categories"]["overall"]
        result["predicted"] = {}
        for name, alpha in [("greedy", overall["agree"])] + [(f"t{t}", overall[f"alpha_{t}"]) for t in TEMPERATURES]:
            gamma = optimal_gamma(alpha, cost["c"])
            result["predicted"][name] = {
                "alpha": alpha,
                "best_gamma": gamma,
                "speedup": expected_speedup(alpha, gamma, cost["c"]),
            }
    return result
