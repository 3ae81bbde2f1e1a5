"""Tiny Qwen3.5 text GGUFs (llama.cpp's arch "qwen35") written tensor by tensor with our GGUF writer,
in the layout llama.cpp's converter writes (conversion/qwen.py) and its loader reads
(src/models/qwen35.cpp): ssm.* keys for the Gated DeltaNet layers, attn_q holding the query and
its output gate, the layer pattern from full_attention_interval (and optionally the per-layer
attention.recurrent_layers array the converter also writes). Random weights, fixed seed.

For the fuzz seeds (test_fuzz.py), the corrupt-file tests, the prefix-cache tests on a hybrid state,
and quant_mix checked against llama.cpp's quantizer (test_quantize.py). The real-width checkpoint
and its converted files are test/qwen35_fixtures.py's.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from edgevlm_ros.tools.gguf_writer import GGUFValueType, GGUFWriter

# 3 Gated DeltaNet layers then one gated full-attention layer (full_attention_interval 4), every
# width small but every head count distinct, so a loader that mixes up two of them meets a shape it
# must refuse.
TINY = {"d": 32, "ff": 64, "vocab": 40, "n_layer": 4, "interval": 4, "n_head": 2, "n_head_kv": 1,
        "head_dim": 16, "rope_dims": 4, "conv": 4, "dk": 8, "n_k_heads": 2, "n_v_heads": 4}
# Every matrix row a whole number of 256-value K-quant super-blocks (as at the real widths), eight
# layers (two full-attention): the quantizer's mix rules meet every tensor kind and layer count.
K_QUANT_SHAPES = {**TINY, "d": 256, "ff": 256, "vocab": 64, "n_layer": 8, "n_head": 2, "n_head_kv": 1,
                  "head_dim": 64, "rope_dims": 16, "dk": 32, "n_k_heads": 4, "n_v_heads": 8}


def state_floats(c: dict[str, int] = TINY) -> int:
    """Floats of recurrent state one Gated DeltaNet layer carries: the conv window ((K-1) x conv
    channels: q, k and v) and one dk x dv delta-rule state per value head (dv = dk in llama.cpp's
    layout)."""
    conv_channels = 2 * c["n_k_heads"] * c["dk"] + c["n_v_heads"] * c["dk"]
    return (c["conv"] - 1) * conv_channels + c["n_v_heads"] * c["dk"] * c["dk"]


def recurrent_layers(c: dict[str, int] = TINY) -> list[bool]:
    return [(i + 1) % c["interval"] != 0 for i in range(c["n_layer"])]


# The 0.8B's widths (Qwen3.5-0.8B, MiniCPM-V 4.6's text_config): for shape-only checks (no data).
REAL_0_8B = {"d": 1024, "ff": 3584, "vocab": 248320, "n_layer": 24, "interval": 4, "n_head": 8, "n_head_kv": 2,
             "head_dim": 256, "rope_dims": 64, "conv": 4, "dk": 128, "n_k_heads": 16, "n_v_heads": 16}


def tensors(c: dict[str, int] = TINY, *, tied: bool = True,
            mtp: bool = False) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, numpy shape, role) of every tensor in file order; role "matrix" (written in the
    caller's kinds), "embd" (the token embedding), "head" (an untied output), "norm" (1 + noise),
    "ssm_a" (negative: the converter stores -exp(A_log)) or "vector" (F32 noise). mtp: a
    multi-token-prediction block after the layers, as llama.cpp's converter writes it (block
    n_layer: a full-attention layer plus nextn.eh_proj, enorm, hnorm, shared_head_norm)."""
    d, ff, hd, dk = c["d"], c["ff"], c["head_dim"], c["dk"]
    key_dim, value_dim = c["n_k_heads"] * dk, c["n_v_heads"] * dk
    out: list[tuple[str, tuple[int, ...], str]] = [("token_embd.weight", (c["vocab"], d), "embd")]
    if not tied:
        out.append(("output.weight", (c["vocab"], d), "head"))
    out.append(("output_norm.weight", (d,), "norm"))
    for layer, recurrent in enumerate(recurrent_layers(c) + ([False] if mtp else [])):
        p = f"blk.{layer}."
        out += [(p + "attn_norm.weight", (d,), "norm"), (p + "post_attention_norm.weight", (d,), "norm")]
        if recurrent:
            out += [(p + "ssm_conv1d.weight", (2 * key_dim + value_dim, c["conv"]), "vector"),
                    (p + "ssm_dt.bias", (c["n_v_heads"],), "vector"), (p + "ssm_a", (c["n_v_heads"],), "ssm_a"),
                    (p + "ssm_norm.weight", (dk,), "norm")]
            matrices = (("attn_qkv", (2 * key_dim + value_dim, d)), ("attn_gate", (value_dim, d)),
                        ("ssm_beta", (c["n_v_heads"], d)), ("ssm_alpha", (c["n_v_heads"], d)),
                        ("ssm_out", (d, value_dim)))
        else:
            out += [(p + "attn_q_norm.weight", (hd,), "norm"), (p + "attn_k_norm.weight", (hd,), "norm")]
            matrices = (("attn_q", (2 * c["n_head"] * hd, d)), ("attn_k", (c["n_head_kv"] * hd, d)),
                        ("attn_v", (c["n_head_kv"] * hd, d)), ("attn_output", (d, c["n_head"] * hd)))
        out += [(p + name + ".weight", shape, "matrix")
                for name, shape in (*matrices, ("ffn_gate", (ff, d)), ("ffn_up", (ff, d)), ("ffn_down", (d, ff)))]
    if mtp:
        p = f"blk.{c['n_layer']}.nextn."
        out += [(p + "eh_proj.weight", (d, 2 * d), "matrix"), (p + "enorm.weight", (d,), "norm"),
                (p + "hnorm.weight", (d,), "norm"), (p + "shared_head_norm.weight", (d,), "norm")]
    return out


