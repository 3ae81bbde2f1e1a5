"""Weight formats (kernels/formats/): the reference dequantizers against the gguf package and
llama.cpp's ggml, the reference quantizers' round trips, and hostile blocks.

Exactness: gguf.quants.dequantize computes in float32 numpy, one rounding per operation, with
the sub-block scale formed first (dl = d * sc, then dl * q - dmin * m; Q5_1 / Q4_1: d * q + m).
Our decoders do the same float32 operations in the same order, each product a statement of its
own (no fused multiply-add), so every output has the same float32 bits: compared as uint32.

Round trips: the RMS error of quantize -> dequantize on Gaussian and heavy-tailed (Student t, 3
degrees of freedom) rows is bounded (a) absolutely, per format, from the step of a uniform
quantizer (RMS = step / sqrt(12)) on the sub-block's expected range, and (b) against llama.cpp's
own reference quantizer (ggml's quantize_row_*_ref, no importance matrix) where llama-cpp-python
is installed: ours may be at most 5% worse. Measured 2026-12-01 (ours / ggml): Q2_K 0.90, Q3_K
0.96, Q4_K 1.01, Q5_K 1.01-1.03, Q6_K 1.01, IQ4_NL 0.95-0.97; Q5_0 / Q5_1 bit-identical.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from edgevlm_ros import _engine

NEW_FORMATS = ("Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL")
OLD_FORMATS = ("Q4_0", "Q4_1", "Q8_0")

# Byte offsets of every fp16 field (d, dmin, m) inside one block (ggml-common.h).
HALF_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q5_0": (0,), "Q5_1": (0, 2), "IQ4_NL": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
}

# Round-trip RMS error over the rows' standard deviation, Gaussian rows. A uniform quantizer of
# step D has RMS D / sqrt(12); the expected max |x| of 16 / 32 normal samples is ~1.77 / 2.07 sigma.
#   Q5_0 (signed, 32 levels over +-2.07): D = 4.14 / 31.5 -> 0.038; measured 0.043 (-16 maps the
#     largest magnitude, +15 the other side: a half level lost)
#   Q5_1 (range / 31): 4.14 / 31 -> 0.039; measured 0.038
#   Q2_K (4 levels per 16, range 3.5 / 3): 0.34; measured 0.27 (the search clips tails)
#   Q3_K (8 signed levels per 16, 1.77 / 4): 0.13; measured 0.145
#   Q4_K (16 levels per 32): 4.14 / 15 -> 0.080; measured 0.072
#   Q5_K (32 levels per 32): 0.039; measured 0.037
#   Q6_K (64 signed levels per 16, 1.77 / 32): 0.016; measured 0.018
#   IQ4_NL (16 non-linear levels per 32, about Q4's): 0.075
# The bounds allow ~10% over the measured values (6 seeds' spread is ~2%).
RMS_BOUND = {
    "Q4_0": 0.095, "Q4_1": 0.085, "Q8_0": 0.0062, "Q5_0": 0.048, "Q5_1": 0.042, "Q2_K": 0.30,
    "Q3_K": 0.16, "Q4_K": 0.080, "Q5_K": 0.041, "Q6_K": 0.020, "IQ4_NL": 0.083,
}
# Formats whose quantizer reproduces its own output's values: y = dequantize(quantize(x)) gives
# dequantize(quantize(y)) == y. The searching quantizers (the K-quants, IQ4_NL) may pick another scale for data
# already on a grid; for them the re-quantization is only bounded (test below).
IDEMPOTENT = ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1")

GGML_LIB = Path(gguf.__file__).resolve().parents[1] / "llama_cpp" / "lib" / "libggml-base.so"


def sizes(fmt: str) -> tuple[int, int]:
    """(elements, bytes) of one block."""
    block, nbytes = gguf.GGML_QUANT_SIZES[QT[fmt]]
    return block, nbytes


def random_blocks(fmt: str, n_blocks: int, seed: int, finite: bool = True) -> np.ndarray:
    """Random bytes; with finite, every fp16 field set to a random finite half (any sign,
    subnormals included) so the reference has no inf / NaN to disagree on."""
    rng = np.random.default_rng(seed)
    _, nbytes = sizes(fmt)
    raw = rng.integers(0, 256, (n_blocks, nbytes), dtype=np.uint8)
    if finite:
        for off in HALF_FIELDS[fmt]:
            bits = rng.integers(0, 0x10000, n_blocks).astype(np.uint16)
            bits = np.where((bits & 0x7C00) == 0x7C00, bits & 0xBFFF, bits).astype(np.uint16)
            raw[:, off:off + 2] = bits.view(np.uint8).reshape(n_blocks, 2)
    return raw


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("fmt", NEW_FORMATS + OLD_FORMATS)
def test_dequantize_random_blocks_equals_gguf(fmt: str) -> None:
    block, _ = sizes(fmt)
    raw = random_blocks(fmt, 2048, seed=len(fmt) * 7 + ord(fmt[1]))
    want = gguf.quants.dequantize(raw, QT[fmt]).reshape(-1)
    got = _engine.dequantize(fmt, raw.reshape(-1), raw.shape[0] * block)
    assert np.all(np.isfinite(want))
    assert same_bits(got, want), f"{fmt}: {np.count_nonzero(got != want)} elements differ"


@pytest.mark.parametrize("fmt", NEW_FORMATS)
def test_dequantize_at_odd_byte_offsets(fmt: str) -> None:
    """Tensor data may be 1-byte aligned: rows starting at every offset decode the same."""
    block, nbytes = sizes(fmt)
    raw = random_blocks(fmt, 8, seed=3).reshape(-1)
    want = _engine.dequantize(fmt, raw, 8 * block)
    for off in (1, 3):
        buf = np.zeros(raw.size + off, np.uint8)
        buf[off:] = raw
        assert same_bits(_engine.dequantize(fmt, buf[off:], 8 * block), want)


@pytest.mark.parametrize("fmt", NEW_FORMATS + OLD_FORMATS)
def test_hostile_blocks_decode_like_gguf(fmt: str) -> None:
    """Any bytes at all (inf and NaN fp16 scales included) decode without a crash, to the same
    finite values as gguf's and to NaN / inf exactly where gguf gives them."""
    block, _ = sizes(fmt)
    raw = random_blocks(fmt, 1024, seed=11, finite=False)
    for off in HALF_FIELDS[fmt][:1]:  # a quarter of the blocks: scale inf or NaN
        raw[::4, off:off + 2] = np.array([0x7C00, 0xFE01], np.uint16)[np.arange(256) % 2].view(np.uint8).reshape(-1, 2)
    with np.errstate(invalid="ignore", over="ignore"):
        want = gguf.quants.dequantize(raw, QT[fmt]).reshape(-1)
    got = _engine.dequantize(fmt, raw.reshape(-1), raw.shape[0] * block)
    assert np.count_nonzero(np.isnan(want)) > 0
    assert np.array_equal(np.isnan(got), np.isnan(want))
    fin = ~np.isnan(want)
    assert same_bits(got[fin], want[fin])


