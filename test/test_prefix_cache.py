"""Prefix-cache files (edgevlm_ros/engine/prefix_cache.py) as untrusted input (issue 7, item 5): a file is
checked (magic, size, header, version, key, hash) before any of it is used, a bad one is refused
with the reason and rebuilt by the caller, and nothing in a file is ever unpickled or executed.
Format 2 (issue 15) adds the recurrent state of hybrid decoders (Qwen3.5's Gated DeltaNet layers):
sized from the header, checked against the file and the model before any of the body is read; a
format-1 file (an older engine's) is stale, not corrupt.

The layout is written again here, independently of save(), so that the tests can make files that
are wrong in exactly one way (the right hash over a wrong version, say).
"""

from __future__ import annotations

import ast
import hashlib
import json
import marshal
import pickle
import struct
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edgevlm_ros import _engine
from edgevlm_ros.engine import prefix_cache
from edgevlm_ros.engine.prefix_cache import PrefixCacheError

KEY = "0" * 64
HEADER_KEYS = ("version", "key", "n_layer", "n_past", "kv_dim", "recurrent", "token_ids")
VERSION = prefix_cache.FORMAT_VERSION
N_REC = 5  # floats of recurrent state in the reference files


def snapshot(n_layer: int = 2, n_past: int = 3, kv_dim: int = 4, seed: int = 0, n_rec: int = 0) -> Any:
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((n_layer, n_past, kv_dim)).astype(np.float32)
    v = rng.standard_normal((n_layer, n_past, kv_dim)).astype(np.float32)
    return _engine.KVSnapshot.from_arrays(k, v, rng.standard_normal(n_rec).astype(np.float32))


