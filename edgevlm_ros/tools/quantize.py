"""`edgevlm quantize IN OUT --type q4_k_m|q5_k_m|q8_0`: a GGUF file requantized to a mix of ours.

Reads any GGUF the engine loads (F32, F16, BF16, Q8_0, Q4_0, Q4_1 and whatever other formats this
build dequantizes, `_engine.weight_formats()`), chooses each tensor's type with the mix rules of
tools/quant_mix.py and writes OUT with tools/gguf_writer.py:

* every metadata key of IN is copied with its exact value type and bytes, in IN's order, except
  `general.file_type` (set to the mix's llama_ftype: 7 Q8_0, 15 Q4_K_M, 17 Q5_K_M) and
  `general.quantization_version` (2); the alignment is IN's;
* a tensor whose type does not change (the norms, or a Q8_0 head in a Q8_0 file) is copied byte for
  byte; any other is dequantized to float32 by the engine's reference dequantizer and quantized by
  its reference quantizer (`_engine.quantize`), so the bytes are what the engine and ggml expect.

Requantizing an already quantized file cannot give back what its quantization lost: the result is at
best as good as IN (the command says so). Everything is checked before anything is written, and OUT
appears only when complete.
"""

from __future__ import annotations

import argparse
import struct
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .gguf_writer import GGMLType, GGUFValueType, GGUFWriter, ggml_type_named
from .quant_mix import MIXES, Mix, TensorSpec, mix_named, plan_types

__all__ = ["QuantizeResult", "add_quantize_arguments", "quantize", "read_encoded_metadata", "run_quantize"]

# GGUF value type -> bytes of one value (the fixed-size ones)
_FIXED = {GGUFValueType.UINT8: 1, GGUFValueType.INT8: 1, GGUFValueType.BOOL: 1, GGUFValueType.UINT16: 2,
          GGUFValueType.INT16: 2, GGUFValueType.UINT32: 4, GGUFValueType.INT32: 4, GGUFValueType.FLOAT32: 4,
          GGUFValueType.UINT64: 8, GGUFValueType.INT64: 8, GGUFValueType.FLOAT64: 8}
_SET_BY_US = ("general.alignment", "general.file_type", "general.quantization_version")
_UNQUANTIZED = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)


@dataclass(frozen=True)
class QuantizeResult:
    path: Path
    mix: Mix
    types: dict[str, GGMLType]  # tensor -> the type written
    input_types: dict[str, GGMLType]  # tensor -> its type in IN
    input_bytes: int
    nbytes: int


def _value_end(buf: bytes, pos: int, vtype: int) -> int:
    """Where the value of type `vtype` that starts at `pos` ends (GGUF v2/v3 layout)."""
    if vtype in _FIXED:
        return pos + _FIXED[GGUFValueType(vtype)]
    if vtype == GGUFValueType.STRING:
        (n,) = struct.unpack_from("<Q", buf, pos)
        return pos + 8 + n
    if vtype == GGUFValueType.ARRAY:
        etype, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if etype in _FIXED:
            return pos + count * _FIXED[GGUFValueType(etype)]
        for _ in range(count):
            pos = _value_end(buf, pos, etype)
        return pos
    raise ValueError(f"unknown GGUF value type {vtype}")


def read_encoded_metadata(path: str | Path, header_bytes: int) -> list[tuple[str, GGUFValueType, bytes]]:
    """Every key of a GGUF file as (key, value type, the encoded value bytes), in file order.
    `header_bytes`: how much of the file holds the header (its data offset). The file must already
    have been opened by the engine's reader, which checks every size: this only slices it."""
    with open(path, "rb") as f:
        buf = f.read(header_bytes)
    try:
        _, n_kv = struct.unpack_from("<QQ", buf, 8)
        pos, out = 24, []
        for _ in range(n_kv):
            (n,) = struct.unpack_from("<Q", buf, pos)
            key = buf[pos + 8 : pos + 8 + n].decode("utf-8", "surrogateescape")
            (vtype,) = struct.unpack_from("<I", buf, pos + 8 + n)
            start = pos + 12 + n
            pos = _value_end(buf, start, vtype)
            if pos > len(buf):
                raise struct.error("past the header")
            out.append((key, GGUFValueType(vtype), buf[start:pos]))
    except (struct.error, ValueError) as exc:
        raise ValueError(f"cannot read the metadata of {path}: {exc}") from None
    return out


def _open(path: Path) -> Any:
    from .. import _engine

    if not path.is_file():
        raise ValueError(f"cannot read {path}: no such file")
    try:
        return _engine.GGUFFile(str(path))
    except (ValueError, OSError) as exc:
        raise ValueError(f"cannot read {path}: {str(exc).splitlines()[0] if str(exc) else exc}") from None