def test_dequantize_refuses_wrong_sizes() -> None:
    raw = random_blocks("Q4_K", 2, seed=1).reshape(-1)
    with pytest.raises(ValueError, match="byte count"):
        _engine.dequantize("Q4_K", raw[:-1], 512)
    with pytest.raises(ValueError, match="byte count"):
        _engine.dequantize("Q4_K", raw, 256)
    with pytest.raises(ValueError, match="multiple of the block size"):
        _engine.quantize("Q6_K", np.zeros(255, np.float32))


@cache
def rows(dist: str, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n) if dist == "normal" else rng.standard_t(3, n)
    return x.astype(np.float32)


def round_trip(fmt: str, x: np.ndarray) -> np.ndarray:
    return _engine.dequantize(fmt, _engine.quantize(fmt, x), x.size)


@pytest.mark.parametrize("fmt", NEW_FORMATS + OLD_FORMATS)
def test_round_trip_error_bounded(fmt: str) -> None:
    for seed in range(3):
        for scale in (1e-3, 1.0, 300.0):  # scales of every decade: the fp16 fields must not bias it
            x = rows("normal", 256 * 64, seed) * np.float32(scale)
            y = round_trip(fmt, x)
            rel = float(np.sqrt(np.mean((x.astype(np.float64) - y) ** 2))) / scale
            assert rel <= RMS_BOUND[fmt], f"{fmt} seed {seed} scale {scale}: RMS {rel:.4f} > {RMS_BOUND[fmt]}"


