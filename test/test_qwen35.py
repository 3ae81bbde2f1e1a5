"""The qwen35 decoder (Qwen3.5's hybrid: Gated DeltaNet layers and gated full attention) against
transformers and llama.cpp.

The model: a random Qwen3_5ForCausalLM at Qwen3.5-0.8B's widths (qwen35_fixtures.py: width 1024,
8/2 heads of 256 with the output gate, 16/16 linear heads of 128, conv 4, vocabulary 248,320, tied
head), 4 layers (three linear, one full) by default, all 24 with EDGEVLM_QWEN35_FULL=1; its F32 GGUF
written by llama.cpp's own convert_hf_to_gguf.py. The engine runs it through `_engine.Decoder`
directly (token ids in, logits out): nothing here depends on the tokenizer.

Checked: every position's logits of 6 prompts (1 to 160 tokens, over chunks of N_BATCH) against
transformers in F32; 32 greedy tokens (decode steps, recurrent state carried token to token) against
transformers' choice at every step; a prompt split after 37 tokens (snapshot, other work, restore,
the rest) bit-equal to the unsplit run; a generate stopped by cancel continuing as if never stopped;
llama.cpp on the same file giving our greedy tokens. Each comparison is shown to see what it checks
(test_parity_sees_the_decay: a reference forgetting at another rate parts from ours far beyond the
bound; the split test's middle step, left unrestored, parts from the whole run).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from qwen35_fixtures import cached_qwen35, cached_qwen35_llama_cpp_gguf, load_hf_model

FULL = os.environ.get("EDGEVLM_QWEN35_FULL") == "1"
LAYERS = 24 if FULL else 4
N_BATCH = 64
N_CTX = 512
N_NEW = 32
SPLIT = 37
# Float32 weights and activations on both sides; they differ in summation order, and transformers
# runs a prompt's delta rule in chunks of 64 (torch_chunk_gated_delta_rule: the recurrence in matrix
# form) where the engine runs the recurrence itself. Measured worst relative L2 of a position's
# logits 2026-12-01 (4 layers): see the test's print. 1e-3 leaves an order of magnitude over it and
# is far below what a real mistake gives (test_parity_sees_the_decay).
MAX_REL = 1e-3
# Prompt lengths: one token (decode kernels), a few, the split point, one chunk exactly, one past it,
# and >= 150 tokens (several chunks of the engine and of transformers' chunked delta rule).
LENGTHS = (1, 7, SPLIT, 64, 65, 160)
# llama.cpp keeps its KV cache in F16 and rounds some activations: its greedy choice may differ
# from ours only where its own top two are this close.
LLAMA_CPP_NEAR_TIE = 0.05


def _prompts(n_vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(15)
    return [[int(t) for t in rng.integers(0, 248044, n)] for n in LENGTHS]


def _rel_l2(ours: np.ndarray, ref: np.ndarray) -> np.ndarray:
    return np.linalg.norm(ours - ref, axis=1) / np.linalg.norm(ref, axis=1)


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return cached_qwen35_llama_cpp_gguf(LAYERS)


@pytest.fixture(scope="module")
def hf() -> Any:
    import torch

    torch.set_num_threads(2)
    return load_hf_model(cached_qwen35(LAYERS))


@pytest.fixture(scope="module")
def engine(gguf_path: Path) -> Any:
    from edgevlm_ros import _engine

    return _engine.Decoder(_engine.GGUFFile(str(gguf_path)), threads=2, n_ctx=N_CTX, n_batch=N_BATCH)


def _ours(engine: Any, ids: list[int]) -> np.ndarray:
    engine.reset()
    return engine.forward(np.array(ids, dtype=np.int32), all_logits=True)


def _hf_logits(hf: Any, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return hf(torch.tensor([ids], dtype=torch.long)).logits[0].float().numpy()


def test_config_read_from_the_file(engine: Any) -> None:
    c = engine.config
    assert c["arch"] == "qwen35"
    shape = (c["n_embd"], c["n_ff"], c["n_layer"], c["n_head"], c["n_head_kv"], c["head_dim"])
    assert shape == (1024, 3584, LAYERS, 8, 2, 256)
    assert c["rope_dims"] == 64 and c["tied_output"] and c["n_vocab"] == 248320
    assert "delta_rule=" in engine.variants()


def test_logits_match_transformers_at_every_position(engine: Any, hf: Any) -> None:
    worst, agree, total = 0.0, 0, 0
    for ids in _prompts(engine.config["n_vocab"]):
        ours, ref = _ours(engine, ids), _hf_logits(hf, ids)
        assert ours.shape == ref.shape
        worst = max(worst, float(_rel_l2(ours, ref).max()))
        agree += int((ours.argmax(1) == ref.argmax(1)).sum())
        total += len(ids)
    print(f"qwen35 ({LAYERS} layers): {total} positions, top-1 {agree}/{total}, worst relative L2 {worst:.2e}")
    assert agree == total
    assert worst < MAX_REL


def test_parity_sees_the_decay(engine: Any, hf: Any) -> None:
    """The comparison above sees the recurrent state's decay: the reference with one linear layer's
    dt_bias moved by +2 (a slower or faster forgetting, everything else equal) parts from ours far
    beyond the bound past the first position, and agrees at the first (where the state is zero)."""
    import torch

    ids = _prompts(engine.config["n_vocab"])[-1]
    dt = hf.model.layers[0].linear_attn.dt_bias
    with torch.no_grad():
        dt += 2.0
        try:
            moved = _hf_logits(hf, ids)
        finally:
            dt -= 2.0
    rel = _rel_l2(_ours(engine, ids), moved)
    print(f"reference with dt_bias + 2: relative L2 {rel[0]:.2e} at position 0, median {np.median(rel[1:]):.2e} after")
    assert rel[0] < MAX_REL
    assert np.median(rel[1:]) > 30 * MAX_REL


def test_greedy_matches_transformers(engine: Any, hf: Any) -> None:
    """32 tokens by decode steps (one token per call: the recurrent state carried between calls)
    after the longest prompts; transformers' argmax after every prefix of ours (teacher forcing: one
    forward over prompt + ours) is our token at every step, so its own greedy run gives ours."""
    for ids in _prompts(engine.config["n_vocab"])[2:]:
        engine.reset()
        res = engine.generate(np.array(ids, dtype=np.int32), N_NEW, [])
        gen = list(res["tokens"])
        assert len(gen) == N_NEW and res["stop_reason"] == "max_tokens"
        ref = _hf_logits(hf, ids + gen)[len(ids) - 1: -1]
        assert ref.argmax(1).tolist() == gen


def test_split_prefill_is_bit_equal(engine: Any) -> None:
    """Snapshot after 37 tokens, other work, restore, the rest: bit-equal logits to one prefill of
    the whole prompt (the delta rule is a recurrence, the conv a window on its state: nothing of how
    a prompt is cut into calls reaches the numbers), and the same greedy tokens after it."""
    ids = _prompts(engine.config["n_vocab"])[-1]
    whole = _ours(engine, ids)
    engine.reset()
    first = engine.forward(np.array(ids[:SPLIT], dtype=np.int32), all_logits=True)
    snap = engine.snapshot()
    engine.forward(np.array(ids[SPLIT: SPLIT + 50][::-1], dtype=np.int32))  # moves every state on
    moved = engine.snapshot()
    engine.restore(snap)
    rest = engine.forward(np.array(ids[SPLIT:], dtype=np.int32), all_logits=True)
    assert np.array_equal(first, whole[:SPLIT])
    assert np.array_equal(rest, whole[SPLIT:])
    # From the state the other work left (no restore of the split's snapshot) the rest parts.
    engine.restore(moved)
    unrestored = engine.forward(np.array(ids[SPLIT:], dtype=np.int32), all_logits=True)
    assert _rel_l2(unrestored, whole[SPLIT:]).min() > 10 * MAX_REL
    engine.restore(snap)
    a = engine.generate(np.array(ids[SPLIT:], dtype=np.int32), 8, [])["tokens"]
    engine.reset()
    b = engine.generate(np.array(ids, dtype=np.int32), 8, [])["tokens"]
    assert list(a) == list(b)


def test_cancelled_generate_leaves_a_consistent_state(engine: Any) -> None:
    """A generate cancelled after its first token leaves the sequence state of the prompt (n_past,
    KV cache and recurrent state together): continuing from there gives the uncancelled run's tokens."""
    ids = _prompts(engine.config["n_vocab"])[2]
    engine.reset()
    want = list(engine.generate(np.array(ids, dtype=np.int32), 6, [])["tokens"])
    engine.reset()
    engine.cancel(True)
    try:
        res = engine.generate(np.array(ids, dtype=np.int32), 6, [])
    finally:
        engine.cancel(False)
    assert res["stop_reason"] == "cancelled" and list(res["tokens"]) == want[:1]
    assert engine.n_past == len(ids)
    more = engine.generate(np.array(want[:1], dtype=np.int32), 5, [])["tokens"]
    assert list(more) == want[1:]


