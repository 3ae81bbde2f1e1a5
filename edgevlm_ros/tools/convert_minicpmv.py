"""MiniCPM-V 4.6 (`MiniCPMV4_6ForConditionalGeneration`) -> its mmproj GGUF in llama.cpp's layout
(`clip.projector_type` minicpmv4_6); the text half goes through tools/convert_qwen35.py.

The layout (llama.cpp 0.3.36's `MiniCPMV4_6VisionModel`; read there, written here):
* the SigLIP tower under `model.vision_tower.` as SmolVLM's (`v.patch_embd`, `v.position_embd` with
  its whole (image_size / patch)^2 bucket table, `v.blk.N.*`, `v.post_ln`);
* 16x mode: the window-attention merger `vision_tower.vit_merger.` -> `v.vit_merger.ln1`, `attn_q/k/v/out`,
  `ds_ln` (pre_norm), `ds_ffn_up` (linear_1), `ds_ffn_down` (linear_2), and the layer it follows in
  `clip.vision.wa_layer_indexes`; 4x mode leaves the merger out (transformers skips it);
* the final DownsampleMLP `model.merger.mlp.0.` -> `mm.input_norm` (pre_norm), `mm.up` (linear_1),
  `mm.down` (linear_2);
* `clip.vision.image_size` is the slice size (the preprocessor's `scale_resolution`, 448), not the
  vision config's 980 (the bucket grid), and `clip.vision.projector.scale_factor` says the mode: 4
  for 16x, 2 for 4x.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..engine.preprocess_minicpmv import DOWNSAMPLE_MODES  # -> clip.vision.projector.scale_factor
from .convert import (
    WEIGHT_TYPES,
    _check_planned,
    _matrix_type,
    _mmproj_writer,
    _Planned,
    _preprocessor,
    _read_json,
    _require,
    _safe_name,
    _SafeTensors,
    _VisionParams,
    siglip_layers_plan,
)
from .gguf_writer import GGMLType, GGUFValueType

__all__ = ["DOWNSAMPLE_MODES", "MINICPMV_WEIGHT_TYPES", "convert_minicpmv_mmproj", "is_minicpmv_checkpoint"]

log = logging.getLogger(__name__)

MINICPMV_WEIGHT_TYPES = ("f32", "f16", "bf16", "q8_0")
_VISION = "model.vision_tower."
_MERGER = "model.merger.mlp.0."
_TEXT_PREFIXES = ("model.language_model.", "lm_head.", "mtp.")


def is_minicpmv_checkpoint(hf_dir: str | Path) -> bool:
    """Whether the folder's config.json is a MiniCPM-V 4.6 one."""
    try:
        config = json.loads((Path(hf_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(config, dict) and config.get("model_type") == "minicpmv4_6"


def _square_pair(cfg: Mapping[str, Any], key: str, where: str) -> None:
    v = cfg.get(key, [2, 2])
    if list(v) != [2, 2]:
        raise ValueError(f"config.json: {where}.{key} {v!r} is not supported (2x2 only)")


def _params(config: Mapping[str, Any], pre: Mapping[str, Any], mode: str) -> tuple[_VisionParams, int, int]:
    """(vision parameters with image_size the slice size, insert_layer_id, the decoder's width)."""
    vc = config.get("vision_config")
    tc = config.get("text_config")
    if not isinstance(vc, dict) or not isinstance(tc, dict):
        raise ValueError("config.json needs 'vision_config' and 'text_config' objects")
    w = "vision_config"
    patch = _require(vc, "patch_size", w)
    grid = _require(vc, "image_size", w)
    slice_size = pre.get("scale_resolution", 448)
    if not isinstance(slice_size, int) or slice_size <= 0 or slice_size % patch:
        raise ValueError(f"image processor config: scale_resolution {slice_size!r} is not a multiple of {patch}")
    if grid % patch:
        raise ValueError(f"config.json: vision_config.image_size {grid} is not a multiple of patch_size {patch}")
    if vc.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ValueError(f"config.json: vision_config.hidden_act {vc['hidden_act']!r} is not supported")
    if config.get("merger_times", 1) != 1:
        raise ValueError(f"config.json: merger_times {config['merger_times']!r} is not supported (1 only)")
    _square_pair(config, "merge_kernel_size", "the top level")
    _square_pair(vc, "window_kernel_size", w)
    vp = _VisionParams(image_size=slice_size, patch_size=patch, width=_require(vc, "hidden_size", w),
                       n_ff=_require(vc, "intermediate_size", w), n_layer=_require(vc, "num_hidden_layers", w),
                       n_head=_require(vc, "num_attention_heads", w), ln_eps=float(vc.get("layer_norm_eps", 1e-6)),
                       scale_factor=DOWNSAMPLE_MODES[mode])
    if vp.width % vp.n_head:
        raise ValueError(f"config.json: vision hidden_size {vp.width} is not divisible by {vp.n_head} heads")
    insert = config.get("insert_layer_id", vc.get("insert_layer_id", 6))
    if not isinstance(insert, int) or not 0 <= insert < vp.n_layer:
        raise ValueError(f"config.json: insert_layer_id {insert!r} is not a layer of the {vp.n_layer}-layer tower")
    return vp, insert, _require(tc, "hidden_size", "text_config")


def _plan(vp: _VisionParams, grid_side: int, n_text: int, mode: str, wtype: GGMLType) -> list[_Planned]:
    w, p = vp.width, vp.patch_size
    f32 = GGMLType.F32

    def pair(gguf: str, hf: str, shape: tuple[int, ...]) -> list[_Planned]:
        return [_Planned(f"{gguf}.weight", f"{hf}.weight", shape, _matrix_type(wtype, shape)),
                _Planned(f"{gguf}.bias", f"{hf}.bias", (shape[0],), f32)]

    plan = [
        _Planned("v.patch_embd.weight", _VISION + "embeddings.patch_embedding.weight", (w, 3, p, p), f32),
        _Planned("v.patch_embd.bias", _VISION + "embeddings.patch_embedding.bias", (w,), f32),
        _Planned("v.position_embd.weight", _VISION + "embeddings.position_embedding.weight", (grid_side**2, w), f32),
        *siglip_layers_plan(_VISION + "encoder.layers.", vp, wtype),
        *pair("v.post_ln", _VISION + "post_layernorm", (w,)),
    ]
    if mode == "16x":
        m = _VISION + "vit_merger."
        wi = 4 * vp.n_ff
        plan += [*pair("v.vit_merger.ln1", m + "layer_norm1", (w,)),
                 *pair("v.vit_merger.attn_q", m + "self_attn.q_proj", (w, w)),
                 *pair("v.vit_merger.attn_k", m + "self_attn.k_proj", (w, w)),
                 *pair("v.vit_merger.attn_v", m + "self_attn.v_proj", (w, w)),
                 *pair("v.vit_merger.attn_out", m + "self_attn.out_proj", (w, w)),
                 *pair("v.vit_merger.ds_ln", m + "pre_norm", (4 * w,)),
                 *pair("v.vit_merger.ds_ffn_up", m + "linear_1", (wi, 4 * w)),
                 *pair("v.vit_merger.ds_ffn_down", m + "linear_2", (w, wi))]
    plan += [*pair("mm.input_norm", _MERGER + "pre_norm", (4 * w,)),
             *pair("mm.up", _MERGER + "linear_1", (4 * w, 4 * w)),
             *pair("mm.down", _MERGER + "linear_2", (n_text, 4 * w))]
    return plan


def convert_minicpmv_mmproj(hf_dir: str | Path, out_dir: str | Path, wtype: str = "f16", *, name: str | None = None,
                            downsample_mode: str | None = None) -> Path:
    """Writes `OUT_DIR/mmproj-<name>-<wtype>.gguf` for a MiniCPM-V 4.6 checkpoint and returns it.
    `downsample_mode`: 16x or 4x (default: config.json's `downsample_mode`). Everything is checked
    before anything is written; a ValueError says what is unsupported."""
    hf = Path(hf_dir)
    if not hf.is_dir():
        raise ValueError(f"{hf} is not a directory")
    if wtype not in MINICPMV_WEIGHT_TYPES:
        raise ValueError(f"weight type {wtype!r} is not offered for the minicpmv4_6 mmproj (choose from "
                         f"{', '.join(MINICPMV_WEIGHT_TYPES)})")
    matrix_type, file_type = WEIGHT_TYPES[wtype]
    config = _read_json(hf / "config.json", "model config")
    if config.get("model_type") != "minicpmv4_6":
        raise ValueError(f"config.json: model_type {config.get('model_type')!r} is not minicpmv4_6")
    mode = downsample_mode or config.get("downsample_mode", "16x")
    if mode not in DOWNSAMPLE_MODES:
        raise ValueError(f"downsample_mode {mode!r} is not supported ({', '.join(DOWNSAMPLE_MODES)})")
    pre = _preprocessor(hf)
    vp, insert, n_text = _params(config, pre, mode)
    grid_side = config["vision_config"]["image_size"] // vp.patch_size
    st = _SafeTensors(hf)
    plan = _plan(vp, grid_side, n_text, mode, matrix_type)
    _check_planned(st, plan)
    known = {p.hf_name for p in plan}
    unknown = sorted(n for n in st.infos if n not in known and not n.startswith(_TEXT_PREFIXES)
                     and not (mode == "4x" and n.startswith(_VISION + "vit_merger.")))
    if unknown:
        shown = ", ".join(unknown[:8]) + (f" and {len(unknown) - 8} more" if len(unknown) > 8 else "")
        raise ValueError(f"checkpoint has tensors this converter does not know: {shown}")

    model_name = name or hf.resolve().name
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"mmproj-{_safe_name(model_name)}-{wtype}.gguf"
    quantized = matrix_type not in (GGMLType.F32, GGMLType.F16)
    w = _mmproj_writer(model_name, file_type, quantized, vp, n_text, pre, projector="minicpmv4_6")
    if mode == "16x":
        w.add_array("clip.vision.wa_layer_indexes", [insert], GGUFValueType.INT32)
    for p in plan:
        w.add_tensor(p.gguf_name, st.loader(p.hf_name, p.transform), p.wtype, shape=p.shape)
    log.info("writing %s (%d tensors, %s)", path, len(plan), mode)
    return w.write(path)