@pytest.mark.parametrize("fmt", NEW_FORMATS + OLD_FORMATS)
def test_round_trip_special_rows(fmt: str) -> None:
    """Zeros stay zeros; a constant row, one outlier in a block, and negative-only rows decode
    near their values (every level of a block used: no off-by-one in the packing)."""
    block, _ = sizes(fmt)
    n = 256 * 4
    assert np.all(round_trip(fmt, np.zeros(n, np.float32)) == 0)
    c = np.full(n, -0.75, np.float32)
    assert np.allclose(round_trip(fmt, c), c, rtol=0.02, atol=0)
    ramp = np.tile(np.linspace(-1, 1, block, dtype=np.float32), n // block)
    assert np.max(np.abs(round_trip(fmt, ramp) - ramp)) <= 0.35
    spike = rows("normal", n, 4).copy()
    spike[::97] = 50
    err = np.abs(round_trip(fmt, spike) - spike)
    assert np.max(err[::97]) <= 50 * 0.06  # the outlier itself is kept (it sets its block's scale)


@pytest.mark.parametrize("fmt", IDEMPOTENT)
def test_quantizer_reproduces_its_own_output(fmt: str) -> None:
    y = round_trip(fmt, rows("normal", 256 * 32, 5))
    assert same_bits(round_trip(fmt, y), y)


@pytest.mark.parametrize("fmt", sorted(set(NEW_FORMATS) - set(IDEMPOTENT)))
def test_requantization_stays_close(fmt: str) -> None:
    """Data already on the format's grid re-quantizes to within a fraction of the first round
    trip's error (the scale search may settle on another grid nearby)."""
    x = rows("normal", 256 * 32, 5)
    y = round_trip(fmt, x)
    y2 = round_trip(fmt, y)
    first = np.sqrt(np.mean((x - y) ** 2))
    assert np.sqrt(np.mean((y - y2) ** 2)) <= 0.8 * first


@pytest.mark.parametrize("fmt", NEW_FORMATS + OLD_FORMATS)
def test_quantize_hostile_floats_never_crash(fmt: str) -> None:
    block, _ = sizes(fmt)
    n = 256 * 3
    specials = np.array([np.nan, np.inf, -np.inf, 3e38, -3e38, 1e-40, -0.0, 65504, 1e6], np.float32)
    x = np.resize(specials, n)
    assert _engine.quantize(fmt, x).size == n // block * sizes(fmt)[1]
    # finite but beyond fp16: the block's scale saturates; still no crash, a value per element
    big = rows("normal", n, 6) * np.float32(1e9)
    assert round_trip(fmt, big).size == n
    # a NaN or an inf in one block leaves the other blocks' values intact
    x = rows("normal", n, 7).copy()
    x[3] = np.nan
    x[n - 5] = np.inf
    y = round_trip(fmt, x)
    lo, hi = 256, n - 256  # whole blocks of every format untouched by the specials
    assert same_bits(y[lo:hi], round_trip(fmt, x[lo:hi]))


def test_q5_quantizers_equal_gguf() -> None:
    """Q5_0 / Q5_1 follow ggml's reference rule, which gguf implements too: the same bytes."""
    for fmt in ("Q5_0", "Q5_1"):
        for dist in ("normal", "t3"):
            x = rows(dist, 32 * 512, 8)
            want = gguf.quants.quantize(x.reshape(16, -1), QT[fmt]).reshape(-1)
            assert np.array_equal(_engine.quantize(fmt, x), want), fmt


def test_q8_k_activation_blocks() -> None:
    """Q8_K (float32 d, 256 int8, 16 int16 sums of 16): decoded by hand from its layout."""
    x = rows("t3", 256 * 8, 9)
    raw = _engine.quantize("Q8_K", x)
    blocks = raw.reshape(8, 292)
    d = blocks[:, :4].copy().view(np.float32).reshape(8, 1)
    q = blocks[:, 4:260].view(np.int8).astype(np.int32)
    bsums = blocks[:, 260:].copy().view(np.int16)
    assert np.array_equal(bsums, q.reshape(8, 16, 16).sum(axis=2))
    assert np.all(np.abs(q).max(axis=1) == 127)
    assert np.all(np.abs(x.reshape(8, 256) - d * q) <= d / 2 * (1 + 1e-6))
    assert np.all(_engine.quantize("Q8_K", np.zeros(256, np.float32)) == 0)
    with pytest.raises(ValueError, match="not supported"):
        _engine.dequantize("Q8_K", raw, 256 * 8)


@cache
def ggml() -> ctypes.CDLL | None:
    if not GGML_LIB.exists():
        return None
    return ctypes.CDLL(str(GGML_LIB))


def ggml_function(prefix: str, fmt: str) -> ctypes._CFuncPtr:
    name = fmt.lower() if not fmt.endswith("_K") else fmt[:-2].lower() + "_K"
    return getattr(ggml(), f"{prefix}_{name}{'_ref' if prefix == 'quantize_row' else ''}")


def ptr(a: np.ndarray) -> ctypes.c_void_p:
    return a.ctypes.data_as(ctypes.c_void_p)


@pytest.mark.parametrize("fmt", NEW_FORMATS)
def test_round_trip_no_worse_than_ggml(fmt: str) -> None:
    if ggml() is None:
        pytest.skip(f"llama.cpp's ggml library is not installed ({GGML_LIB})")
    block, nbytes = sizes(fmt)
    for dist in ("normal", "t3"):
        x = rows(dist, 256 * 256, 10)
        theirs = np.zeros(x.size // block * nbytes, np.uint8)
        ggml_function("quantize_row", fmt)(ptr(x), ptr(theirs), ctypes.c_int64(x.size))
        ours_rms = np.sqrt(np.mean((x - round_trip(fmt, x)) ** 2))
        theirs_rms = np.sqrt(np.mean((x - _engine.dequantize(fmt, theirs, x.size)) ** 2))
        assert ours_rms <= 1.05 * theirs_rms, f"{fmt} {dist}: {ours_rms:.5f} vs ggml {theirs_rms:.5f}"


@pytest.mark.parametrize("fmt", NEW_FORMATS)
def test_dequantize_equals_ggml(fmt: str) -> None:
    """And llama.cpp's own C decoder (ggml's dequantize_row_*) gives the same bits."""
    if ggml() is None:
        pytest.skip(f"llama.cpp's ggml library is not installed ({GGML_LIB})")
    block, _ = sizes(fmt)
    raw = random_blocks(fmt, 512, seed=12)
    theirs = np.zeros(512 * block, np.float32)
    ggml_function("dequantize_row", fmt)(ptr(raw), ptr(theirs), ctypes.c_int64(theirs.size))
    assert same_bits(_engine.dequantize(fmt, raw.reshape(-1), theirs.size), theirs)
