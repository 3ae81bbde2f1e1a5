"""Kernels against their references: every matmul, attention, element-wise, norm, rope and add
variant that runs on this CPU (and 'best', what the operator table picks) against the scalar 'ref', and
'ref' against float64 numpy on the same dequantized weights (element-wise bounds: see the section
at the end).

Tolerances are relative to the magnitude of each sum, sum_k |w_k| |x_k|:
- variants with float activations differ from 'ref' only by summation order and fused
  multiply-adds: a few float32 ulps per term, REL_TOL = 1e-5 of the magnitude;
- variants that quantize activations to int8 blocks of 32 (scale d = max|x| / 127, round to
  nearest) add at most d / 2 per activation: their bound adds sum_blocks d_b / 2 * sum |w| over
  the block. With activations on that int8 grid (power-of-two scales) the quantization is
  lossless, so there they must meet REL_TOL too: that is the sharp test of their integer path.
- variants that split floats into two bfloat16 halves (the AMX tile GEMM: x ~ hi + lo with
  |x - hi - lo| <= 2^-16 |x|, three bf16 products per term, lo * lo dropped) are within
  3 * 2^-16 of each term: SPLIT_BF16_TOL = 6e-5 of the magnitude (REL_TOL added for the sums).
A wrong index, block layout, nibble order, scale or tail loop gives errors of order 1 in these units.
"""

from __future__ import annotations

import itertools
from functools import cache

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from edgevlm_ros import _engine
from edgevlm_ros.tools import tune

FLOAT_TYPES = ("F32", "F16", "BF16")
QUANT_TYPES = ("Q4_0", "Q4_1", "Q8_0")
ROWS = (1, 3, 17, 64, 129)
QUANT_COLS = (32, 96, 160, 576)
FLOAT_COLS = (1, 7, 33) + QUANT_COLS
MS = (1, 2, 3, 4, 5, 64)  # 3 | 4: the decode / prefill boundary (kernels/ops.h kDecodeMaxTokens)
THREADS = (1, 2, 3)
REL_TOL = 1e-5  # of sum |w||x|
DECODE_MAX_TOKENS = 3  # checked below: 'best' must give exactly what the variant chosen for this m gives

# Every matmul variant, by how it treats activations. A new variant must be added to one of these.
FLOAT_ACT_VARIANTS = {"ref", "avx2_f32act", "avx2_gemm", "avx512_gemm"}
INT8_ACT_VARIANTS = {"avx2_q8act", "avx2_q8act_x8", "avxvnni_q8act_x8", "avx512vnni_q8act_x8",
                     "avx512vnni_q8act_x8_ymm", "avx2_q8act_k", "avxvnni_q8act_k", "avx512vnni_q8act_k",
                     "avx512vnni_q8act_gemm", "avxvnni_q8act_gemm", "avx512vnni_q8act_gemm_ymm",
                     "neon_q8act_gemm"}
