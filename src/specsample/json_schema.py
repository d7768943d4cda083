"""What a JSON schema may ask of structured output, checked before anything compiles it.

`served_schema` returns the form of a schema the grammar compiles, or raises `SchemaError` naming the keyword or
limit at fault and where it is. The rule: every keyword is either enforced by the grammar or refused; a keyword that
does not change which documents are valid (`title`, `description`, `examples`, ...) is dropped, so two schemas that
differ only in those compile once (the served form is the cache key).

The grammar engine (xgrammar) enforces: `type`, `enum`, `const`, `properties`, `required` (of listed properties),
`additionalProperties`, `minProperties`, `maxProperties`, `items`, `prefixItems`, `minItems`, `maxItems`, `minLength`,
`maxLength`, `pattern`, the formats in FORMATS, `minimum`, `maximum`, `exclusiveMinimum`, `exclusiveMaximum`,
`anyOf`, local `$ref` (`#...` into the schema, recursion included) and `$defs`/`definitions`. `allOf` of one schema
is read as that schema. Everything else (`not`, `oneOf`, `if`/`then`/`else`, `uniqueItems`, `multipleOf`,
`patternProperties`, external `$ref`, ...) is refused.

A `pattern` is matched by the decoded string (JSON Schema's rule), while the grammar writes the string's JSON text:
each pattern is rewritten so that it only produces characters JSON writes as themselves (no quotes, backslashes or
control characters), which makes the text and the decoded string the same; a pattern that needs one of those
characters is refused. Classes that Python's and ECMA-262's regular expressions read differently (`\\d`, `\\w`,
`\\s` and their negations) are narrowed to what both accept.
"""

from __future__ import annotations

import json
import re
import re._constants as sre
import re._parser as sre_parse
from collections.abc import Iterable
from typing import Any

MAX_SCHEMA_BYTES = 65536  # the schema as compact JSON
MAX_SCHEMA_DEPTH = 64  # nesting of objects and arrays in the schema document
MAX_PATTERN_SIZE = 1000  # characters a pattern spells out with its bounded repetitions unrolled: `.{1000}` is 1000
ANNOTATIONS = frozenset(
    {"title", "description", "examples", "default", "$comment", "deprecated", "readOnly", "writeOnly", "$schema"}
)
TYPES = ("string", "integer", "number", "boolean", "null", "object", "array")
# formats whose grammar writes only valid values (not xgrammar's ipv4: leading zeros; hostname: labels past 63
# characters; uri: not checked)
FORMATS = frozenset({"duration", "email", "ipv6", "uuid"})
# formats served as patterns of valid values only (xgrammar's own allow September 31): RFC 3339's date (February to
# the 28th), time and date-time
_DATE = (
    r"[0-9]{4}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
    r"|02-(?:0[1-9]|1[0-9]|2[0-8]))"
)
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,6})?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
FORMAT_PATTERNS = {"date": f"^{_DATE}$", "time": f"^{_TIME}$", "date-time": f"^{_DATE}T{_TIME}$"}
STRING_KEYWORDS = frozenset({"minLength", "maxLength", "pattern", "format"})
NUMBER_KEYWORDS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})
ARRAY_KEYWORDS = frozenset({"items", "prefixItems", "minItems", "maxItems", "uniqueItems"})
OBJECT_KEYWORDS = frozenset({"properties", "required", "additionalProperties", "minProperties", "maxProperties"})
GENERAL_KEYWORDS = frozenset({"type", "enum", "const", "anyOf", "allOf", "$ref", "$defs", "definitions"})
SUPPORTED = STRING_KEYWORDS | NUMBER_KEYWORDS | ARRAY_KEYWORDS | OBJECT_KEYWORDS | GENERAL_KEYWORDS
REFUSED_HINTS = {
    "oneOf": "use anyOf (the grammar cannot exclude a value that matches several branches)",
    "allOf": "give one schema (allOf is read only when it holds a single schema)",
    "uniqueItems": "the grammar cannot keep array items apart",
}


class SchemaError(ValueError):
    """A schema the grammar cannot enforce; the message names the keyword or limit and its place in the schema."""


