"""What a vision encode costs and what this machine can do: the floating-point work of one
MiniCPM-V 4.6 slice, counted from its mmproj, and the FP32 FLOP/s the engine's own prefill GEMM
reaches here (the `edgevlm bench` peak). Derivation: docs/kernels/vision-flops.md.

Counted: every matrix product as 2 flops per multiply-add (the patch embedding's convolution, the
Q/K/V/O and MLP products, attention's Q K^T and P V, the window merger's and the downsample MLP's
products), as native/models/minicpmv.cpp and siglip.cpp run them. Left out: layernorms, GELU, softmax,
biases, residuals and the window mean (a few flops per activation: well under 1% here).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

PEAK_SHAPE = (4304, 1152, 1024)  # rows x k x tokens: SigLIP so400m's MLP up product on one 448 slice
QUICK_PEAK_SHAPE = (1152, 1152, 256)  # `edgevlm bench --quick`: a smoke test, not a measure


def linear_flops(tokens: int, k: int, rows: int) -> int:
    """A product of `tokens` activations of width k with a rows x k matrix."""
    return 2 * tokens * k * rows


def siglip_layer_flops(tokens: int, width: int, ffn: int) -> dict[str, int]:
    """One SigLIP encoder layer on `tokens` tokens (bidirectional attention over all of them):
    the Q, K, V, O products and the MLP ("linear"), and Q K^T plus P V over every head ("attention":
    each 2 * tokens^2 * head_dim per head, head_dim * heads = width)."""
    return {"linear": 4 * linear_flops(tokens, width, width) + 2 * linear_flops(tokens, width, ffn),
            "attention": 2 * 2 * tokens * tokens * width}


@dataclass(frozen=True)
class MiniCPMVShape:
    """The numbers the count needs, from an mmproj: the tower's config (VisionModel.config), the
    layer the window merger follows (None: 4x mode, no merger) and the merger MLP's width."""

    width: int
    ffn: int
    layers: int
    patch: int
    proj_dim: int
    scale_factor: int
    insert_layer: int | None
    merger_ffn: int

    @classmethod
    def from_mmproj(cls, path: Path, config: Mapping[str, Any]) -> MiniCPMVShape:
        from .. import _engine

        f = _engine.GGUFFile(str(path))
        meta = f.metadata()
        insert: int | None = None
        merger_ffn = 0
        if int(config["scale_factor"]) == 4:
            ids = meta.get("clip.vision.wa_layer_indexes")
            if not isinstance(ids, list) or len(ids) != 1:
                raise ValueError(f"{path.name}: 16x mode without one clip.vision.wa_layer_indexes")
            insert = int(ids[0])
            up = next((t for t in f.tensors() if t["name"] == "v.vit_merger.ds_ffn_up.weight"), None)
            if up is None:
                raise ValueError(f"{path.name}: 16x mode without v.vit_merger.ds_ffn_up.weight")
            merger_ffn = int(up["shape"][-1])
        return cls(int(config["n_embd"]), int(config["n_ff"]), int(config["n_layer"]), int(config["patch_size"]),
                   int(config["proj_dim"]), int(config["scale_factor"]), insert, merger_ffn)


def minicpmv_slice_flops(shape: MiniCPMVShape, gh: int, gw: int) -> dict[str, int]:
    """Flops of one slice of gh x gw patches, by part (and "total"): the patch embedding, the layers
    up to and including the merger's on gh*gw tokens, the window merger (attention inside each 2x2
    window: 4 keys a query; its MLP on the windows' four tokens concatenated), the remaining layers
    on gh*gw/4 tokens, the downsample MLP on 2x2 neighbours of the last grid."""
    d, n = shape.width, gh * gw
    parts: dict[str, int] = {"patch_embedding": linear_flops(n, 3 * shape.patch * shape.patch, d)}
    before = shape.layers if shape.insert_layer is None else shape.insert_layer + 1
    layer = siglip_layer_flops(n, d, shape.ffn)
    parts["layers_full_grid"] = before * sum(layer.values())
    attention = before * layer["attention"]
    tokens = n
    if shape.insert_layer is not None:
        m = n // 4
        window_attention = 2 * 2 * n * 4 * d  # each token's Q K^T and P V against its window's 4 tokens
        parts["window_merger"] = (4 * linear_flops(n, d, d) + window_attention
                                  + linear_flops(m, 4 * d, shape.merger_ffn) + linear_flops(m, shape.merger_ffn, d))
        attention += window_attention
        after = siglip_layer_flops(m, d, shape.ffn)
        parts["layers_quarter_grid"] = (shape.layers - before) * sum(after.values())
        attention += (shape.layers - before) * after["attention"]
        tokens = m
    out = tokens // 4
    parts["downsample_mlp"] = linear_flops(out, 4 * d, 4 * d) + linear_flops(out, 4 * d, shape.proj_dim)
    parts["total"] = sum(parts.values())
    parts["attention"] = attention  # included in the parts above, shown on its own
    return parts


def measure_gemm_peak(formats: Sequence[str], threads: int, shape: tuple[int, int, int] = PEAK_SHAPE,
                      repeats: int = 3, int8: bool = False) -> dict[str, Any]:
    """The FLOP/s of the prefill GEMM the engine picks (active operator table) for each weight
    format, on a rows x k matrix times `tokens` activations (every float variant multiplies and adds
    in FP32; F16 / BF16 weights are widened when packed; int8: the table's int8 rule, as the tower
    runs with vision_int8), best of `repeats` after a warm-up, packing excluded; "gflops" is the
    highest: the peak the encode is measured against."""
    from .. import _engine
    from .tune import random_weight

    rows, k, m = shape
    rng = np.random.default_rng(0)
    x = rng.normal(0.0, 1.0, (m, k)).astype(np.float32)
    per: dict[str, dict[str, Any]] = {}
    for fmt in dict.fromkeys(formats):
        variant = _engine.choose_matmul(fmt, "int8" if int8 else "prefill", rows, k)
        w = random_weight(fmt, rows, k, rng)
        secs = _engine.kernel_matmul_seconds(variant, fmt, w, rows, k, x, threads, repeats, True)
        per[fmt] = {"variant": variant, "seconds": secs, "gflops": linear_flops(m, k, rows) / secs / 1e9}
    best = max(per, key=lambda f: per[f]["gflops"])
    return {"gflops": per[best]["gflops"], "format": best, "variant": per[best]["variant"], "shape": list(shape),
            "threads": threads, "by_format": per}
