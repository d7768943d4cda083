"""Grammars through xgrammar: compile a `Grammar` once per tokenizer, follow one request with a `Matcher`.

xgrammar was chosen by measurement on this project's 2-core CPU with the SmolLM2 tokenizer (vocabulary 49,152):
a next-token mask for a JSON schema costs a median 2.6-3.5 us (p90 ~10 us) against 7-8 us for llguidance and a
12 s compile of free JSON for outlines-core (benchmarks/grammar_engines.py, docs/serving.md#structured-output).
A matcher rolls back any number of tokens, which is what a rejected draft needs.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from specsample.config import Grammar, SettingError

COMPILED_KEPT = 64  # compiled grammars kept per compiler (least recently used dropped first)


def _xgrammar():
    try:
        import xgrammar
    except ImportError as exc:  # the 'grammar' extra
        raise SettingError("grammar", "structured output needs xgrammar: pip install 'specsample[grammar]'") from exc
    return xgrammar


class GrammarCompiler:
    """Compiles grammars for one tokenizer (its vocabulary as the model sees it, and its end-of-sequence ids); keeps
    the last COMPILED_KEPT compiled grammars. Thread-safe: the server compiles off its event loop."""

    def __init__(self, info, vocab_size: int) -> None:
        self._xgr = _xgrammar()
        self._compiler = self._xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self._info = info
        self._token_bytes: list[bytes] | None = None  # each id's bytes, read from `info` on first use
        self.vocab_size = vocab_size
        self._compiled: OrderedDict[Grammar, object] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def from_tokenizer(cls, hf_tokenizer, vocab_size: int, stop_token_ids: Iterable[int]) -> GrammarCompiler:
        """For a Hugging Face tokenizer whose model has `vocab_size` outputs (ids past the tokenizer's are never
        allowed); a grammar ends on any of `stop_token_ids`."""
        xgr = _xgrammar()
        info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(int(t) for t in stop_token_ids))
        return cls(info, vocab_size)

    @classmethod
    def from_vocab(cls, tokens: Sequence[str], stop_token_ids: Iterable[int] = ()) -> GrammarCompiler:
        """For a vocabulary given as each id's text (tests, and tokenizers without a Hugging Face form)."""
        xgr = _xgrammar()
        info = xgr.TokenizerInfo(list(tokens), stop_token_ids=sorted(int(t) for t in stop_token_ids))
        return cls(info, len(tokens))

    def compile(self, grammar: Grammar):
        """The compiled grammar (from the cache when it was compiled lately); `SettingError` naming 'grammar' when
        the engine refuses it (an unsupported schema feature, a malformed pattern)."""
        with self._lock:
            if grammar in self._compiled:
                self._compiled.move_to_end(grammar)
                return self._compiled[grammar]
        try:
            if grammar.kind == "json_object":
                compiled = self._compiler.compile_json_schema(json.dumps({"type": "object"}), any_whitespace=False)
            elif grammar.kind == "json_schema":
                compiled = self._compiler.compile_json_schema(grammar.text, any_whitespace=False)
            elif grammar.kind == "regex":
                compiled = self._compiler.compile_regex(grammar.text)
            else:
                compiled = self._compiler.compile_grammar(grammar.text)
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError and its own errors for bad input
            raise SettingError("grammar", f"the {grammar.kind} grammar cannot be compiled: {exc}") from None
        with self._lock:
            self._compiled[grammar] = compiled
            while len(self._compiled) > COMPILED_KEPT:
                self._compiled.popitem(last=False)
        return compiled

    def token_bytes(self, token: int) -> bytes:
        """The bytes token id `token` stands for (a byte-level token may hold part of a UTF-8 character; a special
        token: its text)."""
        if self._token_bytes is None:
            self._token_bytes = list(self._info.decoded_vocab)
        return self._token_bytes[token] if 0 <= token < len(self._token_bytes) else b""

    def matcher(self, grammar: Grammar) -> Matcher:
        return Matcher(self._xgr, self.compile(grammar), self.vocab_size)


class Matcher:
    """One request's position in its grammar: the committed tokens, and past them a path of drafts it was moved along
    (`follow`), which the next `follow` or `commit` rolls back as far as it differs."""

    def __init__(self, xgr, compiled, vocab_size: int) -> None:
        self._xgr = xgr
        self._matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self._path: list[int] = []  # tokens accepted past the committed ones
        self._words = (vocab_size + 31) // 32

    def follow(self, path: Sequence[int]) -> bool:
        """Move to the committed tokens followed by `path`; False (left at the longest allowed prefix) when the
        grammar disallows a token of it."""
        common = 0
        for had, want in zip(self._path, path):
            if had != want:
                break
            common += 1
        if len(self._path) > common:
            self._matcher.rollback(len(self._path) - common)
            del self._path[common:]
        for token in path[common:]:
            if self._matcher.is_terminated() or not self._matcher.accept_token(int(token)):
                return False
            self._path.append(int(token))
        return True

    def allowed(self, paths: Sequence[Sequence[int]]) -> Tensor:
        """`[len(paths), vocab]` bool: the tokens the grammar allows after each path. A path the grammar does not
        allow, or that ended the grammar, allows every token: no token after it is ever committed (the verifier
        rejects the disallowed token, the engine stops at the end), and a distribution there must stay usable."""
        bitmask = torch.full((len(paths), self._words), -1, dtype=torch.int32)
        for i, path in enumerate(paths):
            if self.follow(path) and not self._matcher.is_terminated():
                self._matcher.fill_next_token_bitmask(bitmask, i)
        return unpack_bitmask(bitmask, self.vocab_size)

    def commit(self, tokens: Sequence[int]) -> bool:
        """Make `tokens` committed (drafts followed past them are rolled back first); False if the grammar disallows
        one of them."""
        ok = self.follow(tokens)
        self._path = []
        return ok

    @property
    def ended(self) -> bool:
        """Whether the committed tokens ended the grammar (accepted an end-of-sequence token)."""
        return not self._path and self._matcher.is_terminated()


_BITS = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(bitmask: Tensor, vocab_size: int) -> Tensor:
    """`[n, words]` int32 (bit j of word w: token 32 w + j allowed) -> `[n, vocab_size]` bool."""
    bits = (bitmask.unsqueeze(-1) >> _BITS) & 1  # [n, words, 32]
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()
