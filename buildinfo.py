"""The native build's one description, shared by setup.py (the extension) and the tests that
build standalone native checks (kernel variants under qemu-aarch64, allocation counting,
sanitizers)."""

from __future__ import annotations

import glob
from pathlib import Path

ROOT = Path(__file__).resolve().parent
INCLUDE_DIRS = ["native", "kernels"]
WARNINGS = ["-Wall", "-Wextra"]


def binding_sources() -> list[str]:
    """The pybind11 files (native/bindings*.cpp: the model API and the kernel test/tune entry
    points): compiled into the extension only, never into a standalone native check."""
    return sorted(glob.glob("native/bindings*.cpp", root_dir=ROOT))


def sources(kernels_only: bool = False) -> list[str]:
    """Library sources, relative to the repo root; test programs (*/tests/*) and the bindings
    excluded."""
    pattern = ["kernels/**/*.cpp"] if kernels_only else ["native/**/*.cpp", "kernels/**/*.cpp"]
    found = sorted(p for pat in pattern for p in glob.glob(pat, root_dir=ROOT, recursive=True))
    bindings = set(binding_sources())
    return [p for p in found if "/tests/" not in p and p not in bindings]


def headers() -> list[str]:
    return sorted(p for d in ("native", "kernels") for ext in ("h", "inc")
                  for p in glob.glob(f"{d}/**/*.{ext}", root_dir=ROOT, recursive=True))


def default_optable() -> str:
    """kernels/optable.tsv as one line of ';'-separated rules, compiled in as the default table."""
    text = (ROOT / "kernels" / "optable.tsv").read_text(encoding="utf-8")
    rules = [" ".join(line.split("#", 1)[0].split()) for line in text.splitlines()]
    return ";".join(r for r in rules if r)


def optable_define() -> tuple[str, str]:
    return ("EVK_DEFAULT_OPTABLE", f'"{default_optable()}"')
