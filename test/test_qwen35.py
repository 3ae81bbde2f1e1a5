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
from qwen35_fixtures import cached_qwen35, cached_qwen35_llama_cpp_gguf, load_hf_model, run_llama_cpp_converter

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


def _prompts() -> list[list[int]]:
    """Random ids below the special tokens (from 248044)."""
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


class Runs:
    """Each prompt's logits (ours from an empty sequence, the reference's) and our greedy tokens,
    computed once for the module: the 248k-row head dominates every run."""

    def __init__(self, engine: Any, hf: Any) -> None:
        self.engine, self.hf = engine, hf
        self._ours: dict[tuple[int, ...], np.ndarray] = {}
        self._ref: dict[tuple[int, ...], np.ndarray] = {}
        self._greedy: dict[tuple[int, ...], list[int]] = {}

    def ours(self, ids: list[int]) -> np.ndarray:
        key = tuple(ids)
        if key not in self._ours:
            self.engine.reset()
            self._ours[key] = self.engine.forward(np.array(ids, dtype=np.int32), all_logits=True)
        return self._ours[key]

    def ref(self, ids: list[int]) -> np.ndarray:
        key = tuple(ids)
        if key not in self._ref:
            self._ref[key] = _hf_logits(self.hf, ids)
        return self._ref[key]

    def greedy(self, ids: list[int]) -> list[int]:
        """N_NEW tokens by decode steps (one token per call: the recurrent state carried between calls)."""
        key = tuple(ids)
        if key not in self._greedy:
            self.engine.reset()
            res = self.engine.generate(np.array(ids, dtype=np.int32), N_NEW, [])
            assert res["stop_reason"] == "max_tokens"
            self._greedy[key] = list(res["tokens"])
        return self._greedy[key]


@pytest.fixture(scope="module")
def runs(engine: Any, hf: Any) -> Runs:
    return Runs(engine, hf)


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


def test_logits_match_transformers_at_every_position(runs: Runs) -> None:
    worst, agree, total = 0.0, 0, 0
    for ids in _prompts():
        ours, ref = runs.ours(ids), runs.ref(ids)
        assert ours.shape == ref.shape
        worst = max(worst, float(_rel_l2(ours, ref).max()))
        agree += int((ours.argmax(1) == ref.argmax(1)).sum())
        total += len(ids)
    print(f"qwen35 ({LAYERS} layers): {total} positions, top-1 {agree}/{total}, worst relative L2 {worst:.2e}")
    assert agree == total
    assert worst < MAX_REL


def test_parity_sees_the_decay(runs: Runs) -> None:
    """The comparison above sees the recurrent state's decay: the reference with one linear layer's
    dt_bias moved by +2 (a slower or faster forgetting, everything else equal) parts from ours far
    beyond the bound past the first position, and agrees at the first (where the state is zero)."""
    import torch

    ids = _prompts()[2]
    dt = runs.hf.model.layers[0].linear_attn.dt_bias
    with torch.no_grad():
        dt += 2.0
        try:
            moved = _hf_logits(runs.hf, ids)
        finally:
            dt -= 2.0
    rel = _rel_l2(runs.ours(ids), moved)
    print(f"reference with dt_bias + 2: relative L2 {rel[0]:.2e} at position 0, median {np.median(rel[1:]):.2e} after")
    assert rel[0] < MAX_REL
    assert np.median(rel[1:]) > 30 * MAX_REL


def test_greedy_matches_transformers(runs: Runs) -> None:
    """32 greedy tokens after the longest prompt (after the 37- and 64-token ones too with
    EDGEVLM_QWEN35_FULL=1); transformers' argmax after every prefix of ours (teacher forcing: one
    forward over prompt + ours) is our token at every step, so its own greedy run gives ours."""
    for ids in (_prompts()[2:4] + _prompts()[-1:]) if FULL else _prompts()[-1:]:
        gen = runs.greedy(ids)
        ref = _hf_logits(runs.hf, ids + gen)[len(ids) - 1: -1]
        assert ref.argmax(1).tolist() == gen


