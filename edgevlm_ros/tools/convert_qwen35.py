"""Qwen3.5 text decoder (Hugging Face) -> one `qwen35` GGUF in llama.cpp's layout.

    edgevlm convert HF_DIR OUT_DIR [--type f32|f16|bf16|q8_0] [--name NAME]

Input: a `Qwen3_5ForCausalLM` checkpoint (config `model_type` qwen3_5_text, tensors under `model.`),
or the text half of a `Qwen3_5ForConditionalGeneration` (qwen3_5) or `MiniCPMV4_6ForConditionalGeneration`
(minicpmv4_6) one (`text_config`, tensors under `model.language_model.`; the vision tower and its merger
are left out). A Qwen3.5 checkpoint's multi-token-prediction block (`mtp.*`, `mtp_num_hidden_layers`
1) is kept as llama.cpp's converter keeps it, unless mtp=False (`--no-mtp`): block n_layer holds its
decoder layer (a full-attention one) and `nextn.eh_proj` (mtp.fc), `nextn.enorm`
(pre_fc_norm_embedding), `nextn.hnorm` (pre_fc_norm_hidden), `nextn.shared_head_norm` (mtp.norm);
block_count counts it, `nextn_predict_layers` is 1. MiniCPM-V 4.6's MTP tensors are left out, as
llama.cpp's converter leaves them. Tokenizer: tokenizer.json with Qwen3.5's pre-tokenizer (NFC, its
split regex, byte level).

The layout (llama.cpp 0.3.36's `Qwen3_5TextModel`; read there, written here):
* names: input_layernorm -> attn_norm, post_attention_layernorm -> post_attention_norm; the linear
  (Gated DeltaNet) layers' in_proj_qkv -> attn_qkv, in_proj_z -> attn_gate, in_proj_a -> ssm_alpha,
  in_proj_b -> ssm_beta, conv1d -> ssm_conv1d, A_log -> ssm_a, dt_bias -> ssm_dt.bias,
  norm -> ssm_norm, out_proj -> ssm_out; the full-attention layers' q/k/v/o_proj -> attn_q/k/v/output
  (attn_q holds query and output gate, per head, as q_proj does), q_norm/k_norm -> attn_q_norm/k_norm;
* values: every Qwen3_5RMSNorm weight w is stored as 1 + w (the reference scales by 1 + w; the
  gated norm `ssm_norm` scales by w and is stored as is); ssm_a = -exp(A_log); conv1d
  [channels, 1, K] drops its middle axis; no RoPE permutation (Qwen3.5 rotates halves, NEOX order);
* value heads, where there are more than key heads, go from grouped order (all value heads of key
  head 0, then of key head 1, ...) to tiled order (value head j of every key head, then j + 1):
  the rows of attn_qkv's value part, attn_gate, ssm_alpha, ssm_beta, ssm_a, ssm_dt, the conv's value
  channels and the columns of ssm_out;
* types: 1-D tensors, norms and ssm_conv1d F32; every other matrix the requested type (rows that are
  not whole Q8_0 blocks F16); the tied head is token_embd itself.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .convert import (
    WEIGHT_TYPES,
    _check_planned,
    _Planned,
    _read_json,
    _read_vocab,
    _require,
    _safe_name,
    _SafeTensors,
    _TextParams,
    _tied_head,
    _Vocab,
    add_bpe_vocab,
)
from .gguf_writer import GGMLType, GGUFValueType, GGUFWriter, resolve_tensor_type

__all__ = ["QWEN35_MODEL_TYPES", "QWEN35_WEIGHT_TYPES", "convert_qwen35", "is_qwen35_checkpoint"]

log = logging.getLogger(__name__)

# model_type -> (where the text config is, prefix of the text tensors, prefixes of the other halves)
QWEN35_MODEL_TYPES: dict[str, tuple[str | None, str, tuple[str, ...]]] = {
    "qwen3_5_text": (None, "model.", ("mtp.",)),
    "qwen3_5": ("text_config", "model.language_model.", ("model.visual.", "mtp.")),
    "minicpmv4_6": ("text_config", "model.language_model.", ("model.vision_tower.", "model.merger.", "mtp.")),
}
QWEN35_WEIGHT_TYPES = ("f32", "f16", "bf16", "q8_0")
_LM_HEAD = "lm_head.weight"
_MTP = "mtp."
_ARCH = "qwen35"
_MROPE_DEFAULT = [11, 11, 10]  # transformers' default sections (Qwen3_5TextRotaryEmbedding)


@dataclass(frozen=True)
class _Params(_TextParams):
    """The llama-family shapes plus Qwen3.5's rotary, linear-attention and layer-pattern ones."""

    rope_dim: int
    rope_sections: list[int]
    conv_kernel: int
    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    recurrent: list[bool]
    interval: int

    @property
    def qk_channels(self) -> int:
        return self.k_heads * self.k_dim

    @property
    def v_channels(self) -> int:
        return self.v_heads * self.v_dim


