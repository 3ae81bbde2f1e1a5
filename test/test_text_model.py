"""The Python API and the CLI on the real model: prefix snapshots, stop rules, errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_prefix_restore_equals_recomputing_the_whole_prompt(engine: Any) -> None:
    system = "You are a robot's eyes. Answer in one short sentence."
    full = engine.encode_prompt("What colour is a ripe banana?", system=system)
    # The system turn is a prefix of the full prompt: everything up to the user turn.
    prefix_ids = engine.tokenizer.encode(engine.chat_text("", system=system), add_bos=False)
    n_pre = next(i for i, (a, b) in enumerate(zip(prefix_ids, full, strict=False)) if a != b)
    prefix = engine.prefix(full[:n_pre])
    assert prefix.snapshot.n_past == n_pre

    recomputed = engine.generate_ids(full, max_new_tokens=24)
    cached = engine.generate_ids(full, max_new_tokens=24, prefix=prefix)
    cached_again = engine.generate_ids(full, max_new_tokens=24, prefix=prefix)  # snapshot reusable
    assert cached.cached_prefix_tokens == n_pre
    assert recomputed.cached_prefix_tokens == 0
    assert cached.token_ids == recomputed.token_ids == cached_again.token_ids
    assert len(cached.token_ids) > 0


def test_prefix_logits_are_bitwise_equal(engine: Any) -> None:
    """A prompt's last logits (what generation starts from: the head over the last token is a
    decode product, docs/kernels/prefill-head.md) are the same bits whether its first 7 tokens
    come from a prefix snapshot or not. Scoring every position (the prefill head, float
    activations) gives the last row within the decode head's int8 activation error of one
    product: 0.46% and 0.76% relative L2 on two prompts (2026-12-06; a near tie may then pick
    another top-1, as in any decode step); 2% bounds it, a wrong row or head is off by order 1."""
    ids = engine.encode_prompt("Name a primary colour.")
    engine.native.reset()
    whole = engine.native.forward(np.asarray(ids, dtype=np.int32))
    engine.native.restore(engine.prefix(ids[:7]).snapshot)
    rest = engine.native.forward(np.asarray(ids[7:], dtype=np.int32))
    np.testing.assert_array_equal(rest, whole)
    scored = engine.logits(ids)[-1]
    assert np.linalg.norm(scored - whole) < 0.02 * np.linalg.norm(scored)


def test_decode_logits_do_not_depend_on_the_chunk_bound(engine: Any, text_model_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """EDGEVLM_DECODE_CHUNK_KB=16 cuts every decode product into chunks of at most 16 KB (the head
    in ~900, each layer matrix in several): a row's result does not depend on its chunk."""
    import edgevlm_ros

    monkeypatch.setenv("EDGEVLM_DECODE_CHUNK_KB", "16")
    fine = edgevlm_ros.load(text_model_path, threads=2)
    ids = np.asarray(engine.encode_prompt("Name a primary colour."), dtype=np.int32)
    out = []
    for m in (engine, fine):
        m.native.reset()
        m.native.forward(ids[:-1])
        out.append(m.native.forward(ids[-1:]))  # one token: the decode kernels
    np.testing.assert_array_equal(out[1], out[0])
    greedy = [m.generate_ids(list(ids), max_new_tokens=12).token_ids for m in (engine, fine)]
    assert greedy[0] == greedy[1]


def test_prefix_not_matching_prompt_is_not_used(engine: Any) -> None:
    prefix = engine.prefix(engine.tokenizer.encode("Completely different text"))
    ids = engine.encode_prompt("What is a robot?")
    r = engine.generate_ids(ids, max_new_tokens=4, prefix=prefix)
    assert r.cached_prefix_tokens == 0
    assert r.token_ids == engine.generate_ids(ids, max_new_tokens=4).token_ids


def test_generation_stops_and_reports(engine: Any) -> None:
    r = engine.generate("Say just the word yes.", max_new_tokens=32)
    assert r.stop_reason in ("stop_token", "max_tokens")
    assert set(r.timings_ms) >= {"tokenize", "prefill", "decode", "detokenize", "total"}
    assert r.text == engine.tokenizer.decode(r.token_ids, skip_special=True)
    assert not set(r.token_ids) & set(engine.stop_ids)
    zero = engine.generate("hello", max_new_tokens=0)
    assert zero.token_ids == [] and zero.stop_reason == "max_tokens"
    one = engine.generate("hello", max_new_tokens=1)
    assert len(one.token_ids) == 1


def test_deadline_stops_decoding(engine: Any) -> None:
    r = engine.generate("Tell me a long story about a robot.", max_new_tokens=200, deadline_ms=1.0)
    assert r.stop_reason == "deadline"
    assert len(r.token_ids) < 200


