"""A synthetic world of shapes for the demo model: seeded scenes, their captions, and a scorer.

A scene is a background with zero to three objects; an object is a shape (circle, square,
triangle, star), a colour (eight names), a size (small, large) and a position (left, centre,
right: the third of the frame its centre lies in). A third holds one kind of object: one, two or
three alike (same shape, colour and size). Objects may partly hide each other and cross the
frame's border (each keeps at least ``MIN_VISIBLE`` of its whole area in view).

The world has the variation a camera brings, so that the model learns colours and shapes rather
than one way of drawing them:

- backgrounds of any colour from black to white, plain, gradients, a floor under a wall, sensor
  noise, textures (stripes, checks, blotches, 1/f "natural image" noise; half of the blotches and
  1/f textures vary in hue too, each channel a field of its own) and clutter (thin lines, scribbles,
  specks: nothing of the vocabulary);
- objects from small (radius ``SIZE_RADIUS["small"]`` of the frame's scale) to filling half the
  frame, anywhere in their third, at any rotation, with anti-aliased or hard edges, with or without
  an outline, lit by a gradient; each colour name covers a range of hue, saturation and value
  (``COLOUR_RANGES``), not one RGB value;
- the camera's own faults over the whole frame: uneven lighting, blur, sensor noise, JPEG
  artefacts, at any frame size (the training tool uses 160x120 up to 1280x720, several aspect
  ratios);
- frames with no known object at all, captioned ``NO_OBJECTS`` ("No known objects.").

The caption is written from the scene description, never from pixels: one mention per occupied
third, ordered left -> centre -> right::

    "Two small red circles on the left and a large blue square on the right."
    "A large green star on the left, three small white triangles in the centre and a small pink circle on the right."

``score(text, scene)`` parses any such sentence (British or American spelling, "middle" for
"centre", "big"/"little" for the sizes) and says which objects are named with the right shape,
colour and position, whether the number of objects named is right, and, for a frame without
objects, whether the text says so.

Reproducibility: ``generate_scene(seed, index)`` draws everything from a NumPy generator seeded
with ``(seed, index)``, so a frame depends on nothing else (not on the frames before it); rendering
is a pure function of the scene. Only NumPy and OpenCV are used (the independent evaluation world,
edgevlm_ros/demo/eval_world.py, draws with Pillow).
"""

from __future__ import annotations

import colorsys
import math
import re
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import cv2
import numpy as np

__all__ = [
    "BACKGROUNDS",
    "COLOURS",
    "COLOUR_RANGES",
    "NO_OBJECTS",
    "POSITIONS",
    "SHAPES",
    "SIZES",
    "SIZE_RADIUS",
    "Scene",
    "SceneObject",
    "SceneScore",
    "caption_for",
    "generate_scene",
    "parse_caption",
    "render_scene",
    "scenes",
    "score",
]

# Each colour name is a range of (hue in degrees, saturation, value): what a person would still
# call that name. The ranges leave gaps between neighbours (red / orange / yellow, purple / pink),
# so a name is never a judgement call. COLOURS holds one representative RGB per name.
COLOUR_RANGES: dict[str, tuple[tuple[float, float], tuple[float, float], tuple[float, float]]] = {
    "red": ((-10.0, 8.0), (0.70, 1.0), (0.60, 1.0)),
    "orange": ((22.0, 36.0), (0.75, 1.0), (0.80, 1.0)),
    "yellow": ((48.0, 60.0), (0.65, 1.0), (0.82, 1.0)),
    "green": ((95.0, 145.0), (0.55, 1.0), (0.45, 0.90)),
    "blue": ((205.0, 235.0), (0.60, 1.0), (0.55, 1.0)),
    "purple": ((268.0, 292.0), (0.50, 0.85), (0.45, 0.80)),
    "pink": ((318.0, 342.0), (0.30, 0.60), (0.88, 1.0)),
    "white": ((0.0, 360.0), (0.0, 0.07), (0.92, 1.0)),
}


def hsv_to_rgb(h_deg: float, s: float, v: float) -> tuple[int, int, int]:
    r, g, b = colorsys.hsv_to_rgb((h_deg % 360.0) / 360.0, s, v)
    return int(round(255 * r)), int(round(255 * g)), int(round(255 * b))


COLOURS: dict[str, tuple[int, int, int]] = {
    name: hsv_to_rgb(sum(h) / 2, sum(s) / 2, sum(v) / 2) for name, (h, s, v) in COLOUR_RANGES.items()
}
SHAPES = ("circle", "square", "triangle", "star")
SIZES = ("small", "large")
POSITIONS = ("left", "centre", "right")
BACKGROUNDS = ("plain", "gradient", "floor_wall", "noise", "texture", "clutter")
TEXTURES = ("stripes", "checks", "blotches", "natural")
NO_OBJECTS = "No known objects."

