"""The native GGUF reader (native/gguf.cpp) against gguf-py, and against hostile files.

Three sources of files:
- the real SmolLM2 model: every key, every tensor info and the dequantized data must equal what
  gguf-py's GGUFReader and gguf.quants read;
- files written by gguf-py's GGUFWriter: every metadata value type, a custom alignment, every
  weight format the engine computes with, awkward shapes;
- files written byte by byte with gguf_builder: GGUF v2, and corrupt or hostile files. Each of those
  must raise ValueError (the reader's GGUFError) naming the field, in this process, which must
  survive: every prefix of a valid file, each corruption at several truncation points, and a seeded
  random-mutation loop.
"""

from __future__ import annotations

import math
import os
import struct
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

from edgevlm_ros import _engine

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gguf_builder as gb  # noqa: E402

COMPUTABLE = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0")


def bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Same shape and the same float32 bit patterns (so -0.0 != 0.0 and NaNs compare by payload)."""
    a32 = np.ascontiguousarray(a, dtype=np.float32)
    b32 = np.ascontiguousarray(b, dtype=np.float32)
    return a32.shape == b32.shape and np.array_equal(a32.view(np.uint32), b32.view(np.uint32))


def reader_value(field: Any) -> Any:
    """gguf-py's value of a metadata field as plain Python (arrays as lists)."""
    value = field.contents()
    return value


# --------------------------------------------------------------------------------------------
# The real model file
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real(text_model_path: Path) -> tuple[Any, Any]:
    return _engine.GGUFFile(str(text_model_path)), gguf.GGUFReader(text_model_path)


def test_real_header(real: tuple[Any, Any], text_model_path: Path) -> None:
    ours, ref = real
    assert ours.version == 3
    assert ours.version == int(ref.fields["GGUF.version"].contents())
    assert ours.alignment == ref.alignment == 32
    assert ours.data_offset == ref.data_offset
    assert ours.file_size == text_model_path.stat().st_size
    assert ours.path == str(text_model_path)


def test_real_metadata_equals_gguf_py(real: tuple[Any, Any]) -> None:
    ours, ref = real
    md = ours.metadata()
    ref_keys = [k for k in ref.fields if not k.startswith("GGUF.")]
    assert len(md) == 33
    assert list(md) == ref_keys  # same keys, same (file) order
    for key in ref_keys:
        field = ref.fields[key]
        expected = reader_value(field)
        got = md[key]
        assert type(got) is type(expected), key
        if isinstance(expected, list):
            assert len(got) == len(expected), key
            assert all(type(g) is type(e) for g, e in zip(got, expected, strict=True)), key
        assert got == expected, key
        # Types as Python sees them: bool for BOOL, int for integers, float for floats.
        main = field.types[0]
        if main == VT.BOOL:
            assert isinstance(got, bool)
        elif main in (VT.FLOAT32, VT.FLOAT64):
            assert isinstance(got, float)
    assert md["general.architecture"] == "llama"
    assert len(md["tokenizer.ggml.tokens"]) == 49152


def test_real_tensor_infos_equal_gguf_py(real: tuple[Any, Any]) -> None:
    ours, ref = real
    infos = ours.tensors()
    assert len(infos) == len(ref.tensors) == 272
    for t, r in zip(infos, ref.tensors, strict=True):
        assert t["name"] == r.name
        assert t["type"] == r.tensor_type.name
        assert t["shape"] == [int(d) for d in r.shape]  # both in ggml order, ne0 first
        assert t["offset"] == r.data_offset  # absolute
        assert t["nbytes"] == r.n_bytes
        assert t["offset"] % ours.alignment == 0
        assert t["offset"] + t["nbytes"] <= ours.file_size
    assert {t["type"] for t in infos} == {"Q4_1", "Q8_0", "F32"}


@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "blk.29.ffn_down.weight", "token_embd.weight",
                                  "blk.0.attn_norm.weight", "output_norm.weight"])
def test_real_dequantize_equals_gguf_py(real: tuple[Any, Any], name: str) -> None:
    ours, ref = real
    r = next(t for t in ref.tensors if t.name == name)
    expected = gguf.quants.dequantize(r.data, r.tensor_type)
    got = ours.dequantize(name)
    assert got.dtype == np.float32
    assert got.shape == tuple(int(d) for d in reversed(r.shape))  # numpy order
    assert bits_equal(got, expected.reshape(got.shape))


def test_real_dequantize_every_type_present(real: tuple[Any, Any]) -> None:
    """The parametrized names above cover all three formats of the file."""
    ours, _ = real
    types = {t["name"]: t["type"] for t in ours.tensors()}
    assert types["blk.0.attn_q.weight"] == "Q4_1"
    assert types["token_embd.weight"] == "Q8_0"
    assert types["blk.0.attn_norm.weight"] == "F32"
    with pytest.raises(KeyError):
        ours.dequantize("no.such.tensor")


# --------------------------------------------------------------------------------------------
# Files written by gguf-py's GGUFWriter
# --------------------------------------------------------------------------------------------

NON_ASCII = "héllo wörld — ✓ 日本語 🤖 \u0000 end"

