"""Prefix-cache files: the sequence state of a fixed prompt prefix (the system prompt), saved so that a
restart skips its prefill. The file is checked (size, hash, version, key) before use and is never
unpickled; a stale or corrupt file is reported and rebuilt by the caller.

Layout (little-endian), format 2:
    b"EVKVC\\x00\\x01\\x00" | header length u32 | header JSON | K f32 | V f32 | recurrent f32 | sha256 of all before
Header: {"version", "key", "n_layer", "n_past", "kv_dim", "recurrent", "token_ids"}; K and V are
(n_layer, n_past, kv_dim) each (n_layer: the layers with a KV cache); `recurrent` is the number of
floats of state the recurrent layers carry (Qwen3.5's Gated DeltaNet conv + delta-rule states, in
layer order, laid out by their block; 0 for a decoder without recurrent layers). Every size comes
from the header and is checked against the file's size (and against the model's state, when the
caller gives it) before any of the body is read.

Format 1 (K and V only, no "recurrent") is an older engine's: such a file is stale, not corrupt.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import _engine

MAGIC = b"EVKVC\x00\x01\x00"
FORMAT_VERSION = 2
OLD_FORMAT_VERSIONS = (1,)  # written by older engines: stale, rebuilt
# Bumped whenever the KV or recurrent layout, or the numerics that fill them, change: old files
# become stale.
ENGINE_KV_VERSION = "edgevlm-kv-1"
MAX_HEADER = 1 << 20
# Each of n_layer, n_past, kv_dim: far above any model's, and small enough that the arrays' shape
# is always representable (a zero-length prefix makes a file of any n_layer and kv_dim valid).
MAX_DIM = 1 << 24
# Floats of recurrent state: Qwen3.5-0.8B carries 5.0 M (18 layers x (16 heads x 128 x 128 + 3 x
# 6144 conv)), its 27B sibling 48 x (48 x 128 x 128 + 3 x 10240) = 39 M; 2^30 (4 GiB) is far above.
MAX_RECURRENT = 1 << 30
_HASH = 32
_FIELDS = ("version", "key", "n_layer", "n_past", "kv_dim", "recurrent", "token_ids")


class PrefixCacheError(ValueError):
    """A cache file that cannot be used (missing, stale, corrupt); the message says why."""


@dataclass(frozen=True)
class StateShape:
    """The sequence state a model restores (Decoder.state_shape): what a file must hold to fit it."""

    n_layer: int  # layers with a KV cache
    kv_dim: int
    n_ctx: int
    recurrent: int  # floats of recurrent state, all recurrent layers together

    @classmethod
    def of(cls, decoder: Any) -> StateShape:
        s = decoder.state_shape
        return cls(int(s["n_layer"]), int(s["kv_dim"]), int(s["n_ctx"]), int(s["recurrent"]))

    def refuses(self, n_layer: int, n_past: int, kv_dim: int, recurrent: int) -> str | None:
        """Why a state of these sizes does not fit, or None when it does."""
        if n_layer != self.n_layer or (n_layer and kv_dim != self.kv_dim):
            return f"{n_layer} cached layers of width {kv_dim}, the model has {self.n_layer} of {self.kv_dim}"
        if recurrent != self.recurrent:
            return f"{recurrent} floats of recurrent state, the model carries {self.recurrent}"
        if n_past > self.n_ctx:
            return f"{n_past} positions, the model's context is {self.n_ctx}"
        return None


def _file_identity(path: Path) -> bytes:
    """sha256 of the whole model file (size first): a model that differs anywhere, even in one
    weight in the middle, never reuses another's cache. ~0.13 s per 100 MB at node start."""
    h = hashlib.sha256(str(path.stat().st_size).encode())
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.digest()


def cache_key(model_path: Path, token_ids: Sequence[int], kv_type: str = "f32") -> str:
    """The file's key: model, engine and tokens, and the KV cache's type when it is not f32 (a q8_0
    cache's keys and values are not an f32 cache's)."""
    h = hashlib.sha256(_file_identity(model_path))
    h.update(ENGINE_KV_VERSION.encode())
    if kv_type != "f32":
        h.update(f"kv_type={kv_type}".encode())
    h.update(np.asarray(token_ids, dtype="<i4").tobytes())
    return h.hexdigest()


def cache_path(cache_dir: str | os.PathLike[str], key: str) -> Path:
    return Path(cache_dir) / f"prefix-{key[:32]}.evkv"


