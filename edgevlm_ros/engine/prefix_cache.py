"""Prefix-cache files: the KV state of a fixed prompt prefix (the system prompt), saved so that a
restart skips its prefill. The file is checked (size, hash, version, key) before use and is never
unpickled; a stale or corrupt file is reported and rebuilt by the caller.

Layout (little-endian):
    b"EVKVC\\x00\\x01\\x00" | header length u32 | header JSON | K float32 | V float32 | sha256 of all before
Header: {"version", "key", "n_layer", "n_past", "kv_dim", "token_ids"}; K and V are
(n_layer, n_past, kv_dim) each.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .. import _engine

MAGIC = b"EVKVC\x00\x01\x00"
FORMAT_VERSION = 1
# Bumped whenever the KV layout or the numerics that fill it change: old files become stale.
ENGINE_KV_VERSION = "edgevlm-kv-1"
MAX_HEADER = 1 << 20
# Each of n_layer, n_past, kv_dim: far above any model's, and small enough that the arrays' shape
# is always representable (a zero-length prefix makes a file of any n_layer and kv_dim valid).
MAX_DIM = 1 << 24
_HASH = 32


class PrefixCacheError(ValueError):
    """A cache file that cannot be used (missing, stale, corrupt); the message says why."""


def _file_identity(path: Path) -> bytes:
    """sha256 of the whole model file (size first): a model that differs anywhere, even in one
    weight in the middle, never reuses another's cache. ~0.13 s per 100 MB at node start."""
    h = hashlib.sha256(str(path.stat().st_size).encode())
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.digest()


def cache_key(model_path: Path, token_ids: Sequence[int]) -> str:
    h = hashlib.sha256(_file_identity(model_path))
    h.update(ENGINE_KV_VERSION.encode())
    h.update(np.asarray(token_ids, dtype="<i4").tobytes())
    return h.hexdigest()


def cache_path(cache_dir: str | os.PathLike[str], key: str) -> Path:
    return Path(cache_dir) / f"prefix-{key[:32]}.evkv"


def save(path: Path, key: str, token_ids: Sequence[int], snapshot: Any) -> None:
    """Writes atomically (temporary file, then rename) so a crash never leaves half a file."""
    k, v = snapshot.arrays()
    header = json.dumps({
        "version": FORMAT_VERSION, "key": key, "n_layer": int(k.shape[0]), "n_past": int(k.shape[1]),
        "kv_dim": int(k.shape[2]), "token_ids": [int(t) for t in token_ids],
    }).encode()
    h = hashlib.sha256()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        for chunk in (MAGIC, struct.pack("<I", len(header)), header,
                      k.astype("<f4", copy=False).tobytes(), v.astype("<f4", copy=False).tobytes()):
            h.update(chunk)
            f.write(chunk)
        f.write(h.digest())
    os.replace(tmp, path)


def _is_int(v: object) -> bool:
    return type(v) is int  # JSON integers only: not bool, not float (1e999 is inf, 2.5 is not a count)


def _parse_header(name: str, raw: bytes) -> dict[str, Any]:
    """The header as save() writes it, every field of its type, or PrefixCacheError."""
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # RecursionError: arrays or objects nested too deep
        raise PrefixCacheError(f"{name}: unreadable header ({exc})") from None
    if not isinstance(header, dict):
        raise PrefixCacheError(f"{name}: unreadable header (not a JSON object)")
    missing = [k for k in ("version", "key", "n_layer", "n_past", "kv_dim", "token_ids") if k not in header]
    if missing:
        raise PrefixCacheError(f"{name}: unreadable header (no {', '.join(missing)})")
    if not all(_is_int(header[k]) for k in ("n_layer", "n_past", "kv_dim")):
        raise PrefixCacheError(f"{name}: unreadable header (n_layer, n_past and kv_dim must be integers)")
    ids = header["token_ids"]
    if not isinstance(ids, list) or not all(_is_int(t) and 0 <= t < 1 << 31 for t in ids):
        raise PrefixCacheError(f"{name}: unreadable header (token_ids must be a list of token ids)")
    return header


def load(path: Path, key: str) -> tuple[list[int], Any]:
    """(token_ids, KVSnapshot) from a cache file, or PrefixCacheError saying why not."""
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise PrefixCacheError(f"no cache file ({exc.strerror})") from None
    if size < len(MAGIC) + 4 + _HASH:
        raise PrefixCacheError(f"{path.name}: truncated ({size} bytes)")
    with open(path, "rb") as f:
        head = f.read(len(MAGIC) + 4)
        if head[: len(MAGIC)] != MAGIC:
            raise PrefixCacheError(f"{path.name}: not a prefix-cache file (bad magic)")
        (hlen,) = struct.unpack("<I", head[len(MAGIC):])
        if hlen > MAX_HEADER or len(head) + hlen + _HASH > size:
            raise PrefixCacheError(f"{path.name}: header length {hlen} does not fit the file")
        raw_header = f.read(hlen)
        header = _parse_header(path.name, raw_header)
        version, file_key, token_ids = header["version"], header["key"], header["token_ids"]
        n_layer, n_past, kv_dim = header["n_layer"], header["n_past"], header["kv_dim"]
        if not _is_int(version) or version != FORMAT_VERSION:
            shown = version if _is_int(version) else type(version).__name__
            raise PrefixCacheError(f"{path.name}: format version {shown}, expected {FORMAT_VERSION}")
        if file_key != key:
            raise PrefixCacheError(f"{path.name}: stale (made for another model, prompt or engine version)")
        if min(n_layer, n_past, kv_dim) < 0 or max(n_layer, n_past, kv_dim) > MAX_DIM or len(token_ids) != n_past:
            raise PrefixCacheError(f"{path.name}: inconsistent header")
        n_floats = n_layer * n_past * kv_dim
        if len(head) + hlen + 8 * n_floats + _HASH != size:
            raise PrefixCacheError(f"{path.name}: size {size} does not match its header")
        body = f.read(8 * n_floats)
        digest = f.read(_HASH)
    if hashlib.sha256(head + raw_header + body).digest() != digest:
        raise PrefixCacheError(f"{path.name}: checksum mismatch (corrupt)")
    kv = np.frombuffer(body, dtype="<f4").reshape(2, n_layer, n_past, kv_dim)
    return token_ids, _engine.KVSnapshot.from_arrays(kv[0], kv[1])
