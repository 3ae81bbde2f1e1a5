"""Constrained answers: `choices` makes the answer exactly one of the given strings (the native
ChoiceTrie over their token encodings), `schema` makes it JSON valid against a JSON schema (the
native JsonSchema, below); greedy among the allowed continuations, per token in native code.
Validation happens here, before anything runs, with one line saying what is wrong."""

from __future__ import annotations

import json
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .. import _engine
from .tokenizer import Tokenizer, TokenType

MAX_CHOICES = 256
MAX_CHOICE_TOKENS = 64

__all__ = ["MAX_CHOICES", "MAX_CHOICE_TOKENS", "CompiledSchema", "choice_constraint", "compile_schema",
           "fallback_tokens", "parse_schema", "schema_constraint", "token_bytes"]


def choice_constraint(tokenizer: Any, n_vocab: int, choices: Sequence[str]) -> Any:
    """An _engine.Choices for these strings, each encoded as the answer's text (no BOS); ValueError
    for no choices, a choice that is not a non-empty string or encodes to no tokens, too many, or
    too long. Duplicates count once."""
    if isinstance(choices, (str, bytes)) or not isinstance(choices, Sequence):
        raise ValueError(f"choices must be a list of strings, got {type(choices).__name__}")
    if not choices:
        raise ValueError("choices is empty: give at least one allowed answer")
    if len(choices) > MAX_CHOICES:
        raise ValueError(f"{len(choices)} choices, at most {MAX_CHOICES}")
    encoded: dict[tuple[int, ...], str] = {}
    for i, c in enumerate(choices):
        if not isinstance(c, str) or not c:
            raise ValueError(f"choice {i} must be a non-empty string, got {c!r}"[:200])
        ids = tuple(tokenizer.encode(c, add_bos=False, add_eos=False))
        if not ids:
            raise ValueError(f"choice {i} ({c!r}) encodes to no tokens"[:200])
        if len(ids) > MAX_CHOICE_TOKENS:
            raise ValueError(f"choice {i} is {len(ids)} tokens, at most {MAX_CHOICE_TOKENS}")
        encoded.setdefault(ids, c)
    return _engine.Choices([list(ids) for ids in encoded], n_vocab)


# -- JSON schema -------------------------------------------------------------------------------
# `schema` makes the answer JSON that validates against a schema of a small subset, written in one
# canonical form the native JsonSchema (native/json_schema.h) walks byte by byte: no whitespace,
# keys in the schema's order (optional ones may be left out, no others), integers of at most
# INTEGER_DIGITS digits, numbers with at most NUMBER_DIGITS.FRACTION_DIGITS digits and no exponent,
# strings of printable characters and short escapes (\" \\ \/ \b \f \n \r \t) of at most maxLength
# (default DEFAULT_MAX_LENGTH) characters, enums as exact texts.

MAX_SCHEMA_BYTES = 16_384  # the schema's JSON text
MAX_SCHEMA_DEPTH = 8  # nested values, the root one included
MAX_SCHEMA_NODES = 256  # values of the schema, all levels
MAX_PROPERTIES = 32  # per object
MAX_KEY_CHARS = 64
MAX_ENUM = 64  # values per enum
MAX_ENUM_CHARS = 64  # characters per enum value
MAX_LENGTH = 1024  # the largest maxLength
DEFAULT_MAX_LENGTH = 64  # a string without maxLength
MAX_ITEMS = 64  # the largest maxItems
DEFAULT_MAX_ITEMS = 8  # an array without maxItems (or minItems, if larger)
INTEGER_DIGITS = 12
NUMBER_DIGITS = 12
FRACTION_DIGITS = 6

# The native node kinds (json_schema.h SchemaNode::Kind).
_OBJECT, _ARRAY, _STRING, _LITERALS, _NUMBER = range(5)

