"""Qwen3.5's multi-token-prediction block (MTP, llama.cpp's "nextn"): kept by our converter as llama.cpp's
converter keeps it, its drafts equal to llama.cpp's own MTP graph, and speculation from it lossless.

The checkpoint is the random 4-layer Qwen3.5 of qwen35_fixtures with a random MTP block of the published layout
(`cached_qwen35_mtp`); the reference is llama.cpp 0.3.36 itself (`llama_mtp_reference.py`: its `graph_mtp` through
llama-cpp-python, F32 attention), run in a subprocess on the file llama.cpp's converter wrote.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import qwen35_fixtures as qf
from test_convert_qwen35 import _differences

from edgevlm_ros import _engine
from edgevlm_ros.tools.convert_qwen35 import convert_qwen35

LAYERS = 4
PROMPT = [9707, 11, 1879, 13, 576, 3346, 374, 264, 2082, 13]
EOS = [qf.EOS_ID]
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def gguf() -> Path:
    return qf.cached_qwen35_mtp_llama_cpp_gguf(LAYERS)


def _decoder(path: Path, mtp: bool = True) -> _engine.Decoder:
    return _engine.Decoder(_engine.GGUFFile(str(path)), threads=2, n_ctx=512, mtp=mtp)


def test_converter_keeps_the_mtp_block_as_llama_cpps_does(tmp_path: Path) -> None:
    src = qf.cached_qwen35_mtp(LAYERS)
    kept = convert_qwen35(src, tmp_path / "kept", "f32", name="mtp")
    assert _differences(kept, qf.cached_qwen35_mtp_llama_cpp_gguf(LAYERS)) == []
    left_out = convert_qwen35(src, tmp_path / "plain", "f32", name="mtp", mtp=False)
    assert _differences(left_out, qf.cached_qwen35_llama_cpp_gguf(LAYERS)) == []


def test_drafts_equal_llama_cpps_mtp_head(gguf: Path, tmp_path: Path) -> None:
    k = 3
    ref_path = tmp_path / "ref.npz"
    done = subprocess.run([sys.executable, str(HERE / "llama_mtp_reference.py"), str(gguf), "--prompt",
                           ",".join(map(str, PROMPT)), "--k", str(k), "--out", str(ref_path)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    ref = np.load(ref_path)
    dec = _decoder(gguf)
    assert dec.has_mtp
    logits = dec.forward(np.array(PROMPT, dtype=np.int32))
    assert int(np.argmax(logits)) == int(ref["next_token"])
    assert np.abs(logits - ref["target_logits"]).max() < 1e-3
    drafts, draft_logits = dec.draft_mtp(int(ref["next_token"]), k)
    assert drafts == [int(t) for t in ref["drafts"]]
    err = np.linalg.norm(draft_logits - ref["draft_logits"], axis=1) / np.linalg.norm(ref["draft_logits"], axis=1)
    assert err.max() < 2e-4, err  # 3.3e-5 measured (summation order)
    # The drafts are the block's own: not the decoder's next token, nor a copy of one another.
    assert len(set(drafts)) == k and int(ref["next_token"]) not in drafts
    assert dec.n_past == len(PROMPT)  # drafting leaves the sequence as it was


def test_a_file_without_the_block_or_mtp_off_has_no_drafts(gguf: Path) -> None:
    for dec in (_decoder(gguf, mtp=False), _decoder(qf.cached_qwen35_llama_cpp_gguf(LAYERS))):
        assert not dec.has_mtp
        dec.forward(np.array(PROMPT, dtype=np.int32))
        with pytest.raises(ValueError, match="multi-token-prediction"):
            dec.draft_mtp(PROMPT[0], 2)


def test_speculation_from_the_block_is_plain_greedy_and_keeps_its_cache(gguf: Path) -> None:
    """Greedy with MTP drafts (random weights: nearly every draft is rejected, so the recurrent state is
    rolled back and the confirmed rows rerun) gives plain greedy's tokens; afterwards the block's cache and
    hidden input are those of a plain run over the same tokens (its next drafts agree); after restore()
    it attends from the restored position on and the tokens are still greedy's."""
    n = 60  # probes of the block at ~16 and ~48 tokens (each failed probe doubles the wait)
    plain = _decoder(gguf, mtp=False).generate(np.array(PROMPT, dtype=np.int32), n, EOS)
    spec_dec = _decoder(gguf)
    spec = spec_dec.generate(np.array(PROMPT, dtype=np.int32), n, EOS)
    assert spec["tokens"] == plain["tokens"]
    assert spec["spec_passes"] >= 2 and spec["spec_drafted"] >= 2, spec
    # the sequence holds the prompt and every generated token but the last
    tokens = spec["tokens"]
    assert spec_dec.n_past == len(PROMPT) + len(tokens) - 1
    after, after_logits = spec_dec.draft_mtp(tokens[-1], 3)
    fresh = _decoder(gguf)
    fresh.forward(np.array(PROMPT + tokens[:-1], dtype=np.int32))
    want, want_logits = fresh.draft_mtp(tokens[-1], 3)
    assert after == want
    assert np.abs(after_logits - want_logits).max() < 1e-3

    fresh.reset()
    fresh.forward(np.array(PROMPT[:6], dtype=np.int32))
    snap = fresh.snapshot()
    fresh.restore(snap)
    again = fresh.generate(np.array(PROMPT[6:], dtype=np.int32), n, EOS)
    assert again["tokens"] == plain["tokens"]


def test_the_cost_script_runs_from_a_separate_process(gguf: Path, tmp_path: Path) -> None:
    out = tmp_path / "cost.json"
    done = subprocess.run([sys.executable, str(HERE.parent / "scripts" / "mtp_cost.py"), str(gguf), "--tokens", "8",
                           "--reps", "1", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "one draft step of the block" in done.stdout and "break-even acceptance" in done.stdout
    rec = json.loads(out.read_text())
    assert rec["draft_step"] > 0 and len(rec["pass"]) == 8 and rec["pass"][0] == 1.0


def test_text_model_says_whether_it_drafts_from_the_block(gguf: Path, caplog: pytest.LogCaptureFixture) -> None:
    from edgevlm_ros.engine.text_model import TextModel

    with caplog.at_level(logging.INFO, logger="edgevlm"):
        with_block = TextModel(gguf, threads=2, n_ctx=256, mtp=True)
        without = TextModel(qf.cached_qwen35_llama_cpp_gguf(LAYERS), threads=2, n_ctx=256, mtp=True)
    assert with_block.native.has_mtp and not without.native.has_mtp
    assert "drafts from its multi-token-prediction block too" in caplog.text
    assert "the file has no multi-token-prediction block" in caplog.text
    ids = with_block.encode_prompt("Describe the robot.")
    r = with_block.generate_ids(ids, max_new_tokens=20)
    assert r.token_ids == without.generate_ids(ids, max_new_tokens=20).token_ids  # the same decoder weights
