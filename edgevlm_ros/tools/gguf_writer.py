"""A small GGUF v3 writer (little-endian), written for our converter.

File layout (all integers little-endian)::

    "GGUF" | version u32 = 3 | tensor_count u64 | kv_count u64
    kv_count x     key (u64 length + UTF-8 bytes) | value type u32 | value
    tensor_count x name (u64 length + bytes) | n_dims u32 | n_dims x u64 (ne0 = contiguous dim first)
                   | ggml type u32 | offset u64 (relative to the data section, a multiple of the alignment)
    zero padding to the alignment | tensor data, each tensor padded to the alignment

Metadata values may be any GGUF value type (uint8 ... float64, bool, string, and arrays of any of
them, arrays of arrays included). Tensors are given in numpy dimension order and written in ggml
order (reversed). Tensor formats: F32, F16, BF16 and the block formats of `GGMLType` (Q8_0, Q4_0,
Q4_1, Q5_0, Q5_1, IQ4_NL in blocks of 32; the K-quants in super-blocks of 256). The block formats are
produced by the engine's reference quantizer (`_engine.quantize`), so the bytes are exactly what the
engine and ggml expect; F32, F16 and BF16 need only numpy (both 16-bit formats round to nearest-even,
as ggml does).

Type fallback: a block format needs rows whose length (the last numpy dimension, ggml's ne0) is a
whole number of blocks. A tensor whose row length is not is written as **F16** instead (and a tensor
asked for as F32, F16 or BF16 is always written as asked); the K-quant mixes choose their own
32-element fallbacks first (tools/quant_mix.py). `GGUFWriter.add_tensor` returns the type actually
used; `resolve_tensor_type` tells it in advance.

Metadata copied from another GGUF can be added as the encoded bytes of its value
(`add_encoded_value`), so every key keeps its exact value type.

Memory: tensor data may be given as a zero-argument callable returning the array; it is called only
while that tensor is written, and the encoded bytes are produced and written in chunks of whole rows,
so the writer never holds a second full copy of the model. The file is written to a temporary name in
the same folder and renamed into place when complete, so a reader never sees a half-written file.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

__all__ = [
    "GGMLType",
    "GGUFValueType",
    "GGUFWriter",
    "block_size",
    "ggml_type_named",
    "resolve_tensor_type",
    "tensor_nbytes",
]

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
DEFAULT_ALIGNMENT = 32
MAX_NAME_BYTES = 63  # ggml's GGML_MAX_NAME (64) includes the terminating NUL
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS

# Rows are encoded in chunks of about this many values (whole rows; a block never spans rows).
_CHUNK_VALUES = 1 << 20


class GGUFValueType(IntEnum):
    """Metadata value type ids of the GGUF specification."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


