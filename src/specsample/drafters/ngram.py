"""Prompt-lookup / n-gram drafting: propose what followed the longest recent repeat of the context.

Deterministic (one-hot draft probabilities), so it needs no draft model and the verifier's
rejection rule reduces to "accept with the target's probability of the proposed token".
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specsample.config import TreeShape
from specsample.drafters.base import Abilities, DraftRequest, Proposal
from specsample.planner.base import DraftSource

BRANCH_MEMORY = 3  # older occurrences kept per n-gram, beside the most recent, for branched lookups


class NgramIndex:
    """One row's tokens and, per n-gram length n in [min_n, max_n], where each n-gram last ended: `find` gives the
    tokens that followed the most recent earlier occurrence of the longest suffix n-gram with a few dictionary reads.
    The hybrid drafter looks up every row every round, right after the target's forward has left the caches cold,
    so a lookup must not scan the history: here it costs a few dictionary reads (about 15 us a round on a 2-core
    CPU), and indexing about 1 us per token, the prompt's at admission."""

    def __init__(self, tokens: Sequence[int], min_n: int, max_n: int, indexed: bool = True) -> None:
        """`indexed` False: the tokens are indexed by `index_next` (a part per round, with the prompt's prefill) or
        at the first `find`."""
        self.tokens = [int(t) for t in tokens]
        self.min_n, self.max_n = min_n, max_n
        self._last_end: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n - min_n + 1)]  # [n - min_n]
        self._earlier: list[dict[tuple[int, ...], list[int]]] = [{} for _ in range(max_n - min_n + 1)]  # older ends
        self._indexed = 0  # ends (positions of an n-gram's last token) 0 .. _indexed - 1 are in the tables
        if indexed:
            self._index()  # the prompt now, with the prefill, not in the first round

    @property
    def unindexed(self) -> int:
        """Ends not in the tables yet (`index_next`)."""
        return max(len(self.tokens) - 1 - self._indexed, 0)

    def index_next(self, count: int) -> None:
        """Enter the next `count` ends."""
        self._index(min(self._indexed + count, len(self.tokens) - 1))

    def extend(self, new: Sequence[int]) -> None:
        """Append committed tokens (indexed lazily, at the next `find`)."""
        self.tokens.extend(int(t) for t in new)

    def _index(self, upto: int | None = None) -> None:
        """Enter every end but the last (up to `upto`): the suffix must match an earlier occurrence, never itself."""
        tokens = self.tokens
        upto = len(tokens) - 1 if upto is None else upto
        for end in range(self._indexed, upto):
            for table, earlier, n in zip(self._last_end, self._earlier, range(self.min_n, self.max_n + 1)):
                if end >= n - 1:
                    key = tuple(tokens[end - n + 1 : end + 1])
                    if key in table:  # the most recent wins; a few older ones stay for branches
                        earlier.setdefault(key, []).insert(0, table[key])
                        del earlier[key][BRANCH_MEMORY:]
                    table[key] = end
        self._indexed = max(self._indexed, upto)

    def find(self, max_tokens: int) -> tuple[list[int], int]:
        """Up to `max_tokens` tokens that followed the most recent earlier occurrence of the longest suffix n-gram
        (n from max_n down to min_n: the longest n wins, then the most recent occurrence), and n; `([], 0)` when
        nothing matches."""
        self._index()
        tokens, length = self.tokens, len(self.tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):  # the longest n with an occurrence wins
            end = self._last_end[n - self.min_n].get(tuple(tokens[length - n :]))
            if end is not None:
                return tokens[end + 1 : end + 1 + max_tokens], n
        return [], 0

    def find_branches(self, max_tokens: int, branches: int) -> list[list[int]]:
        """Up to `branches` different continuations (each up to `max_tokens` tokens) of the longest suffix n-gram's
        occurrences, the most recent first (`find`'s first)."""
        found, n = self.find(max_tokens)
        if not found:
            return []
        tokens, length = self.tokens, len(self.tokens)
        out = [found]
        for end in self._earlier[n - self.min_n].get(tuple(tokens[length - n :]), []):
            continuation = tokens[end + 1 : end + 1 + max_tokens]
            if len(out) >= branches:
                break
            if continuation and continuation not in out:
                out.append(continuation)
        return out


def trie(sequences: list[list[int]], budget: int) -> tuple[list[int], list[int]]:
    """The tokens and parents (-1: the root) of the trie of `sequences` (shared prefixes merged), the first
    sequence's nodes first, at most `budget` nodes; parents come before their children."""
    tokens: list[int] = []
    parents: list[int] = []
    children: dict[tuple[int, int], int] = {}
    for sequence in sequences:
        parent = -1
        for token in sequence:
            node = children.get((parent, token))
            if node is None:
                if len(tokens) >= budget:
                    break
                tokens.append(token)
                parents.append(parent)
                node = children[(parent, token)] = len(tokens) - 1
            parent = node
    return tokens, parents