# key -> (value, value type, array element type or None); values as our reader must return them.
SCALARS: dict[str, tuple[Any, VT]] = {
    "t.u8": (255, VT.UINT8),
    "t.u8_zero": (0, VT.UINT8),
    "t.i8": (-128, VT.INT8),
    "t.i8_max": (127, VT.INT8),
    "t.u16": (65535, VT.UINT16),
    "t.i16": (-32768, VT.INT16),
    "t.u32": (2**32 - 1, VT.UINT32),
    "t.i32": (-(2**31), VT.INT32),
    "t.f32": (float(np.float32(-0.1)), VT.FLOAT32),
    "t.f32_inf": (math.inf, VT.FLOAT32),
    "t.f32_tiny": (float(np.float32(1e-45)), VT.FLOAT32),  # float32 subnormal
    "t.bool_true": (True, VT.BOOL),
    "t.bool_false": (False, VT.BOOL),
    "t.string": (NON_ASCII, VT.STRING),
    "t.string_empty": ("", VT.STRING),
    "t.u64": (2**64 - 1, VT.UINT64),
    "t.i64": (-(2**63), VT.INT64),
    "t.f64": (1e300, VT.FLOAT64),
    "t.f64_neg_zero": (-0.0, VT.FLOAT64),
}
ARRAYS: dict[str, tuple[list[Any], VT | None]] = {
    "a.i32": ([1, -2, 3, 2**31 - 1], None),  # the writer picks INT32
    "a.u8": ([0, 1, 255], VT.UINT8),
    "a.i16": ([-32768, 0, 32767], VT.INT16),
    "a.u64": ([2**64 - 1, 0], VT.UINT64),
    "a.i64": ([-(2**63), 2**63 - 1], VT.INT64),
    "a.f32": ([0.5, -1.25, float(np.float32(3.0e38))], None),  # the writer picks FLOAT32
    "a.f64": ([math.pi, -1e-300], VT.FLOAT64),
    "a.str": (["a", "", NON_ASCII, "x" * 1000], None),
    "a.bool": ([True, False, True], None),
    "a.nested": ([[1, 2, 3], [4], [5, 6]], None),
    "a.nested_str": ([["a", "bc"], ["ü"]], None),
    "a.nested3": ([[[1], [2, 3]], [[4]]], None),
}


def write_metadata_file(path: Path) -> None:
    w = gguf.GGUFWriter(path, arch="testarch")
    for key, (value, vtype) in SCALARS.items():
        w.add_key_value(key, value, vtype)  # add_string skips "", add_key_value does not
    for key, (items, sub) in ARRAYS.items():
        w.add_key_value(key, items, VT.ARRAY, sub_type=sub)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_writer_metadata_every_value_type(tmp_path: Path) -> None:
    path = tmp_path / "meta.gguf"
    write_metadata_file(path)
    f = _engine.GGUFFile(str(path))
    assert f.version == 3
    assert f.tensors() == []
    md = f.metadata()
    assert md["general.architecture"] == "testarch"
    assert len(md) == 1 + len(SCALARS) + len(ARRAYS)
    for key, (value, _) in SCALARS.items():
        got = md[key]
        assert type(got) is type(value), key
        assert got == value, key
    assert math.copysign(1.0, md["t.f64_neg_zero"]) == -1.0
    for key, (items, _) in ARRAYS.items():
        assert md[key] == items, key
        assert all(type(g) is type(e) for g, e in zip(md[key], items, strict=True)), key
    # And gguf-py reads the same values back (it flattens nested arrays, so those are skipped).
    ref = gguf.GGUFReader(path)
    for key in list(SCALARS) + [k for k in ARRAYS if "nested" not in k]:
        expected = reader_value(ref.fields[key])
        assert md[key] == expected, key


def test_builder_empty_and_deep_arrays(tmp_path: Path) -> None:
    """Arrays the writer refuses to write: empty ones, and nesting at the reader's limit (4 deep)."""
    deep: tuple[int, Any] = (gb.INT32, [7])
    for _ in range(3):
        deep = (gb.ARRAY, [deep])
    b = gb.GGUFBuilder()
    b.add("empty.u32", gb.ARRAY, (gb.UINT32, []))
    b.add("empty.str", gb.ARRAY, (gb.STRING, []))
    b.add("empty.nested", gb.ARRAY, (gb.ARRAY, [(gb.FLOAT32, []), (gb.FLOAT32, [])]))
    b.add("deep4", gb.ARRAY, deep)
    b.add("bools", gb.ARRAY, (gb.BOOL, [1, 0, 1]))
    path = tmp_path / "arrays.gguf"
    path.write_bytes(b.build())
    md = _engine.GGUFFile(str(path)).metadata()
    assert md["empty.u32"] == []
    assert md["empty.str"] == []
    assert md["empty.nested"] == [[], []]
    assert md["deep4"] == [[[[7]]]]
    assert md["bools"] == [True, False, True]


def quantized_tensors(rng: np.random.Generator) -> list[tuple[str, QT, np.ndarray]]:
    """(name, format, float32 values in numpy order) with awkward shapes."""
    out: list[tuple[str, QT, np.ndarray]] = []
    shapes = [(3, 64), (1, 32), (5, 96), (2, 3, 32), (2, 1, 2, 64)]
    for qt in (QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.BF16):
        for shape in shapes:
            x = (rng.standard_normal(shape) * rng.choice([1e-3, 1.0, 50.0])).astype(np.float32)
            out.append((f"{qt.name}.{'x'.join(map(str, shape))}", qt, x))
    for qt in (QT.F32, QT.F16):
        for shape in shapes + [(1, 1), (7, 5), (3, 1, 33), (1,)]:
            x = (rng.standard_normal(shape) * 3.0).astype(np.float32)
            out.append((f"{qt.name}.{'x'.join(map(str, shape))}", qt, x))
    return out