def is_qwen35_checkpoint(hf_dir: str | Path) -> bool:
    """Whether the folder's config.json names a model type this module converts."""
    try:
        config = json.loads((Path(hf_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(config, dict) and config.get("model_type") in QWEN35_MODEL_TYPES


def _text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    where = QWEN35_MODEL_TYPES[config["model_type"]][0]
    tc = config if where is None else config.get(where)
    if not isinstance(tc, dict):
        raise ValueError(f"config.json has no {where!r} object")
    if where is not None and tc.get("model_type", "qwen3_5_text") != "qwen3_5_text":
        raise ValueError(f"config.json: text_config.model_type {tc.get('model_type')!r} is not qwen3_5_text")
    return dict(tc)


def _layer_pattern(tc: Mapping[str, Any], n_layer: int) -> tuple[list[bool], int]:
    interval = tc.get("full_attention_interval", 4)
    if isinstance(interval, bool) or not isinstance(interval, int) or interval <= 0:
        raise ValueError(f"config.json: full_attention_interval {interval!r} is not a positive integer")
    types = tc.get("layer_types")
    if types is None:
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layer)]
    if not isinstance(types, list) or len(types) != n_layer:
        raise ValueError(f"config.json: layer_types must list {n_layer} layers")
    bad = sorted({t for t in types if t not in ("linear_attention", "full_attention")}, key=str)
    if bad:
        raise ValueError(f"config.json: layer_types has unknown kinds {bad}")
    return [t == "linear_attention" for t in types], interval


def _rope(tc: Mapping[str, Any], head_dim: int) -> tuple[float, int, list[int]]:
    rp = tc.get("rope_parameters") or {}
    if not isinstance(rp, dict):
        raise ValueError("config.json: rope_parameters must be an object")
    if rp.get("rope_type", "default") != "default":
        raise ValueError(f"config.json: RoPE type {rp.get('rope_type')!r} is not supported (only default)")
    theta = rp.get("rope_theta", tc.get("rope_theta", 10000.0))
    factor = rp.get("partial_rotary_factor", tc.get("partial_rotary_factor", 0.25))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise ValueError(f"config.json: rope_theta {theta!r} is not a positive number")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise ValueError(f"config.json: partial_rotary_factor {factor!r} is not in (0, 1]")
    rope_dim = int(head_dim * factor)
    sections = rp.get("mrope_section", _MROPE_DEFAULT)
    if (not isinstance(sections, list) or not 1 <= len(sections) <= 4
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in sections)):
        raise ValueError(f"config.json: mrope_section {sections!r} is not a list of up to 4 counts")
    if rope_dim % 2 or 2 * sum(sections) > rope_dim:
        raise ValueError(f"config.json: mrope_section {sections} does not fit {rope_dim} rotary dimensions")
    return float(theta), rope_dim, [*sections, *[0] * (4 - len(sections))]