def build(header: dict[str, Any] | bytes, body: bytes, *, magic: bytes = prefix_cache.MAGIC,
          digest: bytes | None = None) -> bytes:
    """A cache file: magic, header length, header, body, sha256 of all before (or `digest`)."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    head = magic + struct.pack("<I", len(raw)) + raw + body
    return head + (hashlib.sha256(head).digest() if digest is None else digest)


def good_parts(n_layer: int = 2, n_past: int = 3, kv_dim: int = 4, n_rec: int = N_REC) -> tuple[dict[str, Any], bytes]:
    header = {"version": VERSION, "key": KEY, "n_layer": n_layer, "n_past": n_past,
              "kv_dim": kv_dim, "recurrent": n_rec, "token_ids": list(range(10, 10 + n_past))}
    body = np.arange(2 * n_layer * n_past * kv_dim + n_rec, dtype="<f4").tobytes()
    return header, body


def refused(path: Path, data: bytes, key: str = KEY, fits: prefix_cache.StateShape | None = None) -> str:
    path.write_bytes(data)
    with pytest.raises(PrefixCacheError) as info:
        prefix_cache.load(path, key, fits)
    return str(info.value)


# -- files written by save() -----------------------------------------------------------------------
@pytest.mark.parametrize("n_rec", [0, N_REC], ids=["kv_only", "hybrid"])
def test_round_trip(tmp_path: Path, n_rec: int) -> None:
    snap = snapshot(n_rec=n_rec)
    path = tmp_path / "deep" / "er" / "prefix.evkv"
    prefix_cache.save(path, KEY, [5, 6, 7], snap)
    ids, loaded = prefix_cache.load(path, KEY)
    assert ids == [5, 6, 7] and loaded.n_recurrent == n_rec
    for a, b in zip(snap.arrays(), loaded.arrays(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert [p.name for p in path.parent.iterdir()] == ["prefix.evkv"]  # no temporary file left
    # The reference layout above is the one save() writes.
    header = {"version": 2, "key": KEY, "n_layer": 2, "n_past": 3, "kv_dim": 4, "recurrent": n_rec,
              "token_ids": [5, 6, 7]}
    k, v, rec = snap.arrays()
    assert rec.shape == (n_rec,)
    assert path.read_bytes() == build(header, b"".join(a.astype("<f4").tobytes() for a in (k, v, rec)))


def test_an_empty_prefix_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "empty.evkv"
    prefix_cache.save(path, KEY, [], snapshot(n_past=0))
    ids, loaded = prefix_cache.load(path, KEY)
    assert ids == [] and loaded.n_past == 0
    # A hybrid decoder's empty prefix still carries its (zero) recurrent state.
    prefix_cache.save(path, KEY, [], snapshot(n_past=0, n_rec=7))
    ids, loaded = prefix_cache.load(path, KEY)
    assert ids == [] and loaded.n_past == 0 and loaded.n_recurrent == 7


def test_a_state_of_only_recurrent_layers_round_trips(tmp_path: Path) -> None:
    """No KV cache at all (every layer recurrent): the body is the recurrent state alone."""
    path = tmp_path / "rec.evkv"
    prefix_cache.save(path, KEY, [1, 2], snapshot(n_layer=0, n_past=2, kv_dim=0, n_rec=9))
    ids, loaded = prefix_cache.load(path, KEY)
    assert ids == [1, 2] and loaded.n_layer == 0 and loaded.n_recurrent == 9


# -- size ------------------------------------------------------------------------------------------
def test_wrong_size(tmp_path: Path) -> None:
    header, body = good_parts()
    data = build(header, body)
    assert "does not match its header" in refused(tmp_path / "long.evkv", data + b"\0")
    # A body one float short, under a hash that is right for it: the size is what is wrong.
    assert "does not match its header" in refused(tmp_path / "short.evkv", build(header, body[:-4]))
    # A header that claims more floats than the file holds, in K and V or in the recurrent state.
    assert "does not match its header" in refused(tmp_path / "claims.evkv", build({**header, "kv_dim": 5}, body))
    for n_rec in (N_REC - 1, N_REC + 1, 0):
        data = build({**header, "recurrent": n_rec}, body)
        assert "does not match its header" in refused(tmp_path / "rec.evkv", data)


def test_truncated_at_every_length(tmp_path: Path) -> None:
    header, body = good_parts()
    data = build(header, body)
    path = tmp_path / "cut.evkv"
    messages = {n: refused(path, data[:n]) for n in range(len(data))}
    assert messages[0] == "cut.evkv: truncated (0 bytes)"
    assert "truncated" in messages[len(prefix_cache.MAGIC) + 4 + 31]
    assert "does not fit the file" in messages[len(prefix_cache.MAGIC) + 4 + 32]  # the header cut off
    assert "does not match its header" in messages[len(data) - 1]


def test_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(PrefixCacheError, match="no cache file"):
        prefix_cache.load(tmp_path / "absent.evkv", KEY)


# -- hash --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["body", "recurrent", "digest", "header_token", "header_shape"])
def test_bad_hash(tmp_path: Path, where: str) -> None:
    header, body = good_parts()
    data = bytearray(build(header, body))
    start_body = len(data) - 32 - len(body)
    if where == "body":
        data[start_body + 5] ^= 0x01  # one bit of one float
    elif where == "recurrent":
        data[len(data) - 32 - 4] ^= 0x01  # one bit of the last float of the recurrent state
    elif where == "digest":
        data[-1] ^= 0x80
    elif where == "header_token":
        # Token id 10 -> 19: still valid JSON of the same length, so only the hash can tell.
        i = bytes(data).index(b"[10, ")
        data[i + 2] = ord("9")
    else:
        # n_layer and n_past swapped (2 x 3 -> 3 x 2, the same number of floats) with token ids to
        # match: a consistent header of the same length, which only the hash tells from the original.
        swapped = {**header, "n_layer": 3, "n_past": 2, "token_ids": [10, 11]}
        raw = json.dumps(swapped).encode().ljust(len(json.dumps(header)), b" ")
        data = bytearray(build(raw, body, digest=bytes(data[-32:])))
    message = refused(tmp_path / "hash.evkv", bytes(data))
    assert "checksum mismatch (corrupt)" in message


# -- version, magic, header ----------------------------------------------------------------------------
@pytest.mark.parametrize("version", [0, 3, 2**40, "2", 2.0, True, None, [2]])
def test_wrong_version(tmp_path: Path, version: Any) -> None:
    header, body = good_parts()
    message = refused(tmp_path / "v.evkv", build({**header, "version": version}, body))
    assert "format version" in message and "expected 2" in message, message
    assert "stale" not in message  # a version no engine wrote: not mistaken for an older engine's file


def format1_file(n_layer: int = 2, n_past: int = 3, kv_dim: int = 4) -> bytes:
    """A file as format 1 (engines before issue 15) wrote it: no "recurrent", K and V only."""
    header = {"version": 1, "key": KEY, "n_layer": n_layer, "n_past": n_past, "kv_dim": kv_dim,
              "token_ids": list(range(10, 10 + n_past))}
    return build(header, np.arange(2 * n_layer * n_past * kv_dim, dtype="<f4").tobytes())


def test_a_format_1_file_is_stale_not_corrupt(tmp_path: Path) -> None:
    message = refused(tmp_path / "old.evkv", format1_file())
    assert message == f"old.evkv: stale (format version 1 of an older engine, expected {VERSION})", message


def test_bad_magic(tmp_path: Path) -> None:
    header, body = good_parts()
    for magic in (b"EVKVC\x00\x02\x00", b"GGUF\x03\x00\x00\x00", b"\x00" * 8):
        assert "bad magic" in refused(tmp_path / "m.evkv", build(header, body, magic=magic))


@pytest.mark.parametrize(("change", "fragment"), [
    ({"n_layer": -1}, "inconsistent header"),
    ({"n_past": 4}, "inconsistent header"),  # 3 token ids for 4 positions
    ({"token_ids": [1, 2, -3]}, "unreadable header"),
    ({"token_ids": "abc"}, "unreadable header"),
    ({"kv_dim": 4.0}, "unreadable header"),
    ({"n_layer": "2"}, "unreadable header"),
    ({"recurrent": -1}, "inconsistent header"),
    ({"recurrent": prefix_cache.MAX_RECURRENT + 1}, "inconsistent header"),
    ({"recurrent": 5.0}, "unreadable header"),
    ({"recurrent": True}, "unreadable header"),
    ({"recurrent": [5]}, "unreadable header"),
    ({"recurrent": 1e999}, "unreadable header"),
    ({"key": None}, "stale"),
])
def test_inconsistent_or_mistyped_header(tmp_path: Path, change: dict[str, Any], fragment: str) -> None:
    header, body = good_parts()
    assert fragment in refused(tmp_path / "h.evkv", build({**header, **change}, body))


@pytest.mark.parametrize("missing", HEADER_KEYS)
def test_header_without_a_field(tmp_path: Path, missing: str) -> None:
    header, body = good_parts()
    del header[missing]
    assert "unreadable header" in refused(tmp_path / "h.evkv", build(header, body))


@pytest.mark.parametrize("raw", [b"", b"{", b"[1, 2]", b"\xff\xfe", b"[" * 100000 + b"]" * 100000, b"null"])
def test_header_that_is_not_a_json_object(tmp_path: Path, raw: bytes) -> None:
    _, body = good_parts()
    message = refused(tmp_path / "j.evkv", build(raw, body))
    assert "unreadable header" in message or "does not fit" in message, message


def test_header_length_beyond_the_limit(tmp_path: Path) -> None:
    data = prefix_cache.MAGIC + struct.pack("<I", 0xFFFFFFFF) + bytes(64)
    assert "header length 4294967295 does not fit the file" in refused(tmp_path / "l.evkv", data)


def _peak_of_refused_load(path: Path, match: str, fits: prefix_cache.StateShape | None = None) -> int:
    tracemalloc.start()
    try:
        with pytest.raises(PrefixCacheError, match=match):
            prefix_cache.load(path, KEY, fits)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak


@pytest.mark.parametrize("change", [{"n_layer": 2**40, "n_past": 3, "kv_dim": 2**40},
                                    {"recurrent": 2**40}, {"recurrent": prefix_cache.MAX_RECURRENT}],
                         ids=["kv", "recurrent", "recurrent_at_the_limit"])
def test_absurd_dimensions_are_refused_before_reading_the_body(tmp_path: Path, change: dict[str, int]) -> None:
    """A header claiming 2^40 x 2^40 x 2^40 floats, or 2^40 (or 2^30: 4 GiB) floats of recurrent
    state, over a small file: refused from the numbers, with no allocation of its size."""
    header, body = good_parts()
    path = tmp_path / "huge.evkv"
    path.write_bytes(build({**header, **change}, body))
    assert _peak_of_refused_load(path, "inconsistent header|does not match its header") < 1 << 20


# -- the model's state: checked from the header, before the body is read ---------------------------------
FITS = prefix_cache.StateShape(n_layer=2, kv_dim=4, n_ctx=8, recurrent=N_REC)


def test_a_file_that_fits_the_model_loads(tmp_path: Path) -> None:
    path = tmp_path / "fits.evkv"
    prefix_cache.save(path, KEY, [5, 6, 7], snapshot(n_rec=N_REC))
    ids, loaded = prefix_cache.load(path, KEY, FITS)
    assert ids == [5, 6, 7] and loaded.n_recurrent == N_REC
    # A KV-only model's n_layer 0 state: kv_dim is then no constraint.
    prefix_cache.save(path, KEY, [5], snapshot(n_layer=0, n_past=1, kv_dim=0, n_rec=N_REC))
    prefix_cache.load(path, KEY, prefix_cache.StateShape(n_layer=0, kv_dim=0, n_ctx=8, recurrent=N_REC))


BIG_REC = 1 << 20  # 4 MiB of recurrent state: loading it would show in tracemalloc's peak


@pytest.mark.parametrize(("model", "fragment"), [
    ({"recurrent": BIG_REC + 1}, f"{BIG_REC} floats of recurrent state, the model carries {BIG_REC + 1}"),
    ({"recurrent": 0}, f"{BIG_REC} floats of recurrent state, the model carries 0"),
    ({"n_layer": 3}, "2 cached layers of width 4, the model has 3 of 4"),
    ({"kv_dim": 8}, "2 cached layers of width 4, the model has 2 of 8"),
    ({"n_ctx": 2}, "3 positions, the model's context is 2"),
])
def test_a_file_that_does_not_fit_the_model_is_refused_from_its_header(tmp_path: Path, model: dict[str, int],
                                                                       fragment: str) -> None:
    """Checked before the body is read: a 4 MiB recurrent state that does not fit is never loaded."""
    header, body = good_parts(n_rec=BIG_REC)
    path = tmp_path / "other.evkv"
    data = build(header, body)
    fits = prefix_cache.StateShape(**{"n_layer": 2, "kv_dim": 4, "n_ctx": 8, "recurrent": BIG_REC, **model})
    assert fragment in refused(path, data, fits=fits)
    assert _peak_of_refused_load(path, "does not fit this model", fits) < 1 << 20  # the body was not read
    # The same file loads into the model it fits (and then the body is read).
    prefix_cache.load(path, KEY, prefix_cache.StateShape(n_layer=2, kv_dim=4, n_ctx=8, recurrent=BIG_REC))


# -- key ---------------------------------------------------------------------------------------------------
def test_stale_key(tmp_path: Path) -> None:
    path = tmp_path / "p.evkv"
    prefix_cache.save(path, KEY, [1, 2, 3], snapshot())
    with pytest.raises(PrefixCacheError, match="stale"):
        prefix_cache.load(path, "1" * 64)


def test_the_key_binds_model_tokens_and_engine_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "model.gguf"
    content = bytearray(np.random.default_rng(0).bytes(3 << 20))  # 3 MiB: the whole file is hashed
    model.write_bytes(content)
    key = prefix_cache.cache_key(model, [1, 2, 3])
    assert key == prefix_cache.cache_key(model, [1, 2, 3])
    assert key != prefix_cache.cache_key(model, [1, 2, 4])
    assert key != prefix_cache.cache_key(model, [1, 2])
    # A byte of the header, one in the middle (a weight of a same-size fine-tune), one of the last tensors.
    for offset in (100, len(content) // 2, len(content) - 100):
        changed = bytearray(content)
        changed[offset] ^= 1
        model.write_bytes(changed)
        assert prefix_cache.cache_key(model, [1, 2, 3]) != key
    model.write_bytes(content + b"\0")
    assert prefix_cache.cache_key(model, [1, 2, 3]) != key
    model.write_bytes(content)
    monkeypatch.setattr(prefix_cache, "ENGINE_KV_VERSION", "edgevlm-kv-0")
    assert prefix_cache.cache_key(model, [1, 2, 3]) != key
    assert prefix_cache.cache_path(tmp_path, key).name == f"prefix-{key[:32]}.evkv"


# -- never unpickled -----------------------------------------------------------------------------------------
class _Payload:
    """Unpickling this creates the marker file: evidence that something was unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return Path.touch, (self.marker,)