_POSITION_PHRASE = {"left": "on the left", "centre": "in the centre", "right": "on the right"}
_COUNT_WORD = {1: "a", 2: "two", 3: "three"}
# Radius (of the circumscribed circle) as a fraction of the frame's scale (see frame_scale). The
# gap between the two sizes keeps the size word clear; a large object alone may fill half the frame.
SIZE_RADIUS = {"small": (0.065, 0.11), "large": (0.15, 0.38)}
LARGE_RADIUS_WITH_OTHERS = 0.25  # the largest radius of a large object that shares the frame
MIN_VISIBLE = 0.6  # every object keeps at least this fraction of its whole area in view
MIN_CONTRAST = 80.0  # RGB distance between an object's colour and the background under it
THIRD_MARGIN = 0.03  # object centres stay this far (a fraction of the width) from a third's edges
_LAYOUTS = ((), (1,), (2,), (1, 1), (3,), (2, 1), (1, 1, 1))
_LAYOUT_P = (0.08, 0.30, 0.08, 0.22, 0.05, 0.10, 0.17)


@dataclass(frozen=True)
class SceneObject:
    """One drawn object. Geometry in pixels of the frame it was generated for."""

    shape: str
    colour: str
    size: str
    position: str
    cx: float
    cy: float
    radius: float
    angle: float  # degrees
    rgb: tuple[int, int, int]  # the exact colour drawn (before lighting)
    outline: tuple[int, int, int] | None = None  # outline colour, or None for none
    outline_fraction: float = 0.0  # outline thickness as a fraction of the radius (at least 1 px)
    hard_edge: bool = False  # aliased edges (cv2.LINE_8) instead of anti-aliased ones
    light: tuple[float, float] = (0.0, 0.0)  # brightness gain per radius along x and y (a lighting gradient)

    @property
    def key(self) -> tuple[str, str, str]:
        """What the scorer checks: (shape, colour, position)."""
        return self.shape, self.colour, self.position


@dataclass(frozen=True)
class Background:
    """Everything needed to paint a background again."""

    kind: str
    colour_a: tuple[int, int, int]
    colour_b: tuple[int, int, int]
    direction: float  # gradient direction (radians); floor/wall: the horizon as a fraction of height
    noise_sigma: float
    noise_seed: int
    texture: str = ""  # texture: one of TEXTURES
    period: float = 0.0  # texture period as a fraction of the frame's scale; clutter: number of items
    contrast: float = 0.0  # texture / clutter strength (0..1)


@dataclass(frozen=True)
class Effects:
    """What the camera does to the whole frame, in this order: lighting, blur, noise, JPEG."""

    light_gain: float = 0.0  # brightness changes by +-light_gain across the frame ...
    light_direction: float = 0.0  # ... along this direction (radians)
    blur_sigma: float = 0.0  # Gaussian blur, pixels
    noise_sigma: float = 0.0  # sensor noise, 8-bit levels
    jpeg_quality: int = 0  # 0: no JPEG round trip
    seed: int = 0


@dataclass(frozen=True)
class Scene:
    """A generated frame's description; ``render_scene(scene)`` paints it (``scene.image()`` too)."""

    seed: int
    index: int
    width: int
    height: int
    background: Background
    objects: tuple[SceneObject, ...]  # in drawing order: later ones cover earlier ones
    caption: str
    effects: Effects = field(default_factory=Effects)

    @property
    def n_objects(self) -> int:
        return len(self.objects)

    def image(self) -> np.ndarray:
        """The frame, RGB uint8 (height, width, 3)."""
        return render_scene(self)


class Described(Protocol):
    """What the scorer needs of a scene (Scene here; eval_world's scenes too)."""

    @property
    def objects(self) -> Sequence[SceneObject]: ...

    @property
    def caption(self) -> str: ...


# -- drawing ----------------------------------------------------------------------------------------


def frame_scale(width: int, height: int) -> float:
    """Object sizes scale with this, so a third of the frame can always hold a large object."""
    return float(min(height, 0.75 * width))