def _params(config: Mapping[str, Any]) -> _Params:
    tc = _text_config(config)
    w = "text config"
    n_embd = _require(tc, "hidden_size", w)
    n_head = _require(tc, "num_attention_heads", w)
    n_head_kv = _require(tc, "num_key_value_heads", w)
    head_dim = _require(tc, "head_dim", w)
    n_layer = _require(tc, "num_hidden_layers", w)
    k_heads = _require(tc, "linear_num_key_heads", w)
    v_heads = _require(tc, "linear_num_value_heads", w)
    if n_head % n_head_kv:
        raise ValueError(f"config.json: {n_head_kv} key/value heads do not divide {n_head} heads")
    if v_heads % k_heads:
        raise ValueError(f"config.json: {k_heads} linear key heads do not divide {v_heads} value heads")
    if tc.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act {tc.get('hidden_act')!r} is not supported (silu only)")
    if tc.get("attention_bias"):
        raise ValueError("config.json: attention_bias is true; biases are not part of the qwen35 layout")
    if tc.get("attn_output_gate") is False:
        raise ValueError("config.json: attn_output_gate false; the qwen35 layout has the output gate")
    recurrent, interval = _layer_pattern(tc, n_layer)
    theta, rope_dim, sections = _rope(tc, head_dim)
    return _Params(
        n_vocab=_require(tc, "vocab_size", w), n_embd=n_embd, n_ff=_require(tc, "intermediate_size", w),
        n_layer=n_layer, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim,
        n_ctx=_require(tc, "max_position_embeddings", w), rope_theta=theta, rope_dim=rope_dim,
        rope_sections=sections, rms_eps=float(_require(tc, "rms_norm_eps", w, float)),
        conv_kernel=_require(tc, "linear_conv_kernel_dim", w), k_heads=k_heads, v_heads=v_heads,
        k_dim=_require(tc, "linear_key_head_dim", w), v_dim=_require(tc, "linear_value_head_dim", w),
        recurrent=recurrent, interval=interval, tied=False,  # decided with the tensors at hand
    )


# -- value transforms -------------------------------------------------------------------------------


def tile_value_heads(x: np.ndarray, axis: int, k_heads: int, head_dim: int) -> np.ndarray:
    """`axis` of x holds value heads grouped by key head ([k][v per k][head_dim]); returns it in
    tiled order ([v per k][k][head_dim]), as llama.cpp's qwen35 layout keeps them."""
    n = x.shape[axis]
    per_k = n // (k_heads * head_dim)
    moved = np.moveaxis(x, axis, 0)
    tiled = moved.reshape(k_heads, per_k, head_dim, *moved.shape[1:]).swapaxes(0, 1).reshape(moved.shape)
    return np.moveaxis(tiled, 0, axis)


def _shifted(w: np.ndarray) -> np.ndarray:
    return w + np.float32(1.0)


def _decay_rate(a_log: np.ndarray) -> np.ndarray:
    return -np.exp(a_log.astype(np.float32))


def _compose(*steps: Callable[[np.ndarray], np.ndarray] | None) -> Callable[[np.ndarray], np.ndarray] | None:
    todo = [s for s in steps if s is not None]
    if not todo:
        return None

    def run(x: np.ndarray) -> np.ndarray:
        for s in todo:
            x = s(x)
        return x

    return run


# -- the tensor plan ----------------------------------------------------------------------------------


def _matrix(wtype: GGMLType, shape: tuple[int, ...]) -> GGMLType:
    return GGMLType.F32 if len(shape) == 1 else resolve_tensor_type(wtype, shape)


