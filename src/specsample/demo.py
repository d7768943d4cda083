"""Speculative generation with the built-in tiny models: `python -m specsample.demo`."""

from __future__ import annotations

import json

from specsample import SamplingParams, SpecConfig, generate, tiny_lm


def main() -> None:
    """Generate from two prompts with a tiny draft, then print tokens and statistics."""
    target = tiny_lm(vocab_size=64, seed=0)
    draft = tiny_lm(vocab_size=64, seed=1, num_layers=1)
    result = generate(target, [[1, 2, 3], [4, 5]], SamplingParams(temperature=0.8, max_new_tokens=32, seed=0),
                      draft=draft, config=SpecConfig(gamma=4))
    for completion in result.completions:
        print(completion.prompt_ids, "->", completion.token_ids)
    print(json.dumps(result.stats, indent=2))


if __name__ == "__main__":
    main()
