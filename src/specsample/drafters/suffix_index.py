"""Where token sequences continued after a given context, and the tree of their frequent continuations
(SuffixDecoding, Oliaro et al. 2024, arXiv:2411.04975).

`SuffixIndex` holds sequences of tokens and, per indexed n-gram length n (`levels`), a dictionary from an n-gram
to the position where it last ended, plus per position the previous end of the same n-gram: a chain through every
occurrence, most recent first. A position enters the index when the token after it arrives, so every occurrence
on a chain has a continuation (and a sequence never matches its own end). A query takes the longest indexed n
whose last n context tokens occur, reads up to `occurrences` of them along the chain, and measures each one's
match length backwards (up to `longest`). Appending a token costs one dictionary write per level; a query a few
dictionary reads and a walk of at most WALK chain links, so neither depends on how much the index holds. That is
why it is not a suffix tree or suffix automaton: a suffix tree's insertion touches up to its depth in nodes per
token, and an automaton cannot forget old sequences, which the shared cache must.

`draft_tree` turns the occurrences into SuffixDecoding's speculation: the trie of their continuations with counts,
each node's estimated probability the product of count ratios along its path, the nodes taken best first while
their probability is at least `min_prob`, at most `factor` x match length + `offset` of them. Every choice reads
tokens already committed, so the draft is deterministic and depends on the past only.
"""

from __future__ import annotations

import heapq
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

LEVELS = (2, 3, 4, 6, 8)  # n-gram lengths indexed: the shortest is the shortest match drafted from
OCCURRENCES = 8  # most recent occurrences of the matched n-gram a query reads
WALK = 4 * OCCURRENCES  # chain links a query follows at most (a link whose n-gram is another's, by a hash collision,
# is passed over)
LONGEST = 24  # longest match measured backwards from an occurrence
SEQ_SHIFT = 32  # a position is packed as (sequence id << SEQ_SHIFT) | index
INDEX_MASK = (1 << SEQ_SHIFT) - 1
# bytes a level's dictionary entry holds outside the dictionary's own table: its key (a 64-bit hash, a 36-byte int)
# and its value (a packed position, a 32-byte int), each rounded up to pymalloc's 8-byte blocks
ENTRY_OBJECT_BYTES = 40 + 32


@dataclass(frozen=True)
class Occurrence:
    """An earlier place where the context's last tokens occurred: its sequence, the index of its last matching
    token, and how many tokens back the match goes (at least the level that found it)."""

    seq: int
    end: int
    match: int


@dataclass(frozen=True)
class Draft:
    """A speculation: tokens with their parents (-1: the pending token; parents come first), each one's estimated
    probability (the product of count ratios along its path), the match length it came from, and its score (the
    probabilities' sum: the tokens it expects accepted)."""

    tokens: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()
    probs: tuple[float, ...] = ()
    match: int = 0
    shared: bool = False  # drawn from a cache other requests wrote to (`SuffixDrafter`)

    @property
    def score(self) -> float:
        return sum(self.probs)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def __len__(self) -> int:
        return len(self.tokens)