def _linear_layer(lp: str, b: str, p: _Params, wtype: GGMLType) -> list[_Planned]:
    tiled = p.v_heads != p.k_heads

    def tile(axis: int, head_dim: int, skip: int = 0) -> Callable[[np.ndarray], np.ndarray] | None:
        if not tiled:
            return None

        def run(x: np.ndarray) -> np.ndarray:
            head, rest = np.split(x, [skip], axis=axis)
            return np.concatenate([head, tile_value_heads(rest, axis, p.k_heads, head_dim)], axis=axis)

        return run

    conv = 2 * p.qk_channels + p.v_channels
    e = p.n_embd
    la = lp + "linear_attn."
    return [
        _Planned(b + "ssm_a", la + "A_log", (p.v_heads,), GGMLType.F32, _compose(tile(0, 1), _decay_rate)),
        _Planned(b + "ssm_dt.bias", la + "dt_bias", (p.v_heads,), GGMLType.F32, tile(0, 1)),
        _Planned(b + "ssm_conv1d.weight", la + "conv1d.weight", (conv, 1, p.conv_kernel), GGMLType.F32,
                 _compose(lambda x: x[:, 0, :], tile(0, p.v_dim, 2 * p.qk_channels))),
        _Planned(b + "ssm_alpha.weight", la + "in_proj_a.weight", (p.v_heads, e), _matrix(wtype, (p.v_heads, e)),
                 tile(0, 1)),
        _Planned(b + "ssm_beta.weight", la + "in_proj_b.weight", (p.v_heads, e), _matrix(wtype, (p.v_heads, e)),
                 tile(0, 1)),
        _Planned(b + "attn_qkv.weight", la + "in_proj_qkv.weight", (conv, e), _matrix(wtype, (conv, e)),
                 tile(0, p.v_dim, 2 * p.qk_channels)),
        _Planned(b + "attn_gate.weight", la + "in_proj_z.weight", (p.v_channels, e),
                 _matrix(wtype, (p.v_channels, e)), tile(0, p.v_dim)),
        _Planned(b + "ssm_norm.weight", la + "norm.weight", (p.v_dim,), GGMLType.F32),
        _Planned(b + "ssm_out.weight", la + "out_proj.weight", (e, p.v_channels), _matrix(wtype, (e, p.v_channels)),
                 tile(1, p.v_dim)),
    ]


def _attention_layer(lp: str, b: str, p: _Params, wtype: GGMLType) -> list[_Planned]:
    sa, e = lp + "self_attn.", p.n_embd
    q, kv = p.n_head * p.head_dim, p.n_head_kv * p.head_dim
    return [
        _Planned(b + "attn_q.weight", sa + "q_proj.weight", (2 * q, e), _matrix(wtype, (2 * q, e))),
        _Planned(b + "attn_k.weight", sa + "k_proj.weight", (kv, e), _matrix(wtype, (kv, e))),
        _Planned(b + "attn_v.weight", sa + "v_proj.weight", (kv, e), _matrix(wtype, (kv, e))),
        _Planned(b + "attn_output.weight", sa + "o_proj.weight", (e, q), _matrix(wtype, (e, q))),
        _Planned(b + "attn_q_norm.weight", sa + "q_norm.weight", (p.head_dim,), GGMLType.F32, _shifted),
        _Planned(b + "attn_k_norm.weight", sa + "k_norm.weight", (p.head_dim,), GGMLType.F32, _shifted),
    ]


def _layer(lp: str, b: str, p: _Params, wtype: GGMLType, recurrent: bool) -> list[_Planned]:
    e, ff = p.n_embd, p.n_ff
    return [
        _Planned(b + "attn_norm.weight", lp + "input_layernorm.weight", (e,), GGMLType.F32, _shifted),
        *(_linear_layer if recurrent else _attention_layer)(lp, b, p, wtype),
        _Planned(b + "post_attention_norm.weight", lp + "post_attention_layernorm.weight", (e,), GGMLType.F32,
                 _shifted),
        _Planned(b + "ffn_gate.weight", lp + "mlp.gate_proj.weight", (ff, e), _matrix(wtype, (ff, e))),
        _Planned(b + "ffn_up.weight", lp + "mlp.up_proj.weight", (ff, e), _matrix(wtype, (ff, e))),
        _Planned(b + "ffn_down.weight", lp + "mlp.down_proj.weight", (e, ff), _matrix(wtype, (e, ff))),
    ]