def test_pickles_are_refused_and_never_run(tmp_path: Path) -> None:
    marker = tmp_path / "unpickled"
    payload = pickle.dumps(_Payload(marker))
    for name, data in (("pickle.evkv", payload), ("numpy.evkv", _npy_with_objects(marker))):
        assert "bad magic" in refused(tmp_path / name, data)
    # A pickle as the body of a well-formed file is loaded as what the layout says it is: floats.
    n = -(-len(payload) // 8)
    body = payload.ljust(8 * n, b"\0")
    header = {"version": VERSION, "key": KEY, "n_layer": 1, "n_past": 1, "kv_dim": n, "recurrent": 0, "token_ids": [1]}
    path = tmp_path / "body.evkv"
    path.write_bytes(build(header, body))
    _, snap = prefix_cache.load(path, KEY)
    k, v, rec = snap.arrays()
    assert np.concatenate([k, v]).tobytes() == body and rec.size == 0
    assert not marker.exists()


def _npy_with_objects(marker: Path) -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, np.array([_Payload(marker)], dtype=object), allow_pickle=True)
    return buf.getvalue()


def test_load_works_with_every_deserializer_disabled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("prefix_cache.load deserialized something")

    for module, names in ((pickle, ("load", "loads", "Unpickler")), (marshal, ("load", "loads")),
                          (np, ("load", "fromfile"))):
        for name in names:
            monkeypatch.setattr(module, name, forbidden)
    path = tmp_path / "p.evkv"
    prefix_cache.save(path, KEY, [4, 5, 6], snapshot())
    ids, _ = prefix_cache.load(path, KEY)
    assert ids == [4, 5, 6]


