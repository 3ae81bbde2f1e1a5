"""JSON-schema answers (`describe(..., schema=...)`, native/json_schema.*): the answer parses as JSON and
validates against the schema, and each token is the one a Python reference picks — a recursive-descent
parser of the canonical form (not the native stack machine) that says whether a text is a prefix of a
valid answer and how many bytes its shortest completion takes, with the same candidate rule (the
TOP_K best by logit, then the best single-byte token). Checked on random logits over two real
vocabularies (SmolLM2's byte-level BPE, Gemma 3's SentencePiece) and end to end on frames of the demo
model's world; bad schemas refused one by one in one line.

EDGEVLM_SCHEMA_FRAMES (default 20) sets the frames per schema end to end; 100 is the long form.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jsonschema
import native_build as nb
import numpy as np
import pytest

from edgevlm_ros import _engine
from edgevlm_ros.demo.scenes import generate_scene, render_scene
from edgevlm_ros.engine import constraints as C
from edgevlm_ros.engine.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
N_FRAMES = int(os.environ.get("EDGEVLM_SCHEMA_FRAMES", "20"))
N_REFERENCE_FRAMES = 3  # of those, checked token by token against the reference
TOP_K = _engine.JsonSchema.top_k

SCENE = {
    "type": "object",
    "properties": {
        "circle": {"type": "boolean"},
        "colour": {"enum": ["red", "green", "blue", "yellow", "white", "black", "orange", "purple"]},
        "count": {"type": "integer"},
        "shapes": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3},
    },
    "required": ["circle", "colour", "count", "shapes"],
}
NESTED = {
    "type": "object",
    "properties": {
        "left": {"type": "object", "properties": {"shape": {"type": "string", "enum": ["circle", "square", "star"]},
                                                  "size": {"type": "number"}},
                 "required": ["shape"]},
        "right": {"type": "object", "properties": {"empty": {"type": "boolean"},
                                                   "note": {"type": "string", "maxLength": 8}},
                  "required": ["empty", "note"]},
        "score": {"type": "number"},
    },
    "required": ["left", "right"],
}
SHORT = {"type": "object", "properties": {"caption": {"type": "string", "maxLength": 20}}, "required": ["caption"]}
LISTS = {"type": "array", "items": {"type": "array", "items": {"type": "integer"}, "maxItems": 2}, "minItems": 2,
         "maxItems": 4}
SCHEMAS = {"scene": SCENE, "nested": NESTED, "short": SHORT}
TOP_LEVEL = {"int": {"type": "integer"}, "num": {"type": "number"}, "lists": LISTS,
             "opt": {"type": "object", "properties": {"a": {"type": "integer"}, "ab": {"type": "boolean"},
                                                      "b": {"type": "string", "maxLength": 3}}},
             # A long optional key before a shorter required one that shares its start.
             "keys": {"type": "object", "properties": {"colour_name": {"type": "boolean"}, "col": {"type": "integer"}},
                      "required": ["col"]}}


# -- the reference -------------------------------------------------------------------------------
class Invalid(Exception):
    pass


class Reference:
    """The canonical form as a recursive-descent parser over the compiled nodes. `rest(text)`: the
    bytes of the shortest completion of `text` to a whole answer (0: it is one), or raises Invalid
    when no answer starts with it."""

    def __init__(self, compiled: C.CompiledSchema, utf8: bool) -> None:
        self.nodes = compiled.nodes
        self.utf8 = utf8
        self.minlen: dict[int, int] = {}
        for i in reversed(range(len(self.nodes))):
            self.minlen[i] = self._minlen(i)

    def _minlen(self, i: int) -> int:
        kind, a, _, children, lits, _ = self.nodes[i]
        if kind == 0:
            return 1 + self._obj_rest(i, 0, False)
        if kind == 1:
            return 2 if a == 0 else 2 + a * self.minlen[children[0]] + a - 1
        if kind == 2:
            return 2
        if kind == 3:
            return min(len(x) for x in lits)
        return 1

    def _obj_rest(self, i: int, k: int, emitted: bool) -> int:
        _, _, _, children, keys, req = self.nodes[i]
        need = [j for j in range(k, len(keys)) if req[j]]
        if not need:
            return 1
        return sum(len(keys[j]) + self.minlen[children[j]] for j in need) + len(need) - (0 if emitted else 1) + 1

    def rest(self, text: bytes) -> int:
        out = self.value(0, text, 0)
        if out[0] == "end":
            if out[1] != len(text):
                raise Invalid("bytes after the answer")
            return 0
        return out[1]

    # Each returns ("end", position after the value) or ("open", bytes to finish the value).
    def value(self, i: int, t: bytes, pos: int) -> tuple[str, int]:
        kind = self.nodes[i][0]
        if pos == len(t):
            return ("open", self.minlen[i])
        return [self.obj, self.arr, self.string, self.literal, self.number][kind](i, t, pos)

    def literal(self, i: int, t: bytes, pos: int) -> tuple[str, int]:
        lits = self.nodes[i][4]
        tail = t[pos:]
        for lit in lits:
            if tail.startswith(lit):
                return ("end", pos + len(lit))
        open_ = [len(lit) - len(tail) for lit in lits if lit.startswith(tail)]
        if not open_:
            raise Invalid("no literal")
        return ("open", min(open_))

    def number(self, i: int, t: bytes, pos: int) -> tuple[str, int]:
        _, digits, frac, *_ = self.nodes[i]
        n = len(t)
        if t[pos:pos + 1] == b"-":
            pos += 1
            if pos == n:
                return ("open", 1)
        if not t[pos:pos + 1].isdigit():
            raise Invalid("no digit")
        if t[pos:pos + 1] == b"0":
            pos += 1
        else:
            start = pos
            while pos < n and t[pos:pos + 1].isdigit() and pos - start < digits:
                pos += 1
        if pos == n:
            return ("open", 0)
        if frac and t[pos:pos + 1] == b".":
            pos += 1
            if pos == n:
                return ("open", 1)
            if not t[pos:pos + 1].isdigit():
                raise Invalid("no fraction digit")
            start = pos
            while pos < n and t[pos:pos + 1].isdigit() and pos - start < frac:
                pos += 1
            if pos == n:
                return ("open", 0)
        return ("end", pos)

    def string(self, i: int, t: bytes, pos: int) -> tuple[str, int]:
        limit, n, chars = self.nodes[i][1], len(t), 0
        if t[pos] != ord('"'):
            raise Invalid("no quote")
        pos += 1
        while True:
            if pos == n:
                return ("open", 1)
            b = t[pos]
            if b == ord('"'):
                return ("end", pos + 1)
            if chars >= limit:
                raise Invalid("too long")
            chars += 1
            if b == ord("\\"):
                if pos + 1 == n:
                    return ("open", 2)
                if t[pos + 1] not in b'"\\/bfnrt':
                    raise Invalid("bad escape")
                pos += 2
            elif 0x20 <= b < 0x7F:
                pos += 1
            else:
                if not self.utf8:
                    raise Invalid("non-ASCII")
                width = 2 if 0xC2 <= b <= 0xDF else 3 if 0xE0 <= b <= 0xEF else 4 if 0xF0 <= b <= 0xF4 else 0
                if not width:
                    raise Invalid("bad lead byte")
                piece = t[pos:pos + width]
                # A cut-off character is fine when some continuation makes it a valid one (the bytes
                # after the second one are free in 80..BF).
                if len(piece) < width:
                    if not any(_decodes((piece + bytes([c]))[:width].ljust(width, b"\x80")) for c in range(0x80, 0xC0)):
                        raise Invalid("bad continuation")
                    return ("open", width - len(piece) + 1)
                if not _decodes(piece):
                    raise Invalid("bad UTF-8")
                pos += width

    def arr(self, i: int, t: bytes, pos: int) -> tuple[str, int]:
        _, lo, hi, (item,), _, _ = self.nodes[i]
        n, ml = len(t), self.minlen[item]

        def after(count: int) -> int:
            return max(lo - count, 0) * (ml + 1) + 1

        if t[pos] != ord("["):
            raise Invalid("no [")
        pos += 1
        if pos == n:
            return ("open", 1 if lo == 0 else lo * ml + lo - 1 + 1)
        if t[pos] == ord("]") and lo == 0:
            return ("end", pos + 1)
        count = 0
        while True:
            if count >= hi:
                raise Invalid("too many items")
            kind, v = self.value(item, t, pos)
            count += 1
            if kind == "open":
                return ("open", v + after(count))
            pos = v
            if pos == n:
                return ("open", after(count))
            if t[pos] == ord("]") and count >= lo:
                return ("end", pos + 1)
            if t[pos] != ord(",") or count >= hi:
                raise Invalid("no , or ]")
            pos += 1
            if pos == n:
                return ("open", ml + max(lo - count - 1, 0) * (ml + 1) + 1)

    def obj(self, i: int, t: bytes, pos: int) -> tuple[str, int]:
        _, _, _, children, keys, req = self.nodes[i]
        n, k, emitted = len(t), 0, False
        if t[pos] != ord("{"):
            raise Invalid("no {")
        pos += 1
        while True:
            if pos == n:
                return ("open", self._obj_rest(i, k, emitted))
            if t[pos] == ord("}") and not any(req[k:]):
                return ("end", pos + 1)
            if emitted:
                if t[pos] != ord(",") or k >= len(keys):
                    raise Invalid("no , or }")
                pos += 1
            # The keys that may come next: up to the first required one.
            reach = next((j for j in range(k, len(keys)) if req[j]), len(keys) - 1)
            cands = range(k, reach + 1)
            tail = t[pos:]
            full = [j for j in cands if tail.startswith(keys[j])]
            if not full:
                open_ = [len(keys[j]) - len(tail) + self.minlen[children[j]] + self._obj_rest(i, j + 1, True)
                         for j in cands if keys[j].startswith(tail)]
                if not open_:
                    raise Invalid("no key")
                return ("open", min(open_))
            j = full[0]
            kind, v = self.value(children[j], t, pos + len(keys[j]))
            if kind == "open":
                return ("open", v + self._obj_rest(i, j + 1, True))
            pos, k, emitted = v, j + 1, True


def _decodes(b: bytes) -> bool:
    try:
        b.decode("utf-8", "strict")
        return True
    except UnicodeDecodeError:
        return False


class RefChooser:
    """The native choose() rule over the reference: the TOP_K best candidates (tokens with bytes, and
    stop tokens; logit descending, lower id first), the first that fits; else the best token of the
    schema's texts that fits; else the best single-byte token or stop token that fits; else the same
    without the budget."""

    def __init__(self, ref: Reference, pieces: list[bytes], stops: list[int], extra: list[int]) -> None:
        self.ref, self.pieces, self.stops = ref, pieces, stops
        self.with_bytes = np.asarray([t for t, p in enumerate(pieces) if p and t not in stops], dtype=np.int64)
        # The fallback's tokens: first the schema texts' own (fallback_tokens), then the single-byte ones.
        self.extra = sorted({t for t in extra if len(pieces[t]) > 1} - set(stops))
        self.singles = [t for t, p in enumerate(pieces) if len(p) == 1 and t not in stops]

    def fits(self, text: bytes, t: int, room: int | None) -> bool:
        if t in self.stops:
            return self._rest(text) == 0
        r = self._rest(text + self.pieces[t])
        return r is not None and (room is None or r <= room)

    def _rest(self, text: bytes) -> int | None:
        try:
            return self.ref.rest(text)
        except Invalid:
            return None

    def choose(self, text: bytes, logits: np.ndarray, budget: int, steps: int) -> tuple[int, bool]:
        room = max(budget - steps - 1, 0)
        cands = np.concatenate([self.with_bytes, np.asarray(self.stops, dtype=np.int64)])
        order = cands[np.lexsort((cands, -logits[cands]))][:TOP_K]
        for t in order:
            if self.fits(text, int(t), room):
                return int(t), False
        for limit in (room, None):
            for tier in (self.extra, self.singles + self.stops):
                pool = [t for t in tier if self.fits(text, t, limit)]
                if pool:
                    return min(pool, key=lambda t: (-logits[t], t)), True
        return -1, True

    def complete(self, text: bytes) -> bool:
        return all(self._rest(text + bytes([b])) is None for b in range(256))


# -- random logits over real vocabularies ----------------------------------------------------------
def _tokenizer(name: str) -> Tokenizer:
    path = ROOT / "models" / name
    assert path.exists(), f"{path} is missing: run scripts/setup.sh"
    return Tokenizer.from_gguf_metadata(_engine.GGUFFile(str(path)).metadata())


@pytest.fixture(scope="module", params=["SmolLM2-135M-Instruct.Q4_1.gguf", "gemma-3-270m-q4_k_m.gguf"])
def vocab(request: pytest.FixtureRequest) -> tuple[Tokenizer, list[bytes], list[int]]:
    tok = _tokenizer(request.param)
    table = C.token_bytes(tok)
    assert C.token_bytes(tok) is table  # built once per tokenizer
    pieces = [b"" if tok.token_type(i) in C._NEVER_CHOSEN else tok.token_bytes(i) for i in range(tok.vocab_size)]
    return tok, pieces, sorted(tok.eot_ids)


def _random_run(tok: Tokenizer, pieces: list[bytes], stops: list[int], schema: Any, seed: int,
                budget: int) -> dict[str, Any]:
    compiled = C.compile_schema(schema)
    native = C.schema_constraint(tok, compiled)
    utf8 = all(any(len(p) == 1 and p[0] == b for p in pieces) for b in range(0x80, 0xC0))
    assert native.utf8_strings == utf8
    extra = C.fallback_tokens(tok, compiled)
    ref = RefChooser(Reference(compiled, utf8), pieces, stops, extra)
    assert native.fallback_tokens == [t for t in extra if len(pieces[t]) > 1]
    rng = np.random.default_rng(seed)
    # A pool of JSON-looking tokens gets a boost, so the top candidates are often allowed.
    jsonish = set(b'{}[]",:-.0123456789abcdefghijklmnopqrstuvwxyz truefalse')
    pool = [t for t, p in enumerate(pieces) if p and set(p) <= jsonish]
    structural = np.asarray([t for t in pool if set(pieces[t]) & set(b'{}[]",:')], dtype=np.int64)
    words = np.asarray([t for t in pool if not set(pieces[t]) & set(b'{}[]",:')], dtype=np.int64)
    n_vocab = len(pieces) + 3  # the head may be wider than the tokenizer
    native.start(budget)
    assert native.min_completion == ref.ref.rest(b"") == native.min_tokens
    text, out, fallbacks, examined = b"", [], 0, 0
    for step in range(budget):
        logits = rng.normal(0, 2, n_vocab).astype(np.float32)
        # Some allowed tokens among boosted disallowed ones: the first that fits lands at any rank,
        # inside the TOP_K or past it (the fallback).
        sample = np.concatenate([rng.choice(structural, 300), rng.choice(words, 100)])
        rng.shuffle(sample)
        fit = [t for t in sample if ref.fits(text, int(t), None)]
        logits[sample[:100]] += rng.normal(6, 1, 100).astype(np.float32)
        if fit:
            logits[fit] += rng.normal(5, 2, len(fit)).astype(np.float32)
        if rng.random() < 0.2:
            logits[stops] += 8
        want, fell = ref.choose(text, logits, budget, step)
        got = native.choose(logits, stops)
        assert got == want, (step, text, got, want)
        fallbacks += fell
        if got in stops:
            break
        native.advance(got)
        text += pieces[got]
        out.append(got)
        assert native.min_completion == ref.ref.rest(text), text
        assert native.accepting == (ref.ref.rest(text) == 0)
        assert native.complete == ref.complete(text), text
        if native.complete:
            break
    examined = native.stats["examined"]
    answer = json.loads(text.decode("utf-8"))
    jsonschema.validate(answer, schema)
    assert tok.decode(out, skip_special=True).encode("utf-8") == text
    return {"steps": len(out), "fallbacks": fallbacks, "examined": examined}


@pytest.mark.parametrize("name", [*SCHEMAS, *TOP_LEVEL])
def test_native_choose_equals_the_reference_on_random_logits(vocab: Any, name: str) -> None:
    tok, pieces, stops = vocab
    schema = {**SCHEMAS, **TOP_LEVEL}[name]
    floor = C.schema_constraint(tok, schema).min_tokens
    runs = []
    for seed in range(3):
        # Budgets from the shortest answer up: the tight ones force the closing bytes early.
        budget = floor + (0, 7, 40)[seed]
        runs.append(_random_run(tok, pieces, stops, schema, seed, budget))
    print(name, runs)
    if name not in ("int", "num"):  # both ways of choosing were taken
        assert 0 < sum(r["fallbacks"] for r in runs) < sum(r["steps"] for r in runs), runs


def test_native_refuses_bad_trees_and_survives_bad_logits() -> None:
    tok = _tokenizer("SmolLM2-135M-Instruct.Q4_1.gguf")
    vocab = C.token_bytes(tok)
    num = (4, 12, 0, (), (), ())
    for nodes, message in [
        ([], "no nodes"),
        ([(0, 0, 0, (0,), (b'"a":',), (True,))], "is not after it"),
        ([(0, 0, 0, (5,), (b'"a":',), (True,)), num], "is not after it"),
        ([(9, 0, 0, (), (), ())], "unknown kind"),
        ([(1, 0, 3, (1, 1), (), ()), num], "exactly one item"),
        ([(1, 4, 3, (1,), (), ()), num], "0 <= min <= max"),
        ([(2, -1, 0, (), (), ())], "a string takes"),
        ([(3, 0, 0, (), (b'"a"', b'"a"b'), ())], "is a prefix of"),
        ([(3, 0, 0, (), (b"",), ())], "empty"),
        ([(4, 0, 0, (), (), ())], "a number takes"),
        ([(0, 0, 0, (1,), (), (True,)), num], "as many keys"),
        ([(1, 0, 1, (i + 1,), (), ()) for i in range(17)] + [num], "nested deeper than 16"),
        ([(1, 4096, 4096, (1,), (), ()), (1, 4096, 4096, (2,), (), ()), num], "shortest answer is more than"),
    ]:
        with pytest.raises(ValueError, match=message):
            _engine.JsonSchema(nodes, vocab)
    with pytest.raises(ValueError, match="fallback token -1 is outside"):
        _engine.JsonSchema([num], vocab, [-1])
    with pytest.raises(ValueError, match="more than 4096 fallback tokens"):
        _engine.JsonSchema([num], vocab, list(range(5000)))
    with pytest.raises(ValueError, match="single byte 0x20"):
        _engine.JsonSchema([num], _engine.TokenBytes([b"ab", b"0", b"1"]))
    c = C.schema_constraint(tok, SCENE)
    c.start(50)
    for logits in (np.full(10, np.nan, np.float32), np.zeros(0, np.float32),
                   np.full(tok.vocab_size + 5, np.nan, np.float32), np.full(tok.vocab_size, -np.inf, np.float32)):
        t = c.choose(logits, [])
        assert t == -1 or c.allows(t)
    assert c.choose(np.zeros(tok.vocab_size, np.float32), [-5, 10 ** 9]) >= 0
    with pytest.raises(ValueError, match="not allowed"):
        c.advance(tok.encode("x", add_bos=False)[0])
    with pytest.raises(ValueError, match="1-D"):
        c.choose(np.zeros((2, 2), np.float32), [])


@nb.ahead
def json_schema_check() -> Path:
    """native/tests/json_schema_check.cpp with the constraint, under ASan + UBSan (no recovery)."""
    flags = nb.common_flags("-O1", *nb.SANITIZE, "-fno-sanitize-recover=all")
    objs = nb.compile_objects(["native/tests/json_schema_check.cpp", "native/json_schema.cpp"], "g++", flags)
    return nb.link("json_schema_check-asan", objs, "g++", flags)


BUILD_AHEAD = (json_schema_check,)


def test_random_and_malformed_trees_under_asan_and_ubsan() -> None:
    """300 random schema trees decoded under hostile logits and budgets (every choice allowed, a cut
    answer still whole), 3000 malformed trees refused or usable: no sanitizer report."""
    import subprocess

    p = subprocess.run([str(json_schema_check()), "300"], capture_output=True, text=True, timeout=600,
                       env={**os.environ, **nb.SANITIZED_RUN_ENV})
    out = p.stdout + p.stderr
    assert p.returncode == 0 and " 0 failed" in out, out[-4000:]
    print(out.strip().splitlines()[-1])


# -- bad schemas, one line each --------------------------------------------------------------------
def _deep(n: int) -> dict[str, Any]:
    s: dict[str, Any] = {"type": "integer"}
    for _ in range(n - 1):
        s = {"type": "array", "items": s}
    return s


@pytest.mark.parametrize(("schema", "message"), [
    ({"type": "string", "pattern": "a+"}, "schema at $: keyword 'pattern' is not supported for string"),
    ({"type": "object", "properties": {"a": {"$ref": "#/x"}}}, "schema at $.properties.a: keyword '$ref' is not"),
    ({"type": "object", "properties": {"a": {}}}, "schema at $.properties.a: 'type' is missing"),
    ({"anyOf": [{"type": "integer"}]}, "schema at $: keyword 'anyOf' is not supported"),
    ({"type": "object", "properties": {"a": {"type": "integer", "minimum": 3}}},
     "schema at $.properties.a: keyword 'minimum' is not supported for integer"),
    ({"type": "null"}, "type 'null' is not supported"),
    ({"type": ["string", "null"]}, "'type' must be one type name"),
    ({"type": "array"}, "needs 'items'"),
    ({"type": "array", "items": [{"type": "integer"}]}, "schema at $.items: a schema must be a JSON object"),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 5, "maxItems": 2}, "minItems 5 is more than"),
    ({"type": "array", "items": {"type": "integer"}, "maxItems": 1000}, "'maxItems' is 1000, must be in 0..64"),
    ({"type": "array", "items": {"type": "integer"}, "maxItems": True}, "'maxItems' must be an integer"),
    ({"type": "string", "maxLength": 5000}, "'maxLength' is 5000"),
    ({"type": "string", "enum": []}, "'enum' must be a non-empty list"),
    ({"type": "string", "enum": ["a", 1]}, "enum value 1 is 1: only strings"),
    ({"enum": [f"v{i}" for i in range(100)]}, "'enum' has 100 values, at most 64"),
    ({"type": "string", "enum": ["a", "a"]}, "enum value 1 repeats"),
    ({"type": "string", "enum": ["abcdef"], "maxLength": 3}, "enum value 0 is 6 characters, at most 3"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"]}, "required property \"b\""),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "integer"}},
     "'additionalProperties' must be true or false"),
    ({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(40)}}, "40 properties, at most 32"),
    ({"type": "object", "properties": {"x" * 100: {"type": "integer"}}}, "longer than 64 characters"),
    (_deep(9), "schema at $.items.items.items.items.items.items.items.items: nested deeper than 8 levels"),
    (_deep(5000), "nested deeper than 8 levels"),
    ({"type": "object", "properties": {"a": {"type": "string", "enum": ["\ud800"]}}}, "not valid Unicode"),
    ("{\"type\": \"integer\"", "schema is not valid JSON: Expecting ',' delimiter at line 1 column 19"),
    ("[1, 2]", "schema must be a JSON object, got list"),
    ('{"type": "string", "maxLength": ' + "9" * 20000 + "}", "bytes, at most 16384"),
    (b'{"type": "string", "enum": ["\xff"]}', "schema is not UTF-8 text (byte 29)"),
    ({"type": "string", "enum": [{1, 2}]}, "schema is not JSON data"),
    (42, "schema must be a dict or JSON text, got int"),
])
def test_bad_schema_refused_in_one_line(schema: Any, message: str) -> None:
    with pytest.raises(ValueError) as err:
        C.compile_schema(schema)
    assert message in str(err.value), str(err.value)
    assert "\n" not in str(err.value) and len(str(err.value)) <= 300


def test_schema_nodes_too_many_refused() -> None:
    wide = {"type": "object", "properties": {
        f"p{i}": {"type": "object", "properties": {f"q{j}": {"type": "integer"} for j in range(30)}}
        for i in range(10)}}
    with pytest.raises(ValueError, match="more than 256 values"):
        C.compile_schema(wide)


def test_compiled_form() -> None:
    c = C.compile_schema(json.dumps(SCENE))
    assert c.nodes[0][0] == 0 and c.nodes[0][4] == (b'"circle":', b'"colour":', b'"count":', b'"shapes":')
    assert c.nodes[1] == (3, 0, 0, (), (b"true", b"false"), ())
    assert c.nodes[3] == (4, C.INTEGER_DIGITS, 0, (), (), ())
    assert c.nodes[4] == (1, 1, 3, (5,), (), ()) and c.nodes[5] == (2, 12, 0, (), (), ())
    assert C.compile_schema(SCENE).text == c.text


# -- end to end on the demo model ------------------------------------------------------------------
@pytest.fixture(scope="module")
def vlm() -> Any:
    import edgevlm_ros
    from edgevlm_ros.demo.demo_model import resolve_pair

    return edgevlm_ros.load_vlm(*resolve_pair(None, None), threads=2)  # the embedded demo pair


def _reference_tokens(vlm: Any, rgb: np.ndarray, prompt: str, schema: Any, max_new: int) -> list[int]:
    """The reference's choices over the engine's own logits (one forward per token, from an empty
    sequence: the same numbers the restored prefix gives, as test_constraints checks)."""
    tok = vlm.text.tokenizer
    pieces = [b"" if tok.token_type(i) in C._NEVER_CHOSEN else tok.token_bytes(i) for i in range(tok.vocab_size)]
    stops = sorted(vlm.text.stop_ids)
    compiled = C.compile_schema(schema)
    utf8 = all(any(len(p) == 1 and p[0] == b for p in pieces) for b in range(0x80, 0xC0))
    ref = RefChooser(Reference(compiled, utf8), pieces, stops, C.fallback_tokens(tok, compiled))
    plan = vlm.images.plan(*rgb.shape[:2])
    pre, rest = vlm.prompt_ids(prompt, plan)
    ids = pre + rest
    feats = vlm.images.encode(vlm.vision, vlm.images.prepare(rgb, plan))
    slots = np.flatnonzero(np.asarray(ids) == vlm.image_token_id)
    native = vlm.text.native
    native.reset()
    logits = native.forward(np.asarray(ids, np.int32), features=feats, slots=slots)
    text, out = b"", []
    for step in range(max_new):
        t, _ = ref.choose(text, logits, max_new, step)
        if t in stops or t < 0:
            break
        out.append(t)
        text += pieces[t]
        if ref.complete(text):
            break
        logits = native.forward(np.asarray([t], np.int32))
    return out


PROMPTS = {"scene": "Describe the image as JSON.", "nested": "What is on the left and on the right?",
           "short": "Caption the image."}
MAX_NEW = {"scene": 80, "nested": 80, "short": 32}  # at least each schema's shortest answer in bytes


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_answers_parse_and_validate(vlm: Any, name: str) -> None:
    schema = SCHEMAS[name]
    stats = []
    for i in range(N_FRAMES):
        rgb = render_scene(generate_scene(seed=91, index=i))
        r = vlm.describe(rgb, PROMPTS[name], max_new_tokens=MAX_NEW[name], schema=schema)
        answer = json.loads(r.text)
        jsonschema.validate(answer, schema)
        assert r.stop_reason in ("complete", "stop_token", "max_tokens"), r.stop_reason
        if i < N_REFERENCE_FRAMES:
            assert r.token_ids == _reference_tokens(vlm, rgb, PROMPTS[name], schema, MAX_NEW[name]), (i, r.text)
        c = vlm.text.constraint(schema=schema)
        stats.append(c.stats["examined"] / max(c.stats["chosen"], 1))
        if i < 3:
            print(f"{name} frame {i}: {r.text} ({r.stop_reason})")
    print(f"{name}: {N_FRAMES} frames valid, {np.mean(stats):.2f} candidates examined per token")


def test_schema_api_refusals_and_cache(vlm: Any) -> None:
    rgb = render_scene(generate_scene(seed=91, index=0))
    with pytest.raises(ValueError, match="give choices or schema, not both"):
        vlm.describe(rgb, "x", schema=SHORT, choices=["a"])
    with pytest.raises(ValueError, match="fewer than the 14 tokens"):
        vlm.describe(rgb, "x", max_new_tokens=8, schema=SHORT)
    with pytest.raises(ValueError, match="keyword 'pattern'"):
        vlm.describe(rgb, "x", schema={"type": "string", "pattern": "x"})
    # compiled once per schema text
    assert vlm.text.constraint(schema=SHORT) is vlm.text.constraint(schema=json.dumps(SHORT))
    # A budget just above the shortest answer still ends in valid JSON.
    r = vlm.describe(rgb, "Caption the image.", max_new_tokens=15, schema=SHORT)
    jsonschema.validate(json.loads(r.text), SHORT)
    # choices still work beside schemas in the same cache.
    assert vlm.describe(rgb, "Is there a circle?", max_new_tokens=4, choices=["yes", "no"]).text in ("yes", "no")