def served_schema(schema: Any) -> dict[str, Any] | bool:
    """The schema the grammar compiles: annotations dropped, keywords checked (see the module's rule), patterns
    rewritten; raises `SchemaError`."""
    if not isinstance(schema, dict | bool):
        raise SchemaError("a JSON schema is an object (or true / false)")
    depth = json_depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise SchemaError(f"the schema nests {depth} levels deep; the limit is {MAX_SCHEMA_DEPTH}")
    size = len(json.dumps(schema, separators=(",", ":")))
    if size > MAX_SCHEMA_BYTES:
        raise SchemaError(f"the schema is {size} bytes as compact JSON; the limit is {MAX_SCHEMA_BYTES}")
    return _Walk(schema).node(schema, "")


def json_depth(value: Any) -> int:
    """How deeply objects and arrays nest in `value` (a scalar: 0), found without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def _at(path: str) -> str:
    return f" at {path}" if path else ""


class _Walk:
    """One schema's check and rewrite; `root` resolves local `$ref`s."""

    def __init__(self, root: Any) -> None:
        self.root = root

    def node(self, schema: Any, path: str) -> dict[str, Any] | bool:
        if isinstance(schema, bool):
            return schema
        if not isinstance(schema, dict):
            raise SchemaError(f"a schema must be an object or a boolean{_at(path)}, got {json.dumps(schema)[:40]}")
        keys = set(schema) - ANNOTATIONS
        unknown = sorted(keys - SUPPORTED)
        if unknown:
            hint = REFUSED_HINTS.get(unknown[0], "the grammar cannot enforce it")
            raise SchemaError(f"unsupported keyword {unknown[0]!r}{_at(path)}: {hint}")
        if "allOf" in keys:
            return self._all_of(schema, keys, path)
        if "$ref" in keys:
            return self._ref(schema, keys, path)
        out: dict[str, Any] = {}
        types = self._types(schema, keys, path)
        if types is not None:
            out["type"] = types[0] if len(types) == 1 else types
        if "enum" in keys or "const" in keys:
            return self._values(schema, keys, types, path)
        for name in ("$defs", "definitions"):
            if name in keys:
                out[name] = self._map(schema[name], f"{path}/{name}")
        if "anyOf" in keys:
            branches = schema["anyOf"]
            if not isinstance(branches, list) or not branches:
                raise SchemaError(f"anyOf{_at(path)} must be a non-empty array of schemas")
            out["anyOf"] = [self.node(b, f"{path}/anyOf/{i}") for i, b in enumerate(branches)]
        self._strings(schema, keys, path, out)
        for name in sorted(keys & NUMBER_KEYWORDS):
            if not isinstance(schema[name], int | float) or isinstance(schema[name], bool):
                raise SchemaError(f"{name}{_at(path)} must be a number")
            out[name] = schema[name]
        self._arrays(schema, keys, path, out)
        self._objects(schema, keys, path, out)
        return out

    def _types(self, schema: dict, keys: set, path: str) -> list[str] | None:
        """The schema's types (None: no `type`); a type-specific keyword without a type is refused, except those of
        objects (the grammar reads them as an object)."""
        if "type" not in keys:
            specific = sorted(keys & (STRING_KEYWORDS | NUMBER_KEYWORDS | ARRAY_KEYWORDS))
            if specific:
                raise SchemaError(f'{specific[0]!r}{_at(path)} needs a "type" beside it')
            return None  # any value; with object keywords, an object (see _objects)
        given = schema["type"]
        types = [given] if isinstance(given, str) else given
        if (
            not isinstance(types, list)
            or not types
            or any(t not in TYPES for t in types)
            or len(set(types)) != len(types)
        ):
            raise SchemaError(f"type{_at(path)} must be one of {', '.join(TYPES)} or a list of them")
        return types

    def _all_of(self, schema: dict, keys: set, path: str) -> dict[str, Any] | bool:
        branches = schema["allOf"]
        if not isinstance(branches, list) or len(branches) != 1 or keys != {"allOf"}:
            raise SchemaError(
                f"unsupported keyword 'allOf'{_at(path)}: {REFUSED_HINTS['allOf']}, with nothing but "
                "annotations beside it"
            )
        return self.node(branches[0], f"{path}/allOf/0")

    def _ref(self, schema: dict, keys: set, path: str) -> dict[str, Any]:
        ref = schema["$ref"]
        if keys - {"$ref", "$defs", "definitions"}:
            extra = sorted(keys - {"$ref", "$defs", "definitions"})[0]
            raise SchemaError(
                f'{extra!r}{_at(path)} beside "$ref" is not supported: move it into the referenced schema'
            )
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise SchemaError(f"$ref{_at(path)} must point inside the schema ('#/$defs/NAME'), got {ref!r}")
        target: Any = self.root
        for part in ref[1:].split("/")[1:] if ref != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and part in target:
                target = target[part]
            elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            else:
                raise SchemaError(f"$ref{_at(path)} points to {ref!r}, which the schema does not hold")
        if not isinstance(target, dict | bool):
            raise SchemaError(f"$ref{_at(path)} points to {ref!r}, which is not a schema")
        out: dict[str, Any] = {"$ref": ref}
        for name in ("$defs", "definitions"):
            if name in keys:
                out[name] = self._map(schema[name], f"{path}/{name}")
        return out

    def _map(self, schemas: Any, path: str) -> dict[str, Any]:
        if not isinstance(schemas, dict):
            raise SchemaError(f"{path.rsplit('/', 1)[-1]}{_at(path.rsplit('/', 1)[0])} must map names to schemas")
        return {name: self.node(s, f"{path}/{name}") for name, s in schemas.items()}

    def _values(self, schema: dict, keys: set, types: list[str] | None, path: str) -> dict[str, Any]:
        """`enum` or `const`: the grammar writes one of the values, so nothing but `type` may stand beside them; a
        value of another type is dropped (JSON Schema's intersection), and no value left is refused."""
        beside = sorted(keys - {"enum", "const", "type"})
        if beside or {"enum", "const"} <= keys:
            other = beside[0] if beside else "const"
            raise SchemaError(f'{other!r}{_at(path)} beside "enum"/"const" is not supported: list only the values')
        if "const" in keys:
            values = [schema["const"]]
        else:
            values = schema["enum"]
            if not isinstance(values, list) or not values:
                raise SchemaError(f"enum{_at(path)} must be a non-empty array")
        kept = [v for v in values if types is None or any(_is_type(v, t) for t in types)]
        if not kept:
            name = "const" if "const" in keys else "enum"
            raise SchemaError(f"{name}{_at(path)} admits no value: none is of type {' or '.join(types or ())}")
        return {"enum": kept}

    def _strings(self, schema: dict, keys: set, path: str, out: dict[str, Any]) -> None:
        for name in ("minLength", "maxLength"):
            if name in keys:
                out[name] = _count(schema[name], name, path)
        if "format" in keys:
            kind = schema["format"]
            if kind in FORMAT_PATTERNS:
                out["pattern"] = json_text_pattern(FORMAT_PATTERNS[kind])
            elif kind in FORMATS:
                out["format"] = kind
            else:
                raise SchemaError(
                    f"format{_at(path)}: {kind!r} is not enforced; the supported formats are "
                    f"{', '.join(sorted(FORMATS | set(FORMAT_PATTERNS)))}"
                )
        if "pattern" in keys:
            if not isinstance(schema["pattern"], str):
                raise SchemaError(f"pattern{_at(path)} must be a string")
            out["pattern"] = json_text_pattern(schema["pattern"], f"{path}/pattern")
        together = sorted(keys & STRING_KEYWORDS)
        if ("pattern" in keys or "format" in keys) and len(together) > 1:
            raise SchemaError(
                f"{together[0]!r} and {together[1]!r}{_at(path)} together are not supported: the "
                "grammar enforces a pattern or a format alone (write the length into the pattern)"
            )

    def _arrays(self, schema: dict, keys: set, path: str, out: dict[str, Any]) -> None:
        if schema.get("uniqueItems", False) is not False:
            raise SchemaError(f"unsupported keyword 'uniqueItems'{_at(path)}: {REFUSED_HINTS['uniqueItems']}")
        if "items" in keys:
            out["items"] = self.node(schema["items"], f"{path}/items")
        if "prefixItems" in keys:
            items = schema["prefixItems"]
            if not isinstance(items, list):
                raise SchemaError(f"prefixItems{_at(path)} must be an array of schemas")
            out["prefixItems"] = [self.node(s, f"{path}/prefixItems/{i}") for i, s in enumerate(items)]
        for name in ("minItems", "maxItems"):
            if name in keys:
                out[name] = _count(schema[name], name, path)

    def _objects(self, schema: dict, keys: set, path: str, out: dict[str, Any]) -> None:
        if not keys & OBJECT_KEYWORDS:
            return
        out.setdefault("type", "object")
        properties = self._map(schema.get("properties", {}), f"{path}/properties")
        if "properties" in keys:
            out["properties"] = properties
        if "required" in keys:
            required = schema["required"]
            if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
                raise SchemaError(f"required{_at(path)} must be an array of property names")
            missing = [r for r in required if r not in properties]
            if missing:
                raise SchemaError(f'required{_at(path)} names {missing[0]!r}, which "properties" does not define')
            out["required"] = required
        if "additionalProperties" in keys:
            out["additionalProperties"] = self.node(schema["additionalProperties"], f"{path}/additionalProperties")
        for name in ("minProperties", "maxProperties"):
            if name in keys:
                out[name] = _count(schema[name], name, path)