class GGMLType(IntEnum):
    """The ggml tensor types this writer produces."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    IQ4_NL = 20
    BF16 = 30


# type -> (values per block, bytes per block): ggml-common.h's block structs
_BLOCKS: dict[GGMLType, tuple[int, int]] = {
    GGMLType.F32: (1, 4),
    GGMLType.F16: (1, 2),
    GGMLType.BF16: (1, 2),
    GGMLType.Q4_0: (32, 18),
    GGMLType.Q4_1: (32, 20),
    GGMLType.Q5_0: (32, 22),
    GGMLType.Q5_1: (32, 24),
    GGMLType.Q8_0: (32, 34),
    GGMLType.IQ4_NL: (32, 18),
    GGMLType.Q2_K: (256, 84),
    GGMLType.Q3_K: (256, 110),
    GGMLType.Q4_K: (256, 144),
    GGMLType.Q5_K: (256, 176),
    GGMLType.Q6_K: (256, 210),
}

_SCALAR_FORMATS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}


def ggml_type_named(name: str | GGMLType) -> GGMLType:
    """'f32', 'F16', 'q8_0', ... -> GGMLType."""
    if isinstance(name, GGMLType):
        return name
    try:
        return GGMLType[name.upper()]
    except KeyError:
        known = ", ".join(t.name.lower() for t in GGMLType)
        raise ValueError(f"unknown tensor type {name!r} (known: {known})") from None


def block_size(wtype: GGMLType) -> int:
    """Values per block of a format (1 for F32, F16, BF16)."""
    return _BLOCKS[wtype][0]


def resolve_tensor_type(requested: str | GGMLType, shape: Sequence[int]) -> GGMLType:
    """The type a tensor of `shape` (numpy order) is written as when `requested` is asked for.

    Block formats need a row length (last numpy dimension) of whole blocks; otherwise F16.
    """
    t = ggml_type_named(requested)
    block = _BLOCKS[t][0]
    row = int(shape[-1]) if len(shape) else 1
    if block > 1 and row % block != 0:
        return GGMLType.F16
    return t


def tensor_nbytes(wtype: GGMLType, shape: Sequence[int]) -> int:
    """Bytes of a tensor of `shape` (numpy order) stored as `wtype`."""
    block, block_bytes = _BLOCKS[wtype]
    n = math.prod(int(d) for d in shape)
    if n % block:
        raise ValueError(f"{n} values are not a whole number of {wtype.name} blocks")
    return n // block * block_bytes


def _pad(n: int, alignment: int) -> int:
    return (alignment - n % alignment) % alignment


# -- metadata encoding -------------------------------------------------------------------------


def _encode_string(s: str | bytes) -> bytes:
    raw = s.encode("utf-8") if isinstance(s, str) else bytes(s)
    return struct.pack("<Q", len(raw)) + raw


def _encode_scalar(vtype: GGUFValueType, value: Any) -> bytes:
    if vtype == GGUFValueType.BOOL:
        if not isinstance(value, (bool, np.bool_)):
            raise ValueError(f"a GGUF bool must be a bool, got {value!r}")
        return b"\x01" if value else b"\x00"
    if vtype == GGUFValueType.STRING:
        if not isinstance(value, (str, bytes)):
            raise ValueError(f"a GGUF string must be str or bytes, got {type(value).__name__}")
        return _encode_string(value)
    fmt = _SCALAR_FORMATS[vtype]
    if vtype in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64):
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise ValueError(f"a GGUF {vtype.name} must be a number, got {value!r}")
        return struct.pack(fmt, float(value))
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"a GGUF {vtype.name} must be an integer, got {value!r}")
    try:
        return struct.pack(fmt, int(value))
    except struct.error:
        raise ValueError(f"{value} does not fit in a GGUF {vtype.name}") from None


def _encode_array(etype: GGUFValueType, items: Sequence[Any]) -> bytes:
    """Element type u32, count u64, elements. For etype ARRAY each item is (element_type, items)."""
    head = struct.pack("<IQ", int(etype), len(items))
    if etype == GGUFValueType.ARRAY:
        parts = []
        for item in items:
            if not (isinstance(item, tuple) and len(item) == 2):
                raise ValueError("items of a nested GGUF array must be (element_type, items) pairs")
            parts.append(_encode_array(GGUFValueType(item[0]), item[1]))
        return head + b"".join(parts)
    if etype == GGUFValueType.STRING:
        return head + b"".join(_encode_scalar(etype, s) for s in items)
    if etype in _SCALAR_FORMATS:
        arr = np.asarray(items)
        if arr.size and etype not in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64):
            if arr.dtype.kind not in "iu":
                raise ValueError(f"elements of a GGUF {etype.name} array must be integers")
            info = np.iinfo(np.dtype(_SCALAR_FORMATS[etype]))
            if arr.min() < info.min or arr.max() > info.max:
                raise ValueError(f"an element does not fit in a GGUF {etype.name}")
        return head + arr.astype(np.dtype(_SCALAR_FORMATS[etype]), copy=False).tobytes()
    return head + b"".join(_encode_scalar(etype, v) for v in items)  # BOOL


# -- tensors -----------------------------------------------------------------------------------

TensorSource = np.ndarray | Callable[[], np.ndarray]
RawSource = bytes | bytearray | memoryview | Callable[[], bytes | bytearray | memoryview]


@dataclass
class _TensorEntry:
    name: str
    shape: tuple[int, ...]  # numpy order
    wtype: GGMLType
    source: TensorSource | RawSource
    nbytes: int
    offset: int = 0
    raw: bool = False  # source gives the encoded bytes, written as they are


def _to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, rounded to nearest-even; NaNs stay (quiet) NaNs."""
    bits = np.ascontiguousarray(x, dtype="<f4").view("<u4")
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")
    return np.where(np.isnan(x), ((bits >> 16) | 0x40).astype("<u2"), rounded)