def polygon(shape: str, cx: float, cy: float, r: float, angle_deg: float) -> np.ndarray | None:
    """Vertices of a polygonal shape (None for a circle), y down, angle 0 = upright."""
    a0 = math.radians(angle_deg)
    if shape == "square":
        # Side r*sqrt(2): the square is inscribed in the circle of radius r.
        angles = [a0 + math.pi / 4 + k * math.pi / 2 for k in range(4)]
        radii = [r] * 4
    elif shape == "triangle":
        angles = [a0 - math.pi / 2 + k * 2 * math.pi / 3 for k in range(3)]
        radii = [r] * 3
    elif shape == "star":
        angles = [a0 - math.pi / 2 + k * math.pi / 5 for k in range(10)]
        radii = [r if k % 2 == 0 else 0.45 * r for k in range(10)]
    else:
        return None
    pts = [(cx + rr * math.cos(a), cy + rr * math.sin(a)) for a, rr in zip(angles, radii, strict=True)]
    return np.asarray(pts, dtype=np.float64)


def shape_area(shape: str, r: float) -> float:
    """The whole area of a shape of circumradius r (also the part outside the frame)."""
    if shape == "circle":
        return math.pi * r * r
    pts = polygon(shape, 0.0, 0.0, r, 0.0)
    assert pts is not None
    x, y = pts[:, 0], pts[:, 1]
    return 0.5 * abs(float(np.dot(x, np.roll(y, 1)) - np.dot(y, np.roll(x, 1))))


_SUBPIXEL = 4  # fractional bits for cv2's shift argument: sub-pixel accurate anti-aliased edges


def _draw_filled(canvas: np.ndarray, obj: SceneObject, colour: tuple[int, ...] | int, line: int) -> None:
    scale = 1 << _SUBPIXEL
    poly = polygon(obj.shape, obj.cx, obj.cy, obj.radius, obj.angle)
    if poly is None:
        center = (int(round(obj.cx * scale)), int(round(obj.cy * scale)))
        cv2.circle(canvas, center, int(round(obj.radius * scale)), colour, thickness=-1, lineType=line,
                   shift=_SUBPIXEL)
    else:
        pts = np.round(poly * scale).astype(np.int32).reshape(-1, 1, 2)
        cv2.fillPoly(canvas, [pts], colour, lineType=line, shift=_SUBPIXEL)


def _draw_outline(canvas: np.ndarray, obj: SceneObject, colour: tuple[int, ...] | int, line: int) -> None:
    scale = 1 << _SUBPIXEL
    thickness = max(1, int(round(obj.radius * obj.outline_fraction)))
    poly = polygon(obj.shape, obj.cx, obj.cy, obj.radius, obj.angle)
    if poly is None:
        center = (int(round(obj.cx * scale)), int(round(obj.cy * scale)))
        cv2.circle(canvas, center, int(round(obj.radius * scale)), colour, thickness=thickness, lineType=line,
                   shift=_SUBPIXEL)
    else:
        pts = np.round(poly * scale).astype(np.int32).reshape(-1, 1, 2)
        cv2.polylines(canvas, [pts], True, colour, thickness=thickness, lineType=line, shift=_SUBPIXEL)


def object_coverage(obj: SceneObject, width: int, height: int) -> np.ndarray:
    """How much of each pixel the object covers (float32 0..1, its outline included)."""
    cover = np.zeros((height, width), dtype=np.uint8)
    line = cv2.LINE_8 if obj.hard_edge else cv2.LINE_AA
    _draw_filled(cover, obj, 255, line)
    if obj.outline is not None:
        _draw_outline(cover, obj, 255, line)
    return cover.astype(np.float32) / 255.0


def _object_mask(obj: SceneObject, width: int, height: int) -> np.ndarray:
    return object_coverage(obj, width, height) > 0.5


def _draw_object(canvas: np.ndarray, obj: SceneObject) -> None:
    """Composites the object onto a float32 RGB canvas: fill (with its lighting gradient), then outline."""
    h, w = canvas.shape[:2]
    r = max(obj.radius, 1.0)
    x0, x1 = max(int(obj.cx - r) - 3, 0), min(int(obj.cx + r) + 4, w)
    y0, y1 = max(int(obj.cy - r) - 3, 0), min(int(obj.cy + r) + 4, h)
    if x0 >= x1 or y0 >= y1:
        return
    line = cv2.LINE_8 if obj.hard_edge else cv2.LINE_AA
    local = SceneObject(**{**obj.__dict__, "cx": obj.cx - x0, "cy": obj.cy - y0})
    fill = np.zeros((y1 - y0, x1 - x0), dtype=np.uint8)
    _draw_filled(fill, local, 255, line)
    yy, xx = np.mgrid[y0:y1, x0:x1].astype(np.float32)
    gain = 1.0 + obj.light[0] * (xx - obj.cx) / r + obj.light[1] * (yy - obj.cy) / r
    colour = np.asarray(obj.rgb, np.float32)[None, None] * gain[..., None]
    a = (fill.astype(np.float32) / 255.0)[..., None]
    region = canvas[y0:y1, x0:x1]
    region[:] = region * (1 - a) + colour * a
    if obj.outline is not None:
        edge = np.zeros_like(fill)
        _draw_outline(edge, local, 255, line)
        a = (edge.astype(np.float32) / 255.0)[..., None]
        region[:] = region * (1 - a) + np.asarray(obj.outline, np.float32)[None, None] * a