# Of those, the ones that requantize float weights to int8 blocks at load (the q8u layout; a last partial
# block of columns zero-padded, in the activations too): on F32 / F16 / BF16 their bound adds
# requant_bound.
REQUANT_VARIANTS = {"avxvnni_q8act_gemm", "avx512vnni_q8act_gemm_ymm", "neon_q8act_gemm"}
SPLIT_BF16_VARIANTS = {"amx_gemm"}
SPLIT_BF16_TOL = 6e-5  # of sum |w||x|
GEMM_VARIANTS = ("avx512_gemm", "amx_gemm")  # the panel GEMMs with p16 and k-block paths of their own
# The formats of the K-quant era (kernels/matmul/kquant_avx2.h): blocks of 32 and super-blocks of 256.
KQUANT_TYPES = ("Q5_0", "Q5_1", "IQ4_NL", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def float_bound(variant: str, magnitude: np.ndarray) -> np.ndarray:
    """The tolerance of a variant that does not quantize activations to int8."""
    return (SPLIT_BF16_TOL if variant in SPLIT_BF16_VARIANTS else REL_TOL) * magnitude


def matmul_variants(wtype: str) -> list[str]:
    """The variants that run wtype on this CPU, 'ref' excluded."""
    return [v["name"] for v in _engine.list_variants()
            if v["op"] == "matmul" and v["available"] and wtype in v["formats"] and v["name"] != "ref"]


def attention_variants() -> list[str]:
    return [v["name"] for v in _engine.list_variants() if v["op"] == "attention" and v["available"]]


def chosen_variant(wtype: str, m: int, rows: int, cols: int) -> str:
    phase = "decode" if m <= DECODE_MAX_TOKENS else "prefill"
    return str(_engine.choose_matmul(wtype, phase, rows, cols))


@cache
def weights(wtype: str, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """(raw GGUF bytes, the float32 values they decode to), seeded by the shape."""
    rng = np.random.default_rng(rows * 100_003 + cols * 7 + len(wtype))
    # Per-row scales over six decades: rows of very different magnitude share one matmul.
    w = rng.standard_normal((rows, cols)) * 10.0 ** rng.uniform(-3, 3, (rows, 1))
    w = w.astype(np.float32)
    if wtype == "BF16":
        raw = gguf.quants.quantize(w, QT.BF16).reshape(-1)
    else:
        raw = _engine.quantize(wtype, w.reshape(-1))
    dequant = _engine.dequantize(wtype, raw, rows * cols).reshape(rows, cols)
    return raw, dequant


@cache
def activations(m: int, cols: int) -> np.ndarray:
    rng = np.random.default_rng(m * 1009 + cols)
    return (rng.standard_normal((m, cols)) * rng.uniform(0.1, 10)).astype(np.float32)


@cache
def grid_activations(m: int, cols: int) -> np.ndarray:
    """Activations an int8 block quantizer reproduces exactly: per block of 32, 2^e * q with
    integer q in [-127, 127] and one |q| = 127, so max|x| / 127 = 2^e exactly."""
    rng = np.random.default_rng(m * 31 + cols + 5)
    nb = cols // 32
    q = rng.integers(-127, 128, (m, nb, 32)).astype(np.float64)
    q[np.arange(m)[:, None], np.arange(nb)[None, :], rng.integers(0, 32, (m, nb))] = rng.choice([-127, 127], (m, nb))
    scale = 2.0 ** rng.integers(-12, 4, (m, nb, 1))
    return (q * scale).reshape(m, cols).astype(np.float32)


def _pad32(a: np.ndarray) -> np.ndarray:
    """a with zero columns up to a whole number of blocks of 32 (as the int8 kernels pad a last
    partial block)."""
    return np.pad(a, ((0, 0), (0, -a.shape[1] % 32)))


def act_quant_bound(wd: np.ndarray, x: np.ndarray) -> np.ndarray:
    """(m, rows): the most that int8 block quantization of x (d = max|x| / 127, round to nearest)
    can move W x: sum over blocks of d_b / 2 * sum_{k in b} |w_k|."""
    wd, x = _pad32(wd), _pad32(x)
    m, cols = x.shape
    d = np.abs(x.astype(np.float64)).reshape(m, cols // 32, 32).max(axis=2) / 127.0
    wsum = np.abs(wd.astype(np.float64)).reshape(wd.shape[0], cols // 32, 32).sum(axis=2)
    return 0.5 * d @ wsum.T * (1 + 1e-6)


def requant_bound(wd: np.ndarray, x: np.ndarray) -> np.ndarray:
    """(m, rows): what requantizing float weights to int8 (step amax / 127 per block of 32, in
    float) adds: each weight moves by at most half its block's step (0.6 with float slack), against
    the activations and their own int8 rounding (half their step)."""
    wd, x = _pad32(wd), _pad32(x)
    m, cols = x.shape
    x64 = np.abs(x.astype(np.float64)).reshape(m, cols // 32, 32)
    step_w = np.abs(wd.astype(np.float64)).reshape(wd.shape[0], cols // 32, 32).max(axis=2) / 127.0
    xs = x64.sum(axis=2) + 16.0 * x64.max(axis=2) / 127.0
    return 0.6 * xs @ step_w.T * (1 + 1e-6)


def check_close(got: np.ndarray, want: np.ndarray, bound: np.ndarray, what: str) -> None:
    assert got.shape == want.shape, what
    assert np.all(np.isfinite(got)), what
    err = np.abs(got.astype(np.float64) - want.astype(np.float64))
    worst = float(np.max(err / (bound + 1e-30)))
    assert worst <= 1.0, f"{what}: error {worst:.3g} x the tolerance"


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def matmul_cases(wtype: str) -> list[tuple[int, int]]:
    cols = FLOAT_COLS if wtype in FLOAT_TYPES else QUANT_COLS
    return list(itertools.product(ROWS, cols))


def test_every_variant_is_classified_and_best_is_not_ref() -> None:
    """On a CPU with AVX2 the comparisons below exercise ISA kernels, not ref against itself."""
    listed = {v["name"] for v in _engine.list_variants() if v["op"] == "matmul"}
    assert "ref" in listed
    unclassified = listed - FLOAT_ACT_VARIANTS - INT8_ACT_VARIANTS - SPLIT_BF16_VARIANTS
    assert not unclassified, f"add {unclassified} to FLOAT_ACT_VARIANTS, INT8_ACT_VARIANTS or SPLIT_BF16_VARIANTS"
    chosen = _engine.kernel_variants()
    assert set(chosen) == {f"matmul/{t}/{p}" for t in _engine.weight_formats() for p in ("decode", "prefill")} | {
        "attention", "softmax", "gelu_tanh", "silu_mul", "gelu_mul", "rmsnorm", "layernorm", "rope", "add", "argmax",
        "causal_conv1d", "delta_rule", "l2norm", "rmsnorm_gated", "sigmoid_mul"}
    for key, name in chosen.items():
        if key.startswith("matmul/"):
            assert name == "ref" or name in matmul_variants(key.split("/")[1]), (key, name)
        else:
            listed = [(v["op"], v["name"]) for v in _engine.list_variants() if v["available"]]
            assert (key, name) in listed, (key, name)
    feats = _engine.cpu_features()
    if feats["avx2"] and feats["fma"] and feats["f16c"]:
        assert all(v != "ref" for v in chosen.values()), chosen


@pytest.mark.parametrize("wtype", FLOAT_TYPES + QUANT_TYPES)
def test_matmul_variants_vs_ref_vs_numpy(wtype: str) -> None:
    variants = matmul_variants(wtype)
    for rows, cols in matmul_cases(wtype):
        raw, wd = weights(wtype, rows, cols)
        w64 = wd.astype(np.float64)
        for m in MS:
            x = activations(m, cols)
            x64 = x.astype(np.float64)
            magnitude = np.abs(x64) @ np.abs(w64).T  # (m, rows)
            tight = REL_TOL * magnitude
            int8_bound = act_quant_bound(wd, x) + tight if wtype in QUANT_TYPES else tight
            shape = f"{wtype} rows={rows} cols={cols} m={m}"
            ref = _engine.kernel_matmul("ref", wtype, raw, rows, cols, x)
            assert ref.shape == (m, rows) and ref.dtype == np.float32
            check_close(ref, x64 @ w64.T, tight, f"ref {shape} vs numpy")
            outputs: dict[str, np.ndarray] = {}
            for variant in variants:
                bound = int8_bound if variant in INT8_ACT_VARIANTS else float_bound(variant, magnitude)
                if variant in REQUANT_VARIANTS and wtype in FLOAT_TYPES:
                    bound = act_quant_bound(wd, x) + requant_bound(wd, x) + tight
                for threads in THREADS:
                    y = _engine.kernel_matmul(variant, wtype, raw, rows, cols, x, threads=threads)
                    what = f"{variant} {shape} threads={threads}"
                    check_close(y, ref, bound, what + " vs ref")
                    # Each output is computed by one thread with the same arithmetic: the thread
                    # count must not change a single bit.
                    if variant in outputs:
                        assert same_bits(y, outputs[variant]), what
                    outputs[variant] = y
            chosen = chosen_variant(wtype, m, rows, cols)
            for threads in THREADS:
                best = _engine.kernel_matmul("best", wtype, raw, rows, cols, x, threads=threads)
                want = ref if chosen == "ref" else outputs[chosen]
                assert same_bits(best, want), f"best {shape} threads={threads} is not {chosen}"


@pytest.mark.parametrize("wtype", QUANT_TYPES)
def test_int8_activation_variants_exact_on_grid_activations(wtype: str) -> None:
    variants = [v for v in matmul_variants(wtype) if v in INT8_ACT_VARIANTS]
    if not variants:
        pytest.skip(f"no int8-activation variant for {wtype} on this CPU")
    for rows, cols in matmul_cases(wtype):
        raw, wd = weights(wtype, rows, cols)
        for m in (1, 2, 3, 5):
            x = grid_activations(m, cols)
            magnitude = np.abs(x.astype(np.float64)) @ np.abs(wd.astype(np.float64)).T
            want = x.astype(np.float64) @ wd.astype(np.float64).T
            for variant in variants:
                y = _engine.kernel_matmul(variant, wtype, raw, rows, cols, x, threads=2)
                check_close(y, want, REL_TOL * magnitude, f"{variant} {wtype} rows={rows} cols={cols} m={m}")


@pytest.mark.parametrize("wtype", ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q6_K"))  # the x8 layouts
def test_x8_token_result_independent_of_its_pass(wtype: str) -> None:
    """The x8 kernels unpack a group's weights once for a pass of 2, 4 or 8 tokens (prefill and
    m = 2..3 decode): each token's result must be bit-identical to the same token alone (m = 1), so
    a prompt split at any token gives the same logits as the unsplit one."""
    variants = [v for v in matmul_variants(wtype) if v.endswith("_x8") and v in INT8_ACT_VARIANTS]
    if not variants:
        pytest.skip(f"no x8 variant for {wtype} on this CPU")
    rows, cols = 40, 512
    raw = (kquant_weights if wtype in KQUANT_TYPES else weights)(wtype, rows, cols)[0]
    x = activations(13, cols)  # passes of 8 (Q5_0) or 4, then 2 and 1
    for variant in variants:
        together = _engine.kernel_matmul(variant, wtype, raw, rows, cols, x, threads=2)
        for t in range(13):
            alone = _engine.kernel_matmul(variant, wtype, raw, rows, cols, x[t : t + 1], threads=1)
            assert same_bits(together[t : t + 1], alone), f"{variant} {wtype}: token {t} of 13"


@pytest.mark.parametrize("wtype", QUANT_TYPES)
def test_int8_tolerances_have_teeth(wtype: str) -> None:
    """The tolerances above still catch real bugs. The int8 bound for random activations is loose
    (it allows d / 2 per element) but a row-wide bug (nibble order) is far outside it; a bug in one
    block of 18 (two blocks swapped) hides in it, and is caught by the tight grid-activation test."""
    rows, cols, m = 64, 576, 2
    _, wd = weights(wtype, rows, cols)
    w64 = wd.astype(np.float64)
    nibbles = w64.reshape(rows, cols // 32, 2, 16)[:, :, ::-1, :].reshape(rows, cols)
    swapped = w64.reshape(rows, cols // 32, 32)[:, [1, 0] + list(range(2, cols // 32)), :].reshape(rows, cols)
    x = activations(m, cols).astype(np.float64)
    loose = act_quant_bound(wd, x) + REL_TOL * np.abs(x) @ np.abs(w64).T
    assert np.median(np.abs(x @ (nibbles - w64).T) / loose) > 3
    g = grid_activations(m, cols).astype(np.float64)
    tight = REL_TOL * np.abs(g) @ np.abs(w64).T
    assert np.min(np.abs(g @ (swapped - w64).T) / tight) > 2  # every output, by a margin


BLOCK_BYTES = {"F16": 2, "BF16": 2, "Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
BLOCK_SIZE = {"F16": 1, "BF16": 1, "Q4_0": 32, "Q4_1": 32, "Q8_0": 32}


def finite_halves(h: np.ndarray) -> np.ndarray:
    """fp16 bit patterns with inf/NaN (exponent 31) moved to exponent 30: every finite value stays."""
    return np.where((h & 0x7C00) == 0x7C00, h & np.uint16(0xFBFF), h).astype(np.uint16)


@pytest.mark.parametrize("wtype", ["F16", "BF16"] + list(QUANT_TYPES))
def test_matmul_on_arbitrary_bytes(wtype: str) -> None:
    """Weights no quantizer would write: random bit patterns (negative and subnormal scales, every
    nibble and int8 value, subnormal and huge halves); inf/NaN halves and bfloat16s excluded."""
    rng = np.random.default_rng(11)
    rows, cols = 64, 96
    n_blocks = rows * cols // BLOCK_SIZE[wtype]
    raw = rng.integers(0, 256, (n_blocks, BLOCK_BYTES[wtype]), dtype=np.uint8)
    n_half = 4 if wtype == "Q4_1" else 2  # the fp16 scale (and min) at the start of each block
    halves = raw[:, :n_half].copy().view(np.uint16)
    if wtype == "BF16":
        halves &= np.uint16(0xBFFF)  # |w| < 2: products with x stay far from float32 overflow
    else:
        halves = finite_halves(halves)
    raw[:, :n_half] = halves.view(np.uint8)
    raw = raw.reshape(-1)
    wd = _engine.dequantize(wtype, raw, rows * cols).reshape(rows, cols)
    assert np.all(np.isfinite(wd))
    for m in (1, 5):
        for x in (activations(m, cols), grid_activations(m, cols)):
            magnitude = np.abs(x.astype(np.float64)) @ np.abs(wd.astype(np.float64)).T
            want = x.astype(np.float64) @ wd.astype(np.float64).T
            ref = _engine.kernel_matmul("ref", wtype, raw, rows, cols, x)
            check_close(ref, want, REL_TOL * magnitude, f"ref {wtype} on random bytes vs numpy")
            for variant in matmul_variants(wtype) + ["best"]:
                actual = chosen_variant(wtype, m, rows, cols) if variant == "best" else variant
                bound = float_bound(actual, magnitude)
                if actual in INT8_ACT_VARIANTS:
                    bound = bound + act_quant_bound(wd, x)
                if actual in REQUANT_VARIANTS and wtype in FLOAT_TYPES:
                    bound = bound + requant_bound(wd, x)
                for threads in (1, 3):
                    y = _engine.kernel_matmul(variant, wtype, raw, rows, cols, x, threads=threads)
                    check_close(y, ref, bound, f"{variant} {wtype} m={m} on random bytes vs ref")


def test_ref_matmul_rows_and_tokens_are_independent() -> None:
    """In 'ref', row r of y depends on row r of W only and token t on x[t] only: a 1 x 1 product of
    each (row, token) equals that entry of the whole product, bit for bit."""
    rows, cols, m = 17, 96, 5
    for wtype in FLOAT_TYPES + QUANT_TYPES:
        raw, _ = weights(wtype, rows, cols)
        x = activations(m, cols)
        row_bytes = raw.size // rows
        full = _engine.kernel_matmul("ref", wtype, raw, rows, cols, x, threads=2)
        for r in (0, 7, 16):
            one_row = raw[r * row_bytes:(r + 1) * row_bytes]
            for t in range(m):
                y = _engine.kernel_matmul("ref", wtype, one_row, 1, cols, x[t:t + 1])
                assert y.view(np.uint32)[0, 0] == full.view(np.uint32)[t, r], (wtype, r, t)


@pytest.mark.parametrize("wtype", FLOAT_TYPES + QUANT_TYPES)
def test_matmul_weights_at_any_byte_alignment(wtype: str) -> None:
    """Weights are read in place from the mapped file, where general.alignment may be 1: a weight
    buffer starting 1, 2 or 3 bytes past an aligned address gives the same bits as an aligned one.
    (Under the sanitizer build this also checks that no kernel loads through a misaligned pointer.)"""
    rows, cols = 17, (37 if wtype in FLOAT_TYPES else 160)  # 37: scalar tails after the SIMD loops
    raw, _ = weights(wtype, rows, cols)
    for m in (1, 5):
        x = activations(m, cols)
        for variant in ["ref", "best"] + matmul_variants(wtype):
            aligned = _engine.kernel_matmul(variant, wtype, raw, rows, cols, x, threads=2)
            for shift in (1, 2, 3):
                buf = np.zeros(raw.size + 64, np.uint8)
                base = (-buf.ctypes.data) % 64  # a 64-byte aligned start inside buf
                view = buf[base + shift:base + shift + raw.size]
                view[:] = raw
                assert view.ctypes.data % 64 == shift
                got = _engine.kernel_matmul(variant, wtype, view, rows, cols, x, threads=2)
                assert same_bits(got, aligned), (variant, m, shift)


@pytest.mark.parametrize("wtype", FLOAT_TYPES + QUANT_TYPES)
def test_matmul_zero_weights_and_inputs(wtype: str) -> None:
    rows, cols = 3, 64
    raw = _engine.quantize(wtype, np.zeros(rows * cols, np.float32)) if wtype != "BF16" else np.zeros(
        rows * cols * 2, np.uint8)
    raw_w, _ = weights(wtype, rows, cols)
    for m in (1, 5):
        x = activations(m, cols)
        for variant in ["ref", "best"] + matmul_variants(wtype):
            assert not np.any(_engine.kernel_matmul(variant, wtype, raw, rows, cols, x)), variant
            assert not np.any(_engine.kernel_matmul(variant, wtype, raw_w, rows, cols, np.zeros_like(x))), variant


@pytest.mark.parametrize("gemm", GEMM_VARIANTS)
@pytest.mark.parametrize("wtype", FLOAT_TYPES + QUANT_TYPES)
def test_gemm_panels_k_blocks_and_token_pieces(wtype: str, gemm: str) -> None:
    """avx512_gemm works in panels of 48 rows (3 x 16 lanes) and k blocks of 192, amx_gemm in
    panels of 32 rows (2 tiles of 16), k blocks of 256 in steps of 32 and 16-token tiles: the
    cases above (<= 129 rows, so small chunks, and k <= 576) do not reach a full panel or a partial
    last k block. Here rows = 1000 (chunks of 128 = 48 + 48 + 32, the last one 104 = 48 + 48 + 8;
    amx: 4 x 32, the last 104 = 3 x 32 + 8), k with a tail block (193, 200 for floats; 416 =
    2 x 192 + 32 = 256 + 160 for blocks; 600 for amx: 2 x 256 + 88), weights at a misaligned
    address, m past one tile (8 tokens, 2 x 16 for amx). Each output is one fixed sequence of
    operations over k, so a token's result must not depend on the other tokens in the call or the
    thread count."""
    if gemm not in matmul_variants(wtype):
        pytest.skip(f"{gemm} does not run on this CPU")
    rows = 1000
    for cols in ((193, 200, 600) if wtype in FLOAT_TYPES else (416,)):
        raw, wd = weights(wtype, rows, cols)
        buf = np.zeros(raw.size + 64, np.uint8)
        base = (-buf.ctypes.data) % 64 + 3  # 3 bytes past a 64-byte boundary
        shifted = buf[base:base + raw.size]
        shifted[:] = raw
        for m in (4, 9, 40, 64):
            x = activations(m, cols)
            magnitude = np.abs(x.astype(np.float64)) @ np.abs(wd.astype(np.float64)).T
            ref = _engine.kernel_matmul("ref", wtype, raw, rows, cols, x)
            got = {}
            for threads in (1, 2, 3):
                y = _engine.kernel_matmul(gemm, wtype, shifted, rows, cols, x, threads=threads)
                check_close(y, ref, float_bound(gemm, magnitude), f"{gemm} {wtype} rows={rows} cols={cols} m={m}")
                got[threads] = y
            assert same_bits(got[1], got[2]) and same_bits(got[1], got[3]), (wtype, cols, m)
            piece = _engine.kernel_matmul(gemm, wtype, raw, rows, cols, x[m - 3:], threads=2)
            assert same_bits(piece, got[1][m - 3:]), (wtype, cols, m)


@pytest.mark.parametrize("gemm", GEMM_VARIANTS)
@pytest.mark.parametrize("wtype", FLOAT_TYPES + QUANT_TYPES)
def test_gemm_prefill_only_weights_read_p16(wtype: str, gemm: str) -> None:
    """A prefill-only weight (the vision tower's: no decode kernel) is read by either GEMM in the
    p16 layout it prefers (kernels/matmul/packed_p16.h) for the float formats; the results are the
    rows path's, bit for bit, for every shape, token count and thread count, and 'best' on such a
    weight is the chosen variant's. A weight with both phases keeps reading the rows (no second
    copy next to the decode kernel's)."""
    if gemm not in matmul_variants(wtype):
        pytest.skip(f"{gemm} does not run on this CPU")
    shapes = ((1, 7), (17, 37), (64, 64), (100, 200), (113, 416), (1000, 193)) if wtype in FLOAT_TYPES else (
        (17, 64), (64, 416), (113, 160))
    for rows, cols in shapes:
        raw, wd = weights(wtype, rows, cols)
        for m in (1, 3, 9, 64, 70):
            x = activations(m, cols)
            want_layout = "p16" if wtype in FLOAT_TYPES else "rows"
            layout = _engine.kernel_matmul_layout(gemm, wtype, raw, rows, cols, x, prefill_only=True)
            assert layout == want_layout
            assert _engine.kernel_matmul_layout(gemm, wtype, raw, rows, cols, x) != "p16"
            rows_path = _engine.kernel_matmul(gemm, wtype, raw, rows, cols, x, threads=2)
            chosen = _engine.choose_matmul(wtype, "prefill", rows, cols)
            for threads in (1, 2, 3):
                got = _engine.kernel_matmul(gemm, wtype, raw, rows, cols, x, threads=threads, prefill_only=True)
                assert same_bits(got, rows_path), (wtype, rows, cols, m, threads)
                best = _engine.kernel_matmul("best", wtype, raw, rows, cols, x, threads=threads, prefill_only=True)
                if chosen == gemm:
                    assert same_bits(best, got), (wtype, rows, cols, m, threads)


def test_matmul_argument_checks() -> None:
    raw, _ = weights("Q4_0", 3, 64)
    x = activations(2, 64)
    with pytest.raises(ValueError):
        _engine.kernel_matmul("best", "Q4_0", raw[:-1], 3, 64, x)  # byte count
    with pytest.raises(ValueError):
        _engine.kernel_matmul("best", "Q4_0", raw, 3, 48, x[:, :48])  # not whole blocks
    with pytest.raises(ValueError):
        _engine.kernel_matmul("best", "Q4_0", raw, 3, 64, x[:, :32])  # x width
    with pytest.raises(ValueError):
        _engine.kernel_matmul("best", "Q4_0", raw, 3, 64, x, threads=0)
    with pytest.raises(ValueError):
        _engine.kernel_matmul("no_such_variant", "Q4_0", raw, 3, 64, x)
    with pytest.raises(ValueError):
        _engine.kernel_matmul("best", "Q4_K", raw, 3, 64, x)
    f32, _ = weights("F32", 3, 64)
    for variant in INT8_ACT_VARIANTS & set(matmul_variants("Q4_0")):
        with pytest.raises(ValueError):
            _engine.kernel_matmul(variant, "F32", f32, 3, 64, x)  # int8 activations need int weights


# --------------------------------------------------------------------------------------------
# Q5_0, Q5_1, IQ4_NL and the K-quants (kernels/matmul/kquant_avx2.h, q8act_k_body.inc)
# --------------------------------------------------------------------------------------------

# Byte offsets of the fp16 fields (scales, mins) in each block.
KQUANT_HALVES = {"Q5_0": (0,), "Q5_1": (0, 2), "IQ4_NL": (0,), "Q2_K": (80, 82), "Q3_K": (108,),
                 "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
KQUANT_ROWS = (1, 3, 17, 129)


def kquant_cols(wtype: str) -> tuple[int, ...]:
    return (256, 512, 2304) if gguf.GGML_QUANT_SIZES[QT[wtype]][0] == 256 else (32, 96, 160, 576)


def need_kquant(wtype: str) -> None:
    if wtype not in _engine.weight_formats():
        pytest.skip(f"{wtype} has no reference dequantizer in this build (kernels/formats)")


@cache
def kquant_weights(wtype: str, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """(raw blocks, their float32 values): random bytes (every quant, scale and high-bit pattern)
    with finite fp16 scales whose size varies over four decades from row to row."""
    rng = np.random.default_rng(rows * 7919 + cols * 13 + len(wtype) + int(QT[wtype]))
    elems, size = gguf.GGML_QUANT_SIZES[QT[wtype]]
    per_row = cols // elems
    raw = rng.integers(0, 256, (rows, per_row, size), dtype=np.uint8)
    row_scale = 10.0 ** rng.uniform(-3, 1, (rows, 1))
    for off in KQUANT_HALVES[wtype]:
        h = (rng.standard_normal((rows, per_row)) * row_scale).astype(np.float16)
        raw[:, :, off:off + 2] = h.view(np.uint8).reshape(rows, per_row, 2)
    raw = raw.reshape(-1)
    dequant = _engine.dequantize(wtype, raw, rows * cols).reshape(rows, cols)
    return raw, dequant


@pytest.mark.parametrize("wtype", KQUANT_TYPES)
def test_kquant_variants_vs_ref_vs_numpy(wtype: str) -> None:
    """Every variant for the format against 'ref' (int8-activation ones within the activation
    rounding bound, the float ones within REL_TOL), 'ref' against gguf's dequantize in float64,
    bit-identical across thread counts, and 'best' is the chosen variant's bits. Rows 1, 3, 17,
    129 (the 4-row interleave's tails), k of 1, 2 and 9 super-blocks (or 1 to 18 blocks of 32: the
    kernels' groups of 8 blocks and their tails)."""
    need_kquant(wtype)
    variants = matmul_variants(wtype)
    for rows, cols in itertools.product(KQUANT_ROWS, kquant_cols(wtype)):
        raw, wd = kquant_weights(wtype, rows, cols)
        w64 = gguf.quants.dequantize(raw, QT[wtype]).reshape(rows, cols).astype(np.float64)
        assert np.array_equal(wd, w64.astype(np.float32)), f"{wtype} reference dequantizer vs gguf"
        for m in (1, 3, 5):
            x = activations(m, cols)
            magnitude = np.abs(x.astype(np.float64)) @ np.abs(w64).T
            shape = f"{wtype} rows={rows} cols={cols} m={m}"
            ref = _engine.kernel_matmul("ref", wtype, raw, rows, cols, x)
            check_close(ref, x.astype(np.float64) @ w64.T, REL_TOL * magnitude, f"ref {shape} vs numpy")
            outputs: dict[str, np.ndarray] = {}
            for variant in variants:
                bound = float_bound(variant, magnitude)
                if variant in INT8_ACT_VARIANTS:
                    bound = bound + act_quant_bound(wd, x)
                for threads in (1, 3):
                    y = _engine.kernel_matmul(variant, wtype, raw, rows, cols, x, threads=threads)
                    check_close(y, ref, bound, f"{variant} {shape} threads={threads} vs ref")
                    if variant in outputs:
                        assert same_bits(y, outputs[variant]), f"{variant} {shape} threads={threads}"
                    outputs[variant] = y
            chosen = chosen_variant(wtype, m, rows, cols)
            best = _engine.kernel_matmul("best", wtype, raw, rows, cols, x, threads=2)
            assert same_bits(best, ref if chosen == "ref" else outputs[chosen]), f"best {shape} is not {chosen}"


@pytest.mark.parametrize("wtype", KQUANT_TYPES)
def test_kquant_int8_variants_exact_on_grid_activations(wtype: str) -> None:
    """On activations the int8 quantizer reproduces exactly, the integer path must be as exact
    as float: a wrong nibble, fifth bit, 6-bit scale or min, level table entry or sub-block order
    moves results by ~1 in these units (test_kquant_tolerances_have_teeth)."""
    need_kquant(wtype)
    variants = [v for v in matmul_variants(wtype) if v in INT8_ACT_VARIANTS]
    if not variants:
        pytest.skip(f"no int8-activation variant for {wtype} on this CPU")
    for rows, cols in itertools.product(KQUANT_ROWS, kquant_cols(wtype)):
        raw, wd = kquant_weights(wtype, rows, cols)
        w64 = wd.astype(np.float64)
        for m in (1, 3):
            x = grid_activations(m, cols)
            want = x.astype(np.float64) @ w64.T
            magnitude = np.abs(x.astype(np.float64)) @ np.abs(w64).T
            for variant in variants:
                y = _engine.kernel_matmul(variant, wtype, raw, rows, cols, x, threads=2)
                check_close(y, want, REL_TOL * magnitude, f"{variant} {wtype} rows={rows} cols={cols} m={m}")


@pytest.mark.parametrize("wtype", KQUANT_TYPES)
def test_kquant_tolerances_have_teeth(wtype: str) -> None:
    """The grid test's bound catches the smallest layout mistakes a kernel could make (on most
    outputs, with a wide margin): two
    sub-blocks of 32 swapped, the two 16-element halves of one swapped (the per-16 scales of
    Q2_K / Q3_K / Q6_K), or one sub-block's scale and min taken from its neighbour."""
    need_kquant(wtype)
    rows, cols, m = 17, kquant_cols(wtype)[1], 2
    _, wd = kquant_weights(wtype, rows, cols)
    w64 = wd.astype(np.float64)
    subs = w64.reshape(rows, cols // 32, 32)
    swapped = subs[:, [1, 0] + list(range(2, cols // 32)), :].reshape(rows, cols)
    halves = subs.copy()
    halves[:, 0] = np.concatenate([subs[:, 0, 16:], subs[:, 0, :16]], axis=1)
    g = grid_activations(m, cols).astype(np.float64)
    tight = REL_TOL * np.abs(g) @ np.abs(w64).T
    # Median, not min: a block whose random fp16 scale is near 0 hides a swap in some outputs.
    assert np.median(np.abs(g @ (swapped - w64).T) / tight) > 10
    assert np.median(np.abs(g @ (halves.reshape(rows, cols) - w64).T) / tight) > 10


@pytest.mark.parametrize("wtype", KQUANT_TYPES)
def test_kquant_weights_at_any_byte_alignment_and_zero(wtype: str) -> None:
    """Rows read in place at any byte offset give the same bits; zero scales or zero inputs give 0."""
    need_kquant(wtype)
    rows, cols = 17, kquant_cols(wtype)[1]
    raw, _ = kquant_weights(wtype, rows, cols)
    zero = raw.reshape(rows * cols // gguf.GGML_QUANT_SIZES[QT[wtype]][0], -1).copy()
    for off in KQUANT_HALVES[wtype]:
        zero[:, off:off + 2] = 0
    for m in (1, 5):
        x = activations(m, cols)
        for variant in ["ref", "best"] + matmul_variants(wtype):
            aligned = _engine.kernel_matmul(variant, wtype, raw, rows, cols, x, threads=2)
            buf = np.zeros(raw.size + 64, np.uint8)
            base = (-buf.ctypes.data) % 64 + 3
            view = buf[base:base + raw.size]
            view[:] = raw
            assert same_bits(_engine.kernel_matmul(variant, wtype, view, rows, cols, x, threads=2), aligned), variant
            assert not np.any(_engine.kernel_matmul(variant, wtype, zero.reshape(-1), rows, cols, x)), variant
            assert not np.any(_engine.kernel_matmul(variant, wtype, raw, rows, cols, np.zeros_like(x))), variant


# --------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------


def attention_numpy(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """(out, sum_j p_j |v_j|) in float64."""
    s = scale * (k.astype(np.float64) @ q.astype(np.float64))
    p = np.exp(s - s.max())
    p /= p.sum()
    return p @ v.astype(np.float64), p @ np.abs(v.astype(np.float64))


def attention_bound(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """Error scale of the attention output: the weighted |v| sum times the spread of the scores.

    A relative error e of a score moves p_j by about e |s_j| p_j, so the output error scales with
    max |s| as well as with sum_j p_j |v_j|.
    """
    s = scale * np.abs(k.astype(np.float64)) @ np.abs(q.astype(np.float64))
    _, weighted = attention_numpy(q, k, v, scale)
    return REL_TOL * (weighted * (1.0 + s.max()) + np.abs(v).max() * 1e-3)


# n_kv around the 8-key score groups and head_dims around the 8-float chunks and 64-float blocks
# of the AVX2 variant (tails of both, one and several blocks).
@pytest.mark.parametrize("n_kv", [1, 2, 7, 9, 31, 33, 257, 300])
@pytest.mark.parametrize("d", [1, 8, 13, 24, 64, 80, 128, 200])
@pytest.mark.parametrize("sharpness", [0.1, 1.0, 8.0])
def test_attention_variants_vs_ref_vs_numpy(n_kv: int, d: int, sharpness: float) -> None:
    rng = np.random.default_rng(n_kv * 1000 + d * 10 + int(sharpness * 10))
    q = (rng.standard_normal(d) * sharpness).astype(np.float32)
    k = rng.standard_normal((n_kv, d)).astype(np.float32)
    v = (rng.standard_normal((n_kv, d)) * 3.0).astype(np.float32)
    scale = float(1.0 / np.sqrt(d))
    want, _ = attention_numpy(q, k, v, scale)
    bound = attention_bound(q, k, v, scale)
    ref = _engine.kernel_attention("ref", q, k, v, scale)
    assert ref.shape == (d,) and ref.dtype == np.float32
    check_close(ref, want, bound, f"attention ref n_kv={n_kv} d={d} vs numpy")
    for variant in ["best"] + attention_variants():
        out = _engine.kernel_attention(variant, q, k, v, scale)
        assert out.shape == (d,) and out.dtype == np.float32
        check_close(out, ref, bound, f"attention {variant} n_kv={n_kv} d={d} vs ref")
        check_close(out, want, bound, f"attention {variant} n_kv={n_kv} d={d} vs numpy")


@pytest.mark.parametrize("variant", ["ref", "best"])
def test_attention_edge_cases(variant: str) -> None:
    rng = np.random.default_rng(5)
    d, n = 64, 31
    v = rng.standard_normal((n, d)).astype(np.float32)
    k = rng.standard_normal((n, d)).astype(np.float32)
    q = rng.standard_normal(d).astype(np.float32)
    # One key: the output is its value exactly.
    assert np.array_equal(_engine.kernel_attention(variant, q, k[:1], v[:1], 0.125), v[0])
    # Scale 0 (or identical keys): a plain mean of the values.
    mean = v.astype(np.float64).mean(axis=0)
    mean_bound = REL_TOL * np.abs(v).mean(axis=0)
    check_close(_engine.kernel_attention(variant, q, k, v, 0.0), mean, mean_bound, "scale 0")
    same_k = np.repeat(k[:1], n, axis=0)
    check_close(_engine.kernel_attention(variant, q, same_k, v, 0.125), mean, mean_bound, "same keys")
    # A dominant key: scores 1e4 apart give weight 1 to it and exactly 0 to the rest, without overflow.
    k2 = k.copy()
    k2[17] = q / np.float32(np.dot(q, q)) * np.float32(1e4)
    out = _engine.kernel_attention(variant, q, k2, v, 1.0)
    assert np.all(np.isfinite(out))
    check_close(out, v[17], REL_TOL * (np.abs(v[17]) + 1e-6), "dominant key")
    # Large scores everywhere (without the max subtraction exp would overflow float32).
    q100 = q * np.float32(100)
    out = _engine.kernel_attention(variant, q100, k, v, 1.0)
    want, _ = attention_numpy(q100, k, v, 1.0)
    assert np.all(np.isfinite(out))
    check_close(out, want, attention_bound(q100, k, v, 1.0), "large scores")


def kv_roundtrip(x: np.ndarray, kv_type: str) -> np.ndarray:
    """x as a kv_type cache holds it: the formats' reference conversion there and back."""
    if kv_type == "f16":
        return x.astype(np.float16).astype(np.float32)
    raw = _engine.quantize("Q8_0", x.reshape(-1))
    return _engine.dequantize("Q8_0", raw, x.size).reshape(x.shape)


# Half and int8 caches (the decoder's kv_type): head sizes that are multiples of 32 (one block, the
# AVX2 variant's 64-float passes and a 32-float last pass), n_kv around its 8-key groups.
@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
@pytest.mark.parametrize("n_kv", [1, 7, 9, 33, 300])
@pytest.mark.parametrize("d", [32, 64, 96, 256])
def test_attention_compressed_cache_vs_ref_vs_numpy(kv_type: str, n_kv: int, d: int) -> None:
    """Every variant on an f16 / q8_0 cache equals attention in float64 over the keys and values the
    cache holds (their round trip through the format), within the float tolerance; and the q8_0
    cache stays within int8's error of the float cache."""
    rng = np.random.default_rng(n_kv * 7 + d + len(kv_type))
    q = (rng.standard_normal(d) * 2.0).astype(np.float32)
    k = rng.standard_normal((n_kv, d)).astype(np.float32)
    v = (rng.standard_normal((n_kv, d)) * 3.0).astype(np.float32)
    scale = float(1.0 / np.sqrt(d))
    kq, vq = kv_roundtrip(k, kv_type), kv_roundtrip(v, kv_type)
    want, _ = attention_numpy(q, kq, vq, scale)
    bound = attention_bound(q, kq, vq, scale)
    for variant in ["ref", "best"] + attention_variants():
        out = _engine.kernel_attention(variant, q, k, v, scale, kv_type=kv_type)
        assert out.shape == (d,) and out.dtype == np.float32
        check_close(out, want, bound, f"attention {variant} kv_type={kv_type} n_kv={n_kv} d={d}")
    # Against the float cache: the format's own error, not a bug's (q8_0: d / 2 per element of
    # keys and values; a 4-key swap or a lost block scale is orders of magnitude beyond).
    exact, _ = attention_numpy(q, k, v, scale)
    err = np.abs(_engine.kernel_attention("best", q, k, v, scale, kv_type=kv_type) - exact)
    assert float(err.max()) < (0.05 if kv_type == "q8_0" else 0.005) * float(np.abs(v).max())


def test_attention_compressed_cache_checks() -> None:
    q = np.zeros(40, np.float32)
    kv = np.zeros((3, 40), np.float32)
    with pytest.raises(ValueError, match="multiple of 32"):
        _engine.kernel_attention("ref", q, kv, kv, 1.0, kv_type="q8_0")
    with pytest.raises(ValueError, match="kv_type"):
        _engine.kernel_attention("ref", q[:32], kv[:, :32], kv[:, :32], 1.0, kv_type="q4_0")


def test_attention_argument_checks() -> None:
    q = np.zeros(8, np.float32)
    kv = np.zeros((3, 8), np.float32)
    with pytest.raises(ValueError):
        _engine.kernel_attention("ref", q, kv[:0], kv[:0], 1.0)  # n_kv = 0
    with pytest.raises(ValueError):
        _engine.kernel_attention("ref", q[:4], kv, kv, 1.0)
    with pytest.raises(ValueError):
        _engine.kernel_attention("ref", q, kv, kv[:2], 1.0)
    with pytest.raises(ValueError):
        _engine.kernel_attention("no_such_variant", q, kv, kv, 1.0)


# --------------------------------------------------------------------------------------------
# Exp-based element-wise operators: softmax, gelu_tanh, silu_mul, gelu_mul
# --------------------------------------------------------------------------------------------
# Error bounds, per element, against float64 evaluated on the same float32 inputs:
#   EXP_REL = 2e-6 relative (the vector exp is ~1.2 ulp on its reduced range; a few roundings
#   follow: measured worst 2.3e-7);
#   + EXP_FLOOR absolute: the variants flush exp() below exp(-87.3) = 1.26e-38 to 0, where libm
#   gives a subnormal; |x| and |b| (at most a few hundred there) scale what is flushed;
#   gelu_tanh + GELU_X_REL |x|: the reference computes 0.5 x (1 + tanh y) in float, and 1 + tanh y
#   keeps no digits where tanh y is near -1 (x below about -3): measured up to 1.0 |x| 2^-23;
#   gelu_mul (gelu_tanh(x) b) the same times |b|, GELU_X_REL |x b|;
#   softmax: the reference adds the exponentials in float, one after another, which costs it up to
#   ~sqrt(n) float roundings of the sum (2.2e-6 at n = 4097); variant and reference are compared
#   after renormalizing each row in float64, which removes the sum, and the variant's own sum (it
#   adds in double) must be 1 within SOFTMAX_SUM_TOL.
EXP_REL = 2e-6
EXP_FLOOR = 1e-35
GELU_X_REL = 2.0 ** -22
SOFTMAX_SUM_TOL = 1e-6
EW_SIZES = (1, 7, 8, 9, 31, 33, 257, 1000, 4097)
EW_SPREADS = (1.0, 8.0, 90.0, 1e4)
EW_OPS = ("softmax", "gelu_tanh", "silu_mul", "gelu_mul")
NORM_OPS = ("rmsnorm", "layernorm", "rope", "add")


def ew_variants(op: str) -> list[str]:
    """The variants of op that run on this CPU, 'ref' excluded."""
    return [v["name"] for v in _engine.list_variants() if v["op"] == op and v["available"] and v["name"] != "ref"]


def sigmoid64(z: np.ndarray) -> np.ndarray:
    t = np.exp(-np.abs(z))
    return np.where(z >= 0, 1.0 / (1.0 + t), t / (1.0 + t))


def gelu64(x: np.ndarray) -> np.ndarray:
    """0.5 x (1 + tanh(y)) = x sigmoid(2y), y = sqrt(2/pi) (x + 0.044715 x^3), in float64."""
    x = x.astype(np.float64)
    return x * sigmoid64(2.0 * np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3))


def softmax64(x: np.ndarray, scale: float) -> np.ndarray:
    """The exact softmax of the float32 arguments the kernels form: scale * (x - max), each
    operation rounded to float32 as in the reference."""
    arg = np.float32(scale) * (x - x.max(axis=-1, keepdims=True))
    e = np.exp(arg.astype(np.float64))
    return e / e.sum(axis=-1, keepdims=True)


def renorm(p: np.ndarray) -> np.ndarray:
    p = p.astype(np.float64)
    return p / p.sum(axis=-1, keepdims=True)


def ew_inputs(op: str, n: int, spread: float) -> tuple[np.ndarray, np.ndarray]:
    """(x, b): 3 rows of n values, uniform in +-spread; for softmax also normal scores and one
    masking-like score of -1e4 per row."""
    rng = np.random.default_rng(n * 31 + int(spread) + len(op))
    x = rng.uniform(-spread, spread, (3, n))
    if op == "softmax":
        x[1] = rng.standard_normal(n) * spread
        if n > 2:
            x[:, n // 3] = -1e4
    b = rng.uniform(-3.0, 3.0, (3, n))
    return x.astype(np.float32), b.astype(np.float32)


def ew_run(op: str, variant: str, x: np.ndarray, b: np.ndarray, scale: float = 0.125) -> np.ndarray:
    if op == "softmax":
        return _engine.kernel_elementwise(op, variant, x, scale=scale)
    if op == "gelu_tanh":
        return _engine.kernel_elementwise(op, variant, x)
    return _engine.kernel_elementwise(op, variant, x, b)


def ew_bound(op: str, want: np.ndarray, x: np.ndarray, b: np.ndarray) -> np.ndarray:
    bound = EXP_REL * np.abs(want) + EXP_FLOOR
    if op == "gelu_tanh":
        bound = bound + GELU_X_REL * np.abs(x.astype(np.float64))
    if op == "gelu_mul":
        bound = bound + GELU_X_REL * np.abs(x.astype(np.float64) * b)
    return bound


@pytest.mark.parametrize("op", EW_OPS + NORM_OPS)
def test_elementwise_variant_is_chosen(op: str) -> None:
    """With AVX2 + FMA the operator table serves softmax, gelu_tanh, silu_mul, gelu_mul, rmsnorm,
    layernorm, rope and add with 'avx2'."""
    chosen = _engine.kernel_variants()
    assert chosen[op] == _engine.choose(op)
    assert chosen[op] == "ref" or chosen[op] in ew_variants(op)
    feats = _engine.cpu_features()
    if feats["avx2"] and feats["fma"] and feats["f16c"]:
        assert chosen[op] == "avx2", (op, chosen[op])
        assert "avx2" in ew_variants(op)


def test_choose_rejects_matmul_and_unknown_operators() -> None:
    with pytest.raises(ValueError):
        _engine.choose("matmul")
    with pytest.raises(ValueError):
        _engine.choose("no_such_op")


@pytest.mark.parametrize("op", EW_OPS)
@pytest.mark.parametrize("spread", EW_SPREADS)
def test_elementwise_variants_vs_ref_vs_numpy(op: str, spread: float) -> None:
    chosen = _engine.kernel_variants()[op]
    for n in EW_SIZES:
        x, b = ew_inputs(op, n, spread)
        shape = f"{op} n={n} spread={spread:g}"
        if op == "softmax":
            want = softmax64(x, 0.125)
        elif op == "gelu_tanh":
            want = gelu64(x)
        elif op == "gelu_mul":
            want = gelu64(x) * b
        else:
            want = x.astype(np.float64) * sigmoid64(x.astype(np.float64)) * b
        bound = ew_bound(op, want, x, b)
        ref = ew_run(op, "ref", x, b)
        assert ref.shape == x.shape and ref.dtype == np.float32
        if op == "softmax":
            # The reference's float sum: compared after renormalizing (see above).
            check_close(renorm(ref), want, bound, f"ref {shape} vs numpy")
        else:
            check_close(ref, want, bound, f"ref {shape} vs numpy")
        for variant in ew_variants(op):
            got = ew_run(op, variant, x, b)
            assert got.shape == x.shape and got.dtype == np.float32
            check_close(got, want, bound, f"{variant} {shape} vs numpy")
            if op == "softmax":
                check_close(renorm(got), renorm(ref), ew_bound(op, renorm(ref), x, b), f"{variant} {shape} vs ref")
                sums = got.astype(np.float64).sum(axis=-1)
                assert np.all(np.abs(sums - 1.0) <= SOFTMAX_SUM_TOL), (variant, shape, sums)
            else:
                check_close(got, ref, 2 * ew_bound(op, ref, x, b), f"{variant} {shape} vs ref")
            if variant == chosen:
                assert same_bits(ew_run(op, "best", x, b), got), f"best {shape} is not {chosen}"


@pytest.mark.parametrize("variant", ["ref", "best"])
def test_elementwise_edge_values(variant: str) -> None:
    """Exact values where the operators have them, and nothing inf or NaN for finite input."""
    x = np.array([0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0, 100.0, -100.0, 1e4, -1e4, 3e38, -3e38], np.float32)
    g = _engine.kernel_elementwise("gelu_tanh", variant, x)
    s = _engine.kernel_elementwise("silu_mul", variant, x, np.ones_like(x))
    gm = _engine.kernel_elementwise("gelu_mul", variant, x, np.ones_like(x))
    assert same_bits(gm, g), (variant, gm, g)  # times 1: gelu_tanh itself
    for y in (g, s):
        assert np.all(np.isfinite(y)), (variant, y)
        assert y[0] == 0 and y[1] == 0
        assert np.all(y[[6, 8, 10]] == x[[6, 8, 10]])  # large positive x: x itself
        assert np.all(y[[7, 9, 11]] == 0)  # large negative x: 0
    # Softmax: one element is 1; equal scores are 1/n; scores 1e4 below the maximum are 0.
    assert _engine.kernel_elementwise("softmax", variant, np.array([5.0], np.float32))[0] == 1.0
    flat = _engine.kernel_elementwise("softmax", variant, np.full(33, 7.0, np.float32), scale=0.3)
    assert np.all(np.abs(flat - 1 / 33) <= EXP_REL / 33)
    p = _engine.kernel_elementwise("softmax", variant, np.array([0.0, -1e4, 1e4, -3e38, 3e38], np.float32))
    assert np.array_equal(p, [0.0, 0.0, 0.0, 0.0, 1.0])


def test_elementwise_argument_checks() -> None:
    x = np.zeros(8, np.float32)
    with pytest.raises(ValueError):
        _engine.kernel_elementwise("softmax", "no_such_variant", x)
    with pytest.raises(ValueError):
        _engine.kernel_elementwise("no_such_op", "ref", x)
    with pytest.raises(ValueError):
        _engine.kernel_elementwise("silu_mul", "ref", x)  # b missing
    with pytest.raises(ValueError):
        _engine.kernel_elementwise("silu_mul", "ref", x, x[:4])
    with pytest.raises(ValueError):
        _engine.kernel_elementwise("gelu_tanh", "ref", x[:0])


# --------------------------------------------------------------------------------------------
# Norms, rope and add
# --------------------------------------------------------------------------------------------
# Error bounds (docs/kernels/elementwise-norms.md derives them), u = 2^-24, against the reference:
#   rmsnorm: the variants add the squares in float lanes (avx2: 32 partial sums, neon: 16, then a
#   fixed tree) where the reference adds in double; a partial of m terms is within m + 5 roundings
#   of the exact sum, which moves the scale by half as much, plus a few roundings of the output:
#   |got - ref| <= (n/32 + 10) u |ref| (n/32: the 16-partial case; measured worst ~0.4 of it);
#   layernorm: the float mean is off by up to (n/16 + 6) u mean|x| (scaled by inv |w| in the
#   output), the variance like rmsnorm's sum: (n/16 + 8) u inv |w| mean|x| + (n/32 + 12) u
#   |(x - mean) inv w| + 2 u |b|;
#   rope: the variants round one product fewer than the reference (an FMA): 4 u (|a| + |b|)(|c| + |s|)
#   per rotated element; elements past the rotated pairs are left bit for bit;
#   add: one rounding, as in the reference: bit for bit.
U = 2.0 ** -24
NORM_SIZES = (1, 7, 8, 9, 63, 64, 65, 576, 577, 768, 1000)


def norm_inputs(n: int, offset: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(x: 5 rows of n, w, b): x normal * 2 + offset (a residual stream's rows are not centred)."""
    rng = np.random.default_rng(n * 7 + abs(int(offset * 10)) + 1)
    x = rng.standard_normal((5, n)) * 2.0 + offset
    x[1] *= 1e-3  # a row of tiny values: eps matters
    w = 1.0 + 0.3 * rng.standard_normal(n)
    b = rng.standard_normal(n)
    return x.astype(np.float32), w.astype(np.float32), b.astype(np.float32)


def rmsnorm64(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + np.float32(eps)) * w


def layernorm_bound(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, eps: float) -> np.ndarray:
    n = x.shape[-1]
    x64 = x.astype(np.float64)
    mu = x64.mean(axis=-1, keepdims=True)
    inv = 1.0 / np.sqrt(((x64 - mu) ** 2).mean(axis=-1, keepdims=True) + np.float32(eps))
    bound = U * ((n / 16 + 8) * inv * np.abs(w) * np.abs(x64).mean(axis=-1, keepdims=True)
                 + (n / 32 + 12) * np.abs((x64 - mu) * inv * w))
    return bound + (2 * U * np.abs(b) if b is not None else 0.0)


@pytest.mark.parametrize("offset", [0.0, 3.0, -40.0])
def test_rmsnorm_variants_vs_ref_vs_numpy(offset: float) -> None:
    chosen = _engine.kernel_variants()["rmsnorm"]
    for n in NORM_SIZES:
        x, w, _ = norm_inputs(n, offset)
        for eps in (1e-5, 1e-6):
            want = rmsnorm64(x, w, eps)
            ref = _engine.kernel_norm("rmsnorm", "ref", x, w, eps=eps)
            assert ref.shape == x.shape and ref.dtype == np.float32
            check_close(ref, want, 6 * U * np.abs(want) + 1e-30, f"rmsnorm ref n={n} vs numpy")
            for variant in ew_variants("rmsnorm"):
                got = _engine.kernel_norm("rmsnorm", variant, x, w, eps=eps)
                bound = (n / 32 + 10) * U * np.abs(ref.astype(np.float64)) + 1e-30
                check_close(got, ref, bound, f"rmsnorm {variant} n={n} offset={offset} eps={eps} vs ref")
                check_close(got, want, bound + 6 * U * np.abs(want), f"rmsnorm {variant} n={n} vs numpy")
                if variant == chosen:
                    assert same_bits(_engine.kernel_norm("rmsnorm", "best", x, w, eps=eps), got)


@pytest.mark.parametrize("offset", [0.0, 3.0, -40.0])
def test_layernorm_variants_vs_ref_vs_numpy(offset: float) -> None:
    chosen = _engine.kernel_variants()["layernorm"]
    for n in NORM_SIZES:
        x, w, b = norm_inputs(n, offset)
        for bias in (b, None):
            x64 = x.astype(np.float64)
            mu = x64.mean(axis=-1, keepdims=True)
            want = (x64 - mu) / np.sqrt(((x64 - mu) ** 2).mean(axis=-1, keepdims=True) + np.float32(1e-6)) * w
            if bias is not None:
                want = want + bias
            bound = layernorm_bound(x, w, bias, 1e-6) + 1e-30
            ref = _engine.kernel_norm("layernorm", "ref", x, w, bias, eps=1e-6)
            assert ref.shape == x.shape and ref.dtype == np.float32
            check_close(ref, want, bound, f"layernorm ref n={n} vs numpy")
            for variant in ew_variants("layernorm"):
                got = _engine.kernel_norm("layernorm", variant, x, w, bias, eps=1e-6)
                what = f"layernorm {variant} n={n} offset={offset} bias={bias is not None}"
                check_close(got, ref, bound, what + " vs ref")
                check_close(got, want, 2 * bound, what + " vs numpy")
                if variant == chosen:
                    assert same_bits(_engine.kernel_norm("layernorm", "best", x, w, bias, eps=1e-6), got)


def test_norm_tolerances_have_teeth() -> None:
    """The bounds above are far below what a lost tail or a wrong sign does: the sum of squares
    without its last 7 elements (a dropped masked tail, n = 63) moves rmsnorm by a few percent, the
    bound is (63/32 + 10) u = 7e-7 relative; rope with the sine's sign flipped is off by 2 |b s|."""
    x, w, _ = norm_inputs(63, 3.0)
    ref = _engine.kernel_norm("rmsnorm", "ref", x, w, eps=1e-5).astype(np.float64)
    x64 = x.astype(np.float64)
    lost = x64 / np.sqrt((x64[:, :56] ** 2).sum(-1, keepdims=True) / 63 + np.float32(1e-5)) * w
    assert np.min(np.abs(lost - ref) / ((63 / 32 + 10) * U * np.abs(ref) + 1e-30)) > 100
    rng = np.random.default_rng(2)
    a, b, t = rng.standard_normal(1000), rng.standard_normal(1000), rng.uniform(-3, 3, 1000)
    c, s = np.cos(t), np.sin(t)
    wrong = (a * c + b * s) - (a * c - b * s)
    assert np.median(np.abs(wrong) / (4 * U * (np.abs(a) + np.abs(b)) * (np.abs(c) + np.abs(s)))) > 1e5


def rope_cases() -> list[tuple[int, int, int]]:
    """(n_heads, head_dim, rope_dims): odd and even head_dims, rope_dims < head_dim (odd too)."""
    cases = []
    for head_dim in (2, 3, 7, 8, 13, 16, 17, 32, 64, 80, 128):
        for rope_dims in sorted({head_dim, head_dim - 1, head_dim // 2, 2}):
            if 2 <= rope_dims <= head_dim:
                cases += [(h, head_dim, rope_dims) for h in (1, 3, 9)]
    return cases


@pytest.mark.parametrize("neox", [False, True])
def test_rope_variants_vs_ref_vs_numpy(neox: bool) -> None:
    chosen = _engine.kernel_variants()["rope"]
    rng = np.random.default_rng(3 + neox)
    for n_heads, head_dim, rope_dims in rope_cases():
        half = rope_dims // 2
        # Row length past the heads (a guard the kernel must not touch), 4 positions' rows.
        x = (rng.standard_normal((4, n_heads * head_dim + 5)) * 4).astype(np.float32)
        pos = float(rng.integers(0, 5000))
        cs = _engine.rope_angles(pos, 10000.0, rope_dims)
        assert cs.shape == (2 * half,)
        c, s = cs[0::2].astype(np.float64), cs[1::2].astype(np.float64)
        heads = x[:, :n_heads * head_dim].reshape(4, n_heads, head_dim).astype(np.float64)
        i0 = np.arange(half) if neox else 2 * np.arange(half)
        i1 = i0 + half if neox else i0 + 1
        a, b = heads[..., i0], heads[..., i1]
        want = heads.copy()
        want[..., i0] = a * c - b * s
        want[..., i1] = a * s + b * c
        scale = (np.abs(a) + np.abs(b)) * (np.abs(c) + np.abs(s))
        bound = np.zeros_like(want)
        bound[..., i0] = bound[..., i1] = 4 * U * scale
        ref = _engine.kernel_rope("ref", x, n_heads, head_dim, rope_dims, cs, neox)
        what = f"heads={n_heads} head_dim={head_dim} rope_dims={rope_dims} neox={neox}"
        for variant in ["ref", *ew_variants("rope")]:
            got = _engine.kernel_rope(variant, x, n_heads, head_dim, rope_dims, cs, neox)
            assert got.shape == x.shape and got.dtype == np.float32
            assert same_bits(got[:, n_heads * head_dim:], x[:, n_heads * head_dim:]), what  # past the heads
            g = got[:, :n_heads * head_dim].reshape(4, n_heads, head_dim)
            x_heads = x[:, :n_heads * head_dim].reshape(4, n_heads, head_dim)
            untouched = np.arange(2 * half, head_dim)
            assert np.array_equal(g[..., untouched], x_heads[..., untouched]), what  # no NaN in x: values suffice
            check_close(g, want, bound / 2 + 1e-30, f"rope {variant} {what} vs numpy")
            if variant != "ref":
                check_close(g, ref[:, :n_heads * head_dim].reshape(4, n_heads, head_dim), bound + 1e-30,
                            f"rope {variant} {what} vs ref")
            if variant == chosen:
                assert same_bits(_engine.kernel_rope("best", x, n_heads, head_dim, rope_dims, cs, neox), got), what


def rope_pairs(v: np.ndarray, n_heads: int, neox: bool) -> np.ndarray:
    """(2, rows, n_heads, 32): the two members of each pair of 64-float heads."""
    p = v.reshape(-1, n_heads, 2, 32) if neox else v.reshape(-1, n_heads, 32, 2).swapaxes(2, 3)
    return np.moveaxis(p, 2, 0)


def test_rope_model_shapes_and_rotation() -> None:
    """SmolLM2's shapes (9 query heads, 3 kv heads of 64): a rotation keeps each pair's norm, and
    position 0 (cos 1, sin 0) changes nothing, bit for bit."""
    rng = np.random.default_rng(9)
    for n_heads in (9, 3):
        x = rng.standard_normal((3, n_heads * 64)).astype(np.float32)
        for variant in ["ref", "best", *ew_variants("rope")]:
            for neox in (False, True):
                at0 = _engine.kernel_rope(variant, x, n_heads, 64, 64, _engine.rope_angles(0.0, 1e4, 64), neox)
                assert same_bits(at0, x), (variant, n_heads, neox)
                got = _engine.kernel_rope(variant, x, n_heads, 64, 64, _engine.rope_angles(123.0, 1e4, 64), neox)
                r_in = np.hypot(*rope_pairs(x.astype(np.float64), n_heads, neox))
                r_out = np.hypot(*rope_pairs(got.astype(np.float64), n_heads, neox))
                assert np.all(np.abs(r_out - r_in) <= 8 * U * r_in + 1e-30), (variant, n_heads, neox)


def test_add_variants_are_exact() -> None:
    rng = np.random.default_rng(4)
    chosen = _engine.kernel_variants()["add"]
    for n in NORM_SIZES + (4097,):
        a = (rng.standard_normal((3, n)) * 10).astype(np.float32)
        b = (rng.standard_normal((3, n)) * 10).astype(np.float32)
        want = a + b  # numpy's float32 sum: one rounding
        for variant in ["ref", "best", *ew_variants("add")]:
            got = _engine.kernel_elementwise("add", variant, a, b)
            assert same_bits(got, want), (variant, n)
        if chosen != "ref":
            assert chosen in ew_variants("add")


def test_argmax_variants_match_numpy() -> None:
    """Greedy decoding's choice: numpy.argmax's index exactly (the first of equal maxima, the first
    NaN if any), on sizes across the vector steps and a vocabulary's (Gemma 3: 262 144 logits)."""
    rng = np.random.default_rng(11)
    chosen = _engine.kernel_variants()["argmax"]
    for n in (1, 7, 8, 9, 31, 32, 33, 65, 1000, 4097, 262_144):
        cases = [rng.standard_normal(n).astype(np.float32) for _ in range(3)]
        cases.append(np.round(cases[0] * 2))  # ties
        cases.append(np.where(np.arange(n) % 3 == 0, np.float32(0.0), np.float32(-0.0)))
        cases.append(np.full(n, -np.inf, np.float32))
        last = cases[1].copy()
        last[-1] = 50.0
        cases.append(last)
        with_nan = cases[2].copy()
        with_nan[rng.integers(0, n, 2)] = np.nan
        cases.append(with_nan)
        for x in cases:
            for variant in ["ref", "best", *ew_variants("argmax")]:
                assert _engine.kernel_argmax(variant, x) == int(np.argmax(x)), (variant, n)
    if chosen != "ref":
        assert chosen in ew_variants("argmax")


def test_norm_argument_checks() -> None:
    x = np.zeros((2, 8), np.float32)
    w = np.ones(8, np.float32)
    with pytest.raises(ValueError):
        _engine.kernel_norm("rmsnorm", "no_such_variant", x, w)
    with pytest.raises(ValueError):
        _engine.kernel_norm("no_such_norm", "ref", x, w)
    with pytest.raises(ValueError):
        _engine.kernel_norm("rmsnorm", "ref", x, w[:4])
    with pytest.raises(ValueError):
        _engine.kernel_norm("rmsnorm", "ref", x, w, w)  # rmsnorm has no bias
    with pytest.raises(ValueError):
        _engine.kernel_norm("layernorm", "ref", x, w, w[:4])
    with pytest.raises(ValueError):
        _engine.kernel_elementwise("add", "ref", x)  # b missing
    cs = _engine.rope_angles(1.0, 1e4, 8)
    with pytest.raises(ValueError):
        _engine.kernel_rope("ref", x, 2, 8, 8, cs)  # 16 floats of heads in a row of 8
    with pytest.raises(ValueError):
        _engine.kernel_rope("ref", x, 1, 8, 10, cs)  # rope_dims > head_dim
    with pytest.raises(ValueError):
        _engine.kernel_rope("ref", x, 1, 8, 8, cs[:4])
    with pytest.raises(ValueError):
        _engine.kernel_rope("no_such_variant", x, 1, 8, 8, cs)


# Gated DeltaNet operators (kernels/deltanet/) against float64 numpy, every variant that runs here.
# Bounds, in float32 units of the magnitudes involved:
# - causal_conv1d: the K-term sum rounds a few times per term (K + 2 roundings of sum |w||in|), the
#   vector sigmoid is within EXP_REL: CONV_REL of (sum |w||in| + |y|);
# - delta_rule: the state is non-expansive (q, k unit-norm, beta in (0, 1), decay <= 1), so rounding
#   does not grow with the tokens beyond a few ulps of the largest state value: DELTA_REL of max |S|
#   over the run for the final state, and that times |q_t|_1 for output t (a sum of q_i S_ij). The chunked form does
#   its chunk in matrix form and meets the same bound (its sums are in double).
# A wrong index, stride, tail, decay or beta gives errors of order 1e-4 and more in these units
# (test_delta_rule_bound_has_teeth).
CONV_REL = 4e-6
DELTA_REL = 1e-6  # measured worst: 1.1e-7 (AVX2, 128 x 128, 200 tokens)
DELTA_SHAPES = ((128, 128), (64, 64), (37, 45), (1, 9), (128, 40), (256, 256))
DELTA_LENGTHS = (1, 2, 37, 63, 64, 65, 200)


def dn_variants(op: str) -> list[str]:
    """Every variant of a Gated DeltaNet operator that runs here, 'ref' included."""
    return [v["name"] for v in _engine.list_variants() if v["op"] == op and v["available"]]


def conv1d_numpy(x: np.ndarray, w: np.ndarray, state: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(y, the state after, sum_j |w_j| |in_j| per output) in float64."""
    K = w.shape[0]
    full = np.concatenate([state, x]).astype(np.float64)
    acc = np.stack([(full[t:t + K] * w).sum(0) for t in range(len(x))])
    mag = np.stack([np.abs(full[t:t + K] * w).sum(0) for t in range(len(x))])
    return acc * sigmoid64(acc), full[len(full) - (K - 1):], mag


@pytest.mark.parametrize("channels", (1, 7, 8, 9, 33, 100, 6144))
@pytest.mark.parametrize("K", (1, 2, 4, 5))
def test_causal_conv1d_variants_vs_numpy(channels: int, K: int) -> None:
    rng = np.random.default_rng(channels * 10 + K)
    for n in (1, 3, 70):
        x = rng.normal(size=(n, channels + 3)).astype(np.float32)  # rows wider than the channels
        w = rng.normal(size=(K, channels)).astype(np.float32)
        state = rng.normal(size=(K - 1, channels)).astype(np.float32)
        want, want_state, mag = conv1d_numpy(x[:, :channels], w, state)
        for variant in (*dn_variants("causal_conv1d"), "best"):
            y, st = _engine.kernel_causal_conv1d(variant, x, w, state)
            check_close(y, want, CONV_REL * (mag + np.abs(want)), f"{variant} n={n}")
            assert np.array_equal(st, want_state.astype(np.float32)), variant  # the inputs, moved
            y2, st2 = _engine.kernel_causal_conv1d(variant, x, w, state, in_place=True)
            assert same_bits(y2, y) and same_bits(st2, st), variant
            # The decode step token by token gives what one call over the prompt gives.
            s = state
            for t in range(n):
                yt, s = _engine.kernel_causal_conv1d(variant, x[t:t + 1], w, s)
                assert same_bits(yt[0], y[t]), (variant, t)


def delta_numpy(S: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray,
                beta: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """The recurrence in float64: (out, the final state, max |S| over the run)."""
    S = S.astype(np.float64).copy()
    out = np.zeros((len(q), S.shape[1]))
    top = float(np.abs(S).max())
    for t in range(len(q)):
        S *= np.exp(np.float64(g[t]))
        delta = (v[t] - S.T @ k[t]) * beta[t]
        S += np.outer(k[t], delta)
        out[t] = S.T @ q[t]
        top = max(top, float(np.abs(S).max()))
    return out, S, top


def delta_case(rng: np.random.Generator, n: int, dk: int, dv: int, decay: float = -1.0) -> tuple[np.ndarray, ...]:
    S, q, k, v, g, beta = tune.delta_rule_inputs(rng, n, dk, dv)
    return S, q, k, v, (g * np.exp(decay + 1.0)).astype(np.float32), beta


@pytest.mark.parametrize("dk, dv", DELTA_SHAPES)
def test_delta_rule_variants_vs_numpy(dk: int, dv: int) -> None:
    rng = np.random.default_rng(dk * 1000 + dv)
    for n in DELTA_LENGTHS if dk * dv <= 128 * 128 else (1, 65):
        for decay in (-1.0, 2.0):  # typical decays; strong ones (g ~ -20: the chunk's exp(G) underflows)
            S, q, k, v, g, beta = delta_case(rng, n, dk, dv, decay)
            want, want_state, top = delta_numpy(S, q, k, v, g, beta)
            for variant in (*dn_variants("delta_rule"), "best"):
                out, st = _engine.kernel_delta_rule(variant, S, q, k, v, g, beta)
                bound = np.broadcast_to(DELTA_REL * top * np.abs(q[:, :dk]).sum(1, keepdims=True), want.shape)
                check_close(out, want, bound, f"{variant} n={n} decay={decay}")
                check_close(st, want_state, np.full(st.shape, DELTA_REL * top), f"{variant} state n={n}")


@pytest.mark.parametrize("variant", [v for v in dn_variants("delta_rule") if "chunk" not in v])
def test_delta_rule_split_prompt_is_bit_equal(variant: str) -> None:
    """Every recurrent variant built and runnable here (x86: ref, avx2 — there is no AVX-512 one yet;
    NEON is checked against the reference under qemu by kernel_check): a prompt split into calls (37
    + the rest, then token by token) gives the bits of one call, outputs and state; q/k rows wider
    than dk (the conv output's layout)."""
    rng = np.random.default_rng(7)
    S, q, k, v, g, beta = delta_case(rng, 80, 128, 128)
    wide = np.concatenate([q, rng.normal(size=(80, 5)).astype(np.float32)], axis=1)
    wide_k = np.concatenate([k, rng.normal(size=(80, 5)).astype(np.float32)], axis=1)
    out, st = _engine.kernel_delta_rule(variant, S, q, k, v, g, beta)
    o_w, st_w = _engine.kernel_delta_rule(variant, S, wide, wide_k, v, g, beta)
    assert same_bits(o_w, out) and same_bits(st_w, st)
    o1, s1 = _engine.kernel_delta_rule(variant, S, q[:37], k[:37], v[:37], g[:37], beta[:37])
    o2, s2 = _engine.kernel_delta_rule(variant, s1, q[37:], k[37:], v[37:], g[37:], beta[37:])
    assert same_bits(np.concatenate([o1, o2]), out) and same_bits(s2, st)
    s = S
    for t in range(80):
        ot, s = _engine.kernel_delta_rule(variant, s, q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1])
        assert same_bits(ot[0], out[t]), t
    assert same_bits(s, st)


def test_delta_rule_bound_has_teeth() -> None:
    """One token's beta off by 0.1%, or one decay skipped, is outside the bound of the outputs."""
    rng = np.random.default_rng(3)
    S, q, k, v, g, beta = delta_case(rng, 64, 128, 128)
    want, _, top = delta_numpy(S, q, k, v, g, beta)
    b2 = beta.copy()
    b2[5] *= 1.001
    g2 = g.copy()
    g2[40] = 0.0
    for bad_b, bad_g in ((b2, g), (beta, g2)):
        out, _ = _engine.kernel_delta_rule("ref", S, q, k, v, bad_g, bad_b)
        assert np.max(np.abs(out - want) / (DELTA_REL * top * np.abs(q).sum(1, keepdims=True))) > 2.0


@pytest.mark.parametrize("n", (1, 7, 8, 9, 31, 33, 128, 1000))
def test_deltanet_norms_and_gate_vs_numpy(n: int) -> None:
    rng = np.random.default_rng(n)
    x = rng.normal(size=(3, n)).astype(np.float32) * np.float32(3.0)
    z = rng.normal(size=(3, n)).astype(np.float32) * np.float32(4.0)
    w = rng.normal(size=n).astype(np.float32)
    x64, z64 = x.astype(np.float64), z.astype(np.float64)
    l2 = x64 / np.sqrt((x64 * x64).sum(1, keepdims=True) + 1e-6)
    rms = x64 / np.sqrt((x64 * x64).mean(1, keepdims=True) + 1e-6)
    gated = rms * w * z64 * sigmoid64(z64)
    gate = x64 * sigmoid64(z64)
    # Each output is a product of a few rounded factors (and EXP_REL for a vector sigmoid).
    tol = (n / 64 + 8) * 2.0 ** -24 + 2 * EXP_REL
    for variant in (*dn_variants("l2norm"), "best"):
        check_close(_engine.kernel_l2norm(variant, x), l2, tol * np.abs(l2) + 1e-30, f"l2norm {variant}")
    for variant in (*dn_variants("rmsnorm_gated"), "best"):
        got = _engine.kernel_rmsnorm_gated(variant, x, w, z)
        check_close(got, gated, tol * np.abs(rms * w) * np.abs(z64) + 1e-30, f"rmsnorm_gated {variant}")
    for variant in (*dn_variants("sigmoid_mul"), "best"):
        got = _engine.kernel_elementwise("sigmoid_mul", variant, x, z)
        check_close(got, gate, tol * np.abs(x64) + 1e-30, f"sigmoid_mul {variant}")


def test_deltanet_argument_checks() -> None:
    S = np.zeros((8, 8), np.float32)
    q = np.zeros((3, 8), np.float32)
    g = np.zeros(3, np.float32)
    with pytest.raises(ValueError):
        _engine.kernel_delta_rule("ref", S, q[:, :4], q[:, :4], q, g, g)  # rows narrower than dk
    with pytest.raises(ValueError):
        _engine.kernel_delta_rule("ref", S, q, q, q[:, :4], g, g)
    with pytest.raises(ValueError):
        _engine.kernel_delta_rule("ref", S, q, q, q, g[:2], g)
    with pytest.raises(ValueError):
        _engine.kernel_delta_rule("no_such_variant", S, q, q, q, g, g)
    with pytest.raises(ValueError):
        _engine.kernel_causal_conv1d("ref", q, S[:4], S[:2])  # state must be (K - 1, channels)
    with pytest.raises(ValueError):
        _engine.kernel_rmsnorm_gated("ref", q, g, q)
    with pytest.raises(ValueError):
        _engine.kernel_rmsnorm_gated("ref", q, np.zeros(8, np.float32), q[:2])


def test_tune_writes_chunked_delta_rules_after_the_recurrent_ones() -> None:
    """A chunked variant faster than the recurrent one still comes after it in a tuned table (it
    would give other bits for a split prompt); the reference closes the block."""
    text = tune.build_table([], {"delta_rule": {"ref": 3e-3, "ref_chunk64": 1e-6, "avx2": 2e-3}}, "", [])
    block = [ln.split()[5] for ln in text.splitlines() if ln.startswith("delta_rule")]
    assert block == ["avx2", "ref_chunk64", "ref"]
