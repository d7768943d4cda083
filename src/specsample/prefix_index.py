"""A radix tree over the token ids of rows, per cache scope: which row shares the longest prefix with a prompt.

Each row is a path from the root; an edge holds a run of tokens, and every node knows the rows whose tokens pass
through it. A lookup walks the prompt down the tree (comparing edges run by run), so it costs the matched length,
whatever the number of rows. Rows of different scopes (tenants) live in different trees and never match.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from specsample.drafters.base import common_prefix


@dataclass
class _Node:
    edge: tuple[int, ...] = ()  # the tokens from the parent to this node
    children: dict[int, _Node] = field(default_factory=dict)  # by the first token of their edge
    rows: set[int] = field(default_factory=set)  # the rows whose tokens pass through (or end at) this node


class PrefixIndex:
    """Rows (by slot) and their tokens, per scope; `longest` finds the row sharing the longest prefix."""

    def __init__(self) -> None:
        self._roots: dict[str, _Node] = {}
        self._rows: dict[int, tuple[str, tuple[int, ...]]] = {}  # slot -> its scope and tokens

    def __contains__(self, slot: int) -> bool:
        return slot in self._rows

    def tokens(self, slot: int) -> tuple[int, ...]:
        return self._rows[slot][1]

    def add(self, slot: int, scope: str, tokens: Sequence[int]) -> None:
        """Index row `slot` with `tokens` (replacing what it held)."""
        self.remove(slot)
        tokens = tuple(tokens)
        self._rows[slot] = (scope, tokens)
        node = self._roots.setdefault(scope, _Node())
        node.rows.add(slot)
        i = 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                child = node.children[tokens[i]] = _Node(edge=tokens[i:])
                child.rows.add(slot)
                return
            shared = _shared(child.edge, tokens, i)
            if shared < len(child.edge):  # split the edge where the row leaves it
                upper = _Node(edge=child.edge[:shared], children={child.edge[shared]: child}, rows=set(child.rows))
                child.edge = child.edge[shared:]
                node.children[tokens[i]] = upper
                child = upper
            child.rows.add(slot)
            node, i = child, i + shared

    def remove(self, slot: int) -> None:
        """Forget row `slot` (nothing if it is not indexed); nodes no row passes through go."""
        entry = self._rows.pop(slot, None)
        if entry is None:
            return
        scope, tokens = entry
        node = self._roots[scope]
        node.rows.discard(slot)
        i = 0
        while i < len(tokens):
            child = node.children[tokens[i]]
            child.rows.discard(slot)
            if not child.rows:
                del node.children[tokens[i]]
                break
            node, i = child, i + len(child.edge)
        if not self._roots[scope].rows:
            del self._roots[scope]

    def longest(self, scope: str, tokens: Sequence[int], among: set[int] | None = None) -> tuple[int | None, int]:
        """The row of `scope` (of `among`, if given) sharing the longest prefix with `tokens`, and that length
        (None, 0 where none shares any)."""
        node = self._roots.get(scope)
        best, length, i = None, 0, 0
        while node is not None and i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                break
            rows = child.rows if among is None else child.rows & among
            if not rows:
                break
            shared = _shared(child.edge, tokens, i)
            best, length = min(rows), i + shared
            if shared < len(child.edge):
                break
            node, i = child, i + shared
        return best, length


def _shared(edge: tuple[int, ...], tokens: Sequence[int], start: int) -> int:
    """How many leading tokens of `edge` equal `tokens[start:]`'s."""
    run = tuple(tokens[start : start + len(edge)])
    return len(edge) if run == edge else common_prefix(edge, run)
