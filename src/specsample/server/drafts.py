"""/admin/draft's sandbox: which drafts a client may swap in (the built-in ones, and drafts inside the server's
`--models-dir` named by their path there, which may not leave it), loaded as the running pair's draft was."""

from __future__ import annotations

import logging
from pathlib import Path

from specsample.drafters.base import Drafter, check_vocabulary
from specsample.models.hub import ALIASES, DRAFTS_DIR, alias_cached, builtin_draft
from specsample.pair import Pair, is_hybrid
from specsample.server.protocol import ProtocolError

log = logging.getLogger("specsample.server")

UNUSABLE_DRAFT = (
    "unknown or unusable draft: give ngram, suffix, hybrid, a built-in draft ({builtin}), hybrid:NAME, "
    "or the name of a draft in the server's models folder (--models-dir)"
)


def load_allowed_draft(pair: Pair, models_dir: str | None, draft: str) -> Drafter:
    """The drafter for an allowed draft, loaded as `pair`'s was: 'ngram', 'suffix', 'hybrid', a built-in alias or
    draft, or a folder or .gguf file inside `models_dir` given by its name there, each also as 'hybrid:NAME'. Anything
    else, and anything that does not load or does not fit the target, gets one `ProtocolError` that says nothing about
    the filesystem (the reason is logged)."""
    refusal = ProtocolError(UNUSABLE_DRAFT.format(builtin=", ".join(sorted(_builtin_names()))), "draft")
    resolved = _allowed_draft(draft, models_dir)
    if resolved is None:
        log.warning("draft %r refused: not a built-in draft nor in the models folder", draft)
        raise refusal
    try:
        drafter = pair.load_draft(resolved)
        if drafter is None:
            raise ValueError("it did not load")
        check_vocabulary(drafter.vocab_size, pair.target.model.vocab_size)
    except Exception as exc:  # noqa: BLE001 - whatever went wrong, the client learns only that the draft is unusable
        log.warning("draft %r refused: %s", draft, exc)
        raise refusal from None
    return drafter


def _builtin_names() -> set[str]:
    """The model aliases and the names of the drafts shipped in the package."""
    shipped = [p.name for p in DRAFTS_DIR.iterdir() if builtin_draft(p.name) is not None] if DRAFTS_DIR.is_dir() else []
    return set(ALIASES) | set(shipped)


def _allowed_draft(draft: str, models_dir: str | None) -> str | None:
    """What to load for an allowed draft, else None."""
    if draft in ("ngram", "suffix", "hybrid"):
        return draft
    if is_hybrid(draft):
        model = _allowed_model(draft.partition(":")[2], models_dir)
        return None if model is None else "hybrid:" + model
    return _allowed_model(draft, models_dir)


def _allowed_model(name: str, models_dir: str | None) -> str | None:
    """A built-in alias or draft by name, or a folder or .gguf file inside `models_dir` by its relative path (which
    may not leave the folder, through '..' or a link)."""
    if name in ALIASES:  # loading an alias that is not cached would download it
        return name if alias_cached(name) else None
    if name in _builtin_names():
        return name
    if not models_dir or not name or Path(name).is_absolute() or "\\" in name or "\0" in name:
        return None
    root = Path(models_dir).resolve()
    try:
        candidate = (root / name).resolve()
    except (OSError, RuntimeError, ValueError):
        return None
    if candidate == root or not candidate.is_relative_to(root):
        return None
    if candidate.is_dir() or (candidate.is_file() and candidate.suffix == ".gguf"):
        return str(candidate)
    return None