def _count(value: Any, name: str, path: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise SchemaError(f"{name}{_at(path)} must be an integer >= 0")
    return value


def _is_type(value: Any, kind: str) -> bool:
    return {
        "string": isinstance(value, str),
        "boolean": isinstance(value, bool),
        "null": value is None,
        "object": isinstance(value, dict),
        "array": isinstance(value, list),
        "integer": isinstance(value, int)
        and not isinstance(value, bool)
        or isinstance(value, float)
        and value.is_integer(),
        "number": isinstance(value, int | float) and not isinstance(value, bool),
    }[kind]


# ----- patterns -------------------------------------------------------------------------------------------------

MAX_CODE = 0x10FFFF
# what a JSON string holds as itself: no control characters, no quote, no backslash, no lone surrogate
_SAFE = ((0x20, 0x21), (0x23, 0x5B), (0x5D, 0xD7FF), (0xE000, MAX_CODE))
_ASCII = ((0x20, 0x7E),)
_LINE_ENDS = (0x0A, 0x0D, 0x2028, 0x2029)  # what `.` does not match (ECMA-262)
# classes read alike by Python's `re` and ECMA-262 (both match these, the Unicode extras aside)
_CATEGORIES = {
    sre.CATEGORY_DIGIT: ((0x30, 0x39),),
    sre.CATEGORY_SPACE: ((0x20, 0x20),),
    sre.CATEGORY_WORD: ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)),
}
_NEGATED = {
    sre.CATEGORY_NOT_DIGIT: sre.CATEGORY_DIGIT,
    sre.CATEGORY_NOT_SPACE: sre.CATEGORY_SPACE,
    sre.CATEGORY_NOT_WORD: sre.CATEGORY_WORD,
}