class NgramDrafter:
    """Drafts by prompt lookup over each row's prompt and output so far."""

    vocab_size = None  # proposes token ids from the context: works with any vocabulary
    abilities = Abilities(looks_up=True, keeps_prefixes=True, copies_prefixes=True, chunks_prefill=True)

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.rows: dict[int, NgramIndex] = {}  # slot -> its prompt and output so far, indexed for lookups
        self._started: set[int] = set()  # rows `start_rows` started, their prompts indexed a part at a time

    def allocate(self, num_slots: int, max_len: int) -> None:
        self.rows.clear()
        self._started.clear()

    def add_rows(self, slots: Sequence[int], prompts: Sequence[Sequence[int]]) -> None:
        """Index each new row's prompt (a row `start_rows` started: what it has left)."""
        for slot, prompt in zip(slots, prompts):
            if slot in self._started:
                self._started.discard(slot)
                self.rows[slot].index_next(self.rows[slot].unindexed)
            else:
                self.rows[slot] = NgramIndex(prompt, self.min_n, self.max_n)

    def start_rows(self, slots: Sequence[int], prompts: Sequence[Sequence[int]]) -> list[int]:
        """Start rows with their prompts not indexed yet: per row, the ends left to index (`prefill_rows`)."""
        for slot, prompt in zip(slots, prompts):
            self.rows[slot] = NgramIndex(prompt, self.min_n, self.max_n, indexed=False)
            self._started.add(slot)
        return [self.rows[slot].unindexed for slot in slots]

    def prefill_rows(self, slots: Sequence[int], units: Sequence[int]) -> None:
        """Index each started row's next `units[i]` ends."""
        for slot, count in zip(slots, units):
            self.rows[slot].index_next(count)

    def release_rows(self, slots: Sequence[int]) -> None:
        for slot in slots:
            self.rows.pop(slot, None)
            self._started.discard(slot)

    def park_rows(self, slots: Sequence[int]) -> None:
        """Nothing to keep: `add_rows` indexes a prompt at about 1 us per token."""
        self.release_rows(slots)

    def copy_prefix(self, source: int, slot: int, tokens: Sequence[int]) -> int:
        """Nothing to copy: `add_rows` indexes the whole prompt."""
        return len(tokens)

    def continuation(self, slot: int, max_tokens: int) -> tuple[list[int], int]:
        """`NgramIndex.find` over the row's history (the engine asks what a lookup offers, then has it proposed: two
        reads of the same tables)."""
        return self.rows[slot].find(max_tokens)

    def offer(self, slot: int, max_tokens: int) -> tuple[int, int]:
        """Tokens the row's lookup proposes, up to `max_tokens`, and its match length (0: none)."""
        found, n = self.continuation(slot, max_tokens)
        return len(found), n

    def drafts_otherwise(self, slots: Sequence[int]) -> list[bool]:
        """No row can draft without its lookup: there is no model."""
        return [False] * len(slots)

    def propose(self, request: DraftRequest) -> Proposal:
        """Each row's lookup (up to its reach); rows sent away from their lookup (DraftSource.MODEL) propose nothing.
        With `request.tree`, up to `tree.branch` continuations per row merged into a trie (`find_branches`)."""
        request.refuse_extension(
            [i for i in range(len(request.slots)) if request.source_of(i) is not DraftSource.MODEL],
            "an n-gram draft has no confidence to extend by",
        )
        if request.tree is not None:
            return self._propose_tree(request, request.tree)
        tokens = torch.zeros(len(request.slots), request.width, dtype=torch.long)
        counts = []
        for row, (slot, limit) in enumerate(zip(request.slots, request.reach)):
            found, _ = (
                self.continuation(slot, min(request.width, limit))
                if request.source_of(row) is not DraftSource.MODEL
                else ([], 0)
            )
            tokens[row, : len(found)] = torch.tensor(found, dtype=torch.long)
            counts.append(len(found))
        return Proposal(tokens=tokens, probs=None, num_drafted=torch.tensor(counts, dtype=torch.long))

    def _propose_tree(self, request: DraftRequest, shape: TreeShape) -> Proposal:
        """Per row the trie of up to `tree.branch` continuations, each `drafts[i]` tokens at most, `reach[i]` nodes at
        most."""
        width = max(request.width, 1)
        tokens = torch.zeros(len(request.slots), width, dtype=torch.long)
        parents = torch.full((len(request.slots), width), -1, dtype=torch.long)
        counts = []
        for row, (slot, depth, reach) in enumerate(zip(request.slots, request.drafts, request.reach)):
            branches = (
                self.rows[slot].find_branches(depth, shape.branch)
                if request.source_of(row) is not DraftSource.MODEL and reach > 0
                else []
            )
            nodes, links = trie(branches, min(reach, width))
            tokens[row, : len(nodes)] = torch.tensor(nodes, dtype=torch.long)
            parents[row, : len(links)] = torch.tensor(links, dtype=torch.long)
            counts.append(len(nodes))
        return Proposal(tokens=tokens, probs=None, num_drafted=torch.tensor(counts, dtype=torch.long), parents=parents)

    def lookup_lengths(self, slots: Sequence[int], max_tokens: Sequence[int]) -> list[int]:
        """Tokens the lookup would propose per row, up to `max_tokens[i]` (0: no match)."""
        return [len(self.continuation(s, m)[0]) if m > 0 else 0 for s, m in zip(slots, max_tokens)]

    def commit(self, slots: Sequence[int], committed: Sequence[Sequence[int]]) -> None:
        for slot, new in zip(slots, committed):
            self.rows[slot].extend(new)