def test_split_prefill_is_bit_equal(runs: Runs) -> None:
    """Snapshot after 37 tokens, other work, restore, the rest: bit-equal logits to one prefill of
    the whole prompt (the delta rule is a recurrence, the conv a window on its state: nothing of how
    a prompt is cut into calls reaches the numbers), and the same greedy tokens after it."""
    engine = runs.engine
    ids = _prompts()[-1]
    whole = runs.ours(ids)
    engine.reset()
    first = engine.forward(np.array(ids[:SPLIT], dtype=np.int32), all_logits=True)
    snap = engine.snapshot()
    engine.forward(np.array(ids[SPLIT: SPLIT + 50][::-1], dtype=np.int32))  # moves every state on
    moved = engine.snapshot()
    engine.restore(snap)
    rest = engine.forward(np.array(ids[SPLIT:], dtype=np.int32), all_logits=True)
    assert np.array_equal(first, whole[:SPLIT])
    assert np.array_equal(rest, whole[SPLIT:])
    engine.restore(snap)
    assert list(engine.generate(np.array(ids[SPLIT:], dtype=np.int32), 8, [])["tokens"]) == runs.greedy(ids)[:8]
    # From the state the other work left (no restore of the split's snapshot) the rest parts.
    engine.restore(moved)
    unrestored = engine.forward(np.array(ids[SPLIT: SPLIT + 8], dtype=np.int32), all_logits=True)
    assert _rel_l2(unrestored, whole[SPLIT: SPLIT + 8]).min() > 10 * MAX_REL


def test_cancelled_generate_leaves_a_consistent_state(runs: Runs) -> None:
    """A generate cancelled after its first token leaves the sequence state of the prompt (n_past,
    KV cache and recurrent state together): continuing from there gives the uncancelled run's tokens."""
    engine = runs.engine
    ids = _prompts()[1]
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
    assert list(engine.generate(np.array(want[:1], dtype=np.int32), 5, [])["tokens"]) == want[1:]


def test_llama_cpp_gives_our_tokens(runs: Runs, gguf_path: Path) -> None:
    """llama.cpp on its own converter's file after the longest prompt: its greedy choice at every
    step is our token (a parting allowed only at one of its near-ties), so our reading of the qwen35
    layout is llama.cpp's."""
    llama_cpp = pytest.importorskip("llama_cpp")
    ids = _prompts()[-1]
    ours = runs.greedy(ids)
    llm = llama_cpp.Llama(model_path=str(gguf_path), n_ctx=N_CTX, n_batch=N_CTX, n_threads=2, logits_all=True,
                          verbose=False)
    llm.eval(ids + ours)
    scores = np.array(llm.scores[len(ids) - 1: len(ids) + N_NEW - 1], dtype=np.float32)
    agree = 0
    for step, tok in enumerate(ours):
        want = int(scores[step].argmax())
        if want != tok:
            top2 = np.sort(scores[step])[-2:]
            assert top2[1] - top2[0] < LLAMA_CPP_NEAR_TIE, f"step {step}: ours {tok}, llama.cpp {want}"
            break
        agree += 1
    print(f"llama.cpp: {agree}/{N_NEW} greedy steps agree")


# --- value heads tiled over fewer key heads -------------------------------------------------
# Qwen3.5-0.8B has as many value heads as key heads; the larger Qwen3.5 models have twice as many,
# which llama.cpp's converter stores tiled (value head j reads key head j % key heads, where the
# reference groups them: j // 2). A small checkpoint of that kind (width 128, 2 key / 4 value
# heads of 32, the real vocabulary for the tokenizer the converter wants), through the same
# converter, against transformers.
TILED = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1,
         "head_dim": 64, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
         "linear_value_head_dim": 32}


def _tiled_checkpoint(out: Path) -> None:
    import json
    import shutil

    import torch
    from qwen35_fixtures import _init_weights, qwen35_config_dict, tokenizer_dir
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = {**qwen35_config_dict(4), **TILED}
    torch.manual_seed(1)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**{k: v for k, v in config.items()
                                                    if k not in ("architectures", "model_type", "dtype")}))
    _init_weights(model)
    model.tie_weights()
    model.save_pretrained(str(out / "hf"))
    saved = json.loads((out / "hf" / "config.json").read_text())
    saved.update({k: v for k, v in config.items() if k != "dtype"})
    (out / "hf" / "config.json").write_text(json.dumps(saved, indent=2))
    for f in tokenizer_dir().iterdir():
        if f.is_file() and not f.name.startswith("."):
            shutil.copy2(f, out / "hf" / f.name)
    run_llama_cpp_converter(out / "hf", out / "tiled-f32.gguf", "f32")