def json_text_pattern(pattern: str, path: str = "") -> str:
    """`pattern` rewritten to produce only characters JSON writes as themselves (see the module's rule), checked
    against MAX_PATTERN_SIZE; raises `SchemaError`."""
    try:
        parsed = sre_parse.parse(pattern)
    except (re.error, RecursionError, OverflowError) as exc:
        raise SchemaError(f"pattern{_at(path.rsplit('/', 1)[0])} is not a regular expression: {exc}") from None
    if parsed.state.flags & (re.IGNORECASE | re.MULTILINE | re.DOTALL | re.VERBOSE):
        raise SchemaError(f"pattern{_at(path.rsplit('/', 1)[0])}: inline flags such as (?i) are not supported")
    items = list(parsed.data)
    head = "^" if items and items[0] == (sre.AT, sre.AT_BEGINNING) else ""
    tail = "$" if items and items[-1] == (sre.AT, sre.AT_END) and len(items) > bool(head) else ""
    body = items[bool(head) : len(items) - bool(tail)]
    text, size = _emit(body, path)
    if size > MAX_PATTERN_SIZE:
        raise SchemaError(
            f"pattern{_at(path.rsplit('/', 1)[0])} spells out {size} characters with its repetitions "
            f"unrolled; the limit is {MAX_PATTERN_SIZE}"
        )
    return head + text + tail


