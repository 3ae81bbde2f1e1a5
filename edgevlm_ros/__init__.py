"""edgevlm_ros: camera topic in, vision-language description and per-stage latency out.

Public API (no ROS needed)::

    import edgevlm_ros
    model = edgevlm_ros.load()            # default SmolLM2-135M-Instruct
    result = model.generate("What is a robot?", max_new_tokens=48)
    print(result.text, result.timings_ms)

    vlm = edgevlm_ros.load_vlm("model.gguf", "mmproj.gguf")   # SmolVLM or MiniCPM-V 4.6 pair
    result = vlm.describe(rgb, "What is on the table?")       # rgb: (H, W, 3) uint8

The names below are imported on first use, so pure-Python modules (tokenizer, preprocessing)
import without the native extension being built.
"""

from __future__ import annotations

from typing import Any

__all__ = ["GenerationResult", "PrefixState", "TextModel", "VisionLanguageModel", "load", "load_vlm"]
__version__ = "0.1.0"
_FROM_VLM = ("VisionLanguageModel", "load_vlm")


def __getattr__(name: str) -> Any:
    if name in _FROM_VLM:
        from .engine import vlm

        return getattr(vlm, name)
    if name in __all__:
        from .engine import text_model

        return getattr(text_model, name)
    raise AttributeError(f"module 'edgevlm_ros' has no attribute '{name}'")