# What each type takes; annotations are allowed everywhere and change nothing.
_KEYWORDS: dict[str, tuple[str, ...]] = {
    "object": ("properties", "required", "additionalProperties"),
    "array": ("items", "minItems", "maxItems"),
    "string": ("enum", "maxLength"),
    "integer": (),
    "number": (),
    "boolean": (),
}
_ANNOTATIONS = frozenset({"title", "description", "$comment", "examples"})
_KNOWN = frozenset({"type", *_ANNOTATIONS, *(k for keys in _KEYWORDS.values() for k in keys)})

SchemaNode = tuple[int, int, int, tuple[int, ...], tuple[bytes, ...], tuple[bool, ...]]


@dataclass(frozen=True)
class CompiledSchema:
    """A schema as the native side takes it: nodes (kind, a, b, children, literals, required) with
    children after their parent, node 0 the root; `text` is the schema's JSON (the cache key)."""

    nodes: tuple[SchemaNode, ...]
    text: str


def _fail(path: str, what: str) -> ValueError:
    return ValueError(f"schema at {path}: {what}"[:300].replace("\n", " "))


def _utf8(text: str, path: str, what: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        raise _fail(path, f"{what} is not valid Unicode (a lone surrogate)") from None


def _child_path(path: str, key: str) -> str:
    return f"{path}.{key}" if key.isidentifier() else f"{path}[{json.dumps(key)}]"


def _count(schema: Mapping[str, Any], key: str, path: str, lo: int, hi: int, default: int) -> int:
    value = schema.get(key, default)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(path, f"'{key}' must be an integer, got {json.dumps(value)[:40]}")
    if not lo <= value <= hi:
        raise _fail(path, f"'{key}' is {value}, must be in {lo}..{hi}")
    return value


class _Compiler:
    def __init__(self) -> None:
        self.nodes: list[SchemaNode | None] = []

    def value(self, schema: Any, path: str, depth: int) -> int:
        if depth > MAX_SCHEMA_DEPTH:
            raise _fail(path, f"nested deeper than {MAX_SCHEMA_DEPTH} levels")
        if len(self.nodes) >= MAX_SCHEMA_NODES:
            raise _fail(path, f"more than {MAX_SCHEMA_NODES} values in the schema")
        if not isinstance(schema, dict):
            raise _fail(path, f"a schema must be a JSON object, got {type(schema).__name__}")
        kind = schema.get("type")
        if kind is None and "enum" in schema:
            kind = "string"  # an enum alone: of strings (checked below)
        typed = kind if isinstance(kind, str) and kind in _KEYWORDS else None
        for key in schema:  # keywords first: "$ref", "anyOf", "pattern" ... are named as such
            if key == "type" or key in _ANNOTATIONS or (key == "$schema" and depth == 1) \
                    or (key in _KEYWORDS[typed] if typed else key in _KNOWN):
                continue
            if typed:
                takes = f"for {typed} (it takes {', '.join(_KEYWORDS[typed]) or 'no keywords'})"
            else:
                takes = f"(supported: {', '.join(sorted(_KNOWN))})"
            raise _fail(path, f"keyword '{key}' is not supported {takes}")
        if kind is None:
            raise _fail(path, f"'type' is missing (supported: {', '.join(_KEYWORDS)})")
        if not isinstance(kind, str):
            raise _fail(path, f"'type' must be one type name, got {json.dumps(kind)[:60]}")
        if kind not in _KEYWORDS:
            raise _fail(path, f"type '{kind}' is not supported (supported: {', '.join(_KEYWORDS)})")
        index = len(self.nodes)
        self.nodes.append(None)
        self.nodes[index] = getattr(self, f"_{kind}")(schema, path, depth)
        return index

    def _object(self, schema: dict[str, Any], path: str, depth: int) -> SchemaNode:
        props = schema.get("properties", {})
        if not isinstance(props, dict):
            raise _fail(path, "'properties' must be an object")
        if len(props) > MAX_PROPERTIES:
            raise _fail(path, f"{len(props)} properties, at most {MAX_PROPERTIES}")
        required = schema.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise _fail(path, "'required' must be a list of property names")
        if len(set(required)) != len(required):
            raise _fail(path, "'required' names a property twice")
        for r in required:
            if r not in props:
                raise _fail(path, f"required property {json.dumps(r)[:80]} is not in 'properties'")
        extra = schema.get("additionalProperties", False)
        if not isinstance(extra, bool):
            raise _fail(path, "'additionalProperties' must be true or false (answers never have other keys)")
        keys, children = [], []
        for name, sub in props.items():
            if len(name) > MAX_KEY_CHARS:
                raise _fail(path, f"property name {json.dumps(name[:20])}... is longer than {MAX_KEY_CHARS} characters")
            keys.append(_utf8(json.dumps(name, ensure_ascii=False), path, "a property name") + b":")
            children.append(self.value(sub, _child_path(f"{path}.properties", name), depth + 1))
        return (_OBJECT, 0, 0, tuple(children), tuple(keys), tuple(name in required for name in props))

    def _array(self, schema: dict[str, Any], path: str, depth: int) -> SchemaNode:
        if "items" not in schema:
            raise _fail(path, "an array needs 'items' (one schema for every item)")
        lo = _count(schema, "minItems", path, 0, MAX_ITEMS, 0)
        hi = _count(schema, "maxItems", path, 0, MAX_ITEMS, max(DEFAULT_MAX_ITEMS, lo))
        if lo > hi:
            raise _fail(path, f"minItems {lo} is more than maxItems {hi}")
        item = self.value(schema["items"], f"{path}.items", depth + 1)
        return (_ARRAY, lo, hi, (item,), (), ())

    def _string(self, schema: dict[str, Any], path: str, depth: int) -> SchemaNode:
        length = _count(schema, "maxLength", path, 0, MAX_LENGTH, DEFAULT_MAX_LENGTH)
        if "enum" not in schema:
            return (_STRING, length, 0, (), (), ())
        values = schema["enum"]
        if not isinstance(values, list) or not values:
            raise _fail(path, "'enum' must be a non-empty list")
        if len(values) > MAX_ENUM:
            raise _fail(path, f"'enum' has {len(values)} values, at most {MAX_ENUM}")
        texts: list[bytes] = []
        for i, v in enumerate(values):
            if not isinstance(v, str):
                raise _fail(path, f"enum value {i} is {json.dumps(v)[:40]}: only strings are supported")
            if len(v) > min(MAX_ENUM_CHARS, length):
                raise _fail(path, f"enum value {i} is {len(v)} characters, at most {min(MAX_ENUM_CHARS, length)}")
            text = _utf8(json.dumps(v, ensure_ascii=False), path, f"enum value {i}")
            if text in texts:
                raise _fail(path, f"enum value {i} repeats an earlier one")
            texts.append(text)
        return (_LITERALS, 0, 0, (), tuple(texts), ())

    def _integer(self, schema: dict[str, Any], path: str, depth: int) -> SchemaNode:
        return (_NUMBER, INTEGER_DIGITS, 0, (), (), ())

    def _number(self, schema: dict[str, Any], path: str, depth: int) -> SchemaNode:
        return (_NUMBER, NUMBER_DIGITS, FRACTION_DIGITS, (), (), ())

    def _boolean(self, schema: dict[str, Any], path: str, depth: int) -> SchemaNode:
        return (_LITERALS, 0, 0, (), (b"true", b"false"), ())


def parse_schema(schema: Mapping[str, Any] | str | bytes) -> tuple[dict[str, Any], str]:
    """The schema as plain JSON data and its JSON text; ValueError (one line) for anything that is not
    a JSON object of at most MAX_SCHEMA_BYTES bytes."""
    if isinstance(schema, (bytes, bytearray)):
        if len(schema) > MAX_SCHEMA_BYTES:
            raise ValueError(f"schema is {len(schema)} bytes, at most {MAX_SCHEMA_BYTES}")
        try:
            schema = bytes(schema).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"schema is not UTF-8 text (byte {exc.start})") from None
    if isinstance(schema, Mapping):
        try:
            schema = json.dumps(schema, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"schema is not JSON data: {exc}"[:300]) from None
        except RecursionError:
            raise ValueError(f"schema is nested deeper than {MAX_SCHEMA_DEPTH} levels") from None
    if not isinstance(schema, str):
        raise ValueError(f"schema must be a dict or JSON text, got {type(schema).__name__}")
    size = len(_utf8(schema, "$", "the schema text"))
    if size > MAX_SCHEMA_BYTES:
        raise ValueError(f"schema is {size} bytes, at most {MAX_SCHEMA_BYTES}")
    try:
        data = json.loads(schema)
    except json.JSONDecodeError as exc:
        raise ValueError(f"schema is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise ValueError(f"schema is nested deeper than {MAX_SCHEMA_DEPTH} levels") from None
    if not isinstance(data, dict):
        raise ValueError(f"schema must be a JSON object, got {type(data).__name__}")
    return data, json.dumps(data, ensure_ascii=False)


def compile_schema(schema: Mapping[str, Any] | str | bytes) -> CompiledSchema:
    """The native form of a schema (a dict, or its JSON text); ValueError naming the keyword and the
    path for anything outside the supported subset or the limits above."""
    data, text = parse_schema(schema)
    compiler = _Compiler()
    compiler.value(data, "$", 1)
    return CompiledSchema(tuple(n for n in compiler.nodes if n is not None), text)


def check_schema(schema: Mapping[str, Any] | str | bytes) -> None:
    """ValueError (one line) when `schema` is not one this engine can constrain to; no tokenizer
    needed (the node checks its description_schema parameter with it before any engine is loaded)."""
    compile_schema(schema)


_TOKEN_BYTES: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_NEVER_CHOSEN = frozenset({TokenType.CONTROL, TokenType.UNKNOWN, TokenType.UNUSED})


def token_bytes(tokenizer: Tokenizer) -> Any:
    """The _engine.TokenBytes of a tokenizer (each token's bytes; b"" for control, unknown and unused
    tokens, which a schema never lets through): built once per tokenizer."""
    table = _TOKEN_BYTES.get(tokenizer)
    if table is None:
        n = tokenizer.vocab_size
        table = _engine.TokenBytes([b"" if tokenizer.token_type(i) in _NEVER_CHOSEN else tokenizer.token_bytes(i)
                                    for i in range(n)])
        _TOKEN_BYTES[tokenizer] = table
    return table


MAX_FALLBACK_TOKENS = 1024


def fallback_tokens(tokenizer: Tokenizer, compiled: CompiledSchema) -> list[int]:
    """Tokens of the schema's own texts (keys after '{' or ',', enum texts and true / false before ',',
    '}' or ']'), as the tokenizer splits them: where the model's best candidates do not fit, the
    native fallback picks among these and the single-byte tokens, so a key is written as words
    rather than byte by byte. At most MAX_FALLBACK_TOKENS, lowest ids first."""
    found: set[int] = set()
    for kind, _, _, _, literals, _ in compiled.nodes:
        for literal in literals:
            text = literal.decode("utf-8")
            for t in ((f"{{{text}", f",{text}") if kind == _OBJECT else (f"{text},", f"{text}}}", f"{text}]")):
                found.update(tokenizer.encode(t, add_bos=False, add_eos=False))
    return sorted(t for t in found if tokenizer.token_type(t) not in _NEVER_CHOSEN)[:MAX_FALLBACK_TOKENS]


def schema_constraint(tokenizer: Tokenizer, schema: Mapping[str, Any] | str | bytes | CompiledSchema) -> Any:
    """An _engine.JsonSchema for this schema over the tokenizer's vocabulary (ValueError when bad)."""
    compiled = schema if isinstance(schema, CompiledSchema) else compile_schema(schema)
    return _engine.JsonSchema(list(compiled.nodes), token_bytes(tokenizer), fallback_tokens(tokenizer, compiled))