def test_writer_tensors_every_format(tmp_path: Path) -> None:
    rng = np.random.default_rng(1234)
    cases = quantized_tensors(rng)
    path = tmp_path / "tensors.gguf"
    w = gguf.GGUFWriter(path, arch="testarch")
    w.add_custom_alignment(64)
    raws: dict[str, np.ndarray] = {}
    for name, qt, x in cases:
        if qt == QT.F32:
            raw = x
            w.add_tensor(name, x)
        elif qt == QT.F16:
            raw = x.astype(np.float16)
            w.add_tensor(name, raw)
        else:
            raw = gguf.quants.quantize(x, qt)
            w.add_tensor(name, raw, raw_dtype=qt)
        raws[name] = raw
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    f = _engine.GGUFFile(str(path))
    ref = gguf.GGUFReader(path)
    assert f.alignment == 64
    assert f.metadata()["general.alignment"] == 64
    assert f.data_offset == ref.data_offset
    assert f.data_offset % 64 == 0
    infos = {t["name"]: t for t in f.tensors()}
    assert list(infos) == [c[0] for c in cases]
    ref_by_name = {t.name: t for t in ref.tensors}
    for name, qt, x in cases:
        t = infos[name]
        r = ref_by_name[name]
        assert t["type"] == qt.name, name
        assert t["shape"] == list(reversed(x.shape)), name
        assert t["shape"] == [int(d) for d in r.shape], name
        assert t["offset"] == r.data_offset, name
        assert t["offset"] % 64 == 0, name
        assert t["nbytes"] == r.n_bytes == raws[name].nbytes, name
        got = f.dequantize(name)
        assert got.shape == x.shape, name
        expected = gguf.quants.dequantize(raws[name], qt).reshape(x.shape)
        assert bits_equal(got, expected), name
        if qt == QT.F32:
            assert bits_equal(got, x), name
        if qt == QT.F16:
            assert bits_equal(got, x.astype(np.float16).astype(np.float32)), name


def test_writer_alignment_1_puts_tensors_at_odd_offsets(tmp_path: Path) -> None:
    """general.alignment = 1 is valid: tensors then start at any byte, and are still read exactly."""
    rng = np.random.default_rng(77)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    path = tmp_path / "align1.gguf"
    w = gguf.GGUFWriter(path, arch="testarch")
    w.add_custom_alignment(1)
    raws: dict[str, tuple[np.ndarray, QT]] = {}
    for i, qt in enumerate((QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1)):
        w.add_tensor(f"pad{i}", np.ones(1 + 2 * i, np.int8))  # odd sizes shift every later tensor
        if qt == QT.F32:
            raw = x
            w.add_tensor(qt.name, raw)
        elif qt == QT.F16:
            raw = x.astype(np.float16)
            w.add_tensor(qt.name, raw)
        else:
            raw = gguf.quants.quantize(x, qt)
            w.add_tensor(qt.name, raw, raw_dtype=qt)
        raws[qt.name] = (raw, qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = _engine.GGUFFile(str(path))
    assert f.alignment == 1
    infos = {t["name"]: t for t in f.tensors()}
    assert {infos[n]["offset"] % 4 for n in raws} != {0}  # some really are misaligned
    for name, (raw, qt) in raws.items():
        assert bits_equal(f.dequantize(name), gguf.quants.dequantize(raw, qt).reshape(x.shape)), name


def test_tensor_of_a_format_without_kernels_loads_but_does_not_dequantize(tmp_path: Path) -> None:
    b = gb.GGUFBuilder()
    b.add_tensor("q5", [32, 2], 9, bytes(2 * 36))  # Q8_1: known, not computable
    path = tmp_path / "q5.gguf"
    path.write_bytes(b.build())
    f = _engine.GGUFFile(str(path))
    assert f.tensors()[0]["type"] == "Q8_1"
    assert f.tensors()[0]["nbytes"] == 72
    with pytest.raises(ValueError, match="Q8_1"):
        f.dequantize("q5")


def small_builder(version: int = 3) -> gb.GGUFBuilder:
    """A small valid file: a few key/values of several types and three tensors."""
    b = gb.GGUFBuilder(version=version)
    b.add("general.architecture", gb.STRING, "llama")
    b.add("x.count", gb.UINT32, 7)
    b.add("x.flag", gb.BOOL, 1)
    b.add("x.scale", gb.FLOAT32, 0.5)
    b.add("x.words", gb.ARRAY, (gb.STRING, ["a", "bc", "ü"]))
    b.add("x.grid", gb.ARRAY, (gb.ARRAY, [(gb.INT32, [1, 2]), (gb.INT32, [3])]))
    b.add_tensor("w.f32", [8, 2], gb.GGML_F32, np.arange(16, dtype=np.float32).tobytes())
    q = gguf.quants.quantize(np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32), QT.Q4_0)
    b.add_tensor("w.q4", [32, 2], gb.GGML_Q4_0, q.tobytes())
    b.add_tensor("w.f16", [3], gb.GGML_F16, np.array([1, -2, 0.5], dtype=np.float16).tobytes())
    return b


def check_small(f: Any, version: int) -> None:
    assert f.version == version
    md = f.metadata()
    assert md == {"general.architecture": "llama", "x.count": 7, "x.flag": True, "x.scale": 0.5,
                  "x.words": ["a", "bc", "ü"], "x.grid": [[1, 2], [3]]}
    assert [t["name"] for t in f.tensors()] == ["w.f32", "w.q4", "w.f16"]
    assert bits_equal(f.dequantize("w.f32"), np.arange(16, dtype=np.float32).reshape(2, 8))
    assert bits_equal(f.dequantize("w.f16"), np.array([1, -2, 0.5], dtype=np.float32))
    assert f.dequantize("w.q4").shape == (2, 32)


