"""SmolVLM / Idefics3 image preprocessing and image-prompt expansion.

This module reproduces, for one RGB image, what Hugging Face ``transformers``'
``Idefics3Processor`` with its PIL-backed image processor (``Idefics3ImageProcessorPil``)
produces: the same tile grid, the same tile order, the same pixel values (bit for bit: the
same Pillow resample filter on the same uint8 images, then the same float arithmetic) and the
same prompt text. Runtime dependencies are numpy and Pillow only; tests check parity against
transformers.

How transformers processes one image (``do_resize=True``, ``do_rescale``, ``do_normalize``)
---------------------------------------------------------------------------------------------
Every resize is Pillow's ``Image.resize`` on the uint8 RGB image (``resample`` is LANCZOS in
SmolVLM's ``preprocessor_config.json``), so intermediate images stay uint8.

1. Resize so the longest edge equals ``size["longest_edge"]`` keeping the aspect ratio (this
   also *upscales* small images); the other edge is ``int(long / aspect)`` rounded up to an
   even number, at least 1; then both are scaled down so neither exceeds 4096.
2. ``do_image_splitting=True`` ("tiled" here): resize again so both edges are multiples of the
   tile size (``max_image_size["longest_edge"]``): the longest edge is rounded up to a multiple
   of the tile, the other is derived from the aspect ratio and rounded up too. If the result is
   larger than one tile it is cut into ``rows x cols`` tiles (row-major) and a global view (the
   whole step-2 image resized to tile x tile) is appended LAST. If it is exactly one tile
   (only possible when ``size["longest_edge"] <= tile``) there is no split and no global view:
   one tile, ``rows = cols = 0``.
3. ``do_image_splitting=False`` ("single" here): the step-1 image is resized to tile x tile
   (stretched, not padded): one tile, ``rows = cols = 0``.
4. ``(uint8 as float64 * rescale_factor) -> float32``, then ``(x - mean) / std`` in float32.

Single mode is meant for robots: one encoder pass per frame whatever the camera's aspect ratio,
so latency is constant. It equals transformers with ``do_image_splitting=False`` and
``size={"longest_edge": tile}``: *two* resizes (longest edge to the tile, keeping the aspect
ratio, then a stretch to a square), not one direct resize, because that is what transformers
does and parity matters more than saving one resize. (transformers with SmolVLM's own
``size={"longest_edge": 2048}`` and ``do_image_splitting=False`` would instead first resize to a
2048 longest edge, which only changes pixel values slightly and costs a big resize per frame.)

llama.cpp differs: it always appends a global view, even to a 1 x 1 grid. We follow
transformers.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image

__all__ = [
    "MAX_GRID",
    "MAX_IMAGE_SIZE",
    "MODES",
    "Idefics3Images",
    "ImagePlan",
    "ImageRefused",
    "PreprocessConfig",
    "PreprocessedImage",
    "expand_image_prompt",
    "preprocess",
    "tile_grid",
]

# transformers' Idefics3 processors never let a resized image edge exceed this (4k).
MAX_IMAGE_SIZE = 4096
# Idefics3 / SmolVLM tokenizers have <row_R_col_C> tokens for R, C in 1..6 only.
MAX_GRID = 6
MODES = ("tiled", "single")

FAKE_IMAGE_TOKEN = "<fake_token_around_image>"
IMAGE_TOKEN = "<image>"
GLOBAL_IMAGE_TOKEN = "<global-img>"

# GGUF keys (llama.cpp's mmproj layout) read by PreprocessConfig.from_mmproj_metadata.
KEY_IMAGE_SIZE = "clip.vision.image_size"
KEY_PATCH_SIZE = "clip.vision.patch_size"
KEY_IMAGE_MEAN = "clip.vision.image_mean"
KEY_IMAGE_STD = "clip.vision.image_std"
KEY_SCALE_FACTOR = "clip.vision.projector.scale_factor"
KEY_PREPROC_SIZE = "clip.vision.preproc_image_size"
KEY_PROJECTOR_TYPE = "clip.projector_type"

_RESAMPLE_FILTERS = frozenset(int(f) for f in Image.Resampling)


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _positive_int(name: str, value: object) -> int:
    if not _is_int(value) or int(value) <= 0:  # type: ignore[arg-type]
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)  # type: ignore[arg-type]


def _three_floats(name: str, value: object, *, positive: bool) -> tuple[float, float, float]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray)):
        raise ValueError(f"{name} must be 3 numbers (one per RGB channel), got {value!r}")
    items = list(np.asarray(value).reshape(-1)) if isinstance(value, np.ndarray) else list(value)
    if len(items) != 3:
        raise ValueError(f"{name} must have 3 values (one per RGB channel), got {len(items)}: {value!r}")
    out: list[float] = []
    for item in items:
        if isinstance(item, (bool, np.bool_)) or not isinstance(item, (int, float, np.integer, np.floating)):
            raise ValueError(f"{name} must be 3 numbers, got {value!r}")
        f = float(item)
        if not math.isfinite(f) or (positive and f <= 0.0):
            raise ValueError(f"{name} values must be finite{' and > 0' if positive else ''}, got {value!r}")
        out.append(f)
    return out[0], out[1], out[2]


@dataclass(frozen=True)
class PreprocessConfig:
    """How to turn an RGB image into the vision encoder's input.

    tile_size: the encoder's square input size (mmproj ``clip.vision.image_size``, e.g. 512).
    longest_edge: tiled mode's first resize target for the image's longest edge (the HF
        processor's ``size["longest_edge"]``; 2048 for SmolVLM-256M). Unused in single mode.
    image_mean, image_std: per-channel normalization, applied after ``rescale_factor``.
    image_seq_len: image tokens per tile, ``(tile // patch)^2 / scale_factor^2`` (64 for SmolVLM-256M).
    mode: "tiled" (HF ``do_image_splitting=True``) or "single" (one tile, constant latency).
    rescale_factor: uint8 -> [0, 1] factor, 1/255.
    resample: the Pillow filter (an ``Image.Resampling`` value); LANCZOS like SmolVLM's processor.
    """

    tile_size: int
    longest_edge: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    image_seq_len: int
    mode: str = "tiled"
    rescale_factor: float = 1.0 / 255.0
    resample: int = Image.Resampling.LANCZOS

    def __post_init__(self) -> None:
        # Normalise types (frozen dataclass: assign through object.__setattr__).
        set_ = object.__setattr__
        set_(self, "tile_size", _positive_int("tile_size", self.tile_size))
        set_(self, "longest_edge", _positive_int("longest_edge", self.longest_edge))
        set_(self, "image_seq_len", _positive_int("image_seq_len", self.image_seq_len))
        set_(self, "image_mean", _three_floats("image_mean", self.image_mean, positive=False))
        set_(self, "image_std", _three_floats("image_std", self.image_std, positive=True))
        if not isinstance(self.mode, str) or self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        rf = self.rescale_factor
        if isinstance(rf, bool) or not isinstance(rf, (int, float, np.integer, np.floating)):
            raise ValueError(f"rescale_factor must be a number, got {rf!r}")
        if not math.isfinite(float(rf)) or float(rf) <= 0.0:
            raise ValueError(f"rescale_factor must be finite and > 0, got {rf!r}")
        set_(self, "rescale_factor", float(rf))
        if not _is_int(self.resample) or int(self.resample) not in _RESAMPLE_FILTERS:
            raise ValueError(f"resample must be a PIL Image.Resampling filter, got {self.resample!r}")
        set_(self, "resample", Image.Resampling(int(self.resample)))
        if self.tile_size > MAX_IMAGE_SIZE:
            raise ValueError(f"tile_size {self.tile_size} exceeds the processor's maximum image size {MAX_IMAGE_SIZE}")
        if self.mode == "tiled":
            grid = self.max_grid
            if grid > MAX_GRID:
                raise ValueError(
                    f"longest_edge {self.longest_edge} with tile_size {self.tile_size} gives up to {grid} tiles "
                    f"per side, but the tokenizer only has <row_R_col_C> tokens up to {MAX_GRID}: "
                    f"use longest_edge <= {MAX_GRID * self.tile_size}"
                )

    @property
    def max_grid(self) -> int:
        """Most tiles along one side that tiled mode can produce (1 = never split)."""
        return math.ceil(min(self.longest_edge, MAX_IMAGE_SIZE) / self.tile_size)

    @classmethod
    def from_mmproj_metadata(
        cls, meta: Mapping[str, Any], mode: str, longest_edge: int | None = None
    ) -> PreprocessConfig:
        """Build from an Idefics3 mmproj GGUF's metadata (keys as llama.cpp writes them).

        ``longest_edge`` overrides the file's ``clip.vision.preproc_image_size`` (llama.cpp
        stores the processor's ``size["longest_edge"]`` there); with neither, 4 * tile_size.
        """
        if not isinstance(meta, Mapping):
            raise ValueError(f"mmproj metadata must be a mapping, got {type(meta).__name__}")
        projector = meta.get(KEY_PROJECTOR_TYPE)
        if projector is not None and projector != "idefics3":
            raise ValueError(f"mmproj {KEY_PROJECTOR_TYPE} is {projector!r}; this preprocessing is for 'idefics3'")
        for key in (KEY_IMAGE_SIZE, KEY_PATCH_SIZE, KEY_IMAGE_MEAN, KEY_IMAGE_STD, KEY_SCALE_FACTOR):
            if key not in meta:
                raise ValueError(f"mmproj metadata lacks {key!r}")
        tile = _positive_int(KEY_IMAGE_SIZE, meta[KEY_IMAGE_SIZE])
        patch = _positive_int(KEY_PATCH_SIZE, meta[KEY_PATCH_SIZE])
        scale = _positive_int(KEY_SCALE_FACTOR, meta[KEY_SCALE_FACTOR])
        if patch > tile:
            raise ValueError(f"{KEY_PATCH_SIZE} {patch} is larger than {KEY_IMAGE_SIZE} {tile}")
        side = tile // patch  # a strided conv: 384 / 14 gives 27 patches per side (SmolVLM-2.2B)
        if side % scale:
            raise ValueError(
                f"patches per side {side} ({tile}/{patch}) is not a multiple of {KEY_SCALE_FACTOR} {scale}"
            )
        if longest_edge is None:
            longest_edge = meta[KEY_PREPROC_SIZE] if KEY_PREPROC_SIZE in meta else 4 * tile
            longest_edge = _positive_int(KEY_PREPROC_SIZE, longest_edge)
        return cls(
            tile_size=tile,
            longest_edge=longest_edge,
            image_mean=_three_floats(KEY_IMAGE_MEAN, meta[KEY_IMAGE_MEAN], positive=False),
            image_std=_three_floats(KEY_IMAGE_STD, meta[KEY_IMAGE_STD], positive=True),
            image_seq_len=(side // scale) ** 2,
            mode=mode,
        )


class ImageRefused(ValueError):
    """A frame refused before any resize or encoding (too many pixels, or image tokens the context
    has no room for); the message is one line."""


@dataclass(frozen=True)
class ImagePlan:
    """What a frame of a given size turns into, known before any pixel is resized (a VLM family's
    `plan`): the text that replaces the prompt's image placeholder and what it costs.

    key: with the prompt, decides the prompt's tokens (the prompt-token cache's key).
    text: the placeholder's expansion (every image feature is one placeholder token in it).
    n_views: encoder passes (tiles, or the source view and slices); grid: (rows, cols), (0, 0) unsplit.
    """

    key: Hashable
    text: str
    n_image_tokens: int
    n_views: int
    grid: tuple[int, int]


@dataclass(frozen=True)
class PreprocessedImage:
    """The encoder input for one image.

    pixel_values: float32 (n_tiles, 3, tile, tile): the tiles row-major, then the global view
        last (as transformers orders them); a single tile when not split.
    rows, cols: the tile grid; 0, 0 when the image was not split.
    n_image_tokens: ``<image>`` tokens (= image embeddings) the prompt needs: n_tiles * image_seq_len.
    image_seq_len: image tokens per tile.
    """

    pixel_values: np.ndarray = field(repr=False)
    rows: int
    cols: int
    n_image_tokens: int
    image_seq_len: int

    @property
    def n_tiles(self) -> int:
        return int(self.pixel_values.shape[0])

    @property
    def prompt_text(self) -> str:
        """The text that replaces this image's ``<image>`` placeholder in the prompt."""
        return expand_image_prompt(self.rows, self.cols, self.image_seq_len)


# --- sizes (same integer arithmetic as transformers, so the sizes match exactly) ----------------


def _longest_edge_size(height: int, width: int, longest: int) -> tuple[int, int]:
    """(height, width) after resizing the longest edge to ``longest`` (aspect kept, even short edge)."""
    aspect = width / height
    if width >= height:
        width = longest
        height = int(width / aspect)
        height += height % 2
    else:
        height = longest
        width = int(height * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    # Then keep both edges within MAX_IMAGE_SIZE (aspect recomputed from the size just found).
    aspect = width / height
    if width >= height and width > MAX_IMAGE_SIZE:
        width = MAX_IMAGE_SIZE
        height = int(width / aspect)
    elif height > width and height > MAX_IMAGE_SIZE:
        height = MAX_IMAGE_SIZE
        width = int(height * aspect)
    return max(height, 1), max(width, 1)


def _tile_multiple_size(height: int, width: int, tile: int) -> tuple[int, int]:
    """(height, width) rounded up to multiples of ``tile``, the short edge derived from the aspect."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


def _tiled_sizes(height: int, width: int, cfg: PreprocessConfig) -> tuple[tuple[int, int], tuple[int, int]]:
    """Tiled mode's two resizes: (longest edge to cfg.longest_edge), then (multiples of the tile)."""
    first = _longest_edge_size(height, width, cfg.longest_edge)
    return first, _tile_multiple_size(*first, cfg.tile_size)


def tile_grid(height: int, width: int, cfg: PreprocessConfig) -> tuple[int, int]:
    """(rows, cols) of the tile grid a height x width image gets under cfg; (0, 0) when it is not
    split (single mode, or one tile). Known from the size alone: nothing is resized."""
    if cfg.mode == "single":
        return 0, 0
    _, (h, w) = _tiled_sizes(_positive_int("height", height), _positive_int("width", width), cfg)
    tile = cfg.tile_size
    return (h // tile, w // tile) if h > tile or w > tile else (0, 0)


def _resize(image: Image.Image, height: int, width: int, resample: int) -> Image.Image:
    # Pillow returns a copy when the size is unchanged, exactly as transformers' call would.
    return image.resize((width, height), resample=Image.Resampling(resample))


# --- the public functions ---------------------------------------------------------------------


def _check_rgb(rgb: object) -> np.ndarray:
    if not isinstance(rgb, np.ndarray):
        raise ValueError(f"image must be a numpy array (H, W, 3) uint8, got {type(rgb).__name__}")
    if rgb.ndim != 3 or rgb.shape[2] != 3:
        raise ValueError(f"image must have shape (H, W, 3) (RGB), got {rgb.shape}")
    if rgb.dtype != np.uint8:
        raise ValueError(f"image must be uint8, got {rgb.dtype}")
    if rgb.shape[0] == 0 or rgb.shape[1] == 0:
        raise ValueError(f"image is empty: shape {rgb.shape}")
    return np.ascontiguousarray(rgb)


def normalize_lut(rescale_factor: float, image_mean: Sequence[float], image_std: Sequence[float]) -> np.ndarray:
    """(3, 256) float32: every uint8 value through transformers' rescale + normalize arithmetic.

    transformers computes ``float32(float64(u8) * rescale_factor)`` then ``(x - mean) / std`` in
    float32; doing the same on the 256 possible values and indexing gives identical floats.
    """
    levels = (np.arange(256, dtype=np.float64) * rescale_factor).astype(np.float32)
    mean = np.asarray(image_mean, dtype=np.float32)[:, None]
    std = np.asarray(image_std, dtype=np.float32)[:, None]
    return (levels[None, :] - mean) / std


def normalize_chw(rgb: np.ndarray, lut: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """(3, H, W) float32 (written into ``out`` when given) from an (H, W, 3) uint8 image through
    ``normalize_lut``'s table: channel-major, the layout the vision encoders take."""
    if out is None:
        out = np.empty((3, rgb.shape[0], rgb.shape[1]), dtype=np.float32)
    for c in range(3):
        out[c] = lut[c][rgb[..., c]]
    return out


def preprocess(rgb: np.ndarray, cfg: PreprocessConfig) -> PreprocessedImage:
    """Resize, tile, rescale and normalize one RGB image as transformers' Idefics3 processor does.

    ``rgb``: (H, W, 3) uint8, RGB order. Raises ValueError for anything else or an empty image.
    """
    if not isinstance(cfg, PreprocessConfig):
        raise ValueError(f"cfg must be a PreprocessConfig, got {type(cfg).__name__}")
    image = Image.fromarray(_check_rgb(rgb))
    tile = cfg.tile_size
    rows = cols = 0
    if cfg.mode == "single":
        h, w = _longest_edge_size(image.height, image.width, tile)
        image = _resize(_resize(image, h, w, cfg.resample), tile, tile, cfg.resample)
        tiles = np.asarray(image)[None]
    else:
        (h, w), (h2, w2) = _tiled_sizes(image.height, image.width, cfg)
        image = _resize(image, h, w, cfg.resample)
        h, w = h2, w2
        image = _resize(image, h, w, cfg.resample)
        if h > tile or w > tile:
            rows, cols = h // tile, w // tile
            full = np.asarray(image)
            tiles = np.empty((rows * cols + 1, tile, tile, 3), dtype=np.uint8)
            # (rows, tile, cols, tile, 3) -> (rows, cols, tile, tile, 3): row-major tiles.
            tiles[:-1] = full.reshape(rows, tile, cols, tile, 3).swapaxes(1, 2).reshape(-1, tile, tile, 3)
            tiles[-1] = np.asarray(_resize(image, tile, tile, cfg.resample))
        else:
            tiles = np.asarray(image)[None]

    lut = normalize_lut(cfg.rescale_factor, cfg.image_mean, cfg.image_std)
    n = tiles.shape[0]
    pixel_values = np.empty((n, 3, tile, tile), dtype=np.float32)
    for i in range(n):
        normalize_chw(tiles[i], lut, out=pixel_values[i])
    return PreprocessedImage(
        pixel_values=pixel_values,
        rows=rows,
        cols=cols,
        n_image_tokens=n * cfg.image_seq_len,
        image_seq_len=cfg.image_seq_len,
    )


def expand_image_prompt(rows: int, cols: int, image_seq_len: int) -> str:
    """The text that replaces one ``<image>`` in the prompt, exactly as Idefics3Processor writes it.

    Not split (rows = cols = 0)::

        <fake_token_around_image><global-img><image>*N<fake_token_around_image>

    Split: for each row, for each column ``<fake_token_around_image><row_R_col_C><image>*N``,
    each row followed by ``"\\n"``; then ``"\\n<fake_token_around_image><global-img><image>*N
    <fake_token_around_image>"`` for the global view (so the last row ends in a blank line).
    """
    for name, value in (("rows", rows), ("cols", cols)):
        if not _is_int(value) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    image_seq_len = _positive_int("image_seq_len", image_seq_len)
    if (rows == 0) != (cols == 0):
        raise ValueError(f"rows and cols must both be 0 (no split) or both positive, got {rows}, {cols}")
    image_run = IMAGE_TOKEN * image_seq_len
    global_view = f"{FAKE_IMAGE_TOKEN}{GLOBAL_IMAGE_TOKEN}{image_run}{FAKE_IMAGE_TOKEN}"
    if rows == 0:
        return global_view
    lines = [
        "".join(f"{FAKE_IMAGE_TOKEN}<row_{r + 1}_col_{c + 1}>{image_run}" for c in range(int(cols)))
        for r in range(int(rows))
    ]
    return "".join(line + "\n" for line in lines) + "\n" + global_view


class Idefics3Images:
    """SmolVLM / Idefics3 frames for the VLM (image_input's family for clip.projector_type idefics3):
    tiles of clip.vision.image_size, ``<image>`` per image feature, encoded in one batch."""

    placeholder = IMAGE_TOKEN

    def __init__(self, meta: Mapping[str, Any], mode: str, tokens_per_tile: int,
                 longest_edge: int | None = None) -> None:
        self.config = PreprocessConfig.from_mmproj_metadata(meta, mode, longest_edge)
        if self.config.image_seq_len != tokens_per_tile:
            raise ValueError(f"mmproj gives {tokens_per_tile} tokens per tile, its metadata implies "
                             f"{self.config.image_seq_len}")

    def plan(self, height: int, width: int, max_image_pixels: int | None = None) -> ImagePlan:
        if max_image_pixels is not None and height * width > max_image_pixels:
            raise ImageRefused(f"image {width}x{height} has {height * width} pixels, more than max_image_pixels "
                               f"{max_image_pixels}")
        rows, cols = tile_grid(height, width, self.config)
        n = rows * cols + 1 if rows else 1
        per = self.config.image_seq_len
        return ImagePlan((rows, cols), expand_image_prompt(rows, cols, per), n * per, n, (rows, cols))

    def prepare(self, rgb: np.ndarray, plan: ImagePlan) -> PreprocessedImage:
        return preprocess(rgb, self.config)

    def encode(self, vision: Any, image: PreprocessedImage) -> np.ndarray:
        """(n_image_tokens, projection width) features, tiles in prompt order."""
        return vision.encode(image.pixel_values)