def _encode_rows(wtype: GGMLType, rows: np.ndarray) -> bytes | memoryview:
    """Encodes a 2-D float32 block of whole rows."""
    if wtype == GGMLType.F32:
        return memoryview(np.ascontiguousarray(rows, dtype="<f4")).cast("B")
    if wtype == GGMLType.F16:
        return memoryview(np.ascontiguousarray(rows.astype("<f2"))).cast("B")
    if wtype == GGMLType.BF16:
        return memoryview(_to_bf16(rows)).cast("B")
    from .. import _engine  # the reference block quantizer; only block formats need the native build

    flat = np.ascontiguousarray(rows, dtype=np.float32).reshape(-1)
    return memoryview(_engine.quantize(wtype.name, flat)).cast("B")


class GGUFWriter:
    """Collects metadata and tensors, then writes one GGUF file with `write(path)`.

    >>> w = GGUFWriter()
    >>> w.add_string("general.architecture", "llama")
    >>> w.add_tensor("token_embd.weight", embeddings, "q8_0")   # numpy [vocab, dim]
    >>> w.write("model.gguf")

    `general.alignment` (uint32) is set from `alignment` on construction.
    """

    def __init__(self, alignment: int = DEFAULT_ALIGNMENT) -> None:
        if alignment <= 0 or alignment % 8:
            raise ValueError(f"alignment must be a positive multiple of 8, got {alignment}")
        self.alignment = alignment
        self._kv: dict[str, bytes] = {}
        self._values: dict[str, Any] = {}
        self._tensors: dict[str, _TensorEntry] = {}
        self.add_uint32("general.alignment", alignment)

    # -- metadata ------------------------------------------------------------------------------

    def _check_new_key(self, key: str) -> None:
        if not key or not isinstance(key, str):
            raise ValueError("a GGUF key must be a non-empty string")
        if key in self._kv:
            raise ValueError(f"GGUF key {key!r} is set twice")

    def add_value(self, key: str, value: Any, vtype: GGUFValueType, element_type: GGUFValueType | None = None) -> None:
        """Adds one key of any type. Arrays need `element_type`; nested array items are (etype, items)."""
        self._check_new_key(key)
        vtype = GGUFValueType(vtype)
        if vtype == GGUFValueType.ARRAY:
            if element_type is None:
                raise ValueError(f"array key {key!r} needs an element type")
            if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray)):
                raise ValueError(f"array key {key!r} needs a sequence, got {type(value).__name__}")
            payload = _encode_array(GGUFValueType(element_type), value)
        else:
            payload = _encode_scalar(vtype, value)
        self._kv[key] = _encode_string(key) + struct.pack("<I", int(vtype)) + payload
        self._values[key] = value

    def add_encoded_value(self, key: str, vtype: GGUFValueType, payload: bytes, value: Any = None) -> None:
        """Adds one key whose value is already encoded as GGUF bytes (`payload`, the bytes after the
        value type, e.g. copied from another file); `value` is what `metadata` shows for it."""
        self._check_new_key(key)
        self._kv[key] = _encode_string(key) + struct.pack("<I", int(GGUFValueType(vtype))) + bytes(payload)
        self._values[key] = value

    def add_uint8(self, key: str, value: int) -> None:
        self.add_value(key, value, GGUFValueType.UINT8)

    def add_int8(self, key: str, value: int) -> None:
        self.add_value(key, value, GGUFValueType.INT8)

    def add_uint16(self, key: str, value: int) -> None:
        self.add_value(key, value, GGUFValueType.UINT16)

    def add_int16(self, key: str, value: int) -> None:
        self.add_value(key, value, GGUFValueType.INT16)

    def add_uint32(self, key: str, value: int) -> None:
        self.add_value(key, value, GGUFValueType.UINT32)

    def add_int32(self, key: str, value: int) -> None:
        self.add_value(key, value, GGUFValueType.INT32)

    def add_uint64(self, key: str, value: int) -> None:
        self.add_value(key, value, GGUFValueType.UINT64)

    def add_int64(self, key: str, value: int) -> None:
        self.add_value(key, value, GGUFValueType.INT64)

    def add_float32(self, key: str, value: float) -> None:
        self.add_value(key, value, GGUFValueType.FLOAT32)

    def add_float64(self, key: str, value: float) -> None:
        self.add_value(key, value, GGUFValueType.FLOAT64)

    def add_bool(self, key: str, value: bool) -> None:
        self.add_value(key, value, GGUFValueType.BOOL)

    def add_string(self, key: str, value: str) -> None:
        self.add_value(key, value, GGUFValueType.STRING)

    def add_array(self, key: str, values: Sequence[Any] | np.ndarray, element_type: GGUFValueType) -> None:
        self.add_value(key, values, GGUFValueType.ARRAY, element_type)

    @property
    def metadata(self) -> dict[str, Any]:
        """The values added so far, as given (for inspection)."""
        return dict(self._values)

    # -- tensors -------------------------------------------------------------------------------

    def add_tensor(self, name: str, data: TensorSource, wtype: str | GGMLType = GGMLType.F32,
                   shape: Sequence[int] | None = None) -> GGMLType:
        """Registers a tensor; returns the type it will be written as (see the module docstring).

        `data` is an array or a zero-argument callable returning one (then `shape`, numpy order, is
        required: the header is written before any data is read). Values are converted to float32
        before encoding.
        """
        raw = name.encode("utf-8")
        if not raw or len(raw) > MAX_NAME_BYTES:
            raise ValueError(f"tensor name {name!r} must be 1..{MAX_NAME_BYTES} bytes")
        if name in self._tensors:
            raise ValueError(f"tensor {name!r} is added twice")
        if shape is None:
            if callable(data):
                raise ValueError(f"tensor {name!r}: a lazily loaded tensor needs its shape")
            shape = np.shape(data)
        shape_t = tuple(int(d) for d in shape)
        if not 1 <= len(shape_t) <= MAX_DIMS or any(d <= 0 for d in shape_t):
            raise ValueError(f"tensor {name!r}: shape {shape_t} must have 1..{MAX_DIMS} positive dimensions")
        if not callable(data) and tuple(np.shape(data)) != shape_t:
            raise ValueError(f"tensor {name!r}: data shape {np.shape(data)} is not {shape_t}")
        t = resolve_tensor_type(wtype, shape_t)
        self._tensors[name] = _TensorEntry(name, shape_t, t, data, tensor_nbytes(t, shape_t))
        return t

    def add_tensor_bytes(self, name: str, data: RawSource, wtype: str | GGMLType, shape: Sequence[int]) -> None:
        """Registers a tensor whose data is already encoded as `wtype` (e.g. copied from another GGUF),
        so its bytes are written unchanged: no decode / re-encode round trip. `shape` is numpy order;
        the byte count is checked when the tensor is written (and now, when `data` is not callable)."""
        raw = name.encode("utf-8")
        if not raw or len(raw) > MAX_NAME_BYTES:
            raise ValueError(f"tensor name {name!r} must be 1..{MAX_NAME_BYTES} bytes")
        if name in self._tensors:
            raise ValueError(f"tensor {name!r} is added twice")
        shape_t = tuple(int(d) for d in shape)
        if not 1 <= len(shape_t) <= MAX_DIMS or any(d <= 0 for d in shape_t):
            raise ValueError(f"tensor {name!r}: shape {shape_t} must have 1..{MAX_DIMS} positive dimensions")
        t = ggml_type_named(wtype)
        if shape_t[-1] % _BLOCKS[t][0]:
            raise ValueError(f"tensor {name!r}: rows of {shape_t[-1]} values are not whole {t.name} blocks")
        nbytes = tensor_nbytes(t, shape_t)
        if not callable(data) and memoryview(data).nbytes != nbytes:
            raise ValueError(f"tensor {name!r}: {memoryview(data).nbytes} bytes given, {t.name} {shape_t} "
                             f"needs {nbytes}")
        self._tensors[name] = _TensorEntry(name, shape_t, t, data, nbytes, raw=True)

    @property
    def tensor_types(self) -> dict[str, GGMLType]:
        """name -> type that will be written."""
        return {n: e.wtype for n, e in self._tensors.items()}

    # -- output --------------------------------------------------------------------------------

    def _header(self) -> bytes:
        parts = [GGUF_MAGIC, struct.pack("<IQQ", GGUF_VERSION, len(self._tensors), len(self._kv))]
        parts.extend(self._kv.values())
        offset = 0
        for e in self._tensors.values():
            e.offset = offset
            dims = e.shape[::-1]  # ggml order: ne0 (contiguous) first
            parts.append(_encode_string(e.name))
            parts.append(struct.pack(f"<I{len(dims)}Q", len(dims), *dims))
            parts.append(struct.pack("<IQ", int(e.wtype), offset))
            offset += e.nbytes + _pad(e.nbytes, self.alignment)
        header = b"".join(parts)
        return header + b"\x00" * _pad(len(header), self.alignment)

    def _write_tensor(self, f: BinaryIO, e: _TensorEntry) -> None:
        data = e.source() if callable(e.source) else e.source
        if e.raw:
            view = memoryview(data).cast("B")  # type: ignore[arg-type]
            if view.nbytes != e.nbytes:
                raise ValueError(f"tensor {e.name!r}: {view.nbytes} bytes given, expected {e.nbytes}")
            f.write(view)
            f.write(b"\x00" * _pad(e.nbytes, self.alignment))
            return
        arr = np.asarray(data)
        if tuple(arr.shape) != e.shape:
            raise ValueError(f"tensor {e.name!r}: loaded shape {arr.shape} is not the declared {e.shape}")
        if arr.dtype.kind not in "fiub":
            raise ValueError(f"tensor {e.name!r}: dtype {arr.dtype} is not numeric")
        row = e.shape[-1]
        rows = arr.reshape(-1, row)
        step = max(1, _CHUNK_VALUES // row)
        written = 0
        for start in range(0, rows.shape[0], step):
            chunk = rows[start : start + step]
            if chunk.dtype != np.float32:
                chunk = chunk.astype(np.float32)
            buf = _encode_rows(e.wtype, chunk)
            f.write(buf)
            written += buf.nbytes
        if written != e.nbytes:  # an engine/writer disagreement on a format's size: never write a bad file
            raise RuntimeError(f"tensor {e.name!r}: wrote {written} bytes, expected {e.nbytes}")
        f.write(b"\x00" * _pad(e.nbytes, self.alignment))

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Writes the file (atomically: temporary name, then rename) and returns its path."""
        out = Path(path)
        tmp = out.with_name(f".{out.name}.{os.getpid()}.part")
        try:
            with open(tmp, "wb") as f:
                f.write(self._header())
                for e in self._tensors.values():
                    self._write_tensor(f, e)
            os.replace(tmp, out)
        finally:
            if tmp.exists():
                tmp.unlink()
        return out