def _mtp_block(p: _Params, wtype: GGMLType) -> list[_Planned]:
    """The multi-token-prediction block as block p.n_layer (see the module docstring)."""
    e, b = p.n_embd, f"blk.{p.n_layer}."
    return [
        *_layer(_MTP + "layers.0.", b, p, wtype, recurrent=False),
        _Planned(b + "nextn.eh_proj.weight", _MTP + "fc.weight", (e, 2 * e), _matrix(wtype, (e, 2 * e))),
        _Planned(b + "nextn.enorm.weight", _MTP + "pre_fc_norm_embedding.weight", (e,), GGMLType.F32, _shifted),
        _Planned(b + "nextn.hnorm.weight", _MTP + "pre_fc_norm_hidden.weight", (e,), GGMLType.F32, _shifted),
        _Planned(b + "nextn.shared_head_norm.weight", _MTP + "norm.weight", (e,), GGMLType.F32, _shifted),
    ]


def _plan(st: _SafeTensors, prefix: str, p: _Params, wtype: GGMLType, mtp: bool) -> list[_Planned]:
    e = p.n_embd
    plan = [_Planned("token_embd.weight", prefix + "embed_tokens.weight", (p.n_vocab, e),
                     _matrix(wtype, (p.n_vocab, e)))]
    for i in range(p.n_layer):
        plan += _layer(f"{prefix}layers.{i}.", f"blk.{i}.", p, wtype, p.recurrent[i])
    plan.append(_Planned("output_norm.weight", prefix + "norm.weight", (e,), GGMLType.F32, _shifted))
    if not p.tied:
        plan.append(_Planned("output.weight", _LM_HEAD, (p.n_vocab, e), _matrix(wtype, (p.n_vocab, e))))
    if mtp:
        plan += _mtp_block(p, wtype)
    _check_planned(st, plan)
    return plan


def _mtp_layers(config: Mapping[str, Any], st: _SafeTensors, model_type: str) -> int:
    """How many MTP blocks the checkpoint carries that the file keeps: 0 or 1."""
    if model_type == "minicpmv4_6" or _MTP + "fc.weight" not in st.infos:
        return 0
    n = _text_config(config).get("mtp_num_hidden_layers")
    if n is None:  # as llama.cpp's converter: counted from the tensors
        n = len({name.split(".")[2] for name in st.infos if name.startswith(_MTP + "layers.")})
    if n != 1:
        raise ValueError(f"config.json: {n} multi-token-prediction layers are not supported (1 is; "
                         "--no-mtp leaves them out)")
    return 1


# -- metadata ---------------------------------------------------------------------------------------


def _writer(name: str, file_type: int, p: _Params, vocab: _Vocab, tok_cfg: Mapping[str, Any],
            n_mtp: int) -> GGUFWriter:
    w = GGUFWriter()
    a = _ARCH
    w.add_string("general.architecture", a)
    w.add_string("general.type", "model")
    w.add_string("general.name", name)
    w.add_uint32("general.file_type", file_type)
    w.add_uint32("general.quantization_version", 2)  # llama.cpp's converter writes it for every type
    counts = {
        "block_count": p.n_layer + n_mtp, "context_length": p.n_ctx, "embedding_length": p.n_embd,
        "feed_forward_length": p.n_ff, "attention.head_count": p.n_head, "attention.head_count_kv": p.n_head_kv,
        "attention.key_length": p.head_dim, "attention.value_length": p.head_dim,
        "ssm.conv_kernel": p.conv_kernel, "ssm.state_size": p.k_dim, "ssm.group_count": p.k_heads,
        "ssm.time_step_rank": p.v_heads, "ssm.inner_size": p.v_channels,
        "full_attention_interval": p.interval, "rope.dimension_count": p.rope_dim,
    }
    if n_mtp:
        counts["nextn_predict_layers"] = n_mtp
    for key, value in counts.items():
        w.add_uint32(f"{a}.{key}", value)
    w.add_array(f"{a}.rope.dimension_sections", p.rope_sections, GGUFValueType.INT32)
    w.add_float32(f"{a}.rope.freq_base", p.rope_theta)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", p.rms_eps)
    w.add_array(f"{a}.attention.recurrent_layers", p.recurrent + [False] * n_mtp, GGUFValueType.BOOL)
    add_bpe_vocab(w, vocab)
    # Only what the tokenizer config states, as llama.cpp's converter does (the engine's default
    # for a byte-level vocabulary is no BOS / EOS).
    if "add_bos_token" in tok_cfg:
        w.add_bool("tokenizer.ggml.add_bos_token", vocab.add_bos)
    if "add_eos_token" in tok_cfg:
        w.add_bool("tokenizer.ggml.add_eos_token", vocab.add_eos)
    if vocab.chat_template is not None:
        w.add_string("tokenizer.chat_template", vocab.chat_template)
    return w


