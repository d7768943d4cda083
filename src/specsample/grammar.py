"""Grammars through xgrammar: compile a `Grammar` once per tokenizer, follow one request with a `Matcher`.

xgrammar was chosen by measurement on this project's 2-core CPU with the SmolLM2 tokenizer (vocabulary 49,152):
a next-token mask for a JSON schema costs a median 2.6-3.5 us (p90 ~10 us) against 7-8 us for llguidance and a
12 s compile of free JSON for outlines-core (benchmarks/grammar_engines.py, docs/serving.md#structured-output).
A matcher rolls back any number of tokens, which is what a rejected draft needs.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from specsample.config import Grammar, SettingError
from specsample.json_schema import SchemaError, served_schema

COMPILED_KEPT = 64  # compiled grammars kept per compiler (least recently used dropped first)
# the classes xgrammar (0.2) writes for a string's characters (in length-bounded strings, and in the others) admit
# surrogate code points, whose UTF-8 is invalid (a decoder reads three replacement characters), and the first raw
# control characters, which JSON forbids inside a string; each is replaced by the class of what JSON holds as itself
_XGRAMMAR_STRING_CLASSES = (r"[^\"\\\r\n]", r"[^\0-\x1f\"\\\r\n]")
_STRING_CLASS = r"[^\0-\x1f\"\\\uD800-\uDFFF]"
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")  # xgrammar's "[time] source.cc:line: " before a message


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
        info = xgr.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(int(t) for t in stop_token_ids)
        )
        return cls(info, vocab_size)

    @classmethod
    def from_vocab(cls, tokens: Sequence[str], stop_token_ids: Iterable[int] = ()) -> GrammarCompiler:
        """For a vocabulary given as each id's text (tests, and tokenizers without a Hugging Face form)."""
        xgr = _xgrammar()
        info = xgr.TokenizerInfo(list(tokens), stop_token_ids=sorted(int(t) for t in stop_token_ids))
        return cls(info, len(tokens))

    @property
    def tokenizer_json(self) -> str:
        """The tokenizer's description as xgrammar serializes it (what a compiling worker process starts from)."""
        return self._info.serialize_json()

    def cached(self, grammar: Grammar):
        """The compiled grammar if it is in the cache, else None."""
        with self._lock:
            if grammar in self._compiled:
                self._compiled.move_to_end(grammar)
                return self._compiled[grammar]
        return None

    def adopt(self, grammar: Grammar, serialized: str) -> None:
        """Cache `grammar` as compiled elsewhere (`compile_serialized` in another process)."""
        self._keep(grammar, self._xgr.CompiledGrammar.deserialize_json(serialized, self._info))

    def compile(self, grammar: Grammar):
        """The compiled grammar (from the cache when it was compiled lately); `SettingError` naming 'grammar' when
        the engine refuses it (a schema keyword it cannot enforce, a malformed pattern: specsample.json_schema)."""
        compiled = self.cached(grammar)
        if compiled is None:
            compiled = compile_grammar(self._compiler, grammar)
            self._keep(grammar, compiled)
        return compiled

    def _keep(self, grammar: Grammar, compiled) -> None:
        with self._lock:
            self._compiled[grammar] = compiled
            self._compiled.move_to_end(grammar)
            while len(self._compiled) > COMPILED_KEPT:
                self._compiled.popitem(last=False)

    def token_bytes(self, token: int) -> bytes:
        """The bytes token id `token` stands for (a byte-level token may hold part of a UTF-8 character; a special
        token: its text)."""
        if self._token_bytes is None:
            self._token_bytes = list(self._info.decoded_vocab)
        return self._token_bytes[token] if 0 <= token < len(self._token_bytes) else b""

    def matcher(self, grammar: Grammar) -> Matcher:
        return Matcher(self._xgr, self.compile(grammar), self.vocab_size)