class SuffixIndex:
    """Sequences of tokens indexed for `find` (see the module docstring). With `capacity`, the oldest sequences are
    dropped while more than `capacity` tokens are held."""

    def __init__(
        self,
        levels: Sequence[int] = LEVELS,
        capacity: int | None = None,
        occurrences: int = OCCURRENCES,
        longest: int = LONGEST,
    ) -> None:
        levels = tuple(sorted(set(levels)))
        if not levels or levels[0] < 1:
            raise ValueError(f"levels must be n-gram lengths >= 1, got {levels}")
        if capacity is not None and capacity < 1:
            raise ValueError(f"capacity must be a number of tokens >= 1 or None, got {capacity}")
        self.levels, self.capacity = levels, capacity
        self.occurrences, self.longest = occurrences, max(longest, levels[-1])
        self._last: list[dict[int, int]] = [{} for _ in levels]  # [level] n-gram hash -> packed position of its end
        self._tokens: dict[int, array] = {}  # sequence id -> its tokens (insertion order: oldest first)
        self._chains: dict[int, list[array]] = {}  # sequence id -> [level] per position: previous end, or -1
        self.held = 0  # tokens held
        self.evicted = 0  # sequences dropped for capacity
        self.version = 0  # changes with every write: answers computed at one version hold until the next

    # ----- writes ---------------------------------------------------------------------------

    def add(self, seq: int, tokens: Sequence[int] = ()) -> None:
        """Start sequence `seq` (a new id: ids are never reused) with `tokens`."""
        if seq in self._tokens:
            raise ValueError(f"sequence {seq} is already indexed")
        if not 0 <= seq < 1 << 31:
            raise ValueError(f"sequence ids are in [0, 2**31), got {seq}")
        self._tokens[seq] = array("i")
        self._chains[seq] = [array("q") for _ in self.levels]
        self.extend(seq, tokens)

    def extend(self, seq: int, tokens: Sequence[int]) -> None:
        """Append tokens to sequence `seq` and index every n-gram they end; a dropped sequence takes nothing."""
        held = self._tokens.get(seq)
        if held is None or not tokens:
            return
        chains, base, start = self._chains[seq], seq << SEQ_SHIFT, max(len(held) - 1, 0)
        held.extend(tokens)
        for end in range(start, len(held) - 1):  # each end once a token follows it
            for n, last, chain in zip(self.levels, self._last, chains):
                if end < n - 1:
                    chain.append(-1)
                    continue
                key = hash(tuple(held[end - n + 1 : end + 1]))
                chain.append(last.get(key, -1))
                last[key] = base | end
        self.held += len(tokens)
        self.version += 1
        if self.capacity is not None:
            while self.held > self.capacity and self._tokens:
                self.drop(next(iter(self._tokens)))
                self.evicted += 1

    def drop(self, seq: int) -> None:
        """Forget sequence `seq`: where it holds an n-gram's latest end, the end before it (if still held) takes its
        place."""
        held = self._tokens.get(seq)
        if held is None:
            return
        chains, base = self._chains[seq], seq << SEQ_SHIFT
        for end in range(len(held) - 1):
            for n, last, chain in zip(self.levels, self._last, chains):
                if end < n - 1:
                    continue
                key = hash(tuple(held[end - n + 1 : end + 1]))
                if last.get(key) == base | end:
                    before = chain[end]
                    if before != -1 and (before >> SEQ_SHIFT) != seq and (before >> SEQ_SHIFT) in self._tokens:
                        last[key] = before
                    else:
                        del last[key]
        self.held -= len(held)
        del self._tokens[seq], self._chains[seq]
        self.version += 1

    # ----- reads ----------------------------------------------------------------------------

    def __contains__(self, seq: int) -> bool:
        return seq in self._tokens

    def tokens(self, seq: int) -> array:
        return self._tokens[seq]

    @property
    def sequences(self) -> int:
        return len(self._tokens)

    def nbytes(self) -> int:
        """Memory held, estimated from the containers' own sizes and the objects their dictionaries hold."""
        # snapshots (`list` of a dictionary's values runs without yielding): another thread may be writing
        held, chains = list(self._tokens.values()), list(self._chains.values())
        total = sum(sys.getsizeof(d) + len(d) * ENTRY_OBJECT_BYTES for d in self._last)
        total += sum(sys.getsizeof(t) for t in held) + sum(sys.getsizeof(c) for per in chains for c in per)
        return total + sys.getsizeof(self._tokens) + sys.getsizeof(self._chains)

    def find(self, context: Sequence[int]) -> list[Occurrence]:
        """Up to `occurrences` earlier occurrences, most recent first, of the context's last n tokens for the
        longest indexed n that has one with a continuation (at least one token after it); [] when none."""
        size = len(context)
        for level in range(len(self.levels) - 1, -1, -1):
            n = self.levels[level]
            if n > size:
                continue
            tail = tuple(context[size - n :])
            found = self._walk(level, n, tail, context)
            if found:
                return found
        return []

    def _walk(self, level: int, n: int, tail: tuple[int, ...], context: Sequence[int]) -> list[Occurrence]:
        """The chain of `tail`'s ends at `level`, most recent first, each with its match length."""
        found: list[Occurrence] = []
        position = self._last[level].get(hash(tail), -1)
        size = len(context)
        for _ in range(WALK):
            if position == -1:
                break
            seq, end = position >> SEQ_SHIFT, position & INDEX_MASK
            held = self._tokens.get(seq)
            if held is None:  # its sequence was dropped: the chain ends here
                break
            if tuple(held[end - n + 1 : end + 1]) == tail:  # not a hash collision
                found.append(Occurrence(seq, end, _match(held, end, context, n, min(self.longest, end + 1, size))))
                if len(found) == self.occurrences:
                    break
            position = self._chains[seq][level][end]
        return found

    def continuation(self, occurrence: Occurrence, depth: int) -> tuple[int, ...]:
        """Up to `depth` tokens that followed an occurrence."""
        return tuple(self._tokens[occurrence.seq][occurrence.end + 1 : occurrence.end + 1 + depth])


