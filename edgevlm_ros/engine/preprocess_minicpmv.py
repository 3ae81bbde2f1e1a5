"""MiniCPM-V 4.6 image preprocessing and image-prompt expansion.

Reproduces, for one RGB image, what transformers' ``MiniCPMV4_6ImageProcessorPil`` and
``MiniCPMV4_6Processor`` (5.24) produce: the same views (a source view, then a grid of slices),
the same pixel values bit for bit (Pillow's BICUBIC on the uint8 image, then the float arithmetic
of preprocess.normalize_lut) and the same placeholder text. numpy and Pillow only.

The rules (S = ``scale_resolution``, 448; A = ``patch_size`` x merge, where merge is the patch-grid
downsample per side: 4 in ``16x`` mode, 2 in ``4x``: A = 56 or 28)
-----------------------------------------------------------------------------------------------
* fit(h, w, upscale): if ``h * w > S^2`` or ``upscale``, take the size of area about S^2 with the
  aspect ratio kept (``h = int(S / sqrt(w / h))``, ``w = int(h * aspect)``); then round both to a
  multiple of A with Python's ``round`` (half to even), at least A.
* grid (tiled mode): ``m = min(ceil(h * w / S^2), max_slice_nums)``; none when ``m <= 1``. Otherwise
  among slice counts m-1, m, m+1 (not 1, not above ``max_slice_nums``) the ``rows x cols``
  factorisation whose ``log(cols / rows)`` is nearest ``log(w / h)``; on a tie the one with more rows.
* source view: the whole image resized to fit(h, w, upscale = no grid). It is the same in both
  modes: with a grid the image is larger than S^2 and is scaled down anyway.
* slices: the image is resized once to a refine size and cut into ``rows x cols`` equal slices,
  row-major. Refine size: ``w' = round_to(w, cols)``, ``h' = round_to(h, rows)``, one slice is
  fit(h' / rows, w' / cols, upscale = yes) ("per-slice adaptive upsampling": a slice smaller than
  S^2 is enlarged to about S^2), times the grid.
* every view: ``(h / 14) x (w / 14)`` patches (its target size), ``patches / merge^2`` image tokens
  (a 448 x 448 view: 64 in ``16x``, 256 in ``4x``).
* prompt: ``<image_id>0</image_id>`` (when ``use_image_id``), ``<image>`` + the source view's
  tokens + ``</image>``, then per grid row ``(<slice>`` + tokens + ``</slice>)`` x cols, the rows
  joined by ``"\\n"`` (no newline after the last). The token is ``<|image_pad|>`` (Qwen3.5's).

Modes: ``tiled`` is transformers' ``slice_mode=True``; ``single`` its ``slice_mode=False``: the
source view only, one encoder pass of about S^2 pixels whatever the frame (constant latency).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image

from .preprocess import (
    KEY_IMAGE_MEAN,
    KEY_IMAGE_SIZE,
    KEY_IMAGE_STD,
    KEY_PATCH_SIZE,
    KEY_PROJECTOR_TYPE,
    KEY_SCALE_FACTOR,
    MODES,
    ImagePlan,
    ImageRefused,
    _check_rgb,
    _positive_int,
    _three_floats,
    normalize_chw,
    normalize_lut,
)

__all__ = [
    "DOWNSAMPLE_MODES",
    "IMAGE_TOKEN",
    "PROJECTOR",
    "ImageRefused",
    "MiniCPMVConfig",
    "MiniCPMVImages",
    "MiniCPMVImage",
    "SlicePlan",
    "check_budget",
    "expand_image_prompt",
    "plan_slices",
    "preprocess",
]

PROJECTOR = "minicpmv4_6"
# downsample_mode -> patch-grid merge per side (llama.cpp's clip.vision.projector.scale_factor):
# "16x" merges 2x2 in the window merger and 2x2 in the final MLP, "4x" only in the MLP.
DOWNSAMPLE_MODES: Mapping[str, int] = {"16x": 4, "4x": 2}

IMAGE_TOKEN = "<|image_pad|>"  # one per image feature
IMAGE_START, IMAGE_END = "<image>", "</image>"
SLICE_START, SLICE_END = "<slice>", "</slice>"
IMAGE_ID_START, IMAGE_ID_END = "<image_id>", "</image_id>"


@dataclass(frozen=True)
class MiniCPMVConfig:
    """How MiniCPM-V 4.6 turns an RGB image into its vision encoder's input.

    scale_resolution: a slice's nominal edge (448; llama.cpp writes it as clip.vision.image_size).
    patch_size: the encoder's patch (14).
    max_slice_nums: most slices of the grid (9, the processor's default).
    downsample_mode: "16x" (64 tokens per 448 slice) or "4x" (256).
    mode: "tiled" (source view + slices) or "single" (source view only).
    use_image_id: prefix ``<image_id>N</image_id>`` (the processor's default, on).
    """

    scale_resolution: int = 448
    patch_size: int = 14
    max_slice_nums: int = 9
    downsample_mode: str = "16x"
    mode: str = "tiled"
    use_image_id: bool = True
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1.0 / 255.0
    resample: int = Image.Resampling.BICUBIC

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        for name in ("scale_resolution", "patch_size", "max_slice_nums"):
            set_(self, name, _positive_int(name, getattr(self, name)))
        if self.downsample_mode not in DOWNSAMPLE_MODES:
            raise ValueError(f"downsample_mode must be one of {tuple(DOWNSAMPLE_MODES)}, got {self.downsample_mode!r}")
        if not isinstance(self.mode, str) or self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if not isinstance(self.use_image_id, bool):
            raise ValueError(f"use_image_id must be a bool, got {self.use_image_id!r}")
        set_(self, "image_mean", _three_floats("image_mean", self.image_mean, positive=False))
        set_(self, "image_std", _three_floats("image_std", self.image_std, positive=True))
        rf = self.rescale_factor
        if isinstance(rf, bool) or not isinstance(rf, (int, float)) or not math.isfinite(rf) or rf <= 0:
            raise ValueError(f"rescale_factor must be a finite number > 0, got {rf!r}")
        set_(self, "rescale_factor", float(rf))
        set_(self, "resample", Image.Resampling(int(self.resample)))
        if self.scale_resolution < self.align:
            raise ValueError(f"scale_resolution {self.scale_resolution} is below one merged patch ({self.align} px)")

    @property
    def merge(self) -> int:
        """Patch-grid downsample per side between the patches and the image tokens."""
        return DOWNSAMPLE_MODES[self.downsample_mode]

    @property
    def align(self) -> int:
        """Every view's edges are multiples of this many pixels."""
        return self.patch_size * self.merge

    def tokens(self, target_size: tuple[int, int]) -> int:
        """Image tokens of a view of ``target_size`` = (rows, cols) patches."""
        return target_size[0] * target_size[1] // (self.merge * self.merge)

    @classmethod
    def from_mmproj_metadata(cls, meta: Mapping[str, Any], mode: str, max_slice_nums: int | None = None,
                             use_image_id: bool = True) -> MiniCPMVConfig:
        """From a ``minicpmv4_6`` mmproj's metadata as llama.cpp's converter writes it:
        clip.vision.image_size = scale_resolution, projector.scale_factor 4 ("16x") or 2 ("4x").
        The file holds no slice limit: ``max_slice_nums`` defaults to the processor's 9."""
        if not isinstance(meta, Mapping):
            raise ValueError(f"mmproj metadata must be a mapping, got {type(meta).__name__}")
        projector = meta.get(KEY_PROJECTOR_TYPE)
        if projector != PROJECTOR:
            raise ValueError(f"mmproj {KEY_PROJECTOR_TYPE} is {projector!r}; this preprocessing is for {PROJECTOR!r}")
        for key in (KEY_IMAGE_SIZE, KEY_PATCH_SIZE, KEY_IMAGE_MEAN, KEY_IMAGE_STD, KEY_SCALE_FACTOR):
            if key not in meta:
                raise ValueError(f"mmproj metadata lacks {key!r}")
        scale = _positive_int(KEY_SCALE_FACTOR, meta[KEY_SCALE_FACTOR])
        modes = {v: k for k, v in DOWNSAMPLE_MODES.items()}
        if scale not in modes:
            raise ValueError(f"mmproj {KEY_SCALE_FACTOR} is {scale}; MiniCPM-V 4.6 has 4 (16x) or 2 (4x)")
        return cls(
            scale_resolution=_positive_int(KEY_IMAGE_SIZE, meta[KEY_IMAGE_SIZE]),
            patch_size=_positive_int(KEY_PATCH_SIZE, meta[KEY_PATCH_SIZE]),
            max_slice_nums=9 if max_slice_nums is None else max_slice_nums,
            downsample_mode=modes[scale],
            mode=mode,
            use_image_id=use_image_id,
            image_mean=_three_floats(KEY_IMAGE_MEAN, meta[KEY_IMAGE_MEAN], positive=False),
            image_std=_three_floats(KEY_IMAGE_STD, meta[KEY_IMAGE_STD], positive=True),
        )


# --- sizes (the processor's float and integer arithmetic, step for step, so sizes match exactly) ----


def _round_to(length: float, step: int) -> int:
    # Python's round() (half to even), as the processor's ensure_divide: 2.5 steps round to 2.
    return max(round(length / step) * step, step)


def _fit(height: float, width: float, cfg: MiniCPMVConfig, upscale: bool) -> tuple[int, int]:
    """(height, width) of a view: area about scale_resolution^2 when larger (or ``upscale``),
    aspect kept, both edges multiples of cfg.align."""
    s = cfg.scale_resolution
    if height * width > s * s or upscale:
        aspect = width / height
        height = int(s / math.sqrt(aspect))
        width = int(height * aspect)
    return _round_to(height, cfg.align), _round_to(width, cfg.align)


def _grid(height: int, width: int, cfg: MiniCPMVConfig) -> tuple[int, int] | None:
    """(rows, cols) of the slice grid, or None for no slices."""
    s, most = cfg.scale_resolution, cfg.max_slice_nums
    multiple = min(math.ceil(width * height / (s * s)), most)
    if multiple <= 1:
        return None
    target = math.log(width / height)
    best, best_error = (1, 1), float("inf")
    for count in (multiple - 1, multiple, multiple + 1):
        if count == 1 or count > most:
            continue
        for rows in range(1, count + 1):
            if count % rows:
                continue
            error = abs(target - math.log((count // rows) / rows))
            # Exact float ties (2/1 and 4/2 give the same log) go to the grid with more rows.
            if error < best_error or (error == best_error and rows > best[0]):
                best, best_error = (rows, count // rows), error
    return best


@dataclass(frozen=True)
class SlicePlan:
    """The sizes one frame turns into, known from its size alone (nothing resized yet).

    source: (height, width) of the source view. refine: (height, width) of the resize the slices are
    cut from, None without slices. grid: (rows, cols), (0, 0) without slices. target_sizes: per view
    (source first, then slices row-major), (rows, cols) of patches. tokens: image tokens per view.
    """

    image: tuple[int, int]
    source: tuple[int, int]
    refine: tuple[int, int] | None
    grid: tuple[int, int]
    target_sizes: tuple[tuple[int, int], ...]
    tokens: tuple[int, ...]

    @property
    def n_image_tokens(self) -> int:
        return sum(self.tokens)

    @property
    def resized_pixels(self) -> int:
        """Pixels of the resized images (source view + refine image) preprocessing will hold."""
        refine = self.refine[0] * self.refine[1] if self.refine else 0
        return self.source[0] * self.source[1] + refine


def plan_slices(height: int, width: int, cfg: MiniCPMVConfig) -> SlicePlan:
    """The views of a height x width frame under cfg."""
    height, width = _positive_int("height", height), _positive_int("width", width)
    grid = _grid(height, width, cfg) if cfg.mode == "tiled" else None
    source = _fit(height, width, cfg, upscale=grid is None)
    views = [source]
    refine = None
    if grid is not None:
        rows, cols = grid
        # The processor hands the per-slice size on as floats (true division): kept so here.
        one = _fit(_round_to(height, rows) / rows, _round_to(width, cols) / cols, cfg, upscale=True)
        refine = (one[0] * rows, one[1] * cols)
        views += [one] * (rows * cols)
    p = cfg.patch_size
    targets = tuple((h // p, w // p) for h, w in views)
    return SlicePlan(image=(height, width), source=source, refine=refine, grid=grid or (0, 0),
                     target_sizes=targets, tokens=tuple(cfg.tokens(t) for t in targets))


def check_budget(plan: SlicePlan, max_image_tokens: int | None = None, max_image_pixels: int | None = None) -> None:
    """Raise ImageRefused (one line) when the frame, its resized views, or its image tokens exceed
    the limits; None means no limit. Call before any resize or encoding."""
    h, w = plan.image
    views = f"source view {plan.source[1]}x{plan.source[0]}"
    if plan.refine:
        views += f" + {plan.grid[0]}x{plan.grid[1]} slices of {plan.refine[1] // plan.grid[1]}x" \
                 f"{plan.refine[0] // plan.grid[0]}"
    if max_image_pixels is not None:
        if h * w > max_image_pixels:
            raise ImageRefused(f"image {w}x{h} has {h * w} pixels, more than max_image_pixels {max_image_pixels}")
        if plan.resized_pixels > max_image_pixels:
            raise ImageRefused(f"image {w}x{h} resizes to {plan.resized_pixels} pixels ({views}), more than "
                               f"max_image_pixels {max_image_pixels}")
    if max_image_tokens is not None and plan.n_image_tokens > max_image_tokens:
        raise ImageRefused(f"image {w}x{h} needs {plan.n_image_tokens} image tokens ({views}) but the context has "
                           f"room for {max_image_tokens}: use image_mode single, fewer slices or a larger context")


# --- the image and its prompt -------------------------------------------------------------------


@dataclass(frozen=True)
class MiniCPMVImage:
    """The encoder input for one image.

    views: per view (source view first, then the slices row-major) a C-contiguous float32
        (3, height, width) array, normalized: what the vision tower encodes one view at a time.
    target_sizes: int32 (n_views, 2): (rows, cols) of 14-px patches of each view.
    tokens: image tokens (encoder outputs) per view; n_image_tokens their sum.
    rows, cols: the slice grid; 0, 0 without slices.
    image_id: the ``<image_id>`` the prompt carries, None without.
    """

    views: tuple[np.ndarray, ...] = field(repr=False)
    target_sizes: np.ndarray = field(repr=False)
    tokens: tuple[int, ...]
    rows: int
    cols: int
    image_id: int | None

    @property
    def n_tiles(self) -> int:
        return len(self.views)

    @property
    def n_image_tokens(self) -> int:
        return sum(self.tokens)

    @property
    def prompt_text(self) -> str:
        """The text that replaces this image's ``<|image_pad|>`` placeholder in the prompt."""
        return expand_image_prompt(self.tokens, self.rows, self.cols, self.image_id)

    def navit_pixel_values(self, patch_size: int = 14) -> np.ndarray:
        """transformers' packed layout: (1, 3, patch, n_patches * patch), every view's patches in
        row-major order side by side (``pixel_values`` of the processor)."""
        parts = []
        for v in self.views:
            _, h, w = v.shape
            p = patch_size
            parts.append(v.reshape(3, h // p, p, w // p, p).transpose(0, 2, 1, 3, 4).reshape(3, p, -1))
        return np.concatenate(parts, axis=-1)[None]


def expand_image_prompt(tokens: Sequence[int], rows: int, cols: int, image_id: int | None = 0) -> str:
    """The placeholder text of one image whose views have ``tokens`` image tokens (source view first,
    then rows x cols slices row-major), as MiniCPMV4_6Processor writes it."""
    if rows < 0 or cols < 0 or (rows == 0) != (cols == 0):
        raise ValueError(f"rows and cols must both be 0 (no slices) or both positive, got {rows}, {cols}")
    if len(tokens) != 1 + rows * cols or any(t <= 0 for t in tokens):
        raise ValueError(f"need one positive token count per view (1 + {rows}x{cols}), got {list(tokens)}")
    text = f"{IMAGE_ID_START}{image_id}{IMAGE_ID_END}" if image_id is not None else ""
    text += IMAGE_START + IMAGE_TOKEN * tokens[0] + IMAGE_END
    lines = ("".join(SLICE_START + IMAGE_TOKEN * n + SLICE_END for n in tokens[1 + r * cols:1 + (r + 1) * cols])
             for r in range(rows))
    return text + "\n".join(lines)


def _resize(image: Image.Image, size: tuple[int, int], resample: int) -> np.ndarray:
    return np.asarray(image.resize((size[1], size[0]), resample=Image.Resampling(resample)))


def preprocess(rgb: np.ndarray, cfg: MiniCPMVConfig, *, max_image_tokens: int | None = None,
               max_image_pixels: int | None = None, image_id: int = 0) -> MiniCPMVImage:
    """Resize, slice and normalize one RGB (H, W, 3) uint8 image as MiniCPM-V 4.6's processor does.

    The limits are checked (check_budget) before any pixel is touched. ``image_id``: the image's
    index in the prompt (0 for the single image of a frame); unused when cfg.use_image_id is off."""
    if not isinstance(cfg, MiniCPMVConfig):
        raise ValueError(f"cfg must be a MiniCPMVConfig, got {type(cfg).__name__}")
    rgb = _check_rgb(rgb)
    plan = plan_slices(rgb.shape[0], rgb.shape[1], cfg)
    check_budget(plan, max_image_tokens, max_image_pixels)
    image = Image.fromarray(rgb)
    lut = normalize_lut(cfg.rescale_factor, cfg.image_mean, cfg.image_std)
    views = [normalize_chw(_resize(image, plan.source, cfg.resample), lut)]
    if plan.refine is not None:
        refine = _resize(image, plan.refine, cfg.resample)
        rows, cols = plan.grid
        sh, sw = plan.refine[0] // rows, plan.refine[1] // cols
        views += [normalize_chw(refine[r * sh:(r + 1) * sh, c * sw:(c + 1) * sw], lut)
                  for r in range(rows) for c in range(cols)]
    return MiniCPMVImage(views=tuple(views), target_sizes=np.asarray(plan.target_sizes, dtype=np.int32),
                         tokens=plan.tokens, rows=plan.grid[0], cols=plan.grid[1],
                         image_id=image_id if cfg.use_image_id else None)


class MiniCPMVImages:
    """MiniCPM-V 4.6 frames for the VLM (image_input's family for clip.projector_type minicpmv4_6):
    a source view and slices, ``<|image_pad|>`` per image feature, each view encoded at its own
    patch grid (VisionModel.encode_slice)."""

    placeholder = IMAGE_TOKEN

    def __init__(self, meta: Mapping[str, Any], mode: str, tokens_per_tile: int) -> None:
        self.config = MiniCPMVConfig.from_mmproj_metadata(meta, mode)
        side = self.config.scale_resolution // self.config.patch_size
        if self.config.tokens((side, side)) != tokens_per_tile:
            raise ValueError(f"mmproj gives {tokens_per_tile} tokens per {self.config.scale_resolution} px slice, its "
                             f"metadata implies {self.config.tokens((side, side))}")

    def plan(self, height: int, width: int, max_image_pixels: int | None = None) -> ImagePlan:
        p = plan_slices(height, width, self.config)
        check_budget(p, None, max_image_pixels)
        image_id = 0 if self.config.use_image_id else None
        return ImagePlan((p.tokens, p.grid), expand_image_prompt(p.tokens, *p.grid, image_id), p.n_image_tokens,
                         len(p.tokens), p.grid)

    def prepare(self, rgb: np.ndarray, plan: ImagePlan) -> MiniCPMVImage:
        return preprocess(rgb, self.config)

    def encode(self, vision: Any, image: MiniCPMVImage) -> np.ndarray:
        """(n_image_tokens, projection width) features: the source view's, then the slices' row-major."""
        return np.concatenate([vision.encode_slice(v) for v in image.views], axis=0)
