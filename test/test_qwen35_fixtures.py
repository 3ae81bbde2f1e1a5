"""The Qwen3.5 fixtures are what they claim: a tokenizer equal to tiktoken on Qwen3.5's ranks that
llama.cpp's converter recognises as `qwen35`, a checkpoint at the 0.8B widths that transformers runs,
and llama.cpp's GGUF of it (built once, cached: see qwen35_fixtures.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import qwen35_fixtures as qf  # noqa: E402

LAYERS = 4


@pytest.fixture(scope="module")
def hf_dir() -> Path:
    return qf.cached_qwen35(LAYERS)


@pytest.fixture(scope="module")
def lcpp_gguf() -> Path:
    return qf.cached_qwen35_llama_cpp_gguf(LAYERS)


@pytest.fixture(scope="module")
def lcpp_fields(lcpp_gguf: Path) -> dict[str, Any]:
    from edgevlm_ros import _engine

    f = _engine.GGUFFile(str(lcpp_gguf))  # gguf-py's reader takes ~80 s on a 248k vocabulary
    fields = dict(f.metadata())
    fields["_tensors"] = {t["name"]: list(t["shape"]) for t in f.tensors()}
    return fields


def test_tokenizer_equals_tiktoken(hf_dir: Path) -> None:
    tok = qf.load_hf_tokenizer(hf_dir)
    enc = qf.tiktoken_encoding()
    texts = ["Describe the scene: a robot arm, two cubes (red & blue) and 3 people.",
             "  leading spaces\tand\ttabs\n\n\nnewlines  ", "Ünïcödé ñ ß ǅ ﬁ", "数字１２３ 和 ４５６",
             "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n<think>\n"]
    for text in texts:
        assert tok.encode(text, add_special_tokens=False) == qf.encode_with_tiktoken(enc, text), text
    assert len(tok) == qf.N_RANKS + len(qf.special_tokens())
    assert tok.convert_tokens_to_ids("<|im_end|>") == qf.IM_END_ID
    assert tok.eos_token == "<|im_end|>"
    assert "<|im_start|>assistant" in tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                              add_generation_prompt=True)


def test_merges_are_one_per_buildable_token() -> None:
    vocab, merges = qf.qwen35_vocab_and_merges()
    assert len(vocab) == qf.N_RANKS
    assert len(merges) == qf.N_RANKS - 256 - qf.UNREACHABLE
    assert merges[0] == ("Ġ", "Ġ")
    # each merge joins two tokens into one of a higher rank than both
    for a, b in merges[:: 997]:
        assert vocab[a + b] > max(vocab[a], vocab[b])


def test_a_broken_rank_table_is_caught() -> None:
    ranks = qf.load_ranks()
    assert qf.split_pair(b"Hello", ranks) is not None
    broken = {t: r for t, r in ranks.items() if t not in (b"ll", b"el", b"He")}  # "Hello"'s building blocks
    assert qf.split_pair(b"Hello", broken) is None
    small = {t: r for t, r in broken.items() if len(t) == 1 or t in (b"Hello", b"Hel", b"lo")}
    with pytest.raises(RuntimeError, match="cannot be built by merging"):
        qf.vocab_and_merges(small)


def test_checkpoint_runs_in_transformers(hf_dir: Path) -> None:
    import torch

    model = qf.load_hf_model(hf_dir)
    cfg = model.config
    assert cfg.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim) == (qf.WIDTH, qf.FFN, qf.HEAD_DIM)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    ids = qf.load_hf_tokenizer(hf_dir).encode("The robot picked up the red cube and", add_special_tokens=False)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].numpy()
    assert logits.shape == (len(ids), qf.VOCAB_ROWS)
    assert np.isfinite(logits).all()
    spread = logits.std(axis=-1)
    assert (spread > 0.5).all() and (spread < 10).all(), spread
    top2 = np.sort(logits, axis=-1)[:, -2:]
    assert (top2[:, 1] - top2[:, 0]).max() > 0.05  # clear winners exist
    # the recurrent state matters: the last token's logits change when an early token changes
    with torch.no_grad():
        other = model(torch.tensor([[ids[0] + 1] + ids[1:]])).logits[0, -1].numpy()
    assert np.abs(other - logits[-1]).max() > 1e-3


def test_llama_cpp_converted_it_as_qwen35(lcpp_fields: dict[str, Any], hf_dir: Path) -> None:
    f = lcpp_fields
    assert f["general.architecture"] == "qwen35"
    assert f["tokenizer.ggml.pre"] == "qwen35"  # llama.cpp's hash of its check text names Qwen3.5's tokenizer
    assert f["qwen35.block_count"] == LAYERS
    assert list(f["qwen35.attention.recurrent_layers"]) == [True, True, True, False]
    assert (f["qwen35.ssm.conv_kernel"], f["qwen35.ssm.state_size"], f["qwen35.ssm.inner_size"]) == (4, 128, 2048)
    assert f["tokenizer.ggml.eos_token_id"] == qf.IM_END_ID
    tokens = f["tokenizer.ggml.tokens"]
    assert len(tokens) == qf.VOCAB_ROWS
    vocab, merges = qf.qwen35_vocab_and_merges()
    assert tokens[: qf.N_RANKS] == sorted(vocab, key=vocab.__getitem__)
    assert f["tokenizer.ggml.merges"] == [f"{a} {b}" for a, b in merges]
    assert [tokens[i] for i, _ in qf.special_tokens()] == [t for _, t in qf.special_tokens()]
    t = f["_tensors"]
    assert t["token_embd.weight"] == [qf.WIDTH, qf.VOCAB_ROWS] and "output.weight" not in t  # tied
    assert t["blk.0.attn_qkv.weight"] == [qf.WIDTH, 3 * 2048]
    assert t["blk.3.attn_q.weight"] == [qf.WIDTH, 2 * qf.HEADS * qf.HEAD_DIM]  # query + output gate