def hue_varies(bg: Background) -> bool:
    """Whether a blotches or 1/f texture varies in hue (each RGB channel a field of its own) rather
    than between two colours (the independent world's blurred random-RGB frames were the ones the
    demo model took for objects). Decided by the background's own seed, so that adding it
    (2026-12-03) left every other scene as it was; of the hue-varying ones, a few (2 of 27 in 600
    frames) drew their objects again under the contrast rule. Half of the checks became mosaics of
    cells of many colours the same way (2026-12-06: the independent world's tiled frames without
    objects were taken for objects)."""
    return bg.kind == "texture" and bg.texture in ("blotches", "natural", "checks") and bg.noise_seed % 2 == 0


def _texture_grid(bg: Background, width: int, height: int) -> tuple[np.ndarray, np.ndarray, float]:
    """The texture's coordinates along and across its direction (u, v: (height, width), pixels) and its
    period in pixels of this frame."""
    period = max(bg.period * frame_scale(width, height), 3.0)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    u = xx * math.cos(bg.direction) + yy * math.sin(bg.direction)
    v = -xx * math.sin(bg.direction) + yy * math.cos(bg.direction)
    return u, v, period


def _mosaic(bg: Background, width: int, height: int, rng: np.random.Generator) -> np.ndarray:
    """Checks whose every cell has a colour of its own (a tiled floor, a wall of boxes): (height, width,
    3) in -1..1, on the checks' rotated grid."""
    u, v, period = _texture_grid(bg, width, height)
    iu = np.floor(u / period).astype(np.int64)
    iv = np.floor(v / period).astype(np.int64)
    iu -= iu.min()
    iv -= iv.min()
    cells = rng.uniform(-1, 1, size=(int(iv.max()) + 1, int(iu.max()) + 1, 3)).astype(np.float32)
    return cells[iv, iu]


def _texture(bg: Background, width: int, height: int, rng: np.random.Generator) -> np.ndarray:
    """A texture in -1..1, (height, width, 1), or (height, width, 3) when hue_varies(bg)."""
    if hue_varies(bg):
        if bg.texture == "checks":
            return _mosaic(bg, width, height, rng)
        plain = Background(bg.kind, bg.colour_a, bg.colour_b, bg.direction, bg.noise_sigma, bg.noise_seed + 1,
                           bg.texture, bg.period, bg.contrast)
        return np.concatenate([_texture(plain, width, height, rng) for _ in range(3)], axis=2)
    return _texture_1(bg, width, height, rng)[..., None]


def _texture_1(bg: Background, width: int, height: int, rng: np.random.Generator) -> np.ndarray:
    """A one-channel texture in -1..1 (height, width)."""
    u, v, period = _texture_grid(bg, width, height)
    if bg.texture == "stripes":
        return np.sign(np.sin(2 * math.pi * u / period)).astype(np.float32)
    if bg.texture == "checks":
        return (np.sign(np.sin(math.pi * u / period)) * np.sign(np.sin(math.pi * v / period))).astype(np.float32)
    if bg.texture == "blotches":
        cells = rng.uniform(-1, 1, size=(max(2, int(height / period) + 2), max(2, int(width / period) + 2)))
        return cv2.resize(cells.astype(np.float32), (width, height), interpolation=cv2.INTER_CUBIC).clip(-1, 1)
    # natural: 1/f amplitude spectrum, random phases (the statistics of natural images)
    fy = np.fft.fftfreq(height)[:, None]
    fx = np.fft.rfftfreq(width)[None, :]
    f = np.sqrt(fx * fx + fy * fy)
    f[0, 0] = 1.0
    spec = (rng.normal(size=f.shape) + 1j * rng.normal(size=f.shape)) / f
    spec[0, 0] = 0.0
    img = np.fft.irfft2(spec, s=(height, width)).astype(np.float32)
    return img / max(float(np.abs(img).max()), 1e-6)


