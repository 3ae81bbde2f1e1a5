"""The image side of each VLM family, chosen by the mmproj's ``clip.projector_type``: how a frame
becomes encoder input, image features and the text that replaces the prompt's image placeholder.

A family (one class in its own preprocessing module) has:
    placeholder: the token the chat template marks the image with, and the one token per image
        feature in the expanded prompt;
    plan(height, width, max_image_pixels) -> ImagePlan: the prompt text and costs from the frame's
        size alone (refuses with ImageRefused before any resize);
    prepare(rgb, plan): the encoder input (resize, slice, normalize);
    encode(vision, prepared) -> (n_image_tokens, width) float32 features in prompt order.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from .preprocess import Idefics3Images, ImagePlan
from .preprocess_minicpmv import MiniCPMVImages

__all__ = ["FAMILIES", "ImageFamily", "image_family"]


class ImageFamily(Protocol):
    placeholder: str

    def plan(self, height: int, width: int, max_image_pixels: int | None = None) -> ImagePlan: ...

    def prepare(self, rgb: np.ndarray, plan: ImagePlan) -> Any: ...

    def encode(self, vision: Any, image: Any) -> np.ndarray: ...


FAMILIES = {"idefics3": "SmolVLM / Idefics3", "minicpmv4_6": "MiniCPM-V 4.6"}


def image_family(projector: str, meta: Mapping[str, Any], tokens_per_tile: int, mode: str,
                 longest_edge: int | None = None) -> ImageFamily:
    """The family of an mmproj whose vision model loaded with this projector type and tokens per tile."""
    if projector == "idefics3":
        return Idefics3Images(meta, mode, tokens_per_tile, longest_edge)
    if projector == "minicpmv4_6":
        if longest_edge is not None:
            raise ValueError("longest_edge applies to SmolVLM (idefics3) mmproj files; MiniCPM-V 4.6 slices by "
                             "area (its scale_resolution)")
        return MiniCPMVImages(meta, mode, tokens_per_tile)
    # The native registry loaded it, so only this module lags behind: a valid file we cannot run yet.
    raise ValueError(f"mmproj projector {projector!r} is not supported for describing images (supported: "
                     f"{', '.join(FAMILIES)})")
