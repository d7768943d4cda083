"""What `SuffixIndex.find` answers, by definition, from the raw sequences: no index, every position scanned."""

from __future__ import annotations


def reference_find(
    sequences: dict[int, list[int]],
    order: list[tuple[int, int]],
    context: list[int],
    levels: tuple[int, ...],
    occurrences: int,
    walk: int,
    longest: int,
) -> list[tuple[int, int, int]]:
    """(sequence, end, match length) of up to `occurrences` earlier occurrences of the context's last n tokens, for
    the longest n of `levels` that has one with a continuation. Candidates are the positions where those n tokens
    end and a token follows, the one whose next token was written most recently first (`order`: every position in
    the order its next token was written), the first `walk` of them read; each match measured backwards up to
    `longest`."""
    longest = max(longest, max(levels))
    for n in sorted(levels, reverse=True):
        if n > len(context):
            continue
        tail = context[-n:]
        ends = [(s, e) for s, e in reversed(order) if e >= n - 1 and sequences[s][e - n + 1 : e + 1] == tail]
        found = []
        for s, e in ends[:walk]:
            tokens = sequences[s]
            if e + 1 < len(tokens):
                match = n
                while (
                    match < min(longest, e + 1, len(context)) and tokens[e - match] == context[len(context) - 1 - match]
                ):
                    match += 1
                found.append((s, e, match))
                if len(found) == occurrences:
                    break
        if found:
            return found
    return []