def test_cancel_from_another_thread_stops_generation(engine: Any) -> None:
    """cancel() is the node's shutdown path: a generation in progress (GIL released) ends at its
    next token with "cancelled", later ones end at once, and cancel(False) re-arms the model."""
    import threading
    import time

    ids = np.asarray(engine.encode_prompt("Tell me a long story about a robot."), dtype=np.int32)
    native = engine.native
    result: dict[str, Any] = {}
    native.reset()
    worker = threading.Thread(target=lambda: result.update(native.generate(ids, 100000, [])))
    worker.start()
    time.sleep(0.3)
    assert worker.is_alive()  # still decoding: 100000 tokens do not fit in 0.3 s
    try:
        native.cancel()
        worker.join(5)
        assert not worker.is_alive()
        assert result["stop_reason"] == "cancelled" and 0 < len(result["tokens"]) < 100000
        native.reset()
        again = native.generate(ids, 50, [])
        assert again["stop_reason"] == "cancelled" and len(again["tokens"]) == 1
    finally:
        native.cancel(False)
    native.reset()
    assert native.generate(ids, 3, [])["stop_reason"] == "max_tokens"


def test_raw_prompt_has_no_template(engine: Any) -> None:
    ids = engine.encode_prompt("Once upon a time", raw=True)
    assert ids == engine.tokenizer.encode("Once upon a time")
    assert engine.tokenizer.bos_id not in ids  # SmolLM2's GGUF sets add_bos_token = false
    chat = engine.encode_prompt("Once upon a time")
    assert chat[0] == engine.tokenizer.token_to_id("<|im_start|>")


def test_bad_token_ids_and_context_overflow_raise(engine: Any) -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.logits([1, 2, 10**6])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.logits([-1])
    with pytest.raises(ValueError, match="context full"):
        engine.native.reset()
        engine.native.forward(np.zeros(engine.native.n_ctx + 1, dtype=np.int32))
    # The model still works afterwards.
    assert engine.generate("hi", max_new_tokens=2).token_ids


def test_loading_a_non_llama_or_broken_file_is_a_value_error(tmp_path: Path) -> None:
    import edgevlm_ros

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 5)
    with pytest.raises(ValueError, match="bad.gguf"):
        edgevlm_ros.load(bad)
    with pytest.raises(FileNotFoundError):
        edgevlm_ros.load(tmp_path / "missing.gguf")


def test_an_unknown_architecture_is_not_supported_and_not_a_bad_file(tmp_path: Path) -> None:
    """The registry picks the decoder from general.architecture: a well-formed file of another one
    (or an mmproj given as the text model) is refused as unsupported, naming what is, before any of
    its keys is read; a text model given as the mmproj likewise."""
    import gguf

    from edgevlm_ros import _engine

    for arch in ("gemma9", "clip"):
        path = tmp_path / f"{arch}.gguf"
        w = gguf.GGUFWriter(str(path), arch)
        w.add_tensor("x", np.zeros(4, np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        with pytest.raises(_engine.UnsupportedModelError,
                           match=rf"general.architecture: '{arch}' is not supported as a text decoder "
                                 r"\(supported: llama, gemma3, qwen35\)") as info:
            _engine.Decoder(_engine.GGUFFile(str(path)))
        assert "bad GGUF file" not in str(info.value) and isinstance(info.value, ValueError)
    with pytest.raises(_engine.UnsupportedModelError, match="'gemma9' is not an mmproj"):
        _engine.VisionModel(_engine.GGUFFile(str(tmp_path / "gemma9.gguf")))


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "edgevlm_ros.cli", *args], capture_output=True, text=True,
                          env=env, timeout=600, cwd=ROOT)


def test_cli_generate_answers_what_is_a_robot() -> None:
    p = _cli("generate", "--prompt", "What is a robot?", "--max-tokens", "48", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert {"text", "token_ids", "prompt_token_ids", "timings_ms", "tokens_per_s"} <= set(out)
    assert "robot" in out["text"].lower()
    assert len(out["token_ids"]) > 10 and out["tokens_per_s"] > 0


@pytest.mark.parametrize(
    "args, message",
    [
        (("generate", "--prompt", "x", "--model", "/nonexistent.gguf"), "not found"),
        (("generate", "--prompt", "x", "--max-tokens", "-3"), "must be >= 0"),
        (("generate", "--prompt", "x", "--threads", "zero"), "not an integer"),
        (("generate",), "required"),
        (("generate", "--prompt", "x", "--model", str(ROOT / "setup.py")), "not a GGUF file"),
    ],
)
def test_cli_errors_are_one_line(args: tuple[str, ...], message: str) -> None:
    p = _cli(*args)
    assert p.returncode != 0
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert message in lines[0]
    assert "Traceback" not in p.stderr


PIN_PROBE = ROOT / "test" / "pin_probe.py"  # the child program


@pytest.mark.parametrize("pin", ["0", "1"])
def test_worker_threads_are_named_and_pinned_on_request(pin: str) -> None:
    """The pool's workers are named evk-worker-N; EDGEVLM_PIN_THREADS=1 pins worker N to the N-th
    CPU the process may use (wrapping), leaving the caller's thread alone."""
    env = {**os.environ, "EDGEVLM_PIN_THREADS": pin}
    done = subprocess.run([sys.executable, str(PIN_PROBE)], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    workers, allowed = report["workers"], report["allowed"]
    assert sorted(workers) == ["evk-worker-1", "evk-worker-2"], workers
    if pin == "1":
        assert workers["evk-worker-1"] == [allowed[1 % len(allowed)]]
        assert workers["evk-worker-2"] == [allowed[2 % len(allowed)]]
    else:
        assert all(cpus == allowed for cpus in workers.values()), workers

