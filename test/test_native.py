"""Native checks built as standalone programs from the same sources as the extension
(buildinfo.py): every kernel variant against its scalar reference on x86 and, cross-compiled with
Debian's g++-aarch64-linux-gnu, under qemu-aarch64 (with and without the dotprod extension);
zero heap allocations per decoded token; the GGUF reader and the kernels under ASan + UBSan."""

from __future__ import annotations

import os
import random
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import native_build as nb  # noqa: E402

import buildinfo  # noqa: E402

CROSS = "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64"
GGUF_CHECK_SOURCES = ["native/gguf.cpp", "native/mapped_file.cpp", "kernels/formats/formats.cpp",
                      "kernels/formats/kquants.cpp"]


# The programs, each built once per distinct input (native_build.py's caches) and ahead of the
# tests (BUILD_AHEAD, conftest.py), in the order the tests below use them.
@nb.ahead
def kernel_check() -> Path:
    return nb.build_program("kernel_check", "kernels/tests/kernel_check.cpp", buildinfo.sources(kernels_only=True))


@nb.ahead
def kernel_check_aarch64() -> Path:
    return nb.build_program("kernel_check-aarch64", "kernels/tests/kernel_check.cpp",
                            buildinfo.sources(kernels_only=True), compiler=CROSS, extra=("-static",))


@nb.ahead
def alloc_check() -> Path:
    return nb.build_program("alloc_check", "native/tests/alloc_check.cpp", buildinfo.sources())


# The extension's own ASan + UBSan objects (the build test_sanitized_extension.py runs against).
@nb.ahead
def gguf_check_asan() -> Path:
    return nb.build_sanitized_program("gguf_check-asan", "native/tests/gguf_check.cpp", GGUF_CHECK_SOURCES)


@nb.ahead
def kernel_check_asan() -> Path:
    return nb.build_sanitized_program("kernel_check-asan", "kernels/tests/kernel_check.cpp",
                                      buildinfo.sources(kernels_only=True))


BUILD_AHEAD = (kernel_check, kernel_check_aarch64, alloc_check, gguf_check_asan, kernel_check_asan)


def _run(cmd: list[str], timeout: int = 600, env: dict[str, str] | None = None) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                       env=None if env is None else {**os.environ, **env})
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert " 0 failed" in out, out[-4000:]
    return out


def test_every_x86_kernel_variant_matches_the_reference() -> None:
    out = _run([str(kernel_check())])
    print(out.splitlines()[-1])


def _need_cross_tools() -> None:
    missing = [t for t in (CROSS, QEMU) if shutil.which(t) is None]
    assert not missing, f"{missing} missing: scripts/setup.sh installs g++-aarch64-linux-gnu and qemu-user"


@pytest.mark.parametrize("cpu, expect_dotprod", [("max", True), ("cortex-a53", False)])
def test_arm_kernel_variants_under_qemu(cpu: str, expect_dotprod: bool) -> None:
    """NEON (and, where the emulated CPU has them, dotprod and i8mm) variants against the reference.
    cortex-a53 lacks both: their variants must be skipped and the plain NEON one still checked."""
    _need_cross_tools()
    out = _run([QEMU, "-cpu", cpu, str(kernel_check_aarch64())])
    assert "neon=1" in out
    assert (f"dotprod={int(expect_dotprod)}") in out
    assert ("skip matmul/neon_q8act_dot" in out) is not expect_dotprod
    # qemu's "max" CPU has FEAT_I8MM too (the smmla variant runs); cortex-a53 has neither.
    assert (f"i8mm={int(expect_dotprod)}") in out
    assert ("skip matmul/neon_q8act_i8mm" in out) is not expect_dotprod
    print(cpu, out.splitlines()[-1])


def test_no_heap_allocation_per_decoded_token(text_model_path: Path) -> None:
    out = _run([str(alloc_check()), str(text_model_path), "100", "2"])
    assert "decode: 100 steps, 0 heap allocations" in out, out
    assert "generate with choices: 100 tokens (complete)" in out and "0 failed" in out, out
    # The JSON-schema constraint: stack, scratch state and candidate heap sized at construction.
    assert re.search(r"generate with a json schema: \d+ tokens \((complete|max_tokens)\), 0 heap allocations", out), out


def _hostile_corpus(src: Path, dest: Path, n_mutations: int = 300) -> list[Path]:
    """Truncations and seeded byte mutations of a real GGUF's header region, plus absurd counts."""
    head = src.read_bytes()[: 1 << 20]
    dest.mkdir(parents=True, exist_ok=True)
    files = []
    for cut in (0, 3, 4, 8, 16, 24, 100, 1000, 40_000, 500_000):
        p = dest / f"cut{cut}.gguf"
        p.write_bytes(head[:cut])
        files.append(p)
    rng = random.Random(7)
    for i in range(n_mutations):
        data = bytearray(head)
        for _ in range(rng.randint(1, 8)):
            pos = rng.randrange(0, 4096)
            data[pos] = rng.randrange(256)
        p = dest / f"mut{i}.gguf"
        p.write_bytes(bytes(data))
        files.append(p)
    for name, blob in {
        "huge_tensor_count": b"GGUF" + struct.pack("<IQQ", 3, 1 << 60, 0),
        "huge_kv_count": b"GGUF" + struct.pack("<IQQ", 3, 0, 1 << 60),
        "huge_array": b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"a"
        + struct.pack("<IIQ", 9, 4, 1 << 40),
        "huge_string": b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 10 << 30) + b"k",
    }.items():
        p = dest / f"{name}.gguf"
        p.write_bytes(blob)
        files.append(p)
    return files


def test_gguf_reader_and_kernels_under_asan_ubsan(text_model_path: Path, tmp_path: Path) -> None:
    reader = gguf_check_asan()
    env = nb.SANITIZED_RUN_ENV
    corpus = _hostile_corpus(text_model_path, tmp_path / "corpus")
    out = _run([str(reader), str(text_model_path), *map(str, corpus)], env=env)
    assert "ERROR: AddressSanitizer" not in out and "runtime error" not in out
    print(out.splitlines()[-2])
    # Super-blocks cut short: the K-quant / Q5 / IQ4_NL seeds ending inside their last tensor.
    cuts = []
    for seed in sorted((ROOT / "test" / "fuzz_seeds" / "gguf").glob("llama_tiny_q*.gguf")):
        for cut in (1, 83, 209, 4000):
            p = tmp_path / f"{seed.stem}-cut{cut}.gguf"
            p.write_bytes(seed.read_bytes()[:-cut])
            cuts.append(p)
    out = _run([str(reader), *map(str, cuts)], env=env)
    assert "ERROR: AddressSanitizer" not in out and "runtime error" not in out
    assert f"loaded 0, refused {len(cuts)}" in out, out
    out = _run([str(kernel_check_asan())], env=env)
    assert "ERROR: AddressSanitizer" not in out and "runtime error" not in out