def test_tiled_value_heads_match_transformers() -> None:
    from hf_fixtures import build_once
    from qwen35_fixtures import cache_root

    from edgevlm_ros import _engine

    out = build_once(cache_root() / "qwen35-random-tiled-v1", {"version": 1, **TILED}, _tiled_checkpoint)
    dec = _engine.Decoder(_engine.GGUFFile(str(out / "tiled-f32.gguf")), threads=2, n_ctx=N_CTX, n_batch=N_BATCH)
    hf = load_hf_model(out / "hf")
    for ids in _prompts()[-1:]:
        dec.reset()
        ours, ref = dec.forward(np.array(ids, dtype=np.int32), all_logits=True), _hf_logits(hf, ids)
        assert np.array_equal(ours.argmax(1), ref.argmax(1))
        assert _rel_l2(ours, ref).max() < MAX_REL


# --- the loader on files that lie ------------------------------------------------------------
# A tiny qwen35 file (width 32, one linear layer and one full one) written here with gguf-py, in
# the layout above; each case changes one key or one tensor. The loader checks every size an
# allocation is computed from against the others and the tensors before allocating anything.
TINY = {"conv_kernel": 4, "state_size": 8, "group_count": 2, "time_step_rank": 4, "inner_size": 4 * 8}


def _tiny_gguf(path: Path, keys: dict[str, int] | None = None, conv_shape: tuple[int, int] | None = None,
               recurrent: list[bool] | None = None, top: dict[str, int] | None = None,
               pattern_key: bool = True) -> Path:
    """keys: qwen35.ssm.* values over TINY's; top: other qwen35.* keys; recurrent_layers as given
    (default [True, False]), none without pattern_key (the pattern then comes from full_attention_interval)."""
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
    if pattern_key:
        w.add_array("qwen35.attention.recurrent_layers", recurrent if recurrent is not None else [True, False])
    for name, v in (top or {}).items():
        w.add_uint64(f"qwen35.{name}", v)

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


def test_tiny_file_layer_pattern_from_the_interval_and_nextn(tmp_path: Path) -> None:
    """Without recurrent_layers, full_attention_interval 2 makes layer 0 linear and layer 1 full (the
    same file as above: the same numbers); nextn_predict_layers 1 leaves the decoder its first layer."""
    ids = np.arange(6, dtype=np.int32)
    want = _load(_tiny_gguf(tmp_path / "a.gguf")).forward(ids, all_logits=True)
    by_interval = _tiny_gguf(tmp_path / "b.gguf", pattern_key=False, top={"full_attention_interval": 2})
    assert np.array_equal(_load(by_interval).forward(ids, all_logits=True), want)
    short = _load(_tiny_gguf(tmp_path / "c.gguf", top={"nextn_predict_layers": 1}))
    assert short.config["n_layer"] == 1 and short.snapshot().nbytes == 4 * ((4 - 1) * 64 + 4 * 8 * 8)
    assert not np.array_equal(short.forward(ids, all_logits=True), want)


@pytest.mark.parametrize(("case", "args", "match"), [
    ("huge state", {"keys": {"state_size": 1 << 12, "inner_size": 4 << 12}}, "ssm.state_size: is larger than"),
    ("heads", {"keys": {"time_step_rank": 3, "inner_size": 24}}, "multiple of the key heads"),
    ("inner size", {"keys": {"inner_size": 4 * 9}}, "ssm_conv1d.weight"),
    ("conv width", {"keys": {"conv_kernel": 3}}, "ssm_conv1d.weight"),
    ("conv layout", {"conv_shape": (4, 64)}, "ssm_conv1d.weight"),
    ("zero kernel", {"keys": {"conv_kernel": 0}}, "ssm.conv_kernel"),
    ("pattern", {"recurrent": [True]}, "recurrent_layers"),
    ("interval", {"pattern_key": False, "top": {"full_attention_interval": 0}}, "full_attention_interval"),
    ("nextn", {"top": {"nextn_predict_layers": 2**64 - 1}}, "nextn_predict_layers"),
])
def test_loader_refuses_inconsistent_files(tmp_path: Path, case: str, args: dict[str, Any], match: str) -> None:
    from edgevlm_ros import _engine

    with pytest.raises(_engine.GGUFError, match=match):
        _load(_tiny_gguf(tmp_path / "bad.gguf", **args))
