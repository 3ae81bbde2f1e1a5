"""The operator implementation table: which kernel variant serves each operator.

The engine's default is kernels/optable.tsv, compiled in. A tuned table (written by
`edgevlm tune` to ~/.cache/edgevlm_ros/optable.tsv, or any file named by $EDGEVLM_OPTABLE)
replaces it when the engine is first loaded. Models loaded afterwards use the active table;
each model logs which variant serves each operator.
"""

from __future__ import annotations

import os
from pathlib import Path

from .. import _engine

TUNED_TABLE = Path.home() / ".cache" / "edgevlm_ros" / "optable.tsv"
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


_BUILTIN: str | None = None


def _builtin_text() -> str:
    """The compiled-in rules, captured before any other table was loaded."""
    global _BUILTIN
    if _BUILTIN is None:
        _BUILTIN = _engine.builtin_optable()
    return _BUILTIN