def served_grammar(grammar: Grammar) -> Grammar:
    """`grammar` as it is compiled and cached: a JSON schema in its served form (specsample.json_schema: annotations
    dropped, keywords checked, patterns rewritten), anything else as it is; `SettingError` naming 'grammar' for a
    schema the grammar cannot enforce."""
    if grammar.kind != "json_schema":
        return grammar
    try:
        return Grammar.json_schema(served_schema(json.loads(grammar.text)))
    except SchemaError as exc:
        raise SettingError("grammar", f"the JSON schema cannot be enforced: {exc}") from None


def compile_grammar(compiler, grammar: Grammar):
    """`grammar` compiled by an xgrammar `GrammarCompiler`; `SettingError` naming 'grammar' for a grammar it refuses,
    with xgrammar's message (less its log prefix)."""
    xgr = _xgrammar()
    grammar = served_grammar(grammar)
    try:
        if grammar.kind in ("json_object", "json_schema"):
            schema = grammar.text if grammar.kind == "json_schema" else json.dumps({"type": "object"})
            ebnf = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False))
            for written in _XGRAMMAR_STRING_CLASSES:
                ebnf = ebnf.replace(written, _STRING_CLASS)
            return compiler.compile_grammar(ebnf)
        if grammar.kind == "regex":
            return compiler.compile_regex(grammar.text)
        return compiler.compile_grammar(grammar.text)
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError and its own errors for bad input
        raise SettingError("grammar", f"the {grammar.kind} grammar cannot be compiled: {_message(exc)}") from None


def _message(exc: Exception) -> str:
    """xgrammar's message for a refused grammar: its first line, without the time and source file it logs."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return _LOG_PREFIX.sub("", lines[0]) if lines else type(exc).__name__


class Matcher:
    """One request's position in its grammar: the committed tokens, and past them the drafts it was moved along
    (`follow`), which the next `follow` or `commit` rolls back as far as they differ."""

    def __init__(self, xgr, compiled, vocab_size: int) -> None:
        self._xgr = xgr
        self._matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self._followed: list[int] = []  # tokens accepted past the committed ones
        self._words = (vocab_size + 31) // 32

    def follow(self, drafts: Sequence[int]) -> bool:
        """Move to the committed tokens followed by `drafts`; False (left at the longest allowed prefix) when the
        grammar disallows a token of them."""
        common = 0
        for had, want in zip(self._followed, drafts):
            if had != want:
                break
            common += 1
        if len(self._followed) > common:
            self._matcher.rollback(len(self._followed) - common)
            del self._followed[common:]
        for token in drafts[common:]:
            if self._matcher.is_terminated() or not self._matcher.accept_token(int(token)):
                return False
            self._followed.append(int(token))
        return True

    def allowed(self, drafts_before: Sequence[Sequence[int]]) -> Tensor:
        """`[len(drafts_before), vocab]` bool: the tokens the grammar allows after each sequence of drafts. Drafts the
        grammar does not allow, or that ended the grammar, allow every token: no token after them is ever committed
        (the verifier rejects the disallowed token, the engine stops at the end), and a distribution there must stay
        usable."""
        bitmask = torch.full((len(drafts_before), self._words), -1, dtype=torch.int32)
        for i, drafts in enumerate(drafts_before):
            if self.follow(drafts) and not self._matcher.is_terminated():
                self._matcher.fill_next_token_bitmask(bitmask, i)
        return unpack_bitmask(bitmask, self.vocab_size)

    def commit(self, tokens: Sequence[int]) -> bool:
        """Make `tokens` committed (drafts followed past them are rolled back first); False if the grammar disallows
        one of them."""
        ok = self.follow(tokens)
        self._followed = []
        return ok

    @property
    def ended(self) -> bool:
        """Whether the committed tokens ended the grammar (accepted an end-of-sequence token)."""
        return not self._followed and self._matcher.is_terminated()


_BITS = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(bitmask: Tensor, vocab_size: int) -> Tensor:
    """`[n, words]` int32 (bit j of word w: token 32 w + j allowed) -> `[n, vocab_size]` bool."""
    bits = (bitmask.unsqueeze(-1) >> _BITS) & 1  # [n, words, 32]
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()