def _clutter(canvas: np.ndarray, bg: Background, rng: np.random.Generator) -> None:
    """Thin lines, scribbles and specks: things in view that are none of the vocabulary's shapes."""
    h, w = canvas.shape[:2]
    scale = frame_scale(w, h)
    base = np.asarray(bg.colour_a, np.float32)
    for _ in range(int(bg.period)):
        tone = base + rng.choice([-1.0, 1.0]) * bg.contrast * 120.0 * rng.uniform(0.5, 1.0)
        colour = tuple(float(c) for c in np.clip(tone + rng.uniform(-15, 15, 3), 0, 255))
        kind = rng.integers(3)
        thickness = int(rng.integers(1, max(2, int(scale * 0.012)) + 1))
        if kind == 0:  # a line
            p = rng.uniform(0, 1, 4) * [w, h, w, h]
            cv2.line(canvas, (int(p[0]), int(p[1])), (int(p[2]), int(p[3])), colour, thickness, cv2.LINE_AA)
        elif kind == 1:  # a scribble
            n = int(rng.integers(3, 8))
            start = rng.uniform(0, 1, 2) * [w, h]
            steps = rng.normal(0, 0.08 * scale, (n, 2))
            pts = np.cumsum(np.vstack([start, steps]), 0).astype(np.int32).reshape(-1, 1, 2)
            cv2.polylines(canvas, [pts], False, colour, thickness, cv2.LINE_AA)
        else:  # a speck, far below a small object's size
            c = rng.uniform(0, 1, 2) * [w, h]
            cv2.circle(canvas, (int(c[0]), int(c[1])), max(1, int(rng.uniform(0.004, 0.015) * scale)), colour, -1,
                       cv2.LINE_AA)


def _paint_background(bg: Background, width: int, height: int) -> np.ndarray:
    """The background, RGB uint8 (what the contrast rule compares object colours with)."""
    return np.ascontiguousarray(np.clip(np.round(_background_f32(bg, width, height)), 0, 255).astype(np.uint8))


def _background_f32(bg: Background, width: int, height: int) -> np.ndarray:
    a = np.asarray(bg.colour_a, dtype=np.float32)
    b = np.asarray(bg.colour_b, dtype=np.float32)
    rng = np.random.default_rng(bg.noise_seed)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    if bg.kind == "gradient" or (bg.kind == "noise" and bg.colour_a != bg.colour_b):
        d = np.array([math.cos(bg.direction), math.sin(bg.direction)], dtype=np.float32)
        t = (xx / max(width - 1, 1) - 0.5) * d[0] + (yy / max(height - 1, 1) - 0.5) * d[1]
        t = (t - t.min()) / max(float(t.max() - t.min()), 1e-6)
        img = a[None, None] * (1 - t[..., None]) + b[None, None] * t[..., None]
    elif bg.kind == "floor_wall":
        horizon = int(round(bg.direction * height))
        img = np.empty((height, width, 3), dtype=np.float32)
        img[:horizon] = a
        # The floor darkens slightly towards the horizon (a hint of depth) and has a skirting line.
        depth = (yy[horizon:] - horizon) / max(height - horizon, 1)
        img[horizon:] = b[None, None] * (0.85 + 0.15 * depth[..., None])
        img[max(horizon - 2, 0) : horizon + 1] = 0.6 * a
    elif bg.kind == "texture":
        t = _texture(bg, width, height, rng)
        if t.shape[2] == 3:  # hue varies: each channel swings by the texture's contrast around the mid colour
            img = (a + b)[None, None] / 2 + t * (bg.contrast * 255.0)
        else:
            img = (a + b)[None, None] / 2 + t * ((b - a)[None, None] / 2)
    else:
        img = np.empty((height, width, 3), dtype=np.float32)
        img[:] = a
    if bg.kind == "clutter":
        _clutter(img, bg, rng)
    if bg.noise_sigma > 0:
        img = img + rng.normal(0.0, bg.noise_sigma, size=img.shape).astype(np.float32)
    return img


def _apply_effects(img: np.ndarray, fx: Effects) -> np.ndarray:
    """float32 RGB -> uint8 RGB through the camera's faults."""
    h, w = img.shape[:2]
    if fx.light_gain:
        yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
        t = ((xx / max(w - 1, 1) - 0.5) * math.cos(fx.light_direction)
             + (yy / max(h - 1, 1) - 0.5) * math.sin(fx.light_direction))
        img = img * (1.0 + 2.0 * fx.light_gain * t)[..., None]
    if fx.blur_sigma > 0:
        img = cv2.GaussianBlur(img, (0, 0), fx.blur_sigma)
    if fx.noise_sigma > 0:
        rng = np.random.default_rng(fx.seed)
        img = img + rng.normal(0.0, fx.noise_sigma, size=img.shape).astype(np.float32)
    out = np.ascontiguousarray(np.clip(np.round(img), 0, 255).astype(np.uint8))
    if fx.jpeg_quality:
        ok, buf = cv2.imencode(".jpg", out[..., ::-1], [cv2.IMWRITE_JPEG_QUALITY, int(fx.jpeg_quality)])
        if ok:
            out = np.ascontiguousarray(cv2.imdecode(buf, cv2.IMREAD_COLOR)[..., ::-1])
    return out


