"""Verification: from a round's drafts and the target's distributions, which drafts to accept and which token follows
them, so that the output is distributed exactly as the target's (docs/exactness.md).

- `chain`: chain rejection sampling, modified rejection sampling over a chain of drafts, and greedy verification;
  `Verdict`, what every rule hands the engine.
- `tree`: tree rejection sampling, multi-candidate rejection sampling over a token tree, and its greedy walk.
- `coupled`: coupled sampling, each position's token the target's Gumbel-max with noise the draft shares, for chains
  and trees.
- `verifier`: the `Verifier`, which picks a round's rule.

A path is the nodes a tree round accepted, root to leaf, by their index among the proposal's drafts. The tree helpers
(depths, ancestors, children, a scored block's parents) are `specsample.token_tree`.
"""