def write(path: Path, *, tied: bool, layer_list: bool, kinds: tuple[str, ...] = ("q8_0",), vocab: bool = False,
          c: dict[str, int] = TINY, keys: Mapping[str, Any] | None = None, mtp: bool = False) -> None:
    """Matrices in `kinds` in turn (the token embedding Q8_0, an untied head F16, norms and the
    small ssm tensors F32). vocab: a minimal byte-level BPE vocabulary too, which llama.cpp needs
    to load the file (the fuzz seeds go without: the harness reads no tokenizer). keys: "qwen35.*"
    keys (named without the prefix) written with another value (an int: u32; a list: the bool
    array attention.recurrent_layers), or left out (None), over tensors of the shapes `c` gives:
    the corrupt files of the loader tests."""
    rng = np.random.default_rng(4)
    g = GGUFWriter()
    g.add_string("general.architecture", "qwen35")
    values = {"context_length": 64, "embedding_length": c["d"], "feed_forward_length": c["ff"],
              "block_count": c["n_layer"] + mtp, "attention.head_count": c["n_head"],
              "attention.head_count_kv": c["n_head_kv"], "attention.key_length": c["head_dim"],
              "attention.value_length": c["head_dim"], "rope.dimension_count": c["rope_dims"],
              "ssm.conv_kernel": c["conv"], "ssm.state_size": c["dk"], "ssm.group_count": c["n_k_heads"],
              "ssm.time_step_rank": c["n_v_heads"], "ssm.inner_size": c["n_v_heads"] * c["dk"],
              "full_attention_interval": c["interval"]}
    if mtp:
        values["nextn_predict_layers"] = 1
    if layer_list:
        values["attention.recurrent_layers"] = recurrent_layers(c) + ([False] if mtp else [])
    values.update(keys or {})
    for key, value in values.items():
        if isinstance(value, list):
            g.add_array(f"qwen35.{key}", value, GGUFValueType.BOOL)
        elif value is not None:
            g.add_uint32(f"qwen35.{key}", value)
    g.add_float32("qwen35.rope.freq_base", 10000000.0)
    g.add_float32("qwen35.attention.layer_norm_rms_epsilon", 1e-6)
    g.add_array("qwen35.rope.dimension_sections", [c["rope_dims"] // 4, c["rope_dims"] // 4, 0, 0],
                GGUFValueType.INT32)
    if vocab:
        g.add_string("tokenizer.ggml.model", "gpt2")
        g.add_string("tokenizer.ggml.pre", "qwen35")
        g.add_array("tokenizer.ggml.tokens", [chr(ord("a") + i) for i in range(c["vocab"])], GGUFValueType.STRING)
        g.add_array("tokenizer.ggml.token_type", [1] * c["vocab"], GGUFValueType.INT32)
        g.add_array("tokenizer.ggml.merges", ["a b"], GGUFValueType.STRING)
    n_matrix = 0
    for name, shape, role in tensors(c, tied=tied, mtp=mtp):
        data = (rng.standard_normal(shape) * 0.2).astype(np.float32)
        if role == "matrix":
            g.add_tensor(name, data, kinds[n_matrix % len(kinds)])
            n_matrix += 1
        else:
            data = {"norm": 1 + data, "ssm_a": -np.exp(data)}.get(role, data)
            g.add_tensor(name, data, {"embd": "q8_0", "head": "f16"}.get(role, "f32"))
    g.write(path)