def render_scene(scene: Scene) -> np.ndarray:
    """Paints a scene: RGB uint8 (height, width, 3). Pure: the same scene gives the same pixels."""
    canvas = _background_f32(scene.background, scene.width, scene.height)
    for obj in scene.objects:
        _draw_object(canvas, obj)
    return _apply_effects(canvas, scene.effects)


# -- captions ---------------------------------------------------------------------------------------


def mentions(objects: Sequence[SceneObject]) -> list[tuple[int, SceneObject]]:
    """(count, representative) per (shape, colour, position), left to right, then top to bottom."""
    groups: dict[tuple[str, str, str], list[SceneObject]] = {}
    for o in objects:
        groups.setdefault(o.key, []).append(o)
    order = sorted(groups.values(), key=lambda g: (POSITIONS.index(g[0].position), min(o.cy for o in g)))
    return [(len(g), min(g, key=lambda o: o.cy)) for g in order]


def caption_for(objects: Sequence[SceneObject]) -> str:
    """The ground-truth sentence for a set of objects (see the module docstring)."""
    if not objects:
        return NO_OBJECTS
    parts = []
    for count, o in mentions(objects):
        noun = o.shape + ("s" if count > 1 else "")
        parts.append(f"{_COUNT_WORD[count]} {o.size} {o.colour} {noun} {_POSITION_PHRASE[o.position]}")
    text = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    return text[0].upper() + text[1:] + "."


# -- generation -------------------------------------------------------------------------------------


def _pick(rng: np.random.Generator, items: Sequence[str]) -> str:
    return items[int(rng.integers(len(items)))]


def _background_colour(rng: np.random.Generator) -> tuple[int, int, int]:
    """Any colour from black to white: mostly near-neutral, some muted colours."""
    if rng.random() < 0.65:
        h, s, v = rng.uniform(0, 360), rng.uniform(0.0, 0.22), rng.uniform(0.03, 1.0)
    else:
        h, s, v = rng.uniform(0, 360), rng.uniform(0.22, 0.6), rng.uniform(0.15, 0.95)
    return hsv_to_rgb(h, s, v)


def _background(rng: np.random.Generator, empty: bool) -> Background:
    # Frames without objects see more of the backgrounds that could be mistaken for something.
    p = (0.1, 0.15, 0.1, 0.15, 0.25, 0.25) if empty else (0.25, 0.2, 0.1, 0.15, 0.15, 0.15)
    kind = BACKGROUNDS[int(rng.choice(len(BACKGROUNDS), p=p))]
    a = _background_colour(rng)
    b = _background_colour(rng)
    direction = float(rng.uniform(0, 2 * math.pi))
    sigma, texture, period, contrast = 0.0, "", 0.0, 0.0
    if kind == "plain":
        b = a
    elif kind == "floor_wall":
        direction = float(rng.uniform(0.3, 0.65))  # horizon height
    elif kind == "noise":
        sigma = float(rng.uniform(4.0, 14.0))
        if rng.random() < 0.5:
            b = a  # noise on a plain colour, else on a gradient
    elif kind == "texture":
        texture = _pick(rng, TEXTURES)
        period = float(rng.uniform(0.03, 0.2))
        contrast = float(rng.uniform(0.1, 0.45))
        mid = np.asarray(a, np.float32)
        step = contrast * 255.0 / 2
        b = tuple(int(np.clip(c + step, 0, 255)) for c in mid)  # type: ignore[assignment]
        a = tuple(int(np.clip(c - step, 0, 255)) for c in mid)  # type: ignore[assignment]
    elif kind == "clutter":
        b = a
        period = float(rng.integers(3, 16))
        contrast = float(rng.uniform(0.15, 0.6))
    return Background(kind, a, b, direction, sigma, int(rng.integers(2**31)), texture, period, contrast)


def _effects(rng: np.random.Generator, width: int, height: int) -> Effects:
    s = frame_scale(width, height) / 240.0
    light = float(rng.uniform(0.05, 0.2)) if rng.random() < 0.4 else 0.0
    blur = float(rng.uniform(0.3, 1.3) * s) if rng.random() < 0.3 else 0.0
    noise = float(rng.uniform(1.0, 10.0)) if rng.random() < 0.5 else 0.0
    jpeg = int(rng.integers(25, 91)) if rng.random() < 0.4 else 0
    return Effects(light, float(rng.uniform(0, 2 * math.pi)), blur, noise, jpeg, int(rng.integers(2**31)))


