"""A process that compiles grammars for the server (specsample.server.grammar_pool), one at a time.

Started as `python -m specsample.server.grammar_worker`; it lowers its own scheduling priority, so the decoding loop
of the server wins the CPU. Frames on stdin and stdout are a 4-byte big-endian length and that many bytes of JSON:
first the tokenizer (xgrammar's serialized TokenizerInfo), answered {"ready": true}; then {"kind", "text"} per
grammar, answered {"compiled": SERIALIZED} or {"error": MESSAGE}. It exits when stdin closes.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from typing import Any, BinaryIO

NICENESS = 19  # the lowest priority: CFS weight 15 against the server's 1024, so the decoding loop wins a shared core


def read_frame(stream: BinaryIO) -> bytes | None:
    """The next frame's bytes, or None at the end of the stream."""
    head = stream.read(4)
    if len(head) < 4:
        return None
    (size,) = struct.unpack(">I", head)
    body = stream.read(size)
    return body if len(body) == size else None


def frame(payload: dict[str, Any]) -> bytes:
    body = json.dumps(payload).encode()
    return struct.pack(">I", len(body)) + body


def main() -> None:
    os.nice(NICENESS)
    import xgrammar

    from specsample.config import Grammar, SettingError
    from specsample.grammar import compile_grammar

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    tokenizer = read_frame(stdin)
    if tokenizer is None:
        return
    info = xgrammar.TokenizerInfo.deserialize_json(tokenizer.decode())
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    stdout.write(frame({"ready": True}))
    stdout.flush()
    while (request := read_frame(stdin)) is not None:
        asked = json.loads(request)
        try:
            answer = {"compiled": compile_grammar(compiler, Grammar(asked["kind"], asked["text"])).serialize_json()}
        except SettingError as exc:
            answer = {"error": str(exc)}
        stdout.write(frame(answer))
        stdout.flush()


if __name__ == "__main__":
    main()