def test_llama_cpp_gives_our_tokens(engine: Any, gguf_path: Path) -> None:
    """llama.cpp on its own converter's file: its greedy tokens are ours (a parting allowed only at
    one of its near-ties), so our reading of the qwen35 layout is llama.cpp's."""
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=str(gguf_path), n_ctx=N_CTX, n_batch=N_CTX, n_threads=2, logits_all=True,
                          verbose=False)
    for ids in _prompts(engine.config["n_vocab"])[3::2]:
        engine.reset()
        ours = list(engine.generate(np.array(ids, dtype=np.int32), N_NEW, [])["tokens"])
        llm.reset()
        llm.eval(ids + ours)
        scores = np.array(llm.scores[len(ids) - 1: len(ids) + N_NEW - 1], dtype=np.float32)
        for step, tok in enumerate(ours):
            want = int(scores[step].argmax())
            if want != tok:
                top2 = np.sort(scores[step])[-2:]
                assert top2[1] - top2[0] < LLAMA_CPP_NEAR_TIE, f"step {step}: ours {tok}, llama.cpp {want}"
                break


# --- the loader on files that lie ------------------------------------------------------------
# A tiny qwen35 file (width 32, one linear layer and one full one) written here with gguf-py, in
# the layout above; each case changes one key or one tensor. The loader checks every size an
# allocation is computed from against the others and the tensors before allocating anything.
TINY = {"conv_kernel": 4, "state_size": 8, "group_count": 2, "time_step_rank": 4, "inner_size": 4 * 8}