def _column_x(position: str, width: int, rng: np.random.Generator) -> float:
    """Anywhere in the third, but not at its edges, so the position name is never ambiguous."""
    k = POSITIONS.index(position)
    return float(rng.uniform(k / 3 + THIRD_MARGIN, (k + 1) / 3 - THIRD_MARGIN)) * width


def _object_colour(rng: np.random.Generator, colour: str) -> tuple[int, int, int]:
    (h0, h1), (s0, s1), (v0, v1) = COLOUR_RANGES[colour]
    return hsv_to_rgb(float(rng.uniform(h0, h1)), float(rng.uniform(s0, s1)), float(rng.uniform(v0, v1)))


def _object(rng: np.random.Generator, shape: str, colour: str, size: str, position: str, width: int,
            height: int, alone: bool) -> SceneObject:
    lo, hi = SIZE_RADIUS[size]
    if size == "large" and not alone:
        hi = LARGE_RADIUS_WITH_OTHERS
    r = float(rng.uniform(lo, hi)) * frame_scale(width, height)
    cx = _column_x(position, width, rng)
    cy = float(rng.uniform(0.2 * r, height - 0.2 * r))
    angle = float(rng.uniform(0, 360))
    rgb = _object_colour(rng, colour)
    style = rng.random()
    if style < 0.35:
        outline, frac = None, 0.0
    elif style < 0.8:  # a dark outline
        outline = tuple(int(x) for x in rng.integers(0, 60, 3))
        frac = float(rng.uniform(0.05, 0.15))
    else:  # an outline of the fill's own hue, darker or lighter
        k = float(rng.choice([0.45, 0.6, 1.35]))
        outline = tuple(int(np.clip(c * k, 0, 255)) for c in rgb)
        frac = float(rng.uniform(0.04, 0.1))
    hard = bool(rng.random() < 0.3)
    light = (float(rng.uniform(-0.15, 0.15)), float(rng.uniform(-0.15, 0.15))) if rng.random() < 0.5 else (0.0, 0.0)
    return SceneObject(shape, colour, size, position, cx, cy, r, angle, rgb, outline, frac, hard,  # type: ignore[arg-type]
                       light)


def _specs(rng: np.random.Generator) -> list[tuple[str, str, str, str]]:
    """(shape, colour, size, position) per object: 0-3 objects, each third holding one kind (1-3 alike).

    Alike objects share size too; three in one third are small (three large ones do not fit).
    """
    counts = _LAYOUTS[int(rng.choice(len(_LAYOUTS), p=_LAYOUT_P))]
    places = rng.permutation(len(POSITIONS))[: len(counts)]
    specs: list[tuple[str, str, str, str]] = []
    for count, place in zip(counts, places, strict=True):
        size = "small" if count == 3 else _pick(rng, SIZES)
        spec = (_pick(rng, SHAPES), _pick(rng, list(COLOURS)), size, POSITIONS[int(place)])
        specs += [spec] * count
    order = rng.permutation(len(specs))
    return [specs[i] for i in order]


def _contrast_ok(bg_image: np.ndarray, obj: SceneObject, mask: np.ndarray) -> bool:
    under = bg_image[mask].astype(np.float32).mean(axis=0)
    return float(np.linalg.norm(under - np.asarray(obj.rgb, dtype=np.float32))) >= MIN_CONTRAST


def placement_ok(bg_image: np.ndarray, objects: Sequence[SceneObject]) -> bool:
    """Whether objects drawn in this order on bg_image (the painted background) keep the world's
    rules: each at least MIN_VISIBLE of its area in view and MIN_CONTRAST from what lies under it."""
    h, w = bg_image.shape[:2]
    masks = [_object_mask(o, w, h) for o in objects]
    return min(visible_fractions(objects, masks)) >= MIN_VISIBLE and all(
        _contrast_ok(bg_image, o, m) for o, m in zip(objects, masks, strict=True))


def visible_fractions(objects: Sequence[SceneObject], masks: Sequence[np.ndarray]) -> list[float]:
    """Per object, the fraction of its whole area (also what lies outside the frame) in view."""
    covered = np.zeros_like(masks[0])
    out = []
    for o, m in zip(reversed(objects), reversed(masks), strict=True):  # last drawn is on top
        out.append(float((m & ~covered).sum()) / max(shape_area(o.shape, o.radius), 1.0))
        covered |= m
    return out[::-1]


