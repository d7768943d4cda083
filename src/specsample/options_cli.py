"""Flags made from a frozen dataclass's fields. Each field's name, type, default, help and choices are written once,
on the field (`setting`); every command that takes the record adds its flags with `add_flags`, naming only what it
does differently (`Flag`: another flag name, help or negation; another default through `defaults`), and reads them
back with `flag_values`. Ray Serve's text arguments go through the same fields (`parse_text`).

    @dataclass(frozen=True)
    class Options:
        steps: int = setting(8, help="steps per round")

    add_flags(parser, Options)                              # --steps N (default: 8)
    Options(**flag_values(Options, parser.parse_args()))
"""

from __future__ import annotations

import argparse
import typing
from collections.abc import Collection, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any

from specsample.config import SettingError

SETTING = "specsample.setting"  # the metadata key of a field's `Setting`


@dataclass(frozen=True)
class Setting:
    """How a field shows as a flag."""

    help: str
    choices: tuple | None = None
    flag: str | None = None  # default: --NAME-WITH-DASHES; for a bool, the flag that sets it true
    negation: str | None = None  # a bool's flag that sets it false (a bool with one and no `flag` has no true flag)
    negation_help: str | None = None  # default: `help`
    metavar: str | None = None


@dataclass(frozen=True)
class Flag:
    """What one command shows differently from a field's `Setting` (None: as the setting says)."""

    flag: str | None = None
    negation: str | None = None
    help: str | None = None
    negation_help: str | None = None


def setting(
    default: Any = MISSING,
    *,
    help: str,
    choices: Collection | None = None,
    flag: str | None = None,
    negation: str | None = None,
    negation_help: str | None = None,
    metavar: str | None = None,
) -> Any:
    """A dataclass field and its flag: `steps: int = setting(8, help="steps per round")`."""
    return field(
        default=default,
        metadata={
            SETTING: Setting(help, None if choices is None else tuple(choices), flag, negation, negation_help, metavar)
        },
    )


def settings(cls: type) -> dict[str, Setting]:
    """The fields of `cls` that have flags, in declaration order."""
    return {f.name: f.metadata[SETTING] for f in fields(cls) if SETTING in f.metadata}


def check_choices(record: object) -> None:
    """Raise `SettingError` for the first field of `record` whose value is not one of its setting's `choices` (None
    passes where the field's type allows it): what a record with choices checks in its `__post_init__`."""
    cls = type(record)
    hints = typing.get_type_hints(cls)
    for name, spec in settings(cls).items():
        value = getattr(record, name)
        if spec.choices is None or value in spec.choices:
            continue
        if value is None and type(None) in typing.get_args(hints[name]):
            continue
        raise SettingError(name, f"{name} must be one of {', '.join(map(str, spec.choices))}, got {value!r}")


def field_kind(cls: type, name: str) -> type:
    """What text given for field `name` is read as: its type without None; a union of several (`int | str`) stays
    text, for the record to parse."""
    hint = typing.get_type_hints(cls)[name]
    kinds = [k for k in typing.get_args(hint) if k is not type(None)] or [hint]
    return kinds[0] if len(kinds) == 1 and kinds[0] in (bool, int, float) else str


def add_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    defaults: object | None = None,
    flags: Mapping[str, Flag] | None = None,
    skip: Collection[str] = (),
    title: str | None = None,
) -> None:
    """Add a flag for every field of `cls` that has a `Setting`, but those in `skip` (which the command sets itself),
    defaulting to `defaults`' values (else the fields' own defaults). The flag of each field is recorded in the
    parser's `flags` default, for errors that name a field to name its flag."""
    flags = dict(flags or {})
    known = settings(cls)
    unknown = (set(flags) | set(skip)) - set(known)
    if unknown:
        raise ValueError(f"{cls.__name__} has no setting {', '.join(sorted(unknown))}")
    group = parser.add_argument_group(title) if title else parser
    names = dict(parser.get_default("flags") or {})
    by_name = {f.name: f for f in fields(cls)}
    for name, spec in known.items():
        if name in skip:
            continue
        names[name] = _add(
            group,
            cls,
            by_name[name],
            spec,
            flags.get(name, Flag()),
            getattr(defaults, name) if defaults is not None else _default(by_name[name]),
        )
    parser.set_defaults(flags=names)


def _default(f: Field) -> Any:
    if f.default is not MISSING:
        return f.default
    return None if f.default_factory is MISSING else f.default_factory()


def _add(group, cls: type, f: Field, spec: Setting, override: Flag, default: Any) -> str:
    """Add field `f`'s flag(s) to `group`; return the name errors about the field use."""
    kind = field_kind(cls, f.name)
    flag = override.flag or spec.flag
    if kind is not bool:
        flag = flag or "--" + f.name.replace("_", "-")
        shown = "" if default is None else f" (default: {default})"
        metavar = spec.metavar or (None if spec.choices else flag.lstrip("-").upper().replace("-", "_"))
        group.add_argument(
            flag,
            dest=f.name,
            default=default,
            type=None if kind is str else kind,
            choices=spec.choices,
            metavar=metavar,
            help=_escape((override.help or spec.help) + shown),
        )
        return flag
    negation = override.negation or spec.negation
    if flag is None and spec.negation is None:
        flag = "--" + f.name.replace("_", "-")
    both = group.add_mutually_exclusive_group() if flag and negation else group
    if flag:
        both.add_argument(
            flag,
            dest=f.name,
            action="store_true",
            default=default,
            help=_escape((override.help or spec.help) + (" (default)" if default else "")),
        )
    if negation:
        text = override.negation_help or spec.negation_help or override.help or spec.help
        both.add_argument(
            negation,
            dest=f.name,
            action="store_false",
            default=default,
            help=_escape(text + ("" if default else " (default)")),
        )
    return flag or negation


def _escape(text: str) -> str:
    return text.replace("%", "%%")  # argparse formats help with %


def flag_values(cls: type, args: argparse.Namespace, skip: Collection[str] = ()) -> dict[str, Any]:
    """The values of `cls`'s fields that `add_flags` made flags for, as parsed into `args`."""
    return {name: getattr(args, name) for name in settings(cls) if name not in skip}


def parse_text(cls: type, name: str, value: Any) -> Any:
    """Field `name`'s value given as text (an argument in a Serve config YAML) as the field's type; anything else as
    given, for the record to check."""
    if not isinstance(value, str):
        return value
    kind = field_kind(cls, name)
    if kind is bool:
        return parse_bool(name, value)
    if kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            raise SettingError(
                name, f"{name} must be {'an integer' if kind is int else 'a number'}, got {value!r}"
            ) from None
    return value


def parse_bool(name: str, value: str | bool) -> bool:
    """A boolean given as a bool or as text (true/false, yes/no, 1/0)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "yes", "1"):
        return True
    if text in ("false", "no", "0"):
        return False
    raise SettingError(name, f"{name}: expected true or false, got {value!r}")