def test_the_module_imports_no_deserializer_and_runs_no_code() -> None:
    tree = ast.parse(Path(prefix_cache.__file__).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                for alias in node.names} | {node.module.split(".")[0] for node in ast.walk(tree)
                                            if isinstance(node, ast.ImportFrom) and node.module}
    assert not imported & {"pickle", "marshal", "shelve", "dill", "joblib", "cloudpickle", "yaml", "torch"}, imported
    calls = {ast.unparse(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    assert "json.loads" in calls  # the header: JSON, which builds only dicts, lists, strings and numbers
    suspicious = {c for c in calls if c.split(".")[-1] in {"eval", "exec", "compile", "__import__", "load", "loads",
                                                           "fromfile", "Unpickler"} and c != "json.loads"}
    assert not suspicious, suspicious


# -- the engine's use of it: a bad file is reported and rebuilt, never used ------------------------------------
@pytest.fixture(scope="module")
def text_engine(text_model_path: Path) -> Any:
    from edgevlm_ros.engine.text_model import TextModel

    return TextModel(text_model_path, threads=2)


def _prefix_ids(engine: Any) -> list[int]:
    return engine.tokenizer.encode(engine.chat_text("", system="You are a robot's eyes."), add_bos=False)[:12]


def test_cached_prefix_builds_loads_and_rebuilds(text_engine: Any, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    engine = text_engine
    ids = _prefix_ids(engine)
    built, status = engine.cached_prefix(ids, tmp_path)
    assert status == "built"
    (path,) = tmp_path.glob("*.evkv")
    loaded, status = engine.cached_prefix(ids, tmp_path)
    assert status == f"loaded from {path}"
    for a, b in zip(built.snapshot.arrays(), loaded.snapshot.arrays(), strict=True):
        np.testing.assert_array_equal(a, b)
    good = path.read_bytes()

    def status_after(data: bytes) -> str:
        path.write_bytes(data)
        state, status = engine.cached_prefix(ids, tmp_path)
        assert state.token_ids == tuple(ids)
        for a, b in zip(built.snapshot.arrays(), state.snapshot.arrays(), strict=True):
            np.testing.assert_array_equal(a, b)  # rebuilt: the same state as computed
        assert path.read_bytes() == good  # and written again
        return status

    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0xFF
    assert status_after(bytes(flipped)).startswith("rebuilt (") and "checksum mismatch" in status_after(bytes(flipped))
    assert "truncated" in status_after(good[:20]) or "does not" in status_after(good[:20])
    assert "does not match its header" in status_after(good[:-1])

    # Stale: the file at this path was written by another engine version (the same name is only
    # the key's first 32 hex digits), or holds other tokens under the right key.
    key = prefix_cache.cache_key(engine.path, ids)
    with monkeypatch.context() as m:
        m.setattr(prefix_cache, "ENGINE_KV_VERSION", "edgevlm-kv-0")
        old_key = prefix_cache.cache_key(engine.path, ids)
    prefix_cache.save(path, old_key, ids, built.snapshot)
    assert "stale" in status_after(path.read_bytes())
    prefix_cache.save(path, key, ids[:-1] + [ids[-1] + 1], built.snapshot)
    assert "holds other tokens" in status_after(path.read_bytes())

    # The right key and hash over a state that does not fit the model (a crafted file): refused
    # from its header, rebuilt.
    k, _, _ = built.snapshot.arrays()
    wrong = _engine.KVSnapshot.from_arrays(np.zeros((k.shape[0] + 1, *k.shape[1:]), np.float32),
                                           np.zeros((k.shape[0] + 1, *k.shape[1:]), np.float32))
    prefix_cache.save(path, key, ids, wrong)
    status = status_after(path.read_bytes())
    assert status.startswith("rebuilt (") and "does not fit this model" in status, status
    # Recurrent state a KV-only model does not carry.
    extra = _engine.KVSnapshot.from_arrays(*built.snapshot.arrays()[:2], np.zeros(3, np.float32))
    prefix_cache.save(path, key, ids, extra)
    assert "3 floats of recurrent state, the model carries 0" in status_after(path.read_bytes())
    # A format-1 file of the right key (what an older engine left in the cache dir): stale, rebuilt.
    header = {"version": 1, "key": key, "n_layer": k.shape[0], "n_past": k.shape[1], "kv_dim": k.shape[2],
              "token_ids": ids}
    old = build(header, b"".join(a.astype("<f4").tobytes() for a in built.snapshot.arrays()[:2]))
    assert "stale (format version 1 of an older engine" in status_after(old)


def test_the_state_shape_is_what_restore_accepts(text_engine: Any) -> None:
    native = text_engine.native
    shape = prefix_cache.StateShape.of(native)
    snap = text_engine.prefix(_prefix_ids(text_engine)).snapshot
    assert (shape.n_layer, shape.kv_dim, shape.recurrent) == (snap.n_layer, snap.kv_dim, snap.n_recurrent)
    assert shape.n_ctx == native.n_ctx and shape.recurrent == 0  # a llama decoder: no recurrent layers
    k, v, _ = snap.arrays()
    with pytest.raises(ValueError, match="does not fit"):
        native.restore(_engine.KVSnapshot.from_arrays(k, v, np.zeros(1, np.float32)))


def test_an_unwritable_cache_dir_is_reported_and_the_prefix_still_built(text_engine: Any, tmp_path: Path) -> None:
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the cache directory should be")
    state, status = text_engine.cached_prefix(_prefix_ids(text_engine), blocker / "cache")
    assert status.startswith("built (not saved: ") and len(state.token_ids) == 12


# -- a hybrid decoder's state through a file (Qwen3.5: Gated DeltaNet layers + full attention) ----------------
def test_a_hybrid_decoders_state_round_trips_through_a_file(tmp_path: Path) -> None:
    """The tiny qwen35 of the fuzz seeds (3 Gated DeltaNet layers, 1 full-attention layer): its
    state after a prefix, saved and loaded, continues the sequence exactly as the snapshot it was
    made from, and as the unsplit prompt does; without its recurrent part it would not."""
    import qwen35_tiny

    seed = Path(__file__).resolve().parent / "fuzz_seeds" / "gguf" / "qwen35_tiny.gguf"
    d = _engine.Decoder(_engine.GGUFFile(str(seed)), threads=1, n_ctx=32)
    shape = prefix_cache.StateShape.of(d)
    c = qwen35_tiny.TINY
    assert shape == prefix_cache.StateShape(n_layer=1, kv_dim=c["n_head_kv"] * c["head_dim"], n_ctx=32,
                                            recurrent=3 * qwen35_tiny.state_floats(c))
    ids = np.array([3, 17, 5, 30, 2, 11, 39, 0, 8, 21, 13], np.int32)
    d.reset()
    whole = d.forward(ids, all_logits=True)[7:]
    d.reset()
    d.forward(ids[:7])
    snap = d.snapshot()
    assert snap.n_recurrent == shape.recurrent and np.any(snap.arrays()[2] != 0)
    path = tmp_path / "hybrid.evkv"
    prefix_cache.save(path, KEY, ids[:7].tolist(), snap)
    token_ids, loaded = prefix_cache.load(path, KEY, shape)
    assert token_ids == ids[:7].tolist()

    def continued(s: Any) -> np.ndarray:
        d.restore(s)
        return d.forward(ids[7:], all_logits=True)

    from_memory, from_file = continued(snap), continued(loaded)
    np.testing.assert_array_equal(from_file, from_memory)
    np.testing.assert_allclose(from_file, whole, rtol=1e-4, atol=1e-5)
    k, v, rec = loaded.arrays()
    without = continued(_engine.KVSnapshot.from_arrays(k, v, np.zeros_like(rec)))
    assert np.abs(without - from_file).max() > 1e-3  # the recurrent part carries the prefix
