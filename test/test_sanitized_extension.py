"""The native tests against an ASan + UBSan build of the extension (setup.py, EDGEVLM_SANITIZE=1).

The sanitized extension is built into build/asan/ (never over the normal in-place
edgevlm_ros/_engine*.so; native_build.py: its objects also make test_native.py's ASan programs,
so whichever test comes first builds it once) and put into a copy of the package tree,
build/asan/pkg/edgevlm_ros. A
child pytest then runs, with that copy first on PYTHONPATH and libasan preloaded into the
interpreter (ASan must be the first library loaded: Python is not built with it; libstdc++ right after it):
- test/test_gguf.py and test/test_kernels.py (the reader, every format, every kernel variant);
- the real-model tests of test/test_text_model.py that reach native code (generation, prefix
  snapshots, bad ids, context overflow, broken files);
- this file's own checks (below, run only in the child): which engine is loaded, a short text
  generation with a prefix-cache file round trip, generation constrained to choices and to a JSON
  schema, the tiny llama, qwen35 (with drafts from its MTP block) and mmproj fuzz seeds (idefics3
  and minicpmv4_6) through both models, and every GGUF fuzz regression input.
It must pass with no sanitizer report. Leak detection is off: CPython frees little at exit by design.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import native_build as nb
import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = nb.ASAN / "pkg"
INNER = os.environ.get("EDGEVLM_SANITIZED_INNER") == "1"
# conftest.py: built in the background while the tests before this one run (not in the child).
BUILD_AHEAD = () if INNER else (nb.sanitized_build,)
TEXT_MODEL_TESTS = " or ".join((
    "test_prefix_restore_equals_recomputing_the_whole_prompt", "test_prefix_logits_are_bitwise_equal",
    "test_generation_stops_and_reports", "test_bad_token_ids_and_context_overflow_raise",
    "test_loading_a_non_llama_or_broken_file_is_a_value_error",
))


def _gcc_lib(name: str) -> str:
    path = subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
    assert os.path.isabs(path) and os.path.exists(path), f"gcc has no {name} ({path!r})"
    return path


def _preload() -> str:
    """libasan first; then libstdc++, which python itself does not link: ASan resolves the real
    __cxa_throw behind its interceptor when it starts, and without libstdc++ loaded by then the
    first C++ exception thrown by the extension stops the process with a CHECK failure."""
    return f"{_gcc_lib('libasan.so')}:{_gcc_lib('libstdc++.so.6')}"


def test_native_tests_pass_under_asan_and_ubsan(tmp_path: Path) -> None:
    if INNER:
        pytest.skip("this is the outer test")
    t0 = time.monotonic()
    pkg = nb.build_sanitized_package()
    t_build = time.monotonic() - t0
    reports = tmp_path / "reports"
    reports.mkdir()
    env = dict(os.environ)
    env.update(
        PYTHONPATH=str(pkg),
        EDGEVLM_SANITIZED_INNER="1",
        LD_PRELOAD=_preload(),
        # Reports go to files as well as being fatal, so none is lost in pytest's output capture.
        ASAN_OPTIONS=f"detect_leaks=0:abort_on_error=1:log_path={reports}/asan",
        UBSAN_OPTIONS=f"halt_on_error=1:print_stacktrace=1:log_path={reports}/ubsan",
        OMP_NUM_THREADS="1",
    )
    tests = ROOT / "test"
    # -P: the working directory (the repo root, with the normal build) is not put on sys.path.
    cmd = [sys.executable, "-P", "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-rs",
           str(tests / "test_gguf.py"), str(tests / "test_kernels.py"),
           str(tests / "test_text_model.py"), "-k", f"not test_text_model or {TEXT_MODEL_TESTS} or inner_",
           str(Path(__file__).resolve())]
    p = subprocess.run(cmd, cwd=pkg, env=env, capture_output=True, text=True, timeout=1200)
    out = p.stdout + p.stderr
    found = sorted(reports.iterdir())
    report_text = "\n".join(f.read_text(errors="replace")[:6000] for f in found)
    assert not found, f"sanitizer reports:\n{report_text}\n{out[-3000:]}"
    assert p.returncode == 0, out[-8000:]
    for marker in ("ERROR: AddressSanitizer", "runtime error:", "ERROR: LeakSanitizer"):
        assert marker not in out, out[-8000:]
    print(f"sanitized build {t_build:.0f} s; {out.strip().splitlines()[-1]} in {time.monotonic() - t0 - t_build:.0f} s")


# --------------------------------------------------------------------------------------------
# Run only in the child process, against the sanitized build.

inner = pytest.mark.skipif(not INNER, reason="runs in test_native_tests_pass_under_asan_and_ubsan's child")


@inner
def test_inner_engine_is_the_sanitized_build() -> None:
    from edgevlm_ros import _engine

    assert Path(_engine.__file__).resolve().is_relative_to(PKG.resolve()), _engine.__file__
    maps = Path("/proc/self/maps").read_text()
    assert "libasan" in maps and "libubsan" in maps
    # Instrumented, not merely linked: the code calls the sanitizers' checks.
    code = Path(_engine.__file__).read_bytes()
    assert b"__asan_report_load" in code and b"__ubsan_handle_" in code


@inner
def test_inner_text_generation_and_prefix_cache_file(text_model_path: Path, tmp_path: Path) -> None:
    import edgevlm_ros

    model = edgevlm_ros.load(text_model_path, threads=2)
    ids = model.encode_prompt("What is a robot?")
    plain = model.generate_ids(ids, max_new_tokens=12)
    assert len(plain.token_ids) > 0
    state, status = model.cached_prefix(ids[:6], cache_dir=tmp_path)
    assert status == "built"
    state, status = model.cached_prefix(ids[:6], cache_dir=tmp_path)
    assert status.startswith("loaded from"), status
    cached = model.generate_ids(ids, max_new_tokens=12, prefix=state)
    assert cached.cached_prefix_tokens == 6
    assert cached.token_ids == plain.token_ids


@inner
def test_inner_constrained_generation(text_model_path: Path) -> None:
    """Choices and a JSON schema through the real decoder (native/constraint.*, native/json_schema.*)."""
    import json

    import edgevlm_ros
    from edgevlm_ros.engine import constraints
    from edgevlm_ros.engine.generation import generate

    model = edgevlm_ros.load(text_model_path, threads=2)
    tok, n_vocab = model.tokenizer, int(model.config["n_vocab"])
    ids = model.encode_prompt("Describe a robot as JSON.")
    schema = {"type": "object", "required": ["name", "legs", "tags"],
              "properties": {"name": {"type": "string", "maxLength": 16}, "legs": {"type": "integer"},
                             "ok": {"type": "boolean"},
                             "tags": {"type": "array", "items": {"enum": ["fast", "slow"]}, "maxItems": 3}}}
    c = constraints.schema_constraint(tok, schema)
    for budget in (c.min_tokens, 48):
        r = generate(model.native, tok, model.stop_ids, ids, max_new_tokens=budget, constraint=c)
        answer = json.loads(r.text)
        assert set(answer) >= {"name", "legs", "tags"}, r.text
    choices = constraints.choice_constraint(tok, n_vocab, ["yes", "no"])
    assert generate(model.native, tok, model.stop_ids, ids, max_new_tokens=4, constraint=choices).text in ("yes", "no")


@inner
def test_inner_tiny_models_from_the_fuzz_seeds() -> None:
    import numpy as np

    from edgevlm_ros import _engine

    seeds = ROOT / "test" / "fuzz_seeds" / "gguf"
    for name in ("llama_tiny.gguf", "llama_tiny_tied_linear_rope.gguf"):
        m = _engine.Decoder(_engine.GGUFFile(str(seeds / name)), threads=2, n_ctx=16)
        m.generate(np.arange(5, dtype=np.int32), 8, [])
        assert np.isfinite(m.forward(np.array([1, 2, 3], dtype=np.int32), True)).all()
    # qwen35 with its multi-token-prediction block: drafts from it, greedy with them equal to plain greedy.
    f = _engine.GGUFFile(str(seeds / "qwen35_tiny_mtp.gguf"))
    prompt = np.arange(1, 6, dtype=np.int32)
    plain = _engine.Decoder(f, threads=2, n_ctx=64).generate(prompt, 48, [])
    m = _engine.Decoder(f, threads=2, n_ctx=64, mtp=True)
    spec = m.generate(prompt, 48, [])
    assert m.has_mtp and spec["tokens"] == plain["tokens"] and spec["spec_drafted"] > 0, spec
    drafts, logits = m.draft_mtp(spec["tokens"][-1], 3)
    assert len(drafts) == 3 and np.isfinite(logits).all()
    for name in ("mmproj_tiny.gguf", "mmproj_tiny_ffn_swapped.gguf"):
        v = _engine.VisionModel(_engine.GGUFFile(str(seeds / name)), threads=2)
        size = v.config["image_size"]
        out = v.encode(np.random.default_rng(0).standard_normal((1, 3, size, size)).astype(np.float32))
        assert np.isfinite(out).all()
    # minicpmv4_6, 16x (window merger) and 4x: a slice of a grid of its own, over two threads.
    for name in ("minicpmv4_6_tiny_16x.gguf", "minicpmv4_6_tiny_4x.gguf"):
        v = _engine.VisionModel(_engine.GGUFFile(str(seeds / name)), threads=2)
        p, s = v.config["patch_size"], v.config["scale_factor"]  # s x 8 patches: 8 // s tokens
        out = v.encode_slice(np.random.default_rng(0).standard_normal((3, s * p, 8 * p)).astype(np.float32))
        assert out.shape == (8 // s, v.config["proj_dim"]) and np.isfinite(out).all()


@inner
def test_inner_fuzz_regressions_are_refused_or_load() -> None:
    from edgevlm_ros import _engine

    for path in sorted((ROOT / "test" / "fuzz_regressions" / "gguf").iterdir()):
        if path.suffix != ".gguf":
            continue
        try:
            f = _engine.GGUFFile(str(path))
        except ValueError:
            continue
        try:
            _engine.Decoder(f, threads=1, n_ctx=8)
        except ValueError:
            pass
        try:
            _engine.VisionModel(f, threads=1)
        except ValueError:
            pass