def _check_codecs(needs: dict[GGMLType, str], dequantized: dict[GGMLType, str]) -> None:
    """Refuses, before anything is written, a tensor this build can neither decode nor encode."""
    from .. import _engine

    readable = set(_engine.weight_formats())
    for t, example in dequantized.items():
        if t.name not in readable:
            raise ValueError(f"tensor {example!r} is {t.name}, which this build cannot dequantize")
    for t, example in needs.items():
        if t in _UNQUANTIZED:
            continue
        try:
            _engine.quantize(t.name, np.zeros(256, np.float32))
        except ValueError:
            raise ValueError(f"this build has no {t.name} quantizer (needed for {example!r} and others of "
                             "that type)") from None


def _raw_reader(path: Path, offset: int, nbytes: int) -> Callable[[], bytes]:
    def read() -> bytes:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(nbytes)

    return read


def quantize(src: str | Path, dst: str | Path, mix: str | Mix = "q4_k_m") -> QuantizeResult:
    """Writes `dst`, the GGUF `src` requantized to `mix` (q4_k_m, q5_k_m or q8_0)."""
    mix = mix_named(mix) if isinstance(mix, str) else mix
    src_p, dst_p = Path(src), Path(dst)
    if src_p.resolve() == dst_p.resolve() or (dst_p.exists() and src_p.exists() and src_p.samefile(dst_p)):
        raise ValueError(f"OUT is the input file {src_p}: write the quantized file to another path")
    if not dst_p.parent.is_dir():
        raise ValueError(f"cannot write {dst_p}: folder {dst_p.parent} does not exist")
    f = _open(src_p)
    meta = f.metadata()
    infos = f.tensors()
    specs = [TensorSpec(t["name"], tuple(t["shape"][::-1]), ggml_type_named(t["type"])) for t in infos]
    arch = meta.get("general.architecture")
    n_layer = meta.get(f"{arch}.block_count")
    plan = plan_types(specs, mix, n_layer if isinstance(n_layer, int) and n_layer > 0 else None)

    needs: dict[GGMLType, str] = {}
    dequantized: dict[GGMLType, str] = {}
    for s in specs:
        if plan[s.name] != s.type:
            needs.setdefault(plan[s.name], s.name)
            dequantized.setdefault(s.type, s.name)
    _check_codecs(needs, dequantized)

    alignment = int(f.alignment)
    w = GGUFWriter(alignment if alignment % 8 == 0 else 32)
    encoded = read_encoded_metadata(src_p, int(f.data_offset))
    for key, vtype, payload in encoded:
        if key == "general.file_type":
            w.add_uint32(key, mix.file_type)
        elif key == "general.quantization_version":
            w.add_uint32(key, 2)
        elif key not in _SET_BY_US:
            w.add_encoded_value(key, vtype, payload, meta.get(key))
    present = {k for k, _, _ in encoded}
    if "general.file_type" not in present:
        w.add_uint32("general.file_type", mix.file_type)
    if "general.quantization_version" not in present:
        w.add_uint32("general.quantization_version", 2)

    for s, info in zip(specs, infos, strict=True):
        if plan[s.name] == s.type:
            w.add_tensor_bytes(s.name, _raw_reader(src_p, int(info["offset"]), int(info["nbytes"])), s.type, s.shape)
        else:
            w.add_tensor(s.name, lambda name=s.name: f.dequantize(name), plan[s.name], shape=s.shape)
    path = w.write(dst_p)
    return QuantizeResult(path, mix, w.tensor_types, {s.name: s.type for s in specs}, src_p.stat().st_size,
                          path.stat().st_size)


# -- command line ---------------------------------------------------------------------------------


def add_quantize_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the `quantize` arguments (IN OUT --type) to a (sub)parser."""
    parser.add_argument("src", metavar="IN", help="GGUF file to requantize")
    parser.add_argument("dst", metavar="OUT", help="GGUF file to write (not IN)")
    parser.add_argument("--type", dest="mix", required=True, type=str.lower, choices=list(MIXES),
                        help="q4_k_m / q5_k_m: llama.cpp's K-quant mixes (Q4_K or Q5_K, Q6_K where it pays, "
                             "32-element fallbacks for rows that are not whole 256-blocks); q8_0: every matrix Q8_0")
    return parser


def run_quantize(args: argparse.Namespace) -> int:
    """Runs a parsed `quantize` command: prints OUT, and what it holds on stderr."""
    r = quantize(args.src, args.dst, args.mix)
    if any(t not in _UNQUANTIZED for t in r.input_types.values()):
        print(f"note: {args.src} was already quantized: its quantization's losses stay in {r.path.name}",
              file=sys.stderr)
    counts = ", ".join(f"{n} {t.name}" for t, n in sorted(Counter(r.types.values()).items()))
    print(r.path)
    print(f"[{r.mix.name.upper()}: {r.nbytes / 1e6:.1f} MB (input {r.input_bytes / 1e6:.1f} MB); tensors: {counts}]",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    from ..engine.argtypes import command_main

    sys.exit(command_main("edgevlm quantize", add_quantize_arguments, run_quantize))
