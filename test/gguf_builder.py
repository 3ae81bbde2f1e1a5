"""Writes GGUF bytes by hand, field by field, so tests can make files no well-behaved writer would.

Layout (GGUF v2 and v3 are identical on disk; v1 used 32-bit counts and lengths):

    magic "GGUF" | version u32 | tensor_count u64 | kv_count u64
    kv_count x   (key: u64 length + bytes) (value type u32) (value)
    tensor_count x (name: u64 length + bytes) (n_dims u32) (n_dims x u64 dims, ne0 first)
                   (ggml type u32) (offset u64, relative to the data section)
    padding to the alignment | tensor data

Every count, length, type id and offset can be overridden with any integer so that hostile files
(absurd counts, unknown types, misaligned offsets, ...) are a one-line change of a valid one.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

MAGIC = b"GGUF"

# Metadata value type ids (gguf spec).
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)

# ggml tensor type ids used by the tests.
GGML_F32, GGML_F16, GGML_Q4_0, GGML_Q4_1, GGML_Q8_0, GGML_BF16 = 0, 1, 2, 3, 8, 30

_SCALAR_FORMATS: dict[int, str] = {
    UINT8: "<B", INT8: "<b", UINT16: "<H", INT16: "<h", UINT32: "<I", INT32: "<i",
    FLOAT32: "<f", BOOL: "<B", UINT64: "<Q", INT64: "<q", FLOAT64: "<d",
}


def u32(v: int) -> bytes:
    return struct.pack("<I", v)


def u64(v: int) -> bytes:
    return struct.pack("<Q", v)


def gstring(s: str | bytes, length: int | None = None) -> bytes:
    """A GGUF string: u64 length then the bytes. `length` overrides the stored length."""
    raw = s.encode("utf-8") if isinstance(s, str) else s
    return u64(len(raw) if length is None else length) + raw


def encode_value(vtype: int, value: object) -> bytes:
    """The bytes of one value of type vtype, without the leading type id.

    Arrays are given as (element_type, items); nested arrays as (ARRAY, [(etype, items), ...]).
    """
    if vtype == STRING:
        assert isinstance(value, (str, bytes))
        return gstring(value)
    if vtype == ARRAY:
        assert isinstance(value, tuple) and len(value) == 2
        etype, items = value
        return u32(etype) + u64(len(items)) + b"".join(encode_value(etype, it) for it in items)
    fmt = _SCALAR_FORMATS[vtype]
    return struct.pack(fmt, value)


@dataclass
class TensorSpec:
    name: str | bytes
    dims: list[int]  # ggml order, ne0 (contiguous) first
    ggml_type: int
    data: bytes = b""
    offset: int | None = None  # stored in the info (relative to the data section); None = where the data is
    n_dims: int | None = None  # overrides len(dims) in the file


@dataclass
class GGUFBuilder:
    version: int = 3
    alignment: int = 32  # used to place data; add a general.alignment key yourself to change it
    magic: bytes = MAGIC
    tensor_count: int | None = None  # overrides the real counts in the header
    kv_count: int | None = None
    kvs: list[bytes] = field(default_factory=list)
    tensors: list[TensorSpec] = field(default_factory=list)
    # Filled by build(): where each region starts, for tests that cut or patch files there.
    kv_start: int = 0
    info_start: int = 0
    info_end: int = 0
    data_start: int = 0

    def add(self, key: str | bytes, vtype: int, value: object) -> GGUFBuilder:
        """A well-formed key/value pair."""
        return self.add_raw(gstring(key) + u32(vtype) + encode_value(vtype, value))

    def add_raw(self, kv_bytes: bytes) -> GGUFBuilder:
        """A key/value pair given as its exact bytes (key, type id, value), for hostile encodings."""
        self.kvs.append(kv_bytes)
        return self

    def add_tensor(self, name: str | bytes, dims: list[int], ggml_type: int, data: bytes,
                   offset: int | None = None, n_dims: int | None = None) -> GGUFBuilder:
        self.tensors.append(TensorSpec(name, list(dims), ggml_type, data, offset, n_dims))
        return self

    def build(self) -> bytes:
        head = self.magic + u32(self.version)
        head += u64(len(self.tensors) if self.tensor_count is None else self.tensor_count)
        head += u64(len(self.kvs) if self.kv_count is None else self.kv_count)
        self.kv_start = len(head)
        out = bytearray(head)
        for kv in self.kvs:
            out += kv
        self.info_start = len(out)
        # Data goes at the next aligned position after the previous tensor's; an explicit offset
        # changes only what the tensor info claims, not where the bytes are put.
        places: list[int] = []
        pos = 0
        for t in self.tensors:
            places.append(pos)
            pos = _pad(pos + len(t.data), self.alignment)
        for t, place in zip(self.tensors, places, strict=True):
            out += gstring(t.name)
            out += u32(len(t.dims) if t.n_dims is None else t.n_dims)
            for d in t.dims:
                out += u64(d)
            out += u32(t.ggml_type)
            out += u64(place if t.offset is None else t.offset)
        self.info_end = len(out)
        # A file without tensors ends right after its tensor infos (no padding to read past).
        self.data_start = _pad(len(out), self.alignment) if self.tensors else len(out)
        out += bytes(self.data_start - len(out))
        for t, place in zip(self.tensors, places, strict=True):
            start = self.data_start + place
            if len(out) < start:
                out += bytes(start - len(out))
            out += t.data
        return bytes(out)


def _pad(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def from_file(path: Path) -> GGUFBuilder:
    """A builder holding a valid file's header, metadata (its bytes as they are) and tensors, so a
    test can change a tensor's type or data and build the file again."""
    import gguf

    data = path.read_bytes()
    reader = gguf.GGUFReader(path)
    (version,) = struct.unpack_from("<I", data, 4)
    (n_kv,) = struct.unpack_from("<Q", data, 16)
    b = GGUFBuilder(version=version, alignment=reader.alignment, kv_count=n_kv)
    b.add_raw(data[24:reader.tensors[0].field.offset])
    for t in reader.tensors:
        raw = data[t.data_offset:t.data_offset + t.n_bytes]
        b.add_tensor(t.name, [int(d) for d in t.shape], int(t.tensor_type), raw)
    return b