@pytest.mark.parametrize("version", [2, 3])
def test_builder_v2_and_v3_are_read(tmp_path: Path, version: int) -> None:
    b = small_builder(version)
    path = tmp_path / f"v{version}.gguf"
    path.write_bytes(b.build())
    f = _engine.GGUFFile(str(path))
    check_small(f, version)
    assert f.data_offset == b.data_start
    # gguf-py agrees on the v3 file (the same bytes with version 2 are the same layout).
    ref = gguf.GGUFReader(path)
    assert [t.data_offset for t in ref.tensors] == [t["offset"] for t in f.tensors()]


def test_builder_v1_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "v1.gguf"
    path.write_bytes(small_builder(1).build())
    with pytest.raises(ValueError, match=r"version: version 1 is not supported"):
        _engine.GGUFFile(str(path))


# --------------------------------------------------------------------------------------------
# Our reference quantizers and fp16 conversion against gguf-py / numpy
# --------------------------------------------------------------------------------------------


def quantizer_inputs() -> list[np.ndarray]:
    rng = np.random.default_rng(42)
    n = 32 * 256
    blocks = [
        rng.standard_normal(n),
        rng.uniform(-1, 1, n) * 1e-6,
        rng.uniform(-1, 1, n) * 6e4,
        rng.uniform(0, 1, n),  # all positive: Q4_1's min > 0
        -rng.uniform(0, 1, n),  # all negative
        np.zeros(n),  # d == 0
        np.full(n, 3.25),  # constant blocks
        np.round(rng.standard_normal(n) * 4) / 4,  # many ties at .5 after scaling
        rng.integers(-127, 128, n).astype(np.float64),  # Q8_0 exact grid
        rng.standard_normal(n) * np.repeat(10.0 ** rng.integers(-30, 30, n // 32), 32),  # per-block scales
    ]
    spiky = rng.standard_normal(n) * 1e-3
    spiky[::32] = 100.0  # one large element per block, the rest below its quantum
    blocks.append(spiky)
    return [b.astype(np.float32) for b in blocks]


@pytest.mark.parametrize("wtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_quantize_bytes_equal_gguf_py(wtype: str) -> None:
    """Our reference quantizers follow ggml's reference bit for bit, as gguf-py's do."""
    for i, x in enumerate(quantizer_inputs()):
        ours = _engine.quantize(wtype, x)
        with np.errstate(over="ignore"):
            theirs = gguf.quants.quantize(x.reshape(1, -1), QT[wtype]).reshape(-1)
        assert ours.dtype == np.uint8
        assert ours.nbytes == theirs.nbytes
        assert np.array_equal(ours, theirs), f"{wtype} input #{i}: {(ours != theirs).sum()} bytes differ"


def test_bf16_quantize_bytes_equal_gguf_py() -> None:
    """BF16's reference from_float (kernels/formats/) rounds to nearest even and keeps a NaN a quiet
    NaN, as ggml's and gguf-py's do."""
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1e-45, 3.4e38,
                        1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-9], np.float32)
    for i, x in enumerate([*quantizer_inputs(), special]):
        ours = _engine.quantize("BF16", x)
        with np.errstate(over="ignore", invalid="ignore"):
            theirs = gguf.quants.quantize(x.reshape(1, -1), QT.BF16).view(np.uint8).reshape(-1)
        assert np.array_equal(ours, theirs), f"input #{i}: {(ours != theirs).sum()} bytes differ"


@pytest.mark.parametrize("wtype", ["Q8_0", "Q4_0", "Q4_1", "F16", "F32"])
def test_dequantize_same_bytes_identical(wtype: str) -> None:
    """Whatever produced the bytes, both sides dequantize them to the same float32 bits."""
    for x in quantizer_inputs():
        with np.errstate(over="ignore"):
            theirs_raw = gguf.quants.quantize(x.reshape(1, -1), QT[wtype]).view(np.uint8)
        for raw in (_engine.quantize(wtype, x), theirs_raw):
            raw = np.ascontiguousarray(raw).reshape(-1)
            ours = _engine.dequantize(wtype, raw, x.size)
            with np.errstate(invalid="ignore"):  # inf scales (inputs of 1e30) times 0 give NaN on both sides
                theirs = gguf.quants.dequantize(raw.reshape(1, -1), QT[wtype]).reshape(-1)
            assert bits_equal(ours, theirs)


@pytest.mark.parametrize("wtype", ["Q8_0", "Q4_0", "Q4_1", "F16", "BF16"])
def test_dequantize_random_bytes_identical(wtype: str) -> None:
    """Arbitrary block bytes (any scale bit pattern except inf/NaN scales) dequantize identically."""
    rng = np.random.default_rng(7)
    n = 32 * 512
    block = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "F16": 64, "BF16": 64}[wtype]
    raw = rng.integers(0, 256, n // 32 * block, dtype=np.uint8)
    if wtype in ("Q8_0", "Q4_0", "Q4_1"):
        scales = raw.reshape(-1, block)
        for off in (0, 2) if wtype == "Q4_1" else (0,):
            h = scales[:, off:off + 2].copy().view(np.uint16)
            h = np.where((h & 0x7C00) == 0x7C00, h & np.uint16(0xFBFF), h).astype(np.uint16)  # inf/NaN -> finite
            scales[:, off:off + 2] = h.view(np.uint8)
        raw = scales.reshape(-1)
    ours = _engine.dequantize(wtype, raw, n)
    theirs = gguf.quants.dequantize(raw.reshape(1, -1), QT[wtype]).reshape(-1)
    assert bits_equal(ours, theirs)


def test_dequantize_every_half_and_bfloat16_pattern() -> None:
    every = np.arange(65536, dtype=np.uint16).view(np.uint8)
    ours = _engine.dequantize("F16", every, 65536)
    assert bits_equal(ours, np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32))
    ours_bf = _engine.dequantize("BF16", every, 65536)
    assert bits_equal(ours_bf, gguf.quants.dequantize(every.reshape(1, -1), QT.BF16).reshape(-1))


