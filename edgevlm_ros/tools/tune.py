"""`edgevlm tune`: measure every kernel variant on this machine and write the operator table.

For each weight format and phase (decode: one token, m = 1; prefill: m = 64 tokens) the matrix
shapes of the model (its layer matrices; for decode also the output head) are run through every
matmul variant that is available here and supports the format, with random weights. Decode
weights are stacked to 16 MiB per call, so every call streams its weights from beyond
L2 as a real decode step does and the per-call set-up cost is small beside the work. The
candidates are timed round-robin (--repeats rounds, best of them); per (format, phase) they are
ranked by the sum of their best times over the shapes, and written fastest first, each with the
features the built-in table names for it, the scalar reference last. When the output head's
winner differs from the layers' winner, a `rows>=N` rule for the head comes first. Attention
variants are timed on one head against 1024 keys (the vision tower's length); the element-wise
variants (softmax, gelu_tanh, silu_mul, rmsnorm, layernorm, add) on 64 rows of 1024 floats (a vision
tower's score rows; the norms row by row), rope on the same 64 rows as 16 heads of 64.

The table is written to optable.TUNED_TABLE (~/.cache/edgevlm_ros/optable.tsv) or --out; the
engine loads it at its next start (or at once: optable.activate(path)). run_tune() leaves the
written table active in the calling process.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import cache
from pathlib import Path

import numpy as np

from ..engine.argtypes import command_main, positive_int

PREFILL_M = 64
ATTN_KV, ATTN_DIM = 1024, 64

# SmolLM2-135M's matrices (rows, k), used when no model file is at hand.
DEFAULT_LAYER_SHAPES = ((576, 576), (192, 576), (1536, 576), (576, 1536))
DEFAULT_HEAD_SHAPE = (49152, 576)


@dataclass
class Measure:
    """Best seconds per call of every candidate on one (format, phase, shape)."""

    fmt: str
    phase: str
    rows: int
    k: int
    m: int
    stacked_rows: int
    seconds: dict[str, float] = field(default_factory=dict)
    is_head: bool = False


@dataclass
class TuneResult:
    """What tune measured and the table it wrote."""

    path: Path
    text: str
    measures: list[Measure]
    attention: dict[str, float]  # operator "attention" of `single`, kept under this name
    threads: int
    single: dict[str, dict[str, float]] = field(default_factory=dict)  # operator -> variant -> s/call


# -- shapes and weights -------------------------------------------------------------------------


def model_shapes(model: Path | None) -> tuple[list[tuple[int, int]], tuple[int, int] | None, str]:
    """(distinct layer matrix shapes (rows, k), the output head's shape, a description) of a GGUF
    text model's first layer; SmolLM2-135M's shapes when model is None or has no layers."""
    if model is None:
        return list(DEFAULT_LAYER_SHAPES), DEFAULT_HEAD_SHAPE, "SmolLM2-135M shapes (built in)"
    from .. import _engine

    tensors = _engine.GGUFFile(str(model)).tensors()
    first = sorted({t["name"].split(".")[1] for t in tensors if t["name"].startswith("blk.")}, key=int)
    shapes: list[tuple[int, int]] = []
    head: tuple[int, int] | None = None
    by_name = {t["name"]: t for t in tensors}
    for t in tensors:
        if len(t["shape"]) != 2:
            continue
        k, rows = int(t["shape"][0]), int(t["shape"][1])
        if first and t["name"].startswith(f"blk.{first[0]}.") and (rows, k) not in shapes:
            shapes.append((rows, k))
    head_t = by_name.get("output.weight") or by_name.get("token_embd.weight")
    if head_t is not None and len(head_t["shape"]) == 2:
        head = (int(head_t["shape"][1]), int(head_t["shape"][0]))
    if not shapes:
        return list(DEFAULT_LAYER_SHAPES), DEFAULT_HEAD_SHAPE, f"{model.name} has no layers: SmolLM2-135M shapes"
    return shapes, head, f"{model.name}"


def random_weight(fmt: str, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Raw GGUF bytes of a rows x k matrix of random weights (rows repeat every 256)."""
    from .. import _engine

    base = min(rows, 256)
    x = rng.normal(0.0, 0.05, (base, k)).astype(np.float32)
    if fmt == "BF16":
        raw = (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(base, -1)
    else:
        raw = np.asarray(_engine.quantize(fmt, x.ravel()), dtype=np.uint8).reshape(base, -1)
    reps = -(-rows // base)
    return np.ascontiguousarray(np.tile(raw, (reps, 1))[:rows]).ravel()


def _whole_blocks(fmt: str, k: int) -> bool:
    try:
        return _row_bytes(fmt, k) > 0
    except ValueError:
        return False


def _row_bytes(fmt: str, k: int) -> int:
    from .. import _engine

    return int(_engine.row_bytes(fmt, k))


# -- timing -------------------------------------------------------------------------------------


def _time_round_robin(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Best (minimum) seconds per call of each function: one warm-up call each, then `repeats`
    rounds in which every function runs once, so all share the machine's noise. The minimum, not
    the median: on a shared machine a sample is only ever slowed down by others, never sped up,
    and the question is which variant is fastest here, not how busy the machine was. A function
    that returns a float has timed itself (e.g. the product without packing its weights): that
    float is the sample."""
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            timed = fn()
            elapsed = time.perf_counter() - t0
            samples[name].append(timed if isinstance(timed, float) else elapsed)
    return {name: float(min(v)) for name, v in samples.items()}


# Variants a table names only by choice: the int8 prefill GEMM quantizes a prompt's activations
# to int8, which moves prefill logits past the parity tests' bounds (SmolLM2 top-1 214 / 221 against
# transformers, Gemma 3 53 / 54: docs/kernels/prefill-q8act-gemm.md). Tuning picks by speed alone,
# so it never offers them. The same for the int8 vision GEMM, which also requantizes float weights
# to int8 blocks: the table's int8 rules name it for a user who allowed it (vision_int8), never a prefill rule.
OPT_IN_ONLY = frozenset({"avx512vnni_q8act_gemm", "avxvnni_q8act_gemm", "avx512vnni_q8act_gemm_ymm",
                         "neon_q8act_gemm"})


def matmul_candidates(fmt: str) -> list[str]:
    """Names of the matmul variants that run here and support fmt (the reference included), but
    those of OPT_IN_ONLY."""
    from .. import _engine

    return [v["name"] for v in _engine.list_variants()
            if v["op"] == "matmul" and v["available"] and fmt in v["formats"] and v["name"] not in OPT_IN_ONLY]


# The weight formats with kernels and the operators, as the extension lists them (kernels/formats/,
# kernels/op_list.h): not repeated here. Asked when needed, not at import: building the `edgevlm`
# parser imports this module, and no other subcommand should load the extension for it.
@cache
def weight_formats() -> tuple[str, ...]:
    from .. import _engine

    return tuple(_engine.weight_formats())


@cache
def elementwise_ops() -> tuple[str, ...]:
    """The matrix-free operators other than attention (softmax, norms, rope, ...)."""
    from .. import _engine

    return tuple(op for op in _engine.operators() if op != "attention")


ELEMENTWISE_SHAPE = (64, 1024)
GATES = ("silu_mul", "gelu_mul")  # a = f(a) * b: x and b
# The Gated DeltaNet operators are timed on Qwen3.5's shapes: causal_conv1d over the rows of
# ELEMENTWISE_SHAPE as tokens (kernel width CONV_K), delta_rule on one head of DELTA_DIM^2 state over
# DELTA_TOKENS tokens (a prefill chunk; decode is the same per-token work).
CONV_K, DELTA_DIM, DELTA_TOKENS = 4, 128, 64
CHUNKED_SUFFIX = "_chunk64"  # delta_rule variants in chunked form (kernels/ops.h DeltaRuleFn)
ROPE_HEAD_DIM = 64  # rope: each row of ELEMENTWISE_SHAPE as heads of this size, all dims rotated


def delta_rule_inputs(rng: np.random.Generator, n: int, dk: int, dv: int) -> tuple[np.ndarray, ...]:
    """(S, q, k, v, g, beta) of one delta-rule head as the qwen35 block hands them over: q and k
    L2-normalised (q times dk^-1/2), g a log-decay <= 0, beta in (0, 1)."""
    q, k = rng.normal(size=(2, n, dk)).astype(np.float32)
    k /= np.linalg.norm(k, axis=1, keepdims=True)
    q /= np.linalg.norm(q, axis=1, keepdims=True) * np.float32(np.sqrt(dk))
    v = rng.normal(size=(n, dv)).astype(np.float32)
    g = (-np.exp(rng.normal(-1.0, 1.0, n))).astype(np.float32)
    beta = (1.0 / (1.0 + np.exp(-rng.normal(size=n)))).astype(np.float32)
    S = rng.normal(0.0, 0.1, (dk, dv)).astype(np.float32)
    return S, q, k, v, g, beta


def op_candidates(op: str) -> list[str]:
    """Names of the variants of a matrix-free operator (attention, softmax, ...) that run here."""
    from .. import _engine

    return [v["name"] for v in _engine.list_variants() if v["op"] == op and v["available"]]


def attention_candidates() -> list[str]:
    return op_candidates("attention")


def variant_features(builtin_text: str) -> dict[tuple[str, str], str]:
    """(operator, variant) -> the features column the built-in table gives it (first rule wins)."""
    feats: dict[tuple[str, str], str] = {}
    for line in builtin_text.replace(";", "\n").splitlines():
        cols = line.split("#", 1)[0].split()
        if len(cols) == 6:
            feats.setdefault((cols[0], cols[5]), cols[4])
    return feats


@dataclass
class TuneConfig:
    model: Path | None = None
    threads: int = 2
    out: Path | None = None
    formats: tuple[str, ...] = field(default_factory=weight_formats)
    repeats: int = 5
    decode_mib: float = 16.0
    prefill_m: int = PREFILL_M
    quick: bool = False
    log: Callable[[str], None] = field(default=lambda s: print(s, flush=True))


def measure_all(cfg: TuneConfig) -> tuple[list[Measure], dict[str, dict[str, float]], str]:
    """Times every candidate, returns (matmul measures, per matrix-free operator the seconds per call
    of each variant, shapes note)."""
    from .. import _engine

    rng = np.random.default_rng(0)
    if cfg.quick:
        layer_shapes: list[tuple[int, int]] = [(64, 64), (96, 256)]  # k = 256: a K-quant super-block
        head: tuple[int, int] | None = (512, 64)
        what = "quick shapes"
    else:
        layer_shapes, head, what = model_shapes(cfg.model)
    measures: list[Measure] = []
    log = cfg.log
    for fmt in cfg.formats:
        cands = matmul_candidates(fmt)
        if not cands:
            log(f"  {fmt}: no variant runs it here")
            continue
        for phase in ("decode", "prefill"):
            m = 1 if phase == "decode" else cfg.prefill_m
            shapes = [(r, k, False) for r, k in layer_shapes]
            if phase == "decode" and head is not None:
                shapes.append((head[0], head[1], True))
            shapes = [s for s in shapes if _whole_blocks(fmt, s[1])]  # K-quants: k a multiple of 256
            for rows, k, is_head in shapes:
                stacked = rows
                if phase == "decode" and not is_head:
                    # Enough rows that one call streams ~decode_mib MiB (rows repeat the shape's pattern).
                    want = int(cfg.decode_mib * (1 << 20) / _row_bytes(fmt, k))
                    stacked = max(rows, want // rows * rows)
                if is_head:
                    cap = int(64 * (1 << 20) / _row_bytes(fmt, k))  # at most 64 MiB of head
                    stacked = min(rows, max(cap, 1))
                w = random_weight(fmt, stacked, k, rng)
                x = rng.normal(0.0, 1.0, (m, k)).astype(np.float32)
                # Each sample is one product as the engine runs it (pool started, weights packed
                # into the variant's layout beforehand): the call's own set-up is not timed.
                fns: dict[str, Callable[[], object]] = {
                    name: (lambda name=name, fmt=fmt, w=w, x=x, stacked=stacked, k=k:
                           _engine.kernel_matmul_seconds(name, fmt, w, stacked, k, x, cfg.threads, 1))
                    for name in cands
                }
                secs = {n: max(t, 1e-9) for n, t in _time_round_robin(fns, cfg.repeats).items()}
                mm = Measure(fmt, phase, rows, k, m, stacked, secs, is_head)
                measures.append(mm)
                log("  " + _describe(mm))
    single: dict[str, dict[str, float]] = {}
    names = attention_candidates()
    if names:
        n_kv = 64 if cfg.quick else ATTN_KV
        q = rng.normal(size=ATTN_DIM).astype(np.float32)
        kk = rng.normal(size=(n_kv, ATTN_DIM)).astype(np.float32)
        vv = rng.normal(size=(n_kv, ATTN_DIM)).astype(np.float32)
        calls = 20 if cfg.quick else 200

        def loop(name: str) -> Callable[[], object]:
            def run() -> None:
                for _ in range(calls):
                    _engine.kernel_attention(name, q, kk, vv, 0.125)
            return run

        attn = {n: s / calls for n, s in _time_round_robin({n: loop(n) for n in names}, cfg.repeats).items()}
        ranked = ", ".join(f"{n} {s * 1e6:.1f} us" for n, s in sorted(attn.items(), key=lambda kv: kv[1]))
        log(f"  attention (1 query, {n_kv} keys, dim {ATTN_DIM}): {ranked}")
        single["attention"] = attn
    x = rng.normal(size=ELEMENTWISE_SHAPE).astype(np.float32)
    b = rng.normal(size=ELEMENTWISE_SHAPE).astype(np.float32)
    w_row, b_row = b[0].copy(), b[1].copy()
    cs = _engine.rope_angles(100.0, 10000.0, ROPE_HEAD_DIM)
    rope_heads = ELEMENTWISE_SHAPE[1] // ROPE_HEAD_DIM
    conv_w = rng.normal(size=(CONV_K, ELEMENTWISE_SHAPE[1])).astype(np.float32)
    conv_state = rng.normal(size=(CONV_K - 1, ELEMENTWISE_SHAPE[1])).astype(np.float32)
    delta_args = delta_rule_inputs(rng, DELTA_TOKENS, DELTA_DIM, DELTA_DIM)
    calls = 5 if cfg.quick else 50
    for op in elementwise_ops():
        names = op_candidates(op)
        if not names:
            continue

        def loop_op(name: str, op: str = op) -> Callable[[], object]:
            def run() -> None:
                for _ in range(calls):
                    if op == "softmax":
                        _engine.kernel_elementwise(op, name, x, scale=0.125)
                    elif op in GATES or op in ("add", "sigmoid_mul"):
                        _engine.kernel_elementwise(op, name, x, b)
                    elif op == "l2norm":
                        _engine.kernel_l2norm(name, x)
                    elif op == "argmax":
                        _engine.kernel_argmax(name, x)
                    elif op == "rmsnorm_gated":
                        _engine.kernel_rmsnorm_gated(name, x, w_row, b)
                    elif op == "causal_conv1d":
                        _engine.kernel_causal_conv1d(name, x, conv_w, conv_state)
                    elif op == "delta_rule":
                        _engine.kernel_delta_rule(name, *delta_args)
                    elif op == "rmsnorm":
                        _engine.kernel_norm(op, name, x, w_row, eps=1e-5)
                    elif op == "layernorm":
                        _engine.kernel_norm(op, name, x, w_row, b_row, eps=1e-5)
                    elif op == "rope":
                        _engine.kernel_rope(name, x, rope_heads, ROPE_HEAD_DIM, ROPE_HEAD_DIM, cs)
                    else:
                        _engine.kernel_elementwise(op, name, x)
            return run

        timed = _time_round_robin({n: loop_op(n) for n in names}, cfg.repeats).items()
        single[op] = {n: s / calls for n, s in timed}
        ranked = ", ".join(f"{n} {s * 1e6:.1f} us" for n, s in sorted(single[op].items(), key=lambda kv: kv[1]))
        log(f"  {op} ({ELEMENTWISE_SHAPE[0]} x {ELEMENTWISE_SHAPE[1]}): {ranked}")
    return measures, single, what


def _describe(mm: Measure) -> str:
    flops = 2.0 * mm.rows * mm.k * mm.m
    parts = []
    for name, s in sorted(mm.seconds.items(), key=lambda kv: kv[1]):
        per_shape = s * mm.rows / mm.stacked_rows  # time for the real (unstacked) matrix
        if mm.phase == "decode":
            gbs = _row_bytes(mm.fmt, mm.k) * mm.stacked_rows / s / 1e9
            parts.append(f"{name} {per_shape * 1e6:.1f} us ({gbs:.1f} GB/s)")
        else:
            parts.append(f"{name} {per_shape * 1e3:.2f} ms ({flops / per_shape / 1e9:.1f} GFLOP/s)")
    head = " head" if mm.is_head else ""
    return f"{mm.fmt:5s} {mm.phase:7s} {mm.rows}x{mm.k}{head} m={mm.m}: " + ", ".join(parts)


def rank(measures: Sequence[Measure], fmt: str, phase: str, head: bool) -> list[tuple[str, float]]:
    """Candidates of (fmt, phase) by the sum over shapes of the real-shape time, fastest first."""
    total: dict[str, float] = {}
    for mm in measures:
        if mm.fmt != fmt or mm.phase != phase or mm.is_head != head:
            continue
        for name, s in mm.seconds.items():
            total[name] = total.get(name, 0.0) + s * mm.rows / mm.stacked_rows
    return sorted(total.items(), key=lambda kv: kv[1])


def build_table(measures: Sequence[Measure], single: dict[str, dict[str, float]], builtin_text: str,
                header: Sequence[str]) -> str:
    """The tuned operator table: per (format, phase) the candidates fastest first, ref last; the
    built-in rules follow as fallbacks for anything not measured. The built-in int8 rules (a user's
    choice, vision_int8, not a measured one) come first: a prefill rule above them would take the
    products they are for. The built-in prefill rules that the built-in table puts above its int8
    rules (AMX's GEMM serves such a product where the CPU has it) go before them as int8 rules, so
    a product allowed int8 gets the built-in table's choice and every other product the measured one."""
    feats = variant_features(builtin_text)
    lines = [f"# {h}" if h else "#" for h in header]
    lines.append("# operator  format  phase  shape  features  variant    # measured time per call")
    builtin = [body for line in builtin_text.replace(";", "\n").splitlines() if (body := line.split("#", 1)[0].strip())]
    int8 = [body for body in builtin if body.split()[:3:2] == ["matmul", "int8"]]
    if int8:
        above = builtin[:builtin.index(int8[0])]
        lines.append("# the built-in int8 rules (vision_int8: chosen by the user, not measured), after the built-in")
        lines.append("# prefill rules above them there, as int8 rules (they take such a product first, as there)")
        lines += [" ".join([*f[:2], "int8", *f[3:]]) for body in above
                  if (f := body.split())[0] == "matmul" and f[2] in ("prefill", "*")]
        lines += int8
    formats = list(dict.fromkeys(mm.fmt for mm in measures))

    def rules(fmt: str, phase: str, shape: str, ranked: list[tuple[str, float]], unit: str) -> list[str]:
        out = []
        for name, s in ranked:
            if name == "ref":
                continue
            t = f"{s * 1e6:.1f} us" if unit == "us" else f"{s * 1e3:.3f} ms"
            out.append(f"matmul  {fmt}  {phase}  {shape}  {feats.get(('matmul', name), '-')}  {name}  # {t}")
        ref = dict(ranked).get("ref")
        note = f"  # {ref * 1e6:.1f} us" if ref is not None and unit == "us" else (
            f"  # {ref * 1e3:.3f} ms" if ref is not None else "")
        out.append(f"matmul  {fmt}  {phase}  {shape}  -  ref{note}")
        return out

    for fmt in formats:
        for phase in ("decode", "prefill"):
            layers = rank(measures, fmt, phase, head=False)
            if not layers:
                continue
            heads = rank(measures, fmt, phase, head=True)
            unit = "us" if phase == "decode" else "ms"
            if heads and heads[0][0] != layers[0][0]:
                max_layer_rows = max(mm.rows for mm in measures if mm.fmt == fmt and not mm.is_head)
                head_rows = min(mm.rows for mm in measures if mm.fmt == fmt and mm.is_head)
                threshold = 1 << max_layer_rows.bit_length()  # next power of two above the layers
                if threshold <= head_rows:
                    lines += rules(fmt, phase, f"rows>={threshold}", heads, unit)
            lines += rules(fmt, phase, "any", layers, unit)
    for op, timed in single.items():
        if not timed:
            continue
        # A chunked delta rule gives other bits when a prompt is split into calls elsewhere than at a
        # chunk boundary: it is written after every recurrent variant, whatever its time.
        for name, s in sorted(timed.items(), key=lambda kv: (kv[0].endswith(CHUNKED_SUFFIX), kv[1])):
            if name != "ref":
                lines.append(f"{op}  *  *  any  {feats.get((op, name), '-')}  {name}  # {s * 1e6:.2f} us")
        lines.append(f"{op}  *  *  any  -  ref")
    lines.append("# built-in rules (kernels/optable.tsv) as fallbacks for anything not measured above")
    lines += [body for body in builtin if body not in int8]
    return "\n".join(lines) + "\n"


def tune(cfg: TuneConfig) -> TuneResult:
    """Measures, writes the table (atomically) and activates it in this process."""
    from .. import _engine
    from ..engine import optable

    log = cfg.log
    out = cfg.out or optable.TUNED_TABLE
    cpu = _cpu_name()
    log(f"edgevlm tune: {cpu}, {cfg.threads} threads, CPU features "
        f"{sorted(k for k, v in _engine.cpu_features().items() if v)}")
    measures, single, what = measure_all(cfg)
    header = [
        "Operator implementation table tuned by `edgevlm tune` (format: see kernels/optable.tsv).",
        f"Measured {datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')} on {cpu}, {cfg.threads} threads, "
        f"shapes of {what}, best of {cfg.repeats} rounds.",
        f"decode: m=1, weights stacked to ~{cfg.decode_mib:g} MiB per call, prefill: m={cfg.prefill_m}. "
        "Times are per call of the real shape, summed over the shapes.",
        "Within each (format, phase): fastest first; the scalar reference last.",
        "",
    ]
    header = [h.replace(";", ",") for h in header]  # the table parser reads ';' as a line break
    text = build_table(measures, single, optable._builtin_text(), header)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    try:
        optable.activate(tmp)  # the engine's own parser checks it before it replaces anything
    except ValueError:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, out)
    optable.activate(out)
    return TuneResult(out, text, measures, single.get("attention", {}), cfg.threads, single)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# -- command line -------------------------------------------------------------------------------


def _formats(text: str) -> tuple[str, ...]:
    vals = tuple(x.strip().upper() for x in text.split(",") if x.strip())
    bad = [v for v in vals if v not in weight_formats()]
    if bad or not vals:
        raise argparse.ArgumentTypeError(
            f"unknown format(s) {', '.join(bad) or text!r} (choose from {','.join(weight_formats())})")
    return vals


def add_tune_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the `tune` arguments to a (sub)parser."""
    parser.add_argument("--model", help="GGUF text model whose shapes to measure (default: SmolLM2-135M from models/)")
    parser.add_argument("--threads", type=positive_int, default=None, help="threads (default: cores, at most 8)")
    parser.add_argument("--out", default=None, help="table file (default: ~/.cache/edgevlm_ros/optable.tsv, "
                        "which the engine loads at start)")
    parser.add_argument("--formats", type=_formats, default=None,
                        help="weight formats, comma-separated (default: every format the engine has kernels for)")
    parser.add_argument("--repeats", type=positive_int, default=None, help="timed rounds per shape (5)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, 1 round: a smoke test, not a tuning")
    return parser


def run_tune(args: argparse.Namespace) -> int:
    """Runs a parsed `tune` command. Prints what it measured and where the table went; returns 0."""
    from ..engine import optable
    from ..engine.paths import default_threads, resolve_model

    model: Path | None = None
    if args.model or not args.quick:
        try:
            model = resolve_model(args.model)
        except FileNotFoundError:
            if args.model:
                raise
            model = None  # no default model fetched: SmolLM2's shapes are built in
    cfg = TuneConfig(
        model=model,
        threads=args.threads or default_threads(),
        out=Path(args.out) if args.out else None,
        formats=tuple(args.formats or weight_formats()),
        repeats=args.repeats or (1 if args.quick else 5),
        decode_mib=0.25 if args.quick else 16.0,
        prefill_m=8 if args.quick else PREFILL_M,
        quick=bool(args.quick),
    )
    result = tune(cfg)
    print(f"wrote {result.path}")
    if result.path.resolve() == optable.TUNED_TABLE.resolve():
        env = os.environ.get("EDGEVLM_OPTABLE")
        if env:
            print(f"note: $EDGEVLM_OPTABLE={env} takes precedence over it at engine start")
        else:
            print("the engine loads it at its next start")
    else:
        print(f"use it with EDGEVLM_OPTABLE={result.path} (or optable.activate(path))")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m edgevlm_ros.tools.tune`: the same as `edgevlm tune`."""
    return command_main("edgevlm tune", add_tune_arguments, run_tune, argv)


if __name__ == "__main__":
    sys.exit(main())
