"""What a model card shows of the command that made it: the command as given, with every path of the machine it ran
on (absolute, or under ~) shown by its last part. A card is read on other machines, where that machine's folders
mean nothing and may name its user; the last part is the name to give the same argument there."""

from __future__ import annotations

import shlex
from pathlib import PurePosixPath


def portable_command(command: str) -> str:
    """`command` (a shell command line) with each absolute or home path argument, alone or as `--flag=PATH`, replaced
    by its last part: `--out /work/distill/draft` becomes `--out draft`."""
    return shlex.join(_portable(word) for word in shlex.split(command))


def portable_spec(spec: str) -> str:
    """A model spec as a card names it: an absolute or home path by its last part, an alias or hub id as given."""
    return PurePosixPath(spec).name or spec if spec.startswith(("/", "~")) else spec


def _portable(word: str) -> str:
    flag, equals, value = word.partition("=") if word.startswith("-") and "=" in word else ("", "", word)
    return flag + equals + portable_spec(value)
