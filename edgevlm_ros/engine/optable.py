"""The operator implementation table: which kernel variant serves each operator.

The engine's default is kernels/optable.tsv, compiled in. A tuned table (written by
`edgevlm tune` to ~/.cache/edgevlm_ros/optable.tsv, or any file named by $EDGEVLM_OPTABLE)
replaces it when the engine is first loaded. Models loaded afterwards use the active table;
each model logs which variant serves each operator.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from .. import _engine

TUNED_TABLE = Path.home() / ".cache" / "edgevlm_ros" / "optable.tsv"

# The robot profile: the CPU features of an x86 robot computer (AVX2 + AVX-VNNI, no AVX-512, no
# AMX), written as a features column of the table. Its table keeps the rules of the built-in one
# that need nothing else.
ROBOT_FEATURES = "avx2,fma,f16c,avxvnni"
ROBOT_TABLE_NAME = "optable-robot-avx2-vnni.tsv"  # shipped in config/ (test_bench_tune checks it)
_active: str | None = None


def table_path() -> Path | None:
    """The table file to use, if any: $EDGEVLM_OPTABLE, else a tuned table, else none (built-in)."""
    env = os.environ.get("EDGEVLM_OPTABLE")
    if env:
        return Path(env)
    return TUNED_TABLE if TUNED_TABLE.is_file() else None


def activate(path: str | os.PathLike[str] | None = None) -> str:
    """Makes a table active (the default lookup when path is None); returns its source.

    A table that does not parse raises ValueError naming the file and line."""
    global _active
    chosen = Path(path) if path else table_path()
    if chosen is None:
        _engine.load_optable(_builtin_text(), "built-in default (kernels/optable.tsv)")
    else:
        try:
            text = chosen.read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"operator table '{chosen}': {exc.strerror}") from None
        _engine.load_optable(text, str(chosen))
    _active = _engine.optable_source()
    return _active


def activate_text(text: str, source: str) -> str:
    """Makes the rules in `text` active (tests, tune)."""
    global _active
    _engine.load_optable(text, source)
    _active = source
    return source


def ensure_active() -> str:
    """Activates the default lookup once per process."""
    return _active if _active is not None else activate()


def restrict_rules(text: str, features: Iterable[str]) -> list[str]:
    """The rules of a table (file or ';'-joined form, comments dropped) whose features column
    names only `features` (or '-'), in their order, columns joined by two spaces."""
    allowed = set(features)
    kept = []
    for line in text.splitlines():
        for rule in line.split("#", 1)[0].split(";"):
            cols = rule.split()
            if len(cols) != 6:
                continue
            needs = set() if cols[4] == "-" else set(cols[4].split(","))
            if needs <= allowed:
                kept.append("  ".join(cols))
    return kept


def robot_table() -> str:
    """The robot profile's operator table (config/optable-robot-avx2-vnni.tsv), as a file."""
    head = [
        "# Operator table of the robot profile: an x86 robot computer with AVX2 + AVX-VNNI + FMA + F16C,",
        "# no AVX-512, no AMX. The rules of kernels/optable.tsv that need nothing else, in their order;",
        "# load it with EDGEVLM_OPTABLE=<this file> or `edgevlm bench --optable <this file>`",
        "# (`edgevlm bench --profile robot` uses the same rules). Columns as in kernels/optable.tsv:",
        "# operator  format  phase  shape  features  variant; the first rule that matches, whose variant",
        "# runs on the CPU, wins; `ref` serves whatever no rule does.",
        "# Regenerate: python -m edgevlm_ros.engine.optable robot > config/" + ROBOT_TABLE_NAME,
    ]
    return "\n".join(head + restrict_rules(_builtin_text(), ROBOT_FEATURES.split(","))) + "\n"


_BUILTIN: str | None = None


def _builtin_text() -> str:
    """The compiled-in rules, captured before any other table was loaded."""
    global _BUILTIN
    if _BUILTIN is None:
        _BUILTIN = _engine.builtin_optable()
    return _BUILTIN


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m edgevlm_ros.engine.optable robot`: prints the robot profile's table."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args != ["robot"]:
        print("usage: python -m edgevlm_ros.engine.optable robot", file=sys.stderr)
        return 2
    sys.stdout.write(robot_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