def fp16_bits_numpy(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return x.astype(np.float16).view(np.uint16)


def fp16_bits_ours(x: np.ndarray) -> np.ndarray:
    return _engine.quantize("F16", x.astype(np.float32)).view(np.uint16)


def test_fp16_conversion_special_values() -> None:
    f32 = np.float32
    values = np.array([
        0.0, -0.0, 1.0, -1.0, 65504.0, -65504.0,  # largest half
        65519.996, 65520.0, -65520.0, 65536.0, 1e6, -1e30, np.finfo(f32).max,  # overflow to inf
        np.inf, -np.inf,
        2.0**-14, 2.0**-14 * (1 - 2.0**-11), 2.0**-24, -(2.0**-24),  # smallest normal / subnormal
        2.0**-25, -(2.0**-25), 2.0**-25 * (1 + 2.0**-20), 2.0**-26, 3 * 2.0**-25, 1e-45, -1e-45,
        2.0**-24 * 1.5, 2.0**-24 * 2.5, 2.0**-24 * 1023.5, 2.0**-24 * 1022.5,  # subnormal ties
        1 + 2.0**-11, 1 + 3 * 2.0**-11, 2048 + 1, 2048 + 3,  # normal ties: down to even, up to even
        0.1, 1 / 3, np.pi, 1e-5, 6.1e-5,
    ], dtype=f32)
    ours = fp16_bits_ours(values)
    assert np.array_equal(ours, fp16_bits_numpy(values)), [
        (float(v), hex(a), hex(b)) for v, a, b in zip(values, ours, fp16_bits_numpy(values), strict=True) if a != b]
    nan = fp16_bits_ours(np.array([np.nan, -np.nan], dtype=f32))
    assert np.all((nan & 0x7C00) == 0x7C00) and np.all((nan & 0x03FF) != 0)  # still NaN
    assert (nan[0] >> 15, nan[1] >> 15) == (0, 1)  # sign kept


def test_fp16_conversion_every_midpoint_and_random_bits() -> None:
    # Every half value exactly, and the exact midpoint between each finite half and the next one up
    # (representable in float32): round to nearest, ties to even, including into inf and subnormals.
    h = np.arange(0x7C00, dtype=np.uint16)  # +0 .. largest finite
    lo = h.view(np.float16).astype(np.float64)
    hi = (h + 1).view(np.float16).astype(np.float64)
    mids = ((lo + hi) / 2).astype(np.float32)
    assert np.array_equal(mids.astype(np.float64), (lo + hi) / 2)  # exact
    for sign in (1.0, -1.0):
        exact = (sign * lo).astype(np.float32)
        assert np.array_equal(fp16_bits_ours(exact), fp16_bits_numpy(exact))
        m = (sign * mids).astype(np.float32)
        assert np.array_equal(fp16_bits_ours(m), fp16_bits_numpy(m))
        # One float32 ulp either side of each midpoint rounds away from the tie.
        for nudge in (np.nextafter(m, np.float32(np.inf)), np.nextafter(m, np.float32(-np.inf))):
            assert np.array_equal(fp16_bits_ours(nudge), fp16_bits_numpy(nudge))
    # Random float32 bit patterns over the whole range (NaNs excluded: payloads are not specified).
    rng = np.random.default_rng(99)
    bits = rng.integers(0, 2**32, 400_000, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    x = x[~np.isnan(x)]
    assert np.array_equal(fp16_bits_ours(x), fp16_bits_numpy(x))
    # Dense coverage of the half subnormal range and the overflow boundary.
    for a, b in ((0.0, 2.0**-13), (65000.0, 66000.0)):
        y = rng.uniform(a, b, 100_000).astype(np.float32)
        assert np.array_equal(fp16_bits_ours(y), fp16_bits_numpy(y))


# --------------------------------------------------------------------------------------------
# Corrupt and hostile files
# --------------------------------------------------------------------------------------------


def load_error(path: Path) -> str:
    """Loads path expecting the reader's error; returns its message."""
    with pytest.raises(ValueError) as info:
        _engine.GGUFFile(str(path))
    assert isinstance(info.value, _engine.GGUFError), type(info.value)
    return str(info.value)


def tensor_info_at(b: gb.GGUFBuilder, data: bytes, index: int) -> int:
    """Offset of tensor info #index in built bytes (just after its name)."""
    pos = b.info_start
    for _ in range(index):
        (n,) = struct.unpack_from("<Q", data, pos)
        pos += 8 + n
        (nd,) = struct.unpack_from("<I", data, pos)
        pos += 4 + 8 * nd + 4 + 8
    return pos


def one_tensor(dims: list[int], ggml_type: int = gb.GGML_F32, data: bytes | None = None,
               offset: int | None = None, n_dims: int | None = None, alignment: int | None = None,
               name: str | bytes = "w") -> bytes:
    b = gb.GGUFBuilder()
    b.add("general.architecture", gb.STRING, "llama")
    if alignment is not None:
        b.add("general.alignment", gb.UINT32, alignment)
    if data is None:
        data = bytes(16)
    b.add_tensor(name, dims, ggml_type, data, offset=offset, n_dims=n_dims)
    return b.build()


def kv_file(*kvs: bytes, kv_count: int | None = None, tensor_count: int | None = None) -> bytes:
    b = gb.GGUFBuilder(kv_count=kv_count, tensor_count=tensor_count)
    b.add("general.architecture", gb.STRING, "llama")
    for kv in kvs:
        b.add_raw(kv)
    return b.build()


def kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    return gb.gstring(key) + gb.u32(vtype) + payload


def nested(depth: int) -> bytes:
    """The payload of an array nested `depth` levels deep around one int32."""
    payload = gb.u32(gb.INT32) + gb.u64(1) + struct.pack("<i", 5)
    for _ in range(depth - 1):
        payload = gb.u32(gb.ARRAY) + gb.u64(1) + payload
    return payload


def with_header(data: bytes, *, magic: bytes | None = None, version: int | None = None,
                tensor_count: int | None = None, kv_count: int | None = None) -> bytes:
    out = bytearray(data)
    if magic is not None:
        out[0:4] = magic
    if version is not None:
        out[4:8] = gb.u32(version)
    if tensor_count is not None:
        out[8:16] = gb.u64(tensor_count)
    if kv_count is not None:
        out[16:24] = gb.u64(kv_count)
    return bytes(out)


def valid_small() -> bytes:
    return small_builder().build()


def duplicate_tensor_names() -> bytes:
    b = gb.GGUFBuilder()
    b.add_tensor("w", [4], gb.GGML_F32, bytes(16))
    b.add_tensor("w", [4], gb.GGML_F32, bytes(16))
    return b.build()


def truncated_data() -> bytes:
    data = one_tensor([64, 4], data=bytes(1024))
    return data[:-1]


def tensor_name_10gb() -> bytes:
    b = gb.GGUFBuilder()
    b.add_tensor("w", [4], gb.GGML_F32, bytes(16))
    data = bytearray(b.build())
    data[b.info_start:b.info_start + 8] = gb.u64(10 * 2**30)
    return bytes(data)


def q4_0_row_33() -> bytes:
    return one_tensor([33, 2], gb.GGML_Q4_0, data=bytes(36))


# name -> (file bytes, substrings the message must contain)
HOSTILE: dict[str, tuple[Callable[[], bytes], list[str]]] = {
    "empty": (lambda: b"", ["magic", "not a GGUF file"]),
    "three_bytes": (lambda: b"GGU", ["magic"]),
    "bad_magic": (lambda: with_header(valid_small(), magic=b"GGML"), ["magic"]),
    "magic_only": (lambda: b"GGUF", ["version", "truncated"]),
    "version_1": (lambda: with_header(valid_small(), version=1), ["version", "version 1 ", "not supported"]),
    "version_99": (lambda: with_header(valid_small(), version=99), ["version", "version 99"]),
    "version_big_endian_3": (lambda: with_header(valid_small(), version=3 << 24),
                             ["version", "50331648", "big-endian"]),
    "tensor_count_2e60": (lambda: with_header(valid_small(), tensor_count=2**60), ["tensor_count", "exceeds"]),
    "tensor_count_max": (lambda: with_header(valid_small(), tensor_count=2**64 - 1), ["tensor_count"]),
    "tensor_count_plus_one": (lambda: kv_file(tensor_count=1), ["tensor #0 name (string length)", "truncated"]),
    "kv_count_2e60": (lambda: with_header(valid_small(), kv_count=2**60), ["metadata_kv_count", "exceeds"]),
    "kv_count_plus_one": (lambda: kv_file(kv("k", gb.UINT8, b"\x01"), kv_count=3),
                          ["metadata key #2 (string length)", "truncated"]),
    "array_count_2e40": (lambda: kv_file(kv("big.arr", gb.ARRAY, gb.u32(gb.UINT8) + gb.u64(2**40))),
                         ["big.arr", "array count 1099511627776"]),
    "array_count_2e40_of_strings": (
        lambda: kv_file(kv("big.arr", gb.ARRAY, gb.u32(gb.STRING) + gb.u64(2**40) + gb.gstring("x"))),
        ["big.arr", "array count"]),
    "array_count_plus_one": (
        lambda: kv_file(kv("arr", gb.ARRAY, gb.u32(gb.UINT32) + gb.u64(3) + gb.u32(1) + gb.u32(2))),
        ["arr", "array count 3 exceeds what the file can hold"]),
    "string_value_10GB": (lambda: kv_file(kv("s.huge", gb.STRING, gb.u64(10 * 2**30) + b"abc")),
                          ["s.huge", "string length 10737418240 is absurd"]),
    "string_key_10GB": (lambda: kv_file(gb.u64(10 * 2**30) + b"key"), ["metadata key #1", "absurd"]),
    "tensor_name_10GB": (tensor_name_10gb, ["tensor #0 name", "string length 10737418240 is absurd"]),
    "string_past_end": (lambda: kv_file(kv("s.cut", gb.STRING, gb.u64(1000) + b"abc")),
                        ["s.cut", "string of 1000 bytes", "truncated"]),
    "string_in_array_past_end": (
        lambda: kv_file(kv("s.arr", gb.ARRAY, gb.u32(gb.STRING) + gb.u64(2) + gb.gstring("ok") + gb.u64(500))),
        ["s.arr", "string of 500 bytes"]),
    "unknown_value_type_13": (lambda: kv_file(kv("odd", 13, gb.u32(0))), ["odd", "unknown value type 13"]),
    "unknown_value_type_max": (lambda: kv_file(kv("odd", 2**32 - 1, gb.u32(0))),
                               ["odd", "unknown value type 4294967295"]),
    "unknown_array_type": (lambda: kv_file(kv("arr", gb.ARRAY, gb.u32(13) + gb.u64(1) + gb.u32(0))),
                           ["arr", "unknown array element type 13"]),
    "unknown_nested_array_type": (
        lambda: kv_file(kv("arr", gb.ARRAY, gb.u32(gb.ARRAY) + gb.u64(1) + gb.u32(77) + gb.u64(0))),
        ["arr", "unknown array element type 77"]),
    "arrays_nested_5": (lambda: kv_file(kv("deep", gb.ARRAY, nested(5))), ["deep", "nested deeper than 4"]),
    "arrays_nested_1000": (lambda: kv_file(kv("deeper", gb.ARRAY, nested(1000))), ["deeper", "nested deeper"]),
    "bool_7": (lambda: kv_file(kv("flag", gb.BOOL, b"\x07")), ["flag", "bool value 7"]),
    "bool_2_in_array": (lambda: kv_file(kv("flags", gb.ARRAY, gb.u32(gb.BOOL) + gb.u64(3) + b"\x01\x00\x02")),
                        ["flags", "bool value 2"]),
    "duplicate_key": (lambda: kv_file(kv("general.architecture", gb.STRING, gb.gstring("x"))),
                      ["general.architecture", "duplicate metadata key"]),
    "key_not_utf8": (lambda: kv_file(kv(b"bad\xff\xfekey", gb.UINT8, b"\x01")),
                     ["metadata key #1", "not valid UTF-8"]),
    "key_utf8_surrogate": (lambda: kv_file(kv(b"k\xed\xa0\x80", gb.UINT8, b"\x01")), ["metadata key #1", "UTF-8"]),
    "key_utf8_overlong": (lambda: kv_file(kv(b"k\xc0\xaf", gb.UINT8, b"\x01")), ["metadata key #1", "UTF-8"]),
    "tensor_name_not_utf8": (lambda: one_tensor([4], name=b"w\x80"), ["tensor #0 name", "not valid UTF-8"]),
    "alignment_0": (lambda: one_tensor([4], alignment=0), ["general.alignment", "0 is not a power of two"]),
    "alignment_48": (lambda: one_tensor([4], alignment=48), ["general.alignment", "48 is not a power of two"]),
    "alignment_not_u32": (lambda: kv_file(kv("general.alignment", gb.UINT64, gb.u64(32))),
                          ["general.alignment", "uint32"]),
    "alignment_2e31_data_past_end": (lambda: one_tensor([4], alignment=2**31), ["data section", "past the end"]),
    "unknown_tensor_type_99": (lambda: one_tensor([4], ggml_type=99), ["tensor 'w'", "unknown tensor type 99"]),
    "retired_tensor_type_4": (lambda: one_tensor([4], ggml_type=4), ["tensor 'w'", "unknown tensor type 4"]),
    "n_dims_0": (lambda: one_tensor([], data=bytes(4)), ["tensor 'w'", "n_dims 0 is not in 1..4"]),
    "n_dims_5": (lambda: one_tensor([1, 1, 1, 1, 4]), ["tensor 'w'", "n_dims 5"]),
    "n_dims_huge": (lambda: one_tensor([4], n_dims=2**31), ["tensor 'w'", "n_dims 2147483648"]),
    "zero_dimension": (lambda: one_tensor([4, 0]), ["tensor 'w'", "dimension 1 = 0"]),
    "dimension_over_int64": (lambda: one_tensor([2**63, 1]), ["tensor 'w'", "dimension 0", "invalid"]),
    "dimensions_overflow_64_bits": (lambda: one_tensor([2**32, 2**32, 2**32]), ["tensor 'w'", "overflows"]),
    "dimensions_wrap_to_small": (lambda: one_tensor([2**32, 2**32 + 1, 1, 1]), ["tensor 'w'", "overflows"]),
    "elements_2e62": (lambda: one_tensor([2**31, 2**31]), ["tensor 'w'", "overflows"]),
    "q4_0_row_33": (q4_0_row_33, ["tensor 'w'", "row length 33 is not a multiple of the Q4_0 block size 32"]),
    "offset_past_end": (lambda: one_tensor([4], offset=2**20), ["tensor 'w'", "runs past the end"]),
    "offset_wraps_64_bits": (lambda: one_tensor([4], offset=2**64 - 32), ["tensor 'w'", "runs past the end"]),
    "offset_not_aligned": (lambda: one_tensor([4], offset=4), ["tensor 'w'", "offset 4 is not aligned to 32"]),
    "offset_not_aligned_64": (lambda: one_tensor([4], offset=32, alignment=64), ["tensor 'w'", "not aligned to 64"]),
    "data_past_end": (truncated_data, ["tensor 'w'", "runs past the end"]),
    "data_section_missing": (lambda: one_tensor([4])[:-32], ["past the end"]),
    "duplicate_tensor_name": (duplicate_tensor_names, ["tensor 'w'", "duplicate tensor name"]),
}


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_file_is_refused_naming_the_field(tmp_path: Path, case: str) -> None:
    make, needles = HOSTILE[case]
    data = make()
    path = write(tmp_path / f"{case}.gguf", data)
    msg = load_error(path)
    assert msg.startswith(f"bad GGUF file '{path}': "), msg
    for needle in needles:
        assert needle in msg, f"{case}: {needle!r} not in {msg!r}"
    # The same corruption cut short anywhere is still refused cleanly.
    cuts = sorted({0, 3, 4, 7, 8, 15, 16, 23, 24, 25, len(data) // 3, len(data) // 2, len(data) - 8, len(data) - 1})
    for cut in cuts:
        if 0 <= cut < len(data):
            load_error(write(tmp_path / "cut.gguf", data[:cut]))


def test_hostile_cases_are_all_distinct_files() -> None:
    """Every hostile case builds a different file (guards against a silently ineffective corruption)."""
    files = {name: make() for name, (make, _) in HOSTILE.items()}
    assert len(set(files.values())) == len(files)
    assert valid_small() not in files.values()


def test_deepest_allowed_nesting_and_wrapped_dimensions_load(tmp_path: Path) -> None:
    """Counterparts of hostile cases that must load: nesting of exactly 4, dimensions near the limit."""
    f = _engine.GGUFFile(str(write(tmp_path / "d4.gguf", kv_file(kv("deep", gb.ARRAY, nested(4))))))
    assert f.metadata()["deep"] == [[[[5]]]]
    f = _engine.GGUFFile(str(write(tmp_path / "one.gguf", one_tensor([1, 1, 1, 4], data=bytes(16)))))
    assert f.tensors()[0]["shape"] == [1, 1, 1, 4]
    assert f.dequantize("w").shape == (4, 1, 1, 1)


def test_every_prefix_of_a_valid_file_is_refused(tmp_path: Path) -> None:
    b = small_builder()
    data = b.build()
    assert b.info_end < b.data_start < len(data)
    full = write(tmp_path / "full.gguf", data)
    check_small(_engine.GGUFFile(str(full)), 3)
    path = tmp_path / "prefix.gguf"
    fields: set[str] = set()
    for n in range(len(data)):
        msg = load_error(write(path, data[:n]))
        fields.add(msg.split(": ")[1] if n else "magic")
    # The cuts hit every kind of field on the way (a sample: the messages name what was cut).
    for field in ("magic", "version", "tensor_count", "metadata_kv_count", "metadata key #2 (string length)",
                  "x.flag (type)", "x.scale", "x.words (array count)", "x.words (string of 2 bytes)",
                  "x.grid (array element type)", "tensor #0 name (string length)", "tensor 'w.f32' dim 1",
                  "tensor 'w.f32' offset", "tensor 'w.q4' n_dims", "data section", "tensor 'w.f16'"):
        assert field in fields, (field, sorted(fields))


def test_file_with_trailing_bytes_loads(tmp_path: Path) -> None:
    data = valid_small() + b"\xff" * 100
    check_small(_engine.GGUFFile(str(write(tmp_path / "trail.gguf", data))), 3)


def test_invalid_utf8_string_value_is_kept_not_raised(tmp_path: Path) -> None:
    """String values are not validated (a tokenizer may hold raw bytes): they come back escaped."""
    data = kv_file(kv("s", gb.STRING, gb.gstring(b"ok\xff")))
    md = _engine.GGUFFile(str(write(tmp_path / "s.gguf", data))).metadata()
    assert md["s"] == "ok\udcff"
    assert md["s"].encode("utf-8", "surrogateescape") == b"ok\xff"


def test_missing_file_raises_value_error(tmp_path: Path) -> None:
    # The reader raises its GGUFError (a ValueError), not FileNotFoundError.
    path = tmp_path / "does-not-exist.gguf"
    with pytest.raises(ValueError, match="cannot open") as info:
        _engine.GGUFFile(str(path))
    assert isinstance(info.value, _engine.GGUFError)
    assert not isinstance(info.value, FileNotFoundError)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("which", ["directory", "dev_null"])
def test_not_a_regular_file_raises_value_error(tmp_path: Path, which: str) -> None:
    path = str(tmp_path) if which == "directory" else os.devnull
    with pytest.raises(ValueError, match="not a regular file"):
        _engine.GGUFFile(path)


def test_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    """open() of a FIFO blocks until a writer appears: the reader must refuse it without opening.

    Should that regress, a timer opens the FIFO for writing after 5 s so the test fails instead of hanging.
    """
    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    rescued: list[bool] = []

    def rescue() -> None:
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO unless a reader is blocked
        except OSError:
            return
        rescued.append(True)
        os.close(fd)

    timer = threading.Timer(5.0, rescue)
    timer.start()
    try:
        with pytest.raises(ValueError, match="not a regular file"):
            _engine.GGUFFile(str(fifo))
    finally:
        timer.cancel()
    assert not rescued, "GGUFFile blocked opening a FIFO"


def exercise(f: Any) -> None:
    """Everything a loaded file offers; only ValueError (a refused format) is acceptable."""
    f.metadata()
    for t in f.tensors():
        try:
            out = f.dequantize(t["name"])
        except ValueError as e:
            assert "is not supported" in str(e)
            assert t["type"] not in COMPUTABLE
            continue
        assert out.size == math.prod(t["shape"])


def test_random_header_mutations(tmp_path: Path) -> None:
    """~2000 seeded mutations of a small valid file's header region: each loads or raises ValueError."""
    b = small_builder()
    data = b.build()
    rng = np.random.default_rng(20261130)
    interesting = [0x00, 0x01, 0x02, 0x04, 0x05, 0x07, 0x08, 0x09, 0x0C, 0x0D, 0x1F, 0x20, 0x40, 0x7F, 0x80, 0xFF]
    loaded = refused = 0
    for i in range(2000):
        buf = bytearray(data)
        for _ in range(int(rng.integers(1, 5))):
            pos = int(rng.integers(0, b.info_end))
            mode = int(rng.integers(0, 3))
            if mode == 0:
                buf[pos] ^= 1 << int(rng.integers(0, 8))
            elif mode == 1:
                buf[pos] = interesting[int(rng.integers(0, len(interesting)))]
            else:
                buf[pos] = int(rng.integers(0, 256))
        path = write(tmp_path / f"mut{i % 4}.gguf", bytes(buf))
        try:
            f = _engine.GGUFFile(str(path))
        except ValueError as e:
            assert isinstance(e, _engine.GGUFError), repr(e)
            assert str(e).startswith(f"bad GGUF file '{path}': "), str(e)
            refused += 1
            continue
        exercise(f)
        del f  # its mapping must not outlive the file being rewritten
        loaded += 1
    assert loaded + refused == 2000
    assert refused > 1000 and loaded > 20, (loaded, refused)  # the loop exercises both outcomes
