"""Where model files live. The setup step fetches the default model into `models/` at the repo
root; an installed package (colcon) looks in $EDGEVLM_MODEL_DIR or ~/.cache/edgevlm_ros/models."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_TEXT_MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"


def model_dirs() -> list[Path]:
    """Directories searched for model files, first match wins."""
    dirs: list[Path] = []
    env = os.environ.get("EDGEVLM_MODEL_DIR")
    if env:
        dirs.append(Path(env))
    dirs.append(Path(__file__).resolve().parents[2] / "models")  # source checkout
    dirs.append(Path.home() / ".cache" / "edgevlm_ros" / "models")
    return dirs


def resolve_model(name_or_path: str | os.PathLike[str] | None, default: str = DEFAULT_TEXT_MODEL) -> Path:
    """A path as given when it exists, else the name looked up in model_dirs().

    Raises FileNotFoundError naming every place that was searched.
    """
    name = Path(name_or_path) if name_or_path else Path(default)
    if name.exists():
        return name
    if not name.is_absolute():
        for d in model_dirs():
            if (d / name).exists():
                return d / name
    searched = ", ".join(str(d) for d in model_dirs())
    raise FileNotFoundError(
        f"model file '{name}' not found (searched: {searched}); run scripts/setup.sh to fetch the default"
    )


def default_threads() -> int:
    """The cores this process may use, capped at 8 (decode stops scaling well before)."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        n = os.cpu_count() or 1
    return max(1, min(8, n))