def _emit(items: list, path: str) -> tuple[str, int]:
    """Regular-expression text for parsed `items`, and its unrolled size."""
    parts, size = [], 0
    for op, av in items:
        if op is sre.LITERAL:
            text, n = _literal(av, path), 1
        elif op in (sre.NOT_LITERAL, sre.ANY, sre.IN):
            ranges = (
                _minus(_SAFE, [(av, av)])
                if op is sre.NOT_LITERAL
                else _minus(_SAFE, [(c, c) for c in _LINE_ENDS])
                if op is sre.ANY
                else _class(av, path)
            )
            if not ranges:
                raise SchemaError(
                    f"pattern{_at(path.rsplit('/', 1)[0])} has a class with no character JSON writes as itself"
                )
            text, n = _class_text(ranges), 1
        elif op is sre.BRANCH:
            emitted = [_emit(list(branch), path) for branch in av[1]]
            text, n = "(?:" + "|".join(t for t, _ in emitted) + ")", max(s for _, s in emitted)
        elif op is sre.SUBPATTERN:
            _, add_flags, del_flags, sub = av
            if add_flags or del_flags:
                raise SchemaError(f"pattern{_at(path.rsplit('/', 1)[0])}: inline flags are not supported")
            inner, n = _emit(list(sub), path)
            text = f"(?:{inner})"
        elif op in (sre.MAX_REPEAT, sre.MIN_REPEAT):
            low, high, sub = av
            inner, unit = _emit(list(sub), path)
            bound = "" if high == sre.MAXREPEAT else str(high)
            text = f"(?:{inner}){{{low},{bound}}}" if bound != str(low) else f"(?:{inner}){{{low}}}"
            n = unit * (high if high != sre.MAXREPEAT else low + 1)
        else:
            name = {
                sre.AT: "an anchor inside the pattern (^ or $ anywhere but its ends)",
                sre.GROUPREF: "a backreference",
                sre.ASSERT: "a lookaround",
                sre.ASSERT_NOT: "a lookaround",
            }.get(op, str(op))
            raise SchemaError(f"pattern{_at(path.rsplit('/', 1)[0])} uses {name}, which is not supported")
        parts.append(text)
        size += n
    return "".join(parts), size


def _literal(code: int, path: str) -> str:
    if not any(lo <= code <= hi for lo, hi in _SAFE):
        raise SchemaError(
            f"pattern{_at(path.rsplit('/', 1)[0])} requires {chr(code)!r}, which JSON writes escaped: "
            "structured output writes strings only of characters that need no escaping"
        )
    return _char(code)


def _class(items: list, path: str) -> list[tuple[int, int]]:
    """A character class's ranges, intersected with what JSON writes as itself."""
    negate = bool(items) and items[0][0] is sre.NEGATE
    ranges: list[tuple[int, int]] = []
    for op, av in items[negate:]:
        if op is sre.LITERAL:
            ranges.append((av, av))
        elif op is sre.RANGE:
            ranges.append(av)
        elif op is sre.CATEGORY and av in _CATEGORIES:
            ranges.extend(_CATEGORIES[av])
        elif op is sre.CATEGORY and av in _NEGATED:
            ranges.extend(_minus(_ASCII, _CATEGORIES[_NEGATED[av]]))
        else:
            raise SchemaError(f"pattern{_at(path.rsplit('/', 1)[0])} has a class this server cannot read ({av})")
    if negate:
        return _minus(_SAFE, ranges)
    return _minus(_SAFE, _minus(((0, MAX_CODE),), ranges))


def _minus(ranges: Iterable[tuple[int, int]], removed: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, merged `ranges` less the code points in `removed`."""
    out = []
    cuts = sorted(removed)
    for lo, hi in sorted(ranges):
        for cut_lo, cut_hi in cuts:
            if cut_hi < lo or cut_lo > hi:
                continue
            if cut_lo > lo:
                out.append((lo, cut_lo - 1))
            lo = max(lo, cut_hi + 1)
            if lo > hi:
                break
        if lo <= hi:
            out.append((lo, hi))
    merged: list[tuple[int, int]] = []
    for lo, hi in out:
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
        else:
            merged.append((lo, hi))
    return merged


def _class_text(ranges: list[tuple[int, int]]) -> str:
    if len(ranges) == 1 and ranges[0][0] == ranges[0][1]:
        return _char(ranges[0][0])  # as the parser reads it back: the served form is its own served form
    return "[" + "".join(_char(lo) if lo == hi else f"{_char(lo)}-{_char(hi)}" for lo, hi in ranges) + "]"


def _char(code: int) -> str:
    """A code point as regular-expression text: letters and digits as themselves, the rest escaped."""
    if chr(code).isascii() and chr(code).isalnum():
        return chr(code)
    return f"\\u{code:04x}" if code <= 0xFFFF else chr(code)
