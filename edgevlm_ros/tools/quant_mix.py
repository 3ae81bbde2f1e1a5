"""Which tensor gets which type in a quantized GGUF: the Q8_0 file and the K-quant mixes Q4_K_M and
Q5_K_M. Pure Python (names and shapes in, types out): `edgevlm quantize` and `edgevlm convert` both
ask it, and the tests check it without quantizing anything.

The rules were learnt from llama.cpp's quantizer (src/llama-quant.cpp of the llama-cpp-python 0.3.36
sdist, which decides the mix of the files the community ships) and are written here as ours, for
the decoders we load (llama, gemma3, and qwen35's hybrid layers):

1. Only matrices are quantized: a tensor of two or more dimensions whose name ends in "weight" and
   that is not a norm, a positional / patch embedding, a token-type table or a conv1d kernel.
   Everything else keeps the type it has: the 1-D norms and biases stay F32, and so do Qwen3.5's
   Gated DeltaNet vectors and small kernels (`ssm_a`, `ssm_dt.bias`, `ssm_norm`, `ssm_conv1d`).
   Its projections (`attn_qkv`, `attn_gate`, `ssm_alpha`, `ssm_beta`, `ssm_out`) are matrices.
2. Each mix has a base type: Q8_0 -> Q8_0, Q4_K_M -> Q4_K, Q5_K_M -> Q5_K.
3. The output head (`output.weight`, or `token_embd.weight` when the file has no `output.weight`, so
   the head is tied to it) -> Q6_K in the K mixes; Q8_0 when its rows are not whole blocks of the
   base type (small models: widths 576, 640, 960); in the Q8_0 file, Q8_0.
4. More bits where quantization hurts most: `attn_v` and `ffn_down` -> Q6_K in the layers that get
   more bits — the first eighth, the last eighth and every third layer in between
   (i < n/8, i >= 7n/8 or (i - n/8) mod 3 = 2), where i counts that tensor kind in layer order and n
   is the number of `attn_v` tensors (for `attn_v`) or of blocks (for `ffn_down`). A fused
   `attn_qkv` is of `attn_v`'s kind (llama.cpp's attention-v category): counted with the `attn_v`
   tensors, in one sequence (a Qwen3.5 file has 18 `attn_qkv` in its linear layers and 6 `attn_v`
   in its full-attention layers: n = 24). llama.cpp's quantizer writes exactly this (checked on a
   qwen35 file, test_quantize.py); its separate "attn_qkv -> Q5_K" branch is never reached there.
5. A K-quant needs rows of whole 256-element super-blocks; a row that is not falls back to a
   32-element format of about the same size: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0; a row that is
   not a multiple of 32 either -> F16 (in every mix).

Left out on purpose (none of our architectures has them): llama.cpp's mixture-of-experts and Falcon
special cases, the 70B attn_v bump, and user overrides of single tensors.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from .gguf_writer import GGMLType, block_size

__all__ = ["MIXES", "Mix", "TensorSpec", "mix_named", "plan_types", "use_more_bits"]


@dataclass(frozen=True)
class Mix:
    name: str        # the --type name: q4_k_m
    base: GGMLType   # the type of every matrix no rule moves
    file_type: int   # general.file_type (llama.cpp's llama_ftype)


MIXES: dict[str, Mix] = {m.name: m for m in (
    Mix("q8_0", GGMLType.Q8_0, 7),
    Mix("q4_k_m", GGMLType.Q4_K, 15),
    Mix("q5_k_m", GGMLType.Q5_K, 17),
)}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # numpy order: the row (ggml's ne0) is the last dimension
    type: GGMLType          # the type it has now (F32 for a checkpoint being converted)


def mix_named(name: str) -> Mix:
    try:
        return MIXES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown --type {name!r} (choose from {', '.join(MIXES)})") from None


# Name parts of tensors that are never quantized (rule 1).
_KEEP = ("_norm.weight", "position_embd", "token_types", ".patch_embd", "ffn_gate_inp.weight",
         "ssm_conv1d", "attn_rel_b.weight")
_FALLBACK = {GGMLType.Q4_K: GGMLType.Q5_0, GGMLType.Q5_K: GGMLType.Q5_1, GGMLType.Q6_K: GGMLType.Q8_0}
_LAYER = re.compile(r"blk\.(\d+)\.")
_ATTN_V_KIND = ("attn_v.weight", "attn_qkv.weight")  # rule 4: one kind, one count


def _is_matrix(t: TensorSpec) -> bool:
    dims = list(t.shape)
    while len(dims) > 1 and dims[0] == 1:  # leading numpy dims of 1 are ggml's trailing ones
        dims.pop(0)
    return len(dims) >= 2 and t.name.endswith("weight") and not any(k in t.name for k in _KEEP)


def use_more_bits(i: int, n: int) -> bool:
    """Whether the i-th of n layers gets the mix's extra bits (rule 4)."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _is_attn_v_kind(name: str) -> bool:
    return any(k in name for k in _ATTN_V_KIND)


def _layer(name: str) -> int:
    m = _LAYER.match(name)
    return int(m.group(1)) if m else -1


def _fits(wtype: GGMLType, row: int) -> GGMLType:
    """Rule 5: the type a row of `row` values can actually be stored as."""
    if row % block_size(wtype) == 0:
        return wtype
    wtype = _FALLBACK.get(wtype, wtype)
    return wtype if row % block_size(wtype) == 0 else GGMLType.F16


def plan_types(tensors: Sequence[TensorSpec], mix: Mix | str, n_layer: int | None = None) -> dict[str, GGMLType]:
    """name -> the type each tensor is written as in `mix`. `n_layer`: the file's block count (its
    `<arch>.block_count`); default: the highest `blk.N.` index + 1."""
    mix = mix_named(mix) if isinstance(mix, str) else mix
    k_mix = mix.base != GGMLType.Q8_0
    tied = not any(t.name == "output.weight" for t in tensors)
    if n_layer is None:
        n_layer = max((_layer(t.name) for t in tensors), default=-1) + 1
    # Tensors of one kind are counted in layer order (ties by name), as they are met in a file.
    order = sorted(tensors, key=lambda t: (_layer(t.name), t.name))
    n_attn_v = sum(_is_attn_v_kind(t.name) for t in tensors)
    seen_v = seen_down = 0
    plan: dict[str, GGMLType] = {}
    for t in order:
        if not _is_matrix(t):
            plan[t.name] = t.type
            continue
        row = t.shape[-1]
        wtype = mix.base
        if t.name == "output.weight" or (tied and t.name == "token_embd.weight"):
            if row % block_size(mix.base):
                wtype = GGMLType.Q8_0
            elif k_mix:
                wtype = GGMLType.Q6_K
        elif _is_attn_v_kind(t.name):
            if k_mix and use_more_bits(seen_v, n_attn_v):
                wtype = GGMLType.Q6_K
            seen_v += 1
        elif "ffn_down" in t.name:
            if k_mix and use_more_bits(seen_down, n_layer):
                wtype = GGMLType.Q6_K
            seen_down += 1
        plan[t.name] = _fits(wtype, row)
    return {t.name: plan[t.name] for t in tensors}  # in the caller's order