def save(path: Path, key: str, token_ids: Sequence[int], snapshot: Any) -> None:
    """Writes atomically (temporary file, then rename) so a crash never leaves half a file."""
    k, v, rec = snapshot.arrays()
    header = json.dumps({
        "version": FORMAT_VERSION, "key": key, "n_layer": int(k.shape[0]), "n_past": int(k.shape[1]),
        "kv_dim": int(k.shape[2]), "recurrent": int(rec.shape[0]), "token_ids": [int(t) for t in token_ids],
    }).encode()
    h = hashlib.sha256()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        for chunk in (MAGIC, struct.pack("<I", len(header)), header, *(a.astype("<f4", copy=False).tobytes()
                                                                         for a in (k, v, rec))):
            h.update(chunk)
            f.write(chunk)
        f.write(h.digest())
    os.replace(tmp, path)


def _is_int(v: object) -> bool:
    return type(v) is int  # JSON integers only: not bool, not float (1e999 is inf, 2.5 is not a count)


def _parse_header(name: str, raw: bytes) -> dict[str, Any]:
    """The header as save() writes it, every field of its type, or PrefixCacheError. The version
    comes first: a file of another format is reported as such, whatever else its header holds."""
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # RecursionError: arrays or objects nested too deep
        raise PrefixCacheError(f"{name}: unreadable header ({exc})") from None
    if not isinstance(header, dict):
        raise PrefixCacheError(f"{name}: unreadable header (not a JSON object)")
    version = header.get("version")
    if _is_int(version) and version in OLD_FORMAT_VERSIONS:
        raise PrefixCacheError(f"{name}: stale (format version {version} of an older engine, "
                               f"expected {FORMAT_VERSION})")
    if "version" in header and (not _is_int(version) or version != FORMAT_VERSION):
        shown = version if _is_int(version) else type(version).__name__
        raise PrefixCacheError(f"{name}: format version {shown}, expected {FORMAT_VERSION}")
    missing = [k for k in _FIELDS if k not in header]
    if missing:
        raise PrefixCacheError(f"{name}: unreadable header (no {', '.join(missing)})")
    if not all(_is_int(header[k]) for k in ("n_layer", "n_past", "kv_dim", "recurrent")):
        raise PrefixCacheError(f"{name}: unreadable header (n_layer, n_past, kv_dim and recurrent must be integers)")
    ids = header["token_ids"]
    if not isinstance(ids, list) or not all(_is_int(t) and 0 <= t < 1 << 31 for t in ids):
        raise PrefixCacheError(f"{name}: unreadable header (token_ids must be a list of token ids)")
    return header


def load(path: Path, key: str, fits: StateShape | None = None) -> tuple[list[int], Any]:
    """(token_ids, KVSnapshot) from a cache file, or PrefixCacheError saying why not. With `fits`
    (the model's StateShape), a file whose header describes another state is refused before its
    body is read."""
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
        file_key, token_ids = header["key"], header["token_ids"]
        n_layer, n_past, kv_dim, n_rec = (header[k] for k in ("n_layer", "n_past", "kv_dim", "recurrent"))
        if file_key != key:
            raise PrefixCacheError(f"{path.name}: stale (made for another model, prompt or engine version)")
        if (min(n_layer, n_past, kv_dim, n_rec) < 0 or max(n_layer, n_past, kv_dim) > MAX_DIM
                or n_rec > MAX_RECURRENT or len(token_ids) != n_past):
            raise PrefixCacheError(f"{path.name}: inconsistent header")
        n_kv = n_layer * n_past * kv_dim
        if len(head) + hlen + 4 * (2 * n_kv + n_rec) + _HASH != size:
            raise PrefixCacheError(f"{path.name}: size {size} does not match its header")
        why = fits.refuses(n_layer, n_past, kv_dim, n_rec) if fits is not None else None
        if why:
            raise PrefixCacheError(f"{path.name}: does not fit this model ({why})")
        body = f.read(4 * (2 * n_kv + n_rec))
        digest = f.read(_HASH)
    if hashlib.sha256(head + raw_header + body).digest() != digest:
        raise PrefixCacheError(f"{path.name}: checksum mismatch (corrupt)")
    floats = np.frombuffer(body, dtype="<f4")
    kv = floats[: 2 * n_kv].reshape(2, n_layer, n_past, kv_dim)
    return token_ids, _engine.KVSnapshot.from_arrays(kv[0], kv[1], floats[2 * n_kv:])