def _match(held: Sequence[int], end: int, context: Sequence[int], match: int, reach: int) -> int:
    """How many tokens back from `end` `held` agrees with the context's tail (at least `match`, at most `reach`):
    compared 8 at a time as slices, then one at a time in the block that differs."""
    size = len(context)
    while match < reach:
        step = min(8, reach - match)
        if held[end - match - step + 1 : end - match + 1] != context[size - match - step : size - match]:
            break
        match += step
    while match < reach and held[end - match] == context[size - 1 - match]:
        match += 1
    return match


def cap(match: int, factor: float, offset: float, budget: int) -> int:
    """Tokens a match of `match` tokens may draft: factor x match + offset, at most `budget`."""
    return max(0, min(budget, int(match * factor + offset + 1e-6)))


def draft_tree(
    continuations: Sequence[tuple[int, ...]], match: int, nodes: int, depth: int, min_prob: float, chain: bool = False
) -> Draft:
    """SuffixDecoding's speculation from the continuations of a match's occurrences (most recent first): in the trie
    of the continuations, a node's count is the continuations through it (the root's: all of them) and its estimated
    probability its count over its parent's times its parent's probability. The nodes of highest probability come
    first (a child's is at most its parent's, so parents come first), while at least `min_prob`, at most `nodes` of
    them and `depth` deep; with `chain`, only the path of most frequent children. Ties go to the more recent
    continuation. Only the nodes taken are expanded, so the cost follows the draft, not the continuations."""
    if not continuations or nodes <= 0 or depth <= 0:
        return Draft(match=match)
    counts: dict[tuple[int, ...], int] = {}
    for continuation in continuations:  # identical continuations grouped, in order of their most recent
        key = continuation[:depth]
        counts[key] = counts.get(key, 0) + 1
    root = list(counts.items())
    out_tokens: list[int] = []
    out_parents: list[int] = []
    out_probs: list[float] = []
    order = 0  # children in order of creation: siblings in order of recency, every child after its parent
    # (-probability, creation order, token, parent in the draft, depth, count, members [(continuation, count)])
    heap = []
    for token, count, members in _children(root, 0):
        heap.append((-count / len(continuations), order, token, -1, 1, count, members))
        order += 1
    heapq.heapify(heap)
    while heap and len(out_tokens) < nodes:
        negative, _, token, parent, level, count, members = heapq.heappop(heap)
        if -negative < min_prob:
            break
        here = len(out_tokens)
        out_tokens.append(token)
        out_parents.append(parent)
        out_probs.append(-negative)
        if level >= depth:
            continue
        grown = _children(members, level)
        if chain:  # the path goes on through the most frequent child only (the first on ties: the most recent)
            heap = []
            grown = [max(grown, key=lambda g: g[1])] if grown else []
        for child_token, child_count, child_members in grown:
            heapq.heappush(
                heap, (negative * child_count / count, order, child_token, here, level + 1, child_count, child_members)
            )
            order += 1
    return Draft(tuple(out_tokens), tuple(out_parents), tuple(out_probs), match)


def _children(members: list[tuple[tuple[int, ...], int]], level: int) -> list[tuple[int, int, list]]:
    """A trie node's children from its continuations (`level` tokens in): per next token, in order of first
    appearance, its count and its continuations."""
    grouped: dict[int, list] = {}
    for continuation, count in members:
        if len(continuation) > level:
            entry = grouped.get(continuation[level])
            if entry is None:
                grouped[continuation[level]] = [count, [(continuation, count)]]
            else:
                entry[0] += count
                entry[1].append((continuation, count))
    return [(token, count, group) for token, (count, group) in grouped.items()]


def best_draft(
    index: SuffixIndex,
    found: Sequence[Occurrence],
    nodes: int,
    depth: int,
    factor: float,
    offset: float,
    min_prob: float,
    chain: bool = False,
) -> Draft:
    """The best draft from a query's occurrences (`SuffixIndex.find`): the draft of those matching furthest back,
    and the draft of them all (more occurrences, fewer tokens allowed), each capped by `cap(match)`; the higher
    score wins, the longer match on ties."""
    best = Draft()
    if not found:
        return best
    for match in sorted({min(o.match for o in found), max(o.match for o in found)}):
        allowed = cap(match, factor, offset, nodes)
        reach = min(depth, allowed)
        draft = draft_tree(
            [index.continuation(o, reach) for o in found if o.match >= match], match, allowed, reach, min_prob, chain
        )
        if draft.tokens and draft.score >= best.score:
            best = draft
    return best
