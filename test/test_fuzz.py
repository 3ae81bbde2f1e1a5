"""Coverage-guided fuzzing of the file readers, in a short fixed-length form (the long campaign is
scripts/fuzz_long.sh; its figures are in docs/reliability/fuzzing.md).

- GGUF and mmproj: native/tests/fuzz_gguf.cpp, a libFuzzer harness built with clang
  -fsanitize=fuzzer,address,undefined from the extension's own sources (buildinfo.py). Each input
  goes through the GGUF reader, then Decoder and VisionModel construction and one forward
  step of whatever builds: each must load or refuse with GGUFError, with no sanitizer report.
- Prefix-cache files: edgevlm_ros.engine.prefix_cache.load under atheris (libFuzzer for Python): it must
  return or raise PrefixCacheError (a ValueError), nothing else.

Seeds (test/fuzz_seeds, each < 64 KiB) are small valid files written by our GGUF writer (a llama
decoder and an idefics3 mmproj in every weight format the engine computes with, the K-quants,
Q5_0 / Q5_1 and IQ4_NL among them; two qwen35 decoders; two minicpmv4_6 mmproj files, 16x with the
window merger and 4x without, whose encode step is a slice of a grid of its own; metadata of every
value type), the first bytes of the real SmolLM2 file, and valid prefix-cache files. Every crash a
campaign finds is kept in test/fuzz_regressions/<target>/ and replayed here.

Also a script: `python test/test_fuzz.py build` (prints the harness path), `... seeds` (rewrites
test/fuzz_seeds), `... prefix-cache [libFuzzer flags] [corpus dirs]` (the atheris target).
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import native_build as nb  # noqa: E402

import buildinfo  # noqa: E402

if TYPE_CHECKING:
    import numpy as np

    from edgevlm_ros.tools.gguf_writer import GGUFWriter

BUILD = ROOT / "build" / "fuzz"
SEEDS = ROOT / "test" / "fuzz_seeds"
REGRESSIONS = ROOT / "test" / "fuzz_regressions"
GGUF_DICT = SEEDS / "gguf.dict"
PREFIX_CACHE_DICT = SEEDS / "prefix_cache.dict"
CXX = os.environ.get("EDGEVLM_FUZZ_CXX", "clang++-14")
MAX_SEED_BYTES = 64 * 1024
# The key every prefix-cache seed is written for, so that mutations get past the key check.
FUZZ_KEY = "f" * 64

# Short in-suite runs: fixed counts and a fixed seed, so a run is repeatable.
GGUF_RUNS = 25_000
PREFIX_CACHE_RUNS = 50_000
# libFuzzer flags shared by the suite and scripts/fuzz_long.sh: a single malloc over the limit
# is a finding (an allocation sized from an unchecked number), as is an input that runs too long.
# rss_limit_mb=0: peak RSS as libFuzzer reads it (getrusage) is inherited from the parent process
# (pytest holding transformers models), so only single allocations are limited.
LIBFUZZER_FLAGS = ["-max_len=65536", "-timeout=20", "-rss_limit_mb=0", "-malloc_limit_mb=1024",
                   "-print_final_stats=1"]
SANITIZER_REPORT = re.compile(r"ERROR: (AddressSanitizer|LeakSanitizer|UndefinedBehaviorSanitizer|libFuzzer)"
                              r"|runtime error:|SUMMARY: ")


# --------------------------------------------------------------------------------------------
# Building the harness


def fuzzer_flags() -> list[str]:
    return nb.common_flags("-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=fuzzer,address,undefined",
                           "-fno-sanitize-recover=all")


def kernel_flags() -> list[str]:
    """The kernels (kernels/): the same sanitizers at -O0, without coverage. clang 14 builds the
    SIMD kernels' unrolled bodies with UBSan at -O1 in minutes (kernels/matmul/matmul_avx2_q8act_x8.cpp:
    177 s, 3.4 s at -O0; the whole harness took 516 s of CPU, three x8 kernel files 410 s of it).
    The fuzzer targets the loaders and models (native/, at -O1 with coverage); the harness's one
    forward step per input runs the kernels on tiny shapes, and their edges would only add noise
    to the coverage (at -O0, tracing their loop compares halved the harness's executions per
    second). Kernel arithmetic under UBSan at -O1 is test_native.py's and
    test_sanitized_extension.py's (gcc, the extension's sanitized objects)."""
    return nb.common_flags("-O0", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
                           "-fno-sanitize-recover=all")


def fuzzer_sources() -> list[str]:
    # The harness replaces MappedFile with an exact-size heap copy (over-reads become ASan reports).
    return ["native/tests/fuzz_gguf.cpp", *(s for s in buildinfo.sources() if s != "native/mapped_file.cpp")]


@nb.ahead
def build_fuzzer() -> Path:
    """Compiles once per distinct input (native_build.py: objects cached per source, headers, flags
    and compiler); the harness is linked into build/fuzz."""
    if shutil.which(CXX) is None:
        pytest.fail(f"{CXX} missing: scripts/setup.sh installs clang-14 and libclang-rt-14-dev (root + apt)")
    flags = fuzzer_flags()
    sources = fuzzer_sources()
    kernels = [s for s in sources if s.startswith("kernels/")]
    objects = [*nb.compile_objects([s for s in sources if s not in kernels], CXX, flags),
               *nb.compile_objects(kernels, CXX, kernel_flags())]
    return nb.link("fuzz_gguf", objects, CXX, flags, folder=BUILD)


BUILD_AHEAD = (build_fuzzer,)  # conftest.py: built in the background while the tests before these run


def _check_clean(out: str) -> None:
    m = SANITIZER_REPORT.search(out)
    assert m is None, f"sanitizer/libFuzzer report:\n{out[max(0, m.start() - 2000): m.start() + 6000]}"


def _final_stats(out: str) -> str:
    done = [ln for ln in out.splitlines() if re.match(r"#\d+\s+DONE", ln)]
    return done[-1] if done else out.strip().splitlines()[-1]


# --------------------------------------------------------------------------------------------
# Seeds


def _tiny_llama(path: Path, *, tied: bool, rope_scaling: bool, ff: int = 64, n_layer: int = 2,
                kinds: tuple[str, ...] = ("q4_0", "q4_1", "q8_0", "f16", "bf16", "f32")) -> None:
    import numpy as np

    from edgevlm_ros.tools.gguf_writer import GGUFWriter

    rng = np.random.default_rng(1)
    d, n_head, n_kv, vocab = 32, 4, 2, 40
    hd = d // n_head

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    g = GGUFWriter()
    g.add_string("general.architecture", "llama")
    for key, value in (("context_length", 64), ("embedding_length", d), ("feed_forward_length", ff),
                       ("block_count", n_layer), ("attention.head_count", n_head),
                       ("attention.head_count_kv", n_kv), ("rope.dimension_count", hd)):
        g.add_uint32(f"llama.{key}", value)
    g.add_float32("llama.rope.freq_base", 10000.0)
    g.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    if rope_scaling:
        g.add_string("llama.rope.scaling.type", "linear")
        g.add_float32("llama.rope.scaling.factor", 2.0)
    g.add_tensor("token_embd.weight", w(vocab, d), "q8_0")
    if not tied:
        g.add_tensor("output.weight", w(vocab, d), "f16")
    g.add_tensor("output_norm.weight", 1 + w(d), "f32")
    # Every format of `kinds` somewhere, per layer in turn ("bf16": written as f16, retyped after).
    bf16: list[str] = []
    for layer in range(n_layer):
        p = f"blk.{layer}."
        g.add_tensor(p + "attn_norm.weight", 1 + w(d), "f32")
        g.add_tensor(p + "ffn_norm.weight", 1 + w(d), "f32")
        for i, (name, shape) in enumerate((("attn_q", (d, d)), ("attn_k", (n_kv * hd, d)), ("attn_v", (n_kv * hd, d)),
                                           ("attn_output", (d, d)), ("ffn_gate", (ff, d)), ("ffn_up", (ff, d)),
                                           ("ffn_down", (d, ff)))):
            kind = kinds[(i + layer) % len(kinds)]
            if kind == "bf16":
                bf16.append(p + name + ".weight")
            g.add_tensor(p + name + ".weight", w(*shape), "f16" if kind == "bf16" else kind)
    g.write(path)
    _retype_bf16(path, bf16)


def _clip_writer(projector: str, keys: dict[str, int]) -> GGUFWriter:
    """An mmproj's header: llama.cpp's clip keys (`keys`: the clip.vision.* integers)."""
    from edgevlm_ros.tools.gguf_writer import GGUFValueType, GGUFWriter

    g = GGUFWriter()
    g.add_string("general.architecture", "clip")
    g.add_bool("clip.has_vision_encoder", True)
    g.add_string("clip.projector_type", projector)
    for key, value in keys.items():
        g.add_uint32(f"clip.vision.{key}", value)
    g.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    g.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5], GGUFValueType.FLOAT32)
    return g


def _siglip_embeddings(g: GGUFWriter, w: Callable[..., np.ndarray], d: int, patch: int, pos_rows: int) -> None:
    g.add_tensor("v.patch_embd.weight", w(d, 3, patch, patch), "f16")
    g.add_tensor("v.patch_embd.bias", w(d), "f32")
    g.add_tensor("v.position_embd.weight", w(pos_rows, d), "f32")
    g.add_tensor("v.post_ln.weight", 1 + w(d), "f32")
    g.add_tensor("v.post_ln.bias", w(d), "f32")


def _siglip_attention(g: GGUFWriter, w: Callable[..., np.ndarray], p: str, d: int, kinds: tuple[str, ...]) -> None:
    """attn_q, attn_k, attn_v, attn_out under prefix p, in kinds[0..3], with their biases."""
    for i, name in enumerate(("attn_q", "attn_k", "attn_v", "attn_out")):
        g.add_tensor(p + name + ".weight", w(d, d), kinds[i])
        g.add_tensor(p + name + ".bias", w(d), "f32")


def _siglip_layers(g: GGUFWriter, w: Callable[..., np.ndarray], d: int, ff: int, n_layer: int, *,
                   swapped: bool = False, kinds: tuple[str, ...] = ("q8_0", "q4_0", "f16", "f32", "q8_0", "q4_0"),
                   ) -> None:
    """The tower's layers: attention in kinds[0..3], ffn_up / ffn_down in kinds[4] / kinds[5]
    (`swapped`: under each other's names, as some published files have them)."""
    up, down = ("ffn_down", "ffn_up") if swapped else ("ffn_up", "ffn_down")
    for layer in range(n_layer):
        p = f"v.blk.{layer}."
        for ln in ("ln1", "ln2"):
            g.add_tensor(p + ln + ".weight", 1 + w(d), "f32")
            g.add_tensor(p + ln + ".bias", w(d), "f32")
        _siglip_attention(g, w, p, d, kinds)
        g.add_tensor(p + up + ".weight", w(ff, d), kinds[4])
        g.add_tensor(p + up + ".bias", w(ff), "f32")
        g.add_tensor(p + down + ".weight", w(d, ff), kinds[5])
        g.add_tensor(p + down + ".bias", w(d), "f32")


def _tiny_mmproj(path: Path, *, swapped: bool) -> None:
    import numpy as np

    rng = np.random.default_rng(2)
    image, patch, d, ff, n_head, n_layer, proj, scale = 16, 4, 32, 64, 4, 1, 32, 2
    n_patches = (image // patch) ** 2

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    g = _clip_writer("idefics3", {"image_size": image, "patch_size": patch, "embedding_length": d,
                                  "feed_forward_length": ff, "block_count": n_layer, "attention.head_count": n_head,
                                  "projection_dim": proj, "projector.scale_factor": scale})
    _siglip_embeddings(g, w, d, patch, n_patches)
    g.add_tensor("mm.model.fc.weight", w(proj, d * scale * scale), "q4_1")
    _siglip_layers(g, w, d, ff, n_layer, swapped=swapped)
    g.write(path)
    _retype_bf16(path, [f"v.blk.{layer}.attn_v.weight" for layer in range(n_layer)])


# The tiny MiniCPM-V 4.6 mmproj seeds (llama.cpp's minicpmv4_6 layout, as tools/convert_minicpmv.py
# writes it): 16 px slices of 4 px patches (a 4 x 4 grid), width 16, 2 layers. 16x mode: the window
# merger after layer 0 (so layers run on both sides of it), every bias, a 6 x 6 bucket table;
# 4x mode: no merger, the connector's optional biases left out, a 5 x 5 table. Width 16 keeps the
# files small (the connector's W_up alone is 16 x width^2); the quantized formats (blocks of 32)
# are on the matrices whose rows are 32 or 64 wide, F16 / BF16 / F32 on those of 16.
MINICPMV_TINY = {"image_size": 16, "patch_size": 4, "embedding_length": 16, "feed_forward_length": 32,
                 "block_count": 2, "attention.head_count": 2, "projection_dim": 32}
MINICPMV_MERGER_FF = 32  # the merger's inner width (4 x feed_forward_length in the real model)


def _tiny_minicpmv(path: Path, *, mode: str) -> None:
    import numpy as np

    from edgevlm_ros.engine.preprocess_minicpmv import DOWNSAMPLE_MODES
    from edgevlm_ros.tools.gguf_writer import GGUFValueType

    rng = np.random.default_rng(4 if mode == "16x" else 5)
    c = MINICPMV_TINY
    d, ff, wi, proj = c["embedding_length"], c["feed_forward_length"], MINICPMV_MERGER_FF, c["projection_dim"]
    merger, buckets = mode == "16x", 6 if mode == "16x" else 5

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    def vec(name: str, n: int, one: bool = False) -> None:
        g.add_tensor(name, one + w(n), "f32")

    g = _clip_writer("minicpmv4_6", {**c, "projector.scale_factor": DOWNSAMPLE_MODES[mode]})
    if merger:
        g.add_array("clip.vision.wa_layer_indexes", [0], GGUFValueType.INT32)
    _siglip_embeddings(g, w, d, c["patch_size"], buckets * buckets)
    _siglip_layers(g, w, d, ff, c["block_count"], kinds=("f32", "f16", "f16", "f32", "f16", "q4_1")
                   if merger else ("f16", "f32", "f16", "f16", "f32", "q8_0"))
    if merger:
        m = "v.vit_merger."
        vec(m + "ln1.weight", d, True)
        vec(m + "ln1.bias", d)
        _siglip_attention(g, w, m, d, ("f16", "f32", "f16", "f32"))
        vec(m + "ds_ln.weight", 4 * d, True)
        vec(m + "ds_ln.bias", 4 * d)
        g.add_tensor(m + "ds_ffn_up.weight", w(wi, 4 * d), "q4_0")
        vec(m + "ds_ffn_up.bias", wi)
        g.add_tensor(m + "ds_ffn_down.weight", w(d, wi), "q8_0")
        vec(m + "ds_ffn_down.bias", d)
    vec("mm.input_norm.weight", 4 * d, True)
    g.add_tensor("mm.up.weight", w(4 * d, 4 * d), "q4_0" if merger else "q4_1")
    g.add_tensor("mm.down.weight", w(proj, 4 * d), "q8_0" if merger else "f16")
    if merger:  # 4x: absent, so zero (llama.cpp's layout makes them optional)
        vec("mm.input_norm.bias", 4 * d)
        vec("mm.up.bias", 4 * d)
        vec("mm.down.bias", proj)
    g.write(path)
    # A layer's attn_v as BF16 (written as F16: our writer has no BF16), and in 16x the merger's attn_q.
    _retype_bf16(path, ["v.blk.1.attn_v.weight", "v.vit_merger.attn_q.weight"] if merger else ["v.blk.0.attn_v.weight"])


def _llama_new_formats(path: Path, downs: tuple[str, ...]) -> None:
    """The tiny llama with feed-forward width 256: each layer's ffn_down (rows of 256) in the next
    K-quant of `downs`, every other matrix (rows of 32) in Q5_0, Q5_1 or IQ4_NL in turn, encoded
    by the engine's reference quantizers."""
    import gguf
    import gguf_builder as gb
    import numpy as np

    from edgevlm_ros import _engine

    _tiny_llama(path, tied=False, rope_scaling=False, ff=256, n_layer=len(downs), kinds=("f32",))
    b = gb.from_file(path)
    small = ("Q5_0", "Q5_1", "IQ4_NL")
    for i, t in enumerate(b.tensors):
        name = str(t.name)
        if t.ggml_type != gb.GGML_F32 or len(t.dims) != 2 or not name.startswith("blk."):
            continue
        kind = downs[int(name.split(".")[1])] if name.endswith("ffn_down.weight") else small[i % len(small)]
        t.data = _engine.quantize(kind, np.frombuffer(t.data, np.float32)).tobytes()
        t.ggml_type = int(gguf.GGMLQuantizationType[kind])
    path.write_bytes(b.build())


def _retype_bf16(path: Path, names: list[str]) -> None:
    """Our writer has no BF16: tensors written as F16 (same size) get the BF16 type id in their info."""
    data = bytearray(path.read_bytes())
    for name in names:
        raw = name.encode()
        at = data.index(struct.pack("<Q", len(raw)) + raw) + 8 + len(raw)
        (n_dims,) = struct.unpack_from("<I", data, at)
        type_at = at + 4 + 8 * n_dims
        assert struct.unpack_from("<I", data, type_at) == (1,), name  # F16
        struct.pack_into("<I", data, type_at, 30)  # BF16
    path.write_bytes(bytes(data))


def _every_value_type() -> bytes:
    """Metadata of every value type (nested arrays too), alignment 1, tensors at odd offsets."""
    import gguf_builder as gb

    b = gb.GGUFBuilder(alignment=1)
    b.add("general.alignment", gb.UINT32, 1)
    for i, (vtype, value) in enumerate(((gb.UINT8, 7), (gb.INT8, -7), (gb.UINT16, 700), (gb.INT16, -700),
                                        (gb.UINT32, 70000), (gb.INT32, -70000), (gb.FLOAT32, 1.5), (gb.BOOL, 1),
                                        (gb.STRING, "héllo"), (gb.UINT64, 1 << 40), (gb.INT64, -(1 << 40)),
                                        (gb.FLOAT64, -2.25))):
        b.add(f"k.{i}", vtype, value)
    b.add("k.arr", gb.ARRAY, (gb.STRING, ["a", "bc", ""]))
    b.add("k.nested", gb.ARRAY, (gb.ARRAY, [(gb.INT32, [1, 2]), (gb.ARRAY, [(gb.UINT8, [3])])]))
    b.add("k.empty", gb.ARRAY, (gb.FLOAT32, []))
    b.add_tensor("t.f16", [3], gb.GGML_F16, bytes(6))
    b.add_tensor("t.q8", [32, 1], gb.GGML_Q8_0, bytes(34))
    b.add_tensor("t.q4_1", [32], gb.GGML_Q4_1, bytes(20))
    return b.build()


def _prefix_cache_file(path: Path, n_layer: int, n_past: int, kv_dim: int, n_rec: int = 0) -> None:
    import numpy as np

    from edgevlm_ros import _engine
    from edgevlm_ros.engine import prefix_cache

    rng = np.random.default_rng(3)
    k = rng.standard_normal((n_layer, n_past, kv_dim)).astype(np.float32)
    v = rng.standard_normal((n_layer, n_past, kv_dim)).astype(np.float32)
    rec = rng.standard_normal(n_rec).astype(np.float32)
    prefix_cache.save(path, FUZZ_KEY, list(range(n_past)), _engine.KVSnapshot.from_arrays(k, v, rec))


# The model the target also checks every file against (prefix_cache.StateShape): that of the
# hybrid seed, so that mutations of it reach the fit checks and, past them, the body.
FUZZ_FITS = {"n_layer": 1, "kv_dim": 8, "n_ctx": 16, "recurrent": 24}


GGUF_KEYS = [
    "general.architecture", "general.alignment", "llama", "clip", "idefics3", "linear", "none",
    *(f"llama.{k}" for k in ("context_length", "embedding_length", "feed_forward_length", "block_count",
                             "attention.head_count", "attention.head_count_kv", "rope.dimension_count",
                             "rope.freq_base", "attention.layer_norm_rms_epsilon", "rope.scaling.type",
                             "rope.scaling.factor")),
    "clip.has_vision_encoder", "clip.projector_type",
    *(f"clip.vision.{k}" for k in ("image_size", "patch_size", "embedding_length", "feed_forward_length",
                                   "block_count", "attention.head_count", "projection_dim",
                                   "projector.scale_factor", "attention.layer_norm_epsilon")),
    "token_embd.weight", "output.weight", "output_norm.weight", "blk.0.", "blk.1.", "v.blk.0.", "v.blk.1.",
    *(f"{n}.weight" for n in ("attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                              "ffn_up", "ffn_down", "ln1", "ln2", "attn_out")),
    *(f"{n}.bias" for n in ("ln1", "ln2", "attn_q", "attn_k", "attn_v", "attn_out", "ffn_up", "ffn_down")),
    "v.patch_embd.weight", "v.patch_embd.bias", "v.position_embd.weight", "v.post_ln.weight", "v.post_ln.bias",
    "mm.model.fc.weight",
    # minicpmv4_6: the window merger (16x mode) and the downsample MLP
    "minicpmv4_6", "clip.vision.wa_layer_indexes", "v.vit_merger.",
    *(f"{n}.{wb}" for n in ("ds_ln", "ds_ffn_up", "ds_ffn_down", "mm.input_norm", "mm.up", "mm.down")
      for wb in ("weight", "bias")),
    # qwen35: its keys and the tensors of both kinds of layer
    "qwen35", "blk.2.", "blk.3.",
    *(f"qwen35.{k}" for k in ("context_length", "embedding_length", "feed_forward_length", "block_count",
                              "attention.head_count", "attention.head_count_kv", "attention.key_length",
                              "attention.value_length", "rope.dimension_count", "rope.freq_base",
                              "rope.dimension_sections", "attention.layer_norm_rms_epsilon", "ssm.conv_kernel",
                              "ssm.state_size", "ssm.group_count", "ssm.time_step_rank", "ssm.inner_size",
                              "full_attention_interval", "attention.recurrent_layers", "nextn_predict_layers")),
    *(f"{n}.weight" for n in ("post_attention_norm", "attn_q_norm", "attn_k_norm", "attn_qkv", "attn_gate",
                              "ssm_conv1d", "ssm_beta", "ssm_alpha", "ssm_norm", "ssm_out")),
    "ssm_dt.bias", "ssm_a",
]


# JSON the header parser may meet: the header's names and values no writer of ours produces.
PREFIX_CACHE_TOKENS = ['"version"', '"key"', '"n_layer"', '"n_past"', '"kv_dim"', '"recurrent"', '"token_ids"',
                       FUZZ_KEY, "Infinity", "-Infinity", "NaN", "1e999", "-1", "0", "1.5", "true", "null", "[]", "{}",
                       "[[[[", '"1"', '"2"', "18446744073709551616", "\\ud800", "\xff", "EVKVC\x00\x01\x00"]


def _dict_escape(token: str) -> str:
    return "".join(c if 32 <= ord(c) < 127 and c not in '"\\' else f"\\x{ord(c):02x}" for c in token)


def write_seeds(dest: Path = SEEDS, model: Path | None = None) -> list[Path]:
    """(Re)writes every seed; deterministic (fixed RNG seeds)."""
    sys.path.insert(0, str(ROOT / "test"))
    g, pc = dest / "gguf", dest / "prefix_cache"
    g.mkdir(parents=True, exist_ok=True)
    pc.mkdir(parents=True, exist_ok=True)
    _tiny_llama(g / "llama_tiny.gguf", tied=False, rope_scaling=False)
    _tiny_llama(g / "llama_tiny_tied_linear_rope.gguf", tied=True, rope_scaling=True)
    _llama_new_formats(g / "llama_tiny_q2k_q3k_q4k.gguf", ("Q2_K", "Q3_K", "Q4_K"))
    _llama_new_formats(g / "llama_tiny_q5k_q6k.gguf", ("Q5_K", "Q6_K"))
    import qwen35_tiny

    qwen35_tiny.write(g / "qwen35_tiny.gguf", tied=True, layer_list=False)
    qwen35_tiny.write(g / "qwen35_tiny_untied_layer_list.gguf", tied=False, layer_list=True,
                      kinds=("q8_0", "q4_0", "f16"))
    qwen35_tiny.write(g / "qwen35_tiny_mtp.gguf", tied=True, layer_list=True, mtp=True, kinds=("q4_0",))
    _tiny_mmproj(g / "mmproj_tiny.gguf", swapped=False)
    _tiny_mmproj(g / "mmproj_tiny_ffn_swapped.gguf", swapped=True)
    _tiny_minicpmv(g / "minicpmv4_6_tiny_16x.gguf", mode="16x")
    _tiny_minicpmv(g / "minicpmv4_6_tiny_4x.gguf", mode="4x")
    (g / "every_value_type.gguf").write_bytes(_every_value_type())
    if model is not None:
        # The real file's opening: header, metadata and the start of the vocabulary array.
        (g / "smollm2_head.gguf").write_bytes(model.read_bytes()[:60_000])
    _prefix_cache_file(pc / "small.evkv", 2, 3, 4)
    _prefix_cache_file(pc / "empty_prefix.evkv", 1, 0, 8)
    _prefix_cache_file(pc / "hybrid.evkv", FUZZ_FITS["n_layer"], 3, FUZZ_FITS["kv_dim"], FUZZ_FITS["recurrent"])
    # The same files as the harness's second reading takes them: header JSON, NUL, body.
    for name in ("small", "empty_prefix", "hybrid"):
        raw = (pc / f"{name}.evkv").read_bytes()
        (hlen,) = struct.unpack_from("<I", raw, 8)
        (pc / f"{name}.json0").write_bytes(raw[12:12 + hlen] + b"\0" + raw[12 + hlen:-32])
    GGUF_DICT.write_text("".join(f'"{k}"\n' for k in GGUF_KEYS) + '"GGUF"\n', encoding="utf-8")
    PREFIX_CACHE_DICT.write_text("".join(f'"{_dict_escape(k)}"\n' for k in PREFIX_CACHE_TOKENS), encoding="utf-8")
    return sorted(p for p in dest.rglob("*") if p.is_file())


# --------------------------------------------------------------------------------------------
# Tests


def _seed_files(sub: str) -> list[Path]:
    return sorted(p for p in (SEEDS / sub).iterdir() if p.is_file())


def _regression_files(sub: str) -> list[Path]:
    d = REGRESSIONS / sub
    return sorted(p for p in d.iterdir() if p.is_file() and p.name != "README.md") if d.is_dir() else []


def test_seeds_are_small_and_the_valid_ones_build_models() -> None:
    from edgevlm_ros import _engine
    from edgevlm_ros.engine import prefix_cache

    for p in SEEDS.rglob("*"):
        if p.is_file():
            assert p.stat().st_size < MAX_SEED_BYTES, p
    # The model seeds stay useful only while they pass the model checks: a seed the loaders
    # refuse would leave the model-building code unreached by every mutation.
    for name, n_layer in (("llama_tiny.gguf", 2), ("llama_tiny_tied_linear_rope.gguf", 2),
                          ("llama_tiny_q2k_q3k_q4k.gguf", 3), ("llama_tiny_q5k_q6k.gguf", 2),
                          ("qwen35_tiny.gguf", 4), ("qwen35_tiny_untied_layer_list.gguf", 4)):
        m = _engine.Decoder(_engine.GGUFFile(str(SEEDS / "gguf" / name)), threads=1, n_ctx=8)
        assert m.config["n_layer"] == n_layer
        if name.startswith("qwen35"):  # 3 Gated DeltaNet layers of 448 floats of state, 1 attention layer
            assert m.state_shape["recurrent"] == 3 * 448 and m.state_shape["n_layer"] == 1
    for name in ("mmproj_tiny.gguf", "mmproj_tiny_ffn_swapped.gguf"):
        _engine.VisionModel(_engine.GGUFFile(str(SEEDS / "gguf" / name)), threads=1)
    # minicpmv4_6: the tile, and the harness's wide slice (scale_factor x 8 patches), in both modes.
    import numpy as np

    for name, scale, tile_tokens, slice_tokens in (("minicpmv4_6_tiny_16x.gguf", 4, 1, 2),
                                                    ("minicpmv4_6_tiny_4x.gguf", 2, 4, 4)):
        v = _engine.VisionModel(_engine.GGUFFile(str(SEEDS / "gguf" / name)), threads=1)
        assert (v.config["projector"], v.config["scale_factor"], v.config["tokens_per_tile"]) == (
            "minicpmv4_6", scale, tile_tokens), name
        patch = v.config["patch_size"]
        features = v.encode_slice(np.full((3, scale * patch, 8 * patch), -0.5, np.float32))
        assert features.shape == (slice_tokens, v.config["proj_dim"]) and np.isfinite(features).all(), name
    for p in _seed_files("prefix_cache"):
        if p.suffix == ".evkv":
            ids, _snap = prefix_cache.load(p, FUZZ_KEY)
    prefix_cache.load(SEEDS / "prefix_cache" / "hybrid.evkv", FUZZ_KEY, prefix_cache.StateShape(**FUZZ_FITS))


def test_the_qwen35_seeds_have_llama_cpps_layout(tmp_path: Path) -> None:
    """The tiny qwen35 of the seeds (with a vocabulary added) loads and generates in llama.cpp, so
    the loader is fuzzed from files of the layout llama.cpp's converter writes; the same file with
    attn_q missing its gate half is refused there, so a wrong shape would show."""
    llama_cpp = pytest.importorskip("llama_cpp",
                                    reason="llama-cpp-python is not installed (scripts/setup.sh builds it)")
    import gguf_builder as gb
    import qwen35_tiny

    for tied, layer_list in ((True, False), (False, True)):
        path = tmp_path / f"qwen35_{tied}_{layer_list}.gguf"
        qwen35_tiny.write(path, tied=tied, layer_list=layer_list, kinds=("q8_0", "q4_0", "f16"), vocab=True)
        llm = llama_cpp.Llama(str(path), n_ctx=64, n_threads=1, verbose=False)
        out = [t for _, t in zip(range(4), llm.generate([1, 2, 3], temp=0.0), strict=False)]
        assert len(out) == 4 and all(0 <= t < qwen35_tiny.TINY["vocab"] for t in out)
        del llm
    b = gb.from_file(path)
    (q,) = (t for t in b.tensors if t.name == "blk.3.attn_q.weight")
    q.dims[1] //= 2
    q.data = q.data[: len(q.data) // 2]
    path.write_bytes(b.build())
    with pytest.raises(ValueError):
        llama_cpp.Llama(str(path), n_ctx=64, n_threads=1, verbose=False)


def test_gguf_and_model_loaders_short_fuzz_run(tmp_path: Path) -> None:
    exe = build_fuzzer()
    corpus = tmp_path / "corpus"  # new inputs go here; the committed seeds are read only
    corpus.mkdir()
    cmd = [str(exe), "-seed=1", f"-runs={GGUF_RUNS}", f"-dict={GGUF_DICT}", *LIBFUZZER_FLAGS,
           f"-artifact_prefix={tmp_path}/", str(corpus), str(SEEDS / "gguf")]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    out = p.stdout + p.stderr
    crashes = sorted(tmp_path.glob("crash-*")) + sorted(tmp_path.glob("oom-*")) + sorted(tmp_path.glob("timeout-*"))
    assert p.returncode == 0 and not crashes, (
        f"fuzz_gguf found a crash ({[c.name for c in crashes]}): fix it and add the input to "
        f"test/fuzz_regressions/gguf/\n{out[-6000:]}")
    _check_clean(out)
    print(_final_stats(out))


def test_gguf_regressions_replay() -> None:
    files = _regression_files("gguf")
    assert files, "test/fuzz_regressions/gguf is empty"
    exe = build_fuzzer()
    # Given files (not directories), libFuzzer runs each once and stops at the first failure.
    p = subprocess.run([str(exe), *LIBFUZZER_FLAGS, *map(str, files)], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-6000:]
    _check_clean(out)
    assert out.count("Executed ") == len(files), out[-3000:]


def test_prefix_cache_reader_short_fuzz_run(tmp_path: Path) -> None:
    pytest.importorskip("atheris", reason="atheris (requirements-test.txt) is not installed")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    cmd = [sys.executable, str(Path(__file__).resolve()), "prefix-cache", "-seed=1", f"-runs={PREFIX_CACHE_RUNS}",
           # No RSS limit: libFuzzer reads peak RSS with getrusage, which a child inherits from its
           # parent (pytest holding transformers models: 2.1 GB seen in CI), so the limit fired at
           # start. A single allocation over 1 GB is still a finding (a size from an unchecked field).
           "-max_len=4096", "-timeout=20", "-rss_limit_mb=0", "-malloc_limit_mb=1024",
           f"-dict={PREFIX_CACHE_DICT}", "-print_final_stats=1",
           f"-artifact_prefix={tmp_path}/", str(corpus), str(SEEDS / "prefix_cache")]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    out = p.stdout + p.stderr
    crashes = sorted(tmp_path.glob("crash-*")) + sorted(tmp_path.glob("timeout-*"))
    assert p.returncode == 0 and not crashes, (
        f"prefix_cache.load raised something other than PrefixCacheError ({[c.name for c in crashes]}): fix it "
        f"and add the input to test/fuzz_regressions/prefix_cache/\n{out[-6000:]}")
    print(_final_stats(out))


@pytest.mark.parametrize("path", _regression_files("prefix_cache"), ids=lambda p: p.name)
def test_prefix_cache_regressions_replay(path: Path, tmp_path: Path) -> None:
    """Each regression input, read both ways the harness reads it, without and with the model's
    state to fit: loads or PrefixCacheError."""
    from edgevlm_ros.engine import prefix_cache

    for i, data in enumerate(prefix_cache_readings(path.read_bytes())):
        f = tmp_path / f"reading{i}.evkv"
        f.write_bytes(data)
        for fits in (None, prefix_cache.StateShape(**FUZZ_FITS)):
            try:
                prefix_cache.load(f, FUZZ_KEY, fits)
            except prefix_cache.PrefixCacheError:
                pass


# --------------------------------------------------------------------------------------------
# Corrupt qwen35 files: each refused by the loader with the engine's own error, before any
# allocation sized from the numbers it doubts

# "qwen35.*" keys (without the prefix) over the tiny model's tensors (qwen35_tiny.TINY: d 32, 2 key
# heads and 4 value heads of 8, conv 4, interval 4; 448 floats of state per linear layer).
QWEN35_BAD_KEYS: dict[str, dict[str, object]] = {
    # A state of 4 x 2^20 x 2^20 floats (16 TiB) per linear layer, or 2^24 value heads of 8 x 8.
    "state_size_2^20": {"ssm.state_size": 1 << 20},
    "value_heads_2^24": {"ssm.time_step_rank": 1 << 24, "ssm.inner_size": 8 << 24},
    # Each key within any bound a loader may set, together 64 heads of 4096 x 4096 (4 GiB) a layer:
    # only the tensors (sized for the tiny model) tell that the promise is false.
    "state_of_4_gib_a_layer": {"ssm.state_size": 4096, "ssm.group_count": 64, "ssm.time_step_rank": 64,
                               "ssm.inner_size": 4096 * 64},
    "conv_kernel_2^31": {"ssm.conv_kernel": 1 << 31},
    "conv_kernel_0": {"ssm.conv_kernel": 0},
    "conv_kernel_3_for_a_width_4_kernel": {"ssm.conv_kernel": 3},
    "key_heads_0": {"ssm.group_count": 0},
    "value_heads_not_a_multiple_of_key_heads": {"ssm.group_count": 3},
    "inner_size_off_by_one": {"ssm.inner_size": 33},
    "inner_size_2^31": {"ssm.inner_size": 1 << 31},
    "no_state_size": {"ssm.state_size": None},
    "no_conv_kernel": {"ssm.conv_kernel": None},
    "interval_0": {"full_attention_interval": 0},
    "interval_1_every_layer_full": {"full_attention_interval": 1},
    "interval_2^31_no_layer_full": {"full_attention_interval": 1 << 31},
    "layer_list_too_short": {"attention.recurrent_layers": [True, True, True]},
    "layer_list_against_the_tensors": {"attention.recurrent_layers": [True, True, False, True]},
    "key_length_2^20": {"attention.key_length": 1 << 20, "attention.value_length": 1 << 20},
    "kv_heads_0": {"attention.head_count_kv": 0},
    "kv_heads_not_dividing_heads": {"attention.head_count_kv": 3},
    "rope_wider_than_a_head": {"rope.dimension_count": 32},
    "block_count_2^20": {"block_count": 1 << 20},
}


def _qwen35_bad_tensors(src: Path, dest: Path) -> list[Path]:
    """The valid tiny qwen35 with one tensor of the wrong shape, or missing."""
    import gguf_builder as gb

    def one(name: str, change: Callable[[gb.TensorSpec], bool]) -> Path:
        b = gb.from_file(src)
        for t in list(b.tensors):
            if t.name == name and not change(t):
                b.tensors.remove(t)
        out = dest / f"qwen35_tensor_{name}.gguf"
        out.write_bytes(b.build())
        return out

    def fewer_values(t: gb.TensorSpec) -> bool:  # an F32 tensor one value shorter along ne0
        t.dims[0] -= 1
        t.data = t.data[: 4 * math.prod(t.dims)]
        return True

    def half_the_rows(t: gb.TensorSpec) -> bool:
        t.dims[1] //= 2
        t.data = t.data[: len(t.data) // 2]
        return True

    return [one("blk.0.ssm_conv1d.weight", fewer_values),  # kernel 3 wide for ssm.conv_kernel 4
            one("blk.1.ssm_a", fewer_values),  # 3 of 4 heads
            one("blk.3.attn_q.weight", half_the_rows),  # no gate half
            one("blk.2.attn_qkv.weight", half_the_rows),  # half of q, k, v
            one("blk.1.ssm_norm.weight", lambda t: False),  # missing
            one("blk.0.ssm_dt.bias", lambda t: False)]  # missing


def test_corrupt_qwen35_files_are_refused_before_allocating(tmp_path: Path) -> None:
    """Every key that sizes a qwen35 model or its recurrent state, set wrong one at a time, and
    tensors of the wrong shape: the fuzz harness (ASan, malloc limit 64 MB, where the tiny model
    needs < 1 MB) meets each without a report, and in-process each is refused with GGUFError or
    UnsupportedModelError naming a key or a tensor, never with anything else."""
    import resource

    import qwen35_tiny

    from edgevlm_ros import _engine

    good = tmp_path / "good.gguf"
    qwen35_tiny.write(good, tied=True, layer_list=False)
    _engine.Decoder(_engine.GGUFFile(str(good)), threads=1, n_ctx=8)  # the good file loads
    files = []
    for name, keys in QWEN35_BAD_KEYS.items():
        files.append(tmp_path / f"qwen35_{name}.gguf")
        qwen35_tiny.write(files[-1], tied=True, layer_list="attention.recurrent_layers" in keys, keys=keys)
    files += _qwen35_bad_tensors(good, tmp_path)
    exe = build_fuzzer()
    flags = [f for f in LIBFUZZER_FLAGS if not f.startswith("-malloc_limit_mb")] + ["-malloc_limit_mb=64"]
    p = subprocess.run([str(exe), *flags, *map(str, files)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-6000:]
    _check_clean(out)
    assert out.count("Executed ") == len(files), out[-3000:]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for path in files:
        with pytest.raises((_engine.GGUFError, _engine.UnsupportedModelError)) as info:
            _engine.Decoder(_engine.GGUFFile(str(path)), threads=1, n_ctx=8)
        message = str(info.value)
        assert "qwen35." in message or "blk." in message, (path.name, message)
        assert "unsupported architecture" not in message, (path.name, message)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 << 10  # KiB: < 64 MiB more


# --------------------------------------------------------------------------------------------
# The atheris target (run as a script, in its own process: atheris.Fuzz() never returns)


def prefix_cache_readings(data: bytes) -> list[bytes]:
    """The files one fuzz input stands for:
    1. the bytes as they are;
    2. the bytes as "header JSON, NUL, body", framed as a writer would (magic, header length,
       sha256). A mutation of the header text that changes its length, or of the body, then reaches
       the checks behind the framing and the checksum instead of stopping at them."""
    from edgevlm_ros.engine import prefix_cache

    header, _, body = data.partition(b"\0")
    head = prefix_cache.MAGIC + struct.pack("<I", len(header)) + header + body
    return [data, head + hashlib.sha256(head).digest()]


def _prefix_cache_main(argv: list[str]) -> None:
    import atheris

    with atheris.instrument_imports(include=["edgevlm_ros.engine.prefix_cache"]):
        from edgevlm_ros.engine import prefix_cache
    fd = os.memfd_create("fuzz_prefix_cache")
    path = Path(f"/proc/self/fd/{fd}")
    model = prefix_cache.StateShape(**FUZZ_FITS)

    def load(data: bytes, fits: prefix_cache.StateShape | None) -> None:
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        try:
            prefix_cache.load(path, FUZZ_KEY, fits)
        except prefix_cache.PrefixCacheError:
            pass

    def one_input(data: bytes) -> None:
        # The input's last bit picks whether the model's state is checked too (half the inputs
        # each, as cheap as one reading per file): mutations flip it freely.
        fits = model if data and data[-1] & 1 else None
        for file in prefix_cache_readings(data):
            load(file, fits)

    atheris.Setup([argv[0], *argv[1:]], one_input)
    atheris.Fuzz()


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[1] == "build":
        print(build_fuzzer())
        return 0
    if len(argv) >= 2 and argv[1] == "seeds":
        model = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
        for p in write_seeds(model=model if model.exists() else None):
            print(f"{p.stat().st_size:7d}  {p.relative_to(ROOT)}")
        return 0
    if len(argv) >= 2 and argv[1] == "prefix-cache":
        _prefix_cache_main([argv[0], *argv[2:]])
        return 0
    print(__doc__)
    print("usage: test_fuzz.py build | seeds | prefix-cache [libFuzzer flags] [corpus dirs]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