def generate_scene(seed: int, index: int = 0, width: int = 320, height: int = 240) -> Scene:
    """Scene number `index` of the stream `seed`, for a width x height frame. Deterministic."""
    if width < 64 or height < 48:
        raise ValueError(f"frame {width}x{height} is too small for the scene generator (at least 64x48)")
    rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, int(index) & 0xFFFFFFFF])
    for _ in range(100):
        specs = _specs(rng)
        bg = _background(rng, empty=not specs)
        fx = _effects(rng, width, height)
        if not specs:
            return Scene(int(seed), int(index), width, height, bg, (), NO_OBJECTS, fx)
        bg_image = _paint_background(bg, width, height)
        for _ in range(30):
            objects = [_object(rng, *s, width, height, alone=len(specs) == 1) for s in specs]
            if placement_ok(bg_image, objects):
                return Scene(int(seed), int(index), width, height, bg, tuple(objects), caption_for(objects), fx)
    raise RuntimeError(f"could not place objects for scene ({seed}, {index}) in {width}x{height}")


def scenes(seed: int, count: int | None = None, start: int = 0, width: int = 320, height: int = 240
           ) -> Iterator[Scene]:
    """Scenes start, start+1, ... of stream `seed` (forever when count is None)."""
    i = start
    while count is None or i < start + count:
        yield generate_scene(seed, i, width, height)
        i += 1


# -- scoring ----------------------------------------------------------------------------------------

_COLOUR_WORDS = {c: c for c in COLOURS} | {"grey": "grey", "gray": "grey"}
_SHAPE_WORDS = {"circle": "circle", "square": "square", "triangle": "triangle", "star": "star"}
_POSITION_WORDS = {"left": "left", "right": "right", "centre": "centre", "center": "centre", "middle": "centre"}
_COUNT_WORDS = {"a": 1, "an": 1, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5}

_SAYS_NOTHING = re.compile(r"\bno (?:known )?(?:objects?|shapes?)\b|\bnothing\b")

_MENTION = re.compile(
    r"\b(?:(?P<count>a|an|one|two|three|four|five)\s+)?"
    r"(?:(?P<size>small|large|big|little|tiny)\s+)?"
    rf"(?P<colour>{'|'.join(_COLOUR_WORDS)})\s+"
    rf"(?P<shape>{'|'.join(_SHAPE_WORDS)})(?P<plural>s)?\b"
    r"(?:\s+(?:on|in|at|to)\s+the\s+(?P<position>left|right|centre|center|middle)\b)?"
)


@dataclass(frozen=True)
class Mention:
    """One noun phrase of a caption: `count` objects of a shape and colour, at a position (or None)."""

    count: int
    size: str | None
    colour: str
    shape: str
    position: str | None


def parse_caption(text: str) -> list[Mention]:
    """The object mentions in a sentence, in order. Unknown words are ignored."""
    out = []
    for m in _MENTION.finditer(text.lower()):
        count_word = m.group("count")
        count = _COUNT_WORDS[count_word] if count_word else (2 if m.group("plural") else 1)
        size = m.group("size")
        size = {"big": "large", "little": "small", "tiny": "small"}.get(size, size) if size else None
        pos = m.group("position")
        out.append(Mention(count, size, _COLOUR_WORDS[m.group("colour")], _SHAPE_WORDS[m.group("shape")],
                           _POSITION_WORDS[pos] if pos else None))
    return out


@dataclass(frozen=True)
class SceneScore:
    """How well a caption describes a scene.

    objects_right: per scene object (drawing order), whether the caption names its shape, colour
        and position (each named object counts once: two named red circles cover at most two).
    count_named / count_true: objects the caption names (counts summed) / objects in the scene.
    exact: the caption equals the ground truth (surrounding whitespace ignored).
    says_nothing: the caption says there is no known object ("No known objects.", "nothing").
    """

    objects_right: tuple[bool, ...]
    count_named: int
    count_true: int
    exact: bool
    says_nothing: bool = False

    @property
    def n_right(self) -> int:
        return sum(self.objects_right)

    @property
    def count_right(self) -> bool:
        return self.count_named == self.count_true

    @property
    def all_right(self) -> bool:
        """Every object named right and nothing more; for a frame without objects: says so, names none."""
        if self.count_true == 0:
            return self.count_named == 0 and self.says_nothing
        return self.count_right and all(self.objects_right)


def score(caption_text: str, scene: Described) -> SceneScore:
    """Scores a caption against the scene it should describe (see SceneScore)."""
    mentions = parse_caption(caption_text)
    named: Counter[tuple[str, str, str]] = Counter()
    for m in mentions:
        if m.position is not None:
            named[(m.shape, m.colour, m.position)] += m.count
    right = []
    for o in scene.objects:
        if named[o.key] > 0:
            named[o.key] -= 1
            right.append(True)
        else:
            right.append(False)
    return SceneScore(tuple(right), sum(m.count for m in mentions), len(scene.objects),
                      caption_text.strip() == scene.caption, bool(_SAYS_NOTHING.search(caption_text.lower())))
