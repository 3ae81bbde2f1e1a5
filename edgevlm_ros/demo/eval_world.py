"""An evaluation world for the demo model, drawn independently of the one it was trained on.

`edgevlm_ros.demo.scenes` draws the training world with OpenCV; a model can learn the way one
library draws (its anti-aliasing, its polygon rasteriser, its colour values) instead of the world
of coloured shapes. This module draws the same vocabulary another way, for evaluation only:

- Pillow's ImageDraw (``ellipse``, ``regular_polygon``, ``polygon``), supersampled 3x and reduced
  with a box filter for smooth edges or drawn at 1x for hard ones, outlines by ImageDraw's own
  ``outline``/``width``; its own star (five points, inner radius 0.38-0.5);
- colour values of its own (``EVAL_COLOURS``: fixed web-style values, each inside its name's
  range of ``scenes.COLOUR_RANGES``, none drawn from the training generator's sampler);
- backgrounds of its own: plain colours from black to white, linear and radial gradients, Gaussian
  noise, blurred-noise "natural" frames (Pillow's GaussianBlur of random pixels, not the training
  world's 1/f spectrum), tiles and dots;
- the camera's faults through Pillow (GaussianBlur, JPEG at a random quality) and NumPy noise;
- frame sizes a newcomer uses: 640x480 (OpenCV's default capture), 320x240, 800x600, 1280x720,
  480x480.

Three sets, each from its own held-out seed stream (``EVAL_SEED``): ``single`` (one object on a
background), ``multi`` (two or three objects: two or three thirds occupied, or two alike in one
third) and ``empty`` (no known object: plain, textured, noise, natural statistics). The captions
are the training world's sentences for the same objects (``scenes.caption_for``), so
``scenes.score`` scores both worlds alike.
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

from .scenes import COLOUR_RANGES, POSITIONS, SHAPES, SceneObject, caption_for

__all__ = ["EVAL_COLOURS", "EVAL_SEED", "EVAL_SETS", "EvalScene", "eval_scene", "eval_scenes"]

EVAL_SEED = 20261202  # never used by training (tools/train_demo_vlm.py draws streams 1-3)
EVAL_SETS = ("single", "multi", "empty")
EVAL_SIZES = ((640, 480), (320, 240), (800, 600), (1280, 720), (480, 480))

# Fixed colour values per name, inside each name's range (test_demo_model checks that they are).
EVAL_COLOURS: dict[str, tuple[tuple[int, int, int], ...]] = {
    "red": ((255, 0, 0), (204, 20, 20), (230, 40, 25), (178, 20, 34)),
    "orange": ((255, 140, 0), (255, 117, 24), (237, 145, 33), (250, 125, 10)),
    "yellow": ((255, 215, 0), (250, 230, 20), (240, 220, 60), (255, 240, 30)),
    "green": ((0, 128, 0), (34, 139, 34), (50, 205, 50), (20, 170, 80)),
    "blue": ((65, 105, 225), (0, 80, 200), (30, 60, 230), (20, 110, 210)),
    "purple": ((128, 40, 170), (110, 40, 150), (150, 60, 190), (120, 30, 160)),
    "pink": ((255, 105, 180), (250, 140, 200), (240, 120, 190), (255, 150, 210)),
    "white": ((255, 255, 255), (245, 245, 245), (250, 248, 240), (238, 240, 242)),
}

_SMALL = (0.07, 0.10)  # circumradius / frame scale (inside the training world's size ranges)
_LARGE = (0.17, 0.33)
_LARGE_WITH_OTHERS = 0.22
_MIN_CONTRAST = 100.0  # RGB distance between an object and the background around it


@dataclass(frozen=True)
class EvalScene:
    """One evaluation frame: its set, description and pixels (RGB uint8)."""

    set_name: str
    index: int
    width: int
    height: int
    objects: tuple[SceneObject, ...]
    caption: str
    pixels: np.ndarray

    @property
    def n_objects(self) -> int:
        return len(self.objects)

    def image(self) -> np.ndarray:
        return self.pixels


def _scale(width: int, height: int) -> float:
    return float(min(height, 0.75 * width))


def _grey(rng: np.random.Generator) -> tuple[int, int, int]:
    g = int(rng.integers(0, 256))
    tint = rng.integers(-12, 13, 3)
    return tuple(int(np.clip(g + t, 0, 255)) for t in tint)  # type: ignore[return-value]


def _background(rng: np.random.Generator, width: int, height: int, empty: bool) -> Image.Image:
    kinds = ("plain", "linear", "radial", "noise", "natural", "tiles", "dots")
    p = (0.15, 0.1, 0.1, 0.2, 0.25, 0.1, 0.1) if empty else (0.4, 0.2, 0.15, 0.1, 0.05, 0.05, 0.05)
    kind = kinds[int(rng.choice(len(kinds), p=p))]
    a = np.asarray(_grey(rng), np.float32)
    b = np.asarray(_grey(rng), np.float32)
    if kind == "plain":
        return Image.new("RGB", (width, height), tuple(int(c) for c in a))
    if kind in ("linear", "radial"):
        y, x = np.mgrid[0:height, 0:width].astype(np.float32)
        if kind == "linear":
            t = x / (width - 1) if rng.random() < 0.5 else y / (height - 1)
        else:
            cx, cy = rng.uniform(0.2, 0.8) * width, rng.uniform(0.2, 0.8) * height
            t = np.hypot(x - cx, y - cy) / math.hypot(width, height)
            t = np.clip(t / max(float(t.max()), 1e-6), 0, 1)
        img = a * (1 - t[..., None]) + b * t[..., None]
        return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))
    if kind == "noise":
        img = a + rng.normal(0, rng.uniform(5, 30), (height, width, 3))
        return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))
    if kind == "natural":
        small = rng.integers(0, 256, (max(4, height // 8), max(4, width // 8), 3), dtype=np.uint8)
        img = Image.fromarray(small).resize((width, height), Image.Resampling.BICUBIC)
        img = img.filter(ImageFilter.GaussianBlur(rng.uniform(2, 8)))
        arr = np.asarray(img, np.float32)
        arr = (arr - arr.mean()) * rng.uniform(0.3, 0.9) + a.mean()
        return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))
    img = Image.new("RGB", (width, height), tuple(int(c) for c in a))
    draw = ImageDraw.Draw(img)
    if kind == "tiles":
        step = int(rng.integers(12, 60))
        for yy in range(0, height, step):
            for xx in range(0, width, step):
                if (xx // step + yy // step) % 2:
                    draw.rectangle((xx, yy, xx + step - 1, yy + step - 1), fill=tuple(int(c) for c in b))
    else:  # dots: much smaller than a small object
        r = max(1, int(0.01 * _scale(width, height)))
        for _ in range(int(rng.integers(20, 120))):
            x, y = rng.uniform(0, width), rng.uniform(0, height)
            draw.ellipse((x - r, y - r, x + r, y + r), fill=tuple(int(c) for c in b))
    return img


def _star(cx: float, cy: float, r: float, rotation: float, inner: float) -> list[tuple[float, float]]:
    pts = []
    for k in range(10):
        rr = r if k % 2 == 0 else inner * r
        a = math.radians(rotation) + k * math.pi / 5 - math.pi / 2
        pts.append((cx + rr * math.cos(a), cy + rr * math.sin(a)))
    return pts


def _draw(img: Image.Image, o: SceneObject, rgb: tuple[int, int, int], rng: np.random.Generator) -> None:
    """Draws one object onto img, supersampled (smooth edges) or not (hard edges)."""
    ss = 3 if rng.random() < 0.7 else 1
    outline = None
    width = 0
    if rng.random() < 0.5:
        outline = (0, 0, 0) if rng.random() < 0.6 else tuple(int(c * 0.5) for c in rgb)
        width = max(1, int(o.radius * ss * rng.uniform(0.04, 0.12)))
    pad = int(o.radius) + 4
    x0, y0 = int(o.cx) - pad, int(o.cy) - pad
    size = 2 * pad
    layer = Image.new("RGBA", (size * ss, size * ss), (0, 0, 0, 0))
    draw = ImageDraw.Draw(layer)
    cx, cy, r = (o.cx - x0) * ss, (o.cy - y0) * ss, o.radius * ss
    if o.shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=rgb, outline=outline, width=width)
    elif o.shape in ("square", "triangle"):
        # Pillow's rotation turns counter-clockwise; any angle is fine for the vocabulary.
        draw.regular_polygon((cx, cy, r), 4 if o.shape == "square" else 3, rotation=o.angle, fill=rgb,
                             outline=outline, width=width)
    else:
        draw.polygon(_star(cx, cy, r, o.angle, float(rng.uniform(0.38, 0.5))), fill=rgb, outline=outline,
                     width=width)
    if ss > 1:
        layer = layer.resize((size, size), Image.Resampling.BOX)
    img.paste(layer, (x0, y0), layer)


def _contrast_ok(img: Image.Image, o: SceneObject, rgb: tuple[int, int, int]) -> bool:
    arr = np.asarray(img, np.float32)
    h, w = arr.shape[:2]
    r = o.radius
    ring = arr[max(int(o.cy - r), 0):min(int(o.cy + r) + 1, h), max(int(o.cx - r), 0):min(int(o.cx + r) + 1, w)]
    return float(np.linalg.norm(ring.reshape(-1, 3).mean(0) - np.asarray(rgb, np.float32))) >= _MIN_CONTRAST


def _camera(img: Image.Image, rng: np.random.Generator) -> np.ndarray:
    if rng.random() < 0.3:
        img = img.filter(ImageFilter.GaussianBlur(rng.uniform(0.5, 1.5) * _scale(*img.size) / 480))
    arr = np.asarray(img, np.float32)
    if rng.random() < 0.4:
        arr = arr + rng.normal(0, rng.uniform(2, 8), arr.shape)
    out = Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))
    if rng.random() < 0.4:
        buf = io.BytesIO()
        out.save(buf, format="JPEG", quality=int(rng.integers(30, 95)))
        out = Image.open(io.BytesIO(buf.getvalue())).convert("RGB")
    return np.ascontiguousarray(np.asarray(out, np.uint8))


def _specs(rng: np.random.Generator, set_name: str) -> list[tuple[str, str, str, str]]:
    """(shape, colour, size, position) per object."""
    colours = list(EVAL_COLOURS)

    def kind() -> tuple[str, str]:
        return SHAPES[int(rng.integers(len(SHAPES)))], colours[int(rng.integers(len(colours)))]

    if set_name == "empty":
        return []
    if set_name == "single":
        return [(*kind(), "large" if rng.random() < 0.6 else "small", POSITIONS[int(rng.integers(3))])]
    if rng.random() < 0.25:  # two alike in one third
        shape, colour = kind()
        return [(shape, colour, "small", POSITIONS[int(rng.integers(3))])] * 2
    places = rng.permutation(3)[: int(rng.integers(2, 4))]
    return [(*kind(), "large" if rng.random() < 0.4 else "small", POSITIONS[int(p)]) for p in places]


def _place(rng: np.random.Generator, specs: list[tuple[str, str, str, str]], width: int, height: int
           ) -> list[SceneObject] | None:
    scale = _scale(width, height)
    out: list[SceneObject] = []
    for shape, colour, size, position in specs:
        lo, hi = _SMALL if size == "small" else _LARGE
        if size == "large" and len(specs) > 1:
            hi = _LARGE_WITH_OTHERS
        r = float(rng.uniform(lo, hi)) * scale
        k = POSITIONS.index(position)
        left, right = (k / 3 + 0.05) * width, ((k + 1) / 3 - 0.05) * width
        cx = float(rng.uniform(left, right))
        cy = float(rng.uniform(min(r, height / 2), max(height - r, height / 2)))
        o = SceneObject(shape, colour, size, position, cx, cy, r, float(rng.uniform(0, 360)), (0, 0, 0))
        if any(math.hypot(o.cx - p.cx, o.cy - p.cy) < 1.05 * (o.radius + p.radius) for p in out):
            return None  # no overlap in this world: every object whole
        out.append(o)
    return out


def eval_scene(set_name: str, index: int, seed: int = EVAL_SEED) -> EvalScene:
    """Frame `index` of one evaluation set. Deterministic in (set, index, seed)."""
    if set_name not in EVAL_SETS:
        raise ValueError(f"unknown evaluation set {set_name!r} (one of {', '.join(EVAL_SETS)})")
    rng = np.random.default_rng([seed, EVAL_SETS.index(set_name), index])
    width, height = EVAL_SIZES[int(rng.integers(len(EVAL_SIZES)))]
    for _ in range(200):
        specs = _specs(rng, set_name)
        img = _background(rng, width, height, empty=not specs)
        placed = _place(rng, specs, width, height)
        if placed is None:
            continue
        objects = []
        ok = True
        for o in placed:
            choices = EVAL_COLOURS[o.colour]
            rgb = choices[int(rng.integers(len(choices)))]
            if not _contrast_ok(img, o, rgb):
                ok = False
                break
            objects.append(SceneObject(**{**o.__dict__, "rgb": rgb}))
        if not ok:
            continue
        for o in objects:
            _draw(img, o, o.rgb, rng)
        return EvalScene(set_name, index, width, height, tuple(objects), caption_for(objects), _camera(img, rng))
    raise RuntimeError(f"could not draw evaluation frame {set_name} {index}")


def eval_scenes(set_name: str, count: int, start: int = 0, seed: int = EVAL_SEED) -> Iterator[EvalScene]:
    for i in range(start, start + count):
        yield eval_scene(set_name, i, seed)


def in_range(colour: str, rgb: tuple[int, int, int]) -> bool:
    """Whether an RGB value lies inside a colour name's (hue, saturation, value) range."""
    import colorsys

    (h0, h1), (s0, s1), (v0, v1) = COLOUR_RANGES[colour]
    h, s, v = colorsys.rgb_to_hsv(*(c / 255.0 for c in rgb))
    hd = h * 360.0
    if h0 < 0 and hd > 180:
        hd -= 360.0
    return h0 <= hd <= h1 and s0 <= s <= s1 and v0 <= v <= v1