def _tiny_gguf(path: Path, keys: dict[str, int] | None = None, conv_shape: tuple[int, int] | None = None,
               recurrent: list[bool] | None = None) -> Path:
    import gguf

    k = {**TINY, **(keys or {})}
    d, ff, hd, vocab = 32, 64, 16, 64
    key_dim, value_dim = 2 * 8, 4 * 8
    conv_dim = 2 * key_dim + value_dim
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "qwen35")
    w.add_context_length(256)
    w.add_embedding_length(d)
    w.add_block_count(2)
    w.add_feed_forward_length(ff)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(4)
    for name, v in k.items():
        w.add_uint32(f"qwen35.ssm.{name}", v)
    w.add_array("qwen35.attention.recurrent_layers", recurrent if recurrent is not None else [True, False])

    def add(name: str, *shape: int) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * 0.1).astype(np.float32))

    add("token_embd.weight", vocab, d)
    add("output_norm.weight", d)
    for i in range(2):
        p = f"blk.{i}."
        for n in ("attn_norm", "post_attention_norm"):
            add(p + n + ".weight", d)
        add(p + "ffn_gate.weight", ff, d)
        add(p + "ffn_up.weight", ff, d)
        add(p + "ffn_down.weight", d, ff)
    p = "blk.0."
    add(p + "attn_qkv.weight", conv_dim, d)
    add(p + "attn_gate.weight", value_dim, d)
    add(p + "ssm_alpha.weight", 4, d)
    add(p + "ssm_beta.weight", 4, d)
    add(p + "ssm_out.weight", d, value_dim)
    add(p + "ssm_conv1d.weight", *(conv_shape or (conv_dim, 4)))
    w.add_tensor(p + "ssm_a", -np.exp(rng.standard_normal(4)).astype(np.float32))
    add(p + "ssm_dt.bias", 4)
    add(p + "ssm_norm.weight", 8)
    p = "blk.1."
    add(p + "attn_q.weight", 2 * 2 * hd, d)
    add(p + "attn_k.weight", hd, d)
    add(p + "attn_v.weight", hd, d)
    add(p + "attn_output.weight", d, 2 * hd)
    add(p + "attn_q_norm.weight", hd)
    add(p + "attn_k_norm.weight", hd)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _load(path: Path) -> Any:
    from edgevlm_ros import _engine

    return _engine.Decoder(_engine.GGUFFile(str(path)), threads=1, n_ctx=64, n_batch=8)


def test_tiny_file_loads_and_runs(tmp_path: Path) -> None:
    dec = _load(_tiny_gguf(tmp_path / "ok.gguf"))
    out = dec.forward(np.arange(10, dtype=np.int32), all_logits=True)
    assert out.shape == (10, 64) and np.isfinite(out).all()
    # The recurrent state: (K - 1) x conv channels + value heads x dk x dv floats, in the snapshot.
    assert dec.snapshot().nbytes == 4 * (10 * 16 * 2 + (4 - 1) * 64 + 4 * 8 * 8)


@pytest.mark.parametrize(("case", "args", "match"), [
    ("huge state", {"keys": {"state_size": 1 << 12, "inner_size": 4 << 12}}, "ssm.state_size: is larger than"),
    ("heads", {"keys": {"time_step_rank": 3, "inner_size": 24}}, "multiple of the key heads"),
    ("inner size", {"keys": {"inner_size": 4 * 9}}, "ssm_conv1d.weight"),
    ("conv width", {"keys": {"conv_kernel": 3}}, "ssm_conv1d.weight"),
    ("conv layout", {"conv_shape": (4, 64)}, "ssm_conv1d.weight"),
    ("zero kernel", {"keys": {"conv_kernel": 0}}, "ssm.conv_kernel"),
    ("pattern", {"recurrent": [True]}, "recurrent_layers"),
])
def test_loader_refuses_inconsistent_files(tmp_path: Path, case: str, args: dict[str, Any], match: str) -> None:
    from edgevlm_ros import _engine

    with pytest.raises(_engine.GGUFError, match=match):
        _load(_tiny_gguf(tmp_path / "bad.gguf", **args))