# -- entry point --------------------------------------------------------------------------------------


def convert_qwen35(hf_dir: str | Path, out_dir: str | Path, wtype: str = "f16", *, name: str | None = None,
                   mtp: bool = True) -> Path:
    """Converts a Qwen3.5 text decoder (see the module docstring); returns the GGUF's path,
    `OUT_DIR/<name>-<wtype>.gguf`. mtp=False leaves a multi-token-prediction block out. Everything is
    checked before anything is written."""
    hf = Path(hf_dir)
    if not hf.is_dir():
        raise ValueError(f"{hf} is not a directory")
    if wtype not in QWEN35_WEIGHT_TYPES:
        raise ValueError(f"weight type {wtype!r} is not offered for qwen35 (choose from "
                         f"{', '.join(QWEN35_WEIGHT_TYPES)}; `edgevlm quantize` makes the others)")
    matrix_type, file_type = WEIGHT_TYPES[wtype]
    config = _read_json(hf / "config.json", "model config")
    model_type = config.get("model_type")
    if model_type not in QWEN35_MODEL_TYPES:
        raise ValueError(f"config.json: model_type {model_type!r} is not a Qwen3.5 text model "
                         f"({', '.join(QWEN35_MODEL_TYPES)})")
    _, prefix, others = QWEN35_MODEL_TYPES[model_type]
    params = _params(config)
    st = _SafeTensors(hf)
    # The top-level flag decides, else the text config's (a qwen3_5_text config is both).
    params = dataclasses.replace(params, tied=_tied_head({**config, "text_config": _text_config(config)}, st))
    n_mtp = _mtp_layers(config, st, model_type) if mtp else 0
    plan = _plan(st, prefix, params, matrix_type, n_mtp > 0)
    known = {p.hf_name for p in plan} | ({_LM_HEAD} if params.tied else set())
    unknown = sorted(n for n in st.infos if n not in known and not n.startswith(others))
    if unknown:
        shown = ", ".join(unknown[:8]) + (f" and {len(unknown) - 8} more" if len(unknown) > 8 else "")
        raise ValueError(f"checkpoint has tensors this converter does not know: {shown}")
    tok_cfg_path = hf / "tokenizer_config.json"
    tok_cfg = _read_json(tok_cfg_path, "tokenizer config") if tok_cfg_path.is_file() else {}
    vocab = _read_vocab(hf, {"text_config": _text_config(config)}, params.n_vocab)
    if vocab.pre != "qwen35":
        raise ValueError(f"tokenizer.json: pre-tokenizer {vocab.pre!r} is not Qwen3.5's")

    model_name = name or hf.resolve().name
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{_safe_name(model_name)}-{wtype}.gguf"
    w = _writer(model_name, file_type, params, vocab, tok_cfg, n_mtp)
    for p in plan:  # the conv weight drops its middle axis: [channels, 1, K] -> [channels, K]
        shape = (p.shape[0], p.shape[2]) if len(p.shape) == 3 else p.shape
        w.add_tensor(p.gguf_name, st.loader(p.hf_name, p.transform), p.wtype, shape=shape)
    log.info("writing %s (%d tensors)", path, len(plan))
    return w.write(path)
