"""What the gamma controller measures on the real pair, and gamma auto against plain decoding.

One Spec-Bench prompt per category (the first N), temperature 0, batch 1, interleaved: gamma auto (one
controller kept across the prompts, as the server keeps it) and plain decoding. After each prompt it
prints both speeds, the controller's cost model (c: a draft step over a plain round; k: what a drafting
round costs beyond a plain round and its draft steps) beside the draft-step / target-forward ratio, the
pooled acceptance rate, and the rounds the request spent in fallback; at the end, the round cost per
gamma the controller uses (measured where it timed such rounds, else 1 + k + gamma c).

    python benchmarks/controller_costs.py --prompts 6
"""

from __future__ import annotations

import argparse

from specsample.bench.run import add_pad_rows_option, add_pair_options, load_prompts, measured_widths
from specsample.bench.systems import Ours
from specsample.config import SamplingParams, SpecConfig
from specsample.pair import load_pair


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pair_options(parser)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    add_pad_rows_option(parser)
    args = parser.parse_args()

    pair = load_pair(args.target, args.draft, args.dtype, args.device, draft_window=args.draft_window)
    tokenizer, target, eos = pair.target.tokenizer, pair.target.model, pair.target.tokenizer.eos_token_ids
    prompts = load_prompts("spec-bench", 1, 0)[: args.prompts]
    widths = measured_widths(target, 8, args.pad_rows)
    auto = Ours("gamma=auto", target, pair.drafter,
                SpecConfig(gamma=8, adaptive=True, max_batch_size=1, target_widths=widths), eos)
    plain = Ours("plain", target, None, SpecConfig(speculative=False, max_batch_size=1), eos)
    controller = auto.controller
    for i, prompt in enumerate(prompts):
        ids = tokenizer.encode(prompt.turns[0], chat=True)
        params = SamplingParams(temperature=0, max_new_tokens=args.max_new_tokens, seed=i)
        fast, base = auto.run([ids], params)[0], plain.run([ids], params)[0]
        auto_tps, plain_tps = len(fast.tokens) / fast.seconds, len(base.tokens) / base.seconds
        pooled = controller._pooled[0] / max(sum(controller._pooled), 1e-9)
        plain_ms = controller._plain_round[1].value * 1000 if 1 in controller._plain_round else float("nan")
        draft_ms = controller._draft_step[1].value * 1000 if 1 in controller._draft_step else float("nan")
        step_ratio = controller._draft_step[1].value / controller._target_step[1].value
        print(f"{prompt.category}: auto {auto_tps:.1f} tok/s, plain {plain_tps:.1f} tok/s ({auto_tps / plain_tps:.2f}x); "
              f"c {controller.cost_ratio(1):.3f}, k {controller.overhead(1):.3f} (plain round {plain_ms:.1f} ms, "
              f"+{draft_ms:.1f} ms per draft step; "
              f"draft step / target forward {step_ratio:.3f}); pooled alpha {pooled:.2f}; "
              f"fallback rounds {fast.stats.get('fallback_row_rounds')}", flush=True)
    pooled = controller._pooled[0] / max(sum(controller._pooled), 1e-9)
    print("round cost for gamma 1..4 (plain rounds):",
          ", ".join(f"{controller.round_cost(1, g):.3f}" for g in range(1, 5)))
    print("predicted speedup for gamma 1..4:", ", ".join(f"{controller.speedup(pooled, g, 1):.3f}" for g in range(1, 5)))


if __name__ == "__main__":
    main()
