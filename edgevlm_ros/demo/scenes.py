"""A synthetic world of shapes for the demo model: seeded scenes, their captions, and a scorer.

A scene is a background (plain, gradient, floor/wall, light noise) with one to three objects; an
object is a shape (circle, square, triangle, star), a colour (eight names), a size (small, large)
and a position (left, centre, right: the third of the frame its centre lies in). A third holds
one kind of object: one, two or three alike (same shape, colour and size). Objects may partly
hide each other (each keeps at least ``MIN_VISIBLE`` of its area in view).

The caption is written from the scene description, never from pixels: one mention per occupied
third, ordered left -> centre -> right::

    "Two small red circles on the left and a large blue square on the right."
    "A large green star on the left, three small white triangles in the centre and a small pink circle on the right."

``score(text, scene)`` parses any such sentence (British or American spelling, "middle" for
"centre", "big"/"little" for the sizes) and says which objects are named with the right shape,
colour and position, and whether the number of objects named is right.

Reproducibility: ``generate_scene(seed, index)`` draws everything from a NumPy generator seeded
with ``(seed, index)``, so a frame depends on nothing else (not on the frames before it); rendering
is a pure function of the scene. Only NumPy and OpenCV are used.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import cv2
import numpy as np

__all__ = [
    "BACKGROUNDS",
    "COLOURS",
    "POSITIONS",
    "SHAPES",
    "SIZES",
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

# Names -> RGB. Chosen far apart (and from the background palette) so a name is never a judgement call.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (215, 35, 35),
    "orange": (245, 135, 20),
    "yellow": (240, 215, 30),
    "green": (40, 160, 60),
    "blue": (35, 75, 210),
    "purple": (125, 50, 165),
    "pink": (245, 120, 185),
    "white": (245, 245, 240),
}
SHAPES = ("circle", "square", "triangle", "star")
SIZES = ("small", "large")
POSITIONS = ("left", "centre", "right")
BACKGROUNDS = ("plain", "gradient", "floor_wall", "noise")

# Muted background colours (RGB): low saturation, so every object colour stands out on some of them.
_BACKGROUND_PALETTE: tuple[tuple[int, int, int], ...] = (
    (60, 60, 60), (90, 90, 90), (120, 120, 120), (150, 150, 150), (180, 180, 175),
    (60, 70, 85), (85, 95, 110), (40, 65, 65), (70, 95, 90), (105, 105, 85),
    (130, 115, 95), (160, 145, 120), (190, 178, 158), (95, 80, 70), (125, 120, 140),
    (75, 60, 80), (140, 150, 160), (55, 80, 60),
)

_POSITION_PHRASE = {"left": "on the left", "centre": "in the centre", "right": "on the right"}
_COUNT_WORD = {1: "a", 2: "two", 3: "three"}
# Radius (of the circumscribed circle) as a fraction of the frame's scale (see _frame_scale).
_RADIUS = {"small": (0.075, 0.095), "large": (0.14, 0.17)}
MIN_VISIBLE = 0.65  # every object keeps at least this fraction of its pixels in view
MIN_CONTRAST = 90.0  # RGB distance between an object's colour and the background under it
OUTLINE_RGB = (20, 20, 20)  # every object is drawn with a dark outline of this colour ...
OUTLINE_FRACTION = 0.12  # ... and this thickness (a fraction of its radius, at least 2 px)
_COLOUR_JITTER = 12  # per channel, so the model does not learn one exact RGB value per name


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
    rgb: tuple[int, int, int]  # the exact (jittered) colour drawn

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

    @property
    def n_objects(self) -> int:
        return len(self.objects)

    def image(self) -> np.ndarray:
        """The frame, RGB uint8 (height, width, 3)."""
        return render_scene(self)


# -- drawing ----------------------------------------------------------------------------------------


def _frame_scale(width: int, height: int) -> float:
    """Object sizes scale with this, so a third of the frame can always hold a large object."""
    return float(min(height, 0.75 * width))


def _polygon(shape: str, cx: float, cy: float, r: float, angle_deg: float) -> np.ndarray | None:
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


_SUBPIXEL = 4  # fractional bits for cv2's shift argument: sub-pixel accurate anti-aliased edges


def _draw_object(canvas: np.ndarray, obj: SceneObject, colour: tuple[int, int, int]) -> None:
    scale = 1 << _SUBPIXEL
    poly = _polygon(obj.shape, obj.cx, obj.cy, obj.radius, obj.angle)
    if poly is None:
        center = (int(round(obj.cx * scale)), int(round(obj.cy * scale)))
        cv2.circle(canvas, center, int(round(obj.radius * scale)), colour, thickness=-1, lineType=cv2.LINE_AA,
                   shift=_SUBPIXEL)
    else:
        pts = np.round(poly * scale).astype(np.int32).reshape(-1, 1, 2)
        cv2.fillPoly(canvas, [pts], colour, lineType=cv2.LINE_AA, shift=_SUBPIXEL)


def _object_mask(obj: SceneObject, width: int, height: int) -> np.ndarray:
    mask = np.zeros((height, width), dtype=np.uint8)
    _draw_object(mask, obj, (255, 255, 255))
    return mask > 127


def _paint_background(bg: Background, width: int, height: int) -> np.ndarray:
    a = np.asarray(bg.colour_a, dtype=np.float32)
    b = np.asarray(bg.colour_b, dtype=np.float32)
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
    else:
        img = np.empty((height, width, 3), dtype=np.float32)
        img[:] = a
    if bg.noise_sigma > 0:
        rng = np.random.default_rng(bg.noise_seed)
        img = img + rng.normal(0.0, bg.noise_sigma, size=img.shape).astype(np.float32)
    return np.ascontiguousarray(np.clip(np.round(img), 0, 255).astype(np.uint8))


def _draw_outline(canvas: np.ndarray, obj: SceneObject) -> None:
    """A dark outline along the object's edge (a cartoon style): the silhouette then reads the same
    whatever the fill and background colours, which is what a small vision tower needs to tell the
    shapes apart (tools/train_demo_vlm.py: held-out shape slots 0.30-0.35 -> 0.40 at equal training)."""
    scale = 1 << _SUBPIXEL
    thickness = max(2, int(round(obj.radius * OUTLINE_FRACTION)))
    poly = _polygon(obj.shape, obj.cx, obj.cy, obj.radius, obj.angle)
    if poly is None:
        center = (int(round(obj.cx * scale)), int(round(obj.cy * scale)))
        cv2.circle(canvas, center, int(round(obj.radius * scale)), OUTLINE_RGB, thickness=thickness,
                   lineType=cv2.LINE_AA, shift=_SUBPIXEL)
    else:
        pts = np.round(poly * scale).astype(np.int32).reshape(-1, 1, 2)
        cv2.polylines(canvas, [pts], True, OUTLINE_RGB, thickness=thickness, lineType=cv2.LINE_AA, shift=_SUBPIXEL)


def render_scene(scene: Scene) -> np.ndarray:
    """Paints a scene: RGB uint8 (height, width, 3). Pure: the same scene gives the same pixels."""
    canvas = _paint_background(scene.background, scene.width, scene.height)
    for obj in scene.objects:
        _draw_object(canvas, obj, obj.rgb)
        _draw_outline(canvas, obj)
    return canvas


# -- captions ---------------------------------------------------------------------------------------


def _mentions(objects: Sequence[SceneObject]) -> list[tuple[int, SceneObject]]:
    """(count, representative) per (shape, colour, position), left to right, then top to bottom."""
    groups: dict[tuple[str, str, str], list[SceneObject]] = {}
    for o in objects:
        groups.setdefault(o.key, []).append(o)
    order = sorted(groups.values(), key=lambda g: (POSITIONS.index(g[0].position), min(o.cy for o in g)))
    return [(len(g), min(g, key=lambda o: o.cy)) for g in order]


def caption_for(objects: Sequence[SceneObject]) -> str:
    """The ground-truth sentence for a set of objects (see the module docstring)."""
    if not objects:
        return "Nothing."
    parts = []
    for count, o in _mentions(objects):
        noun = o.shape + ("s" if count > 1 else "")
        parts.append(f"{_COUNT_WORD[count]} {o.size} {o.colour} {noun} {_POSITION_PHRASE[o.position]}")
    text = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    return text[0].upper() + text[1:] + "."


# -- generation -------------------------------------------------------------------------------------


def _pick(rng: np.random.Generator, items: Sequence[str]) -> str:
    return items[int(rng.integers(len(items)))]


def _background(rng: np.random.Generator) -> Background:
    kind = _pick(rng, BACKGROUNDS)
    pal = _BACKGROUND_PALETTE
    a = pal[int(rng.integers(len(pal)))]
    b = pal[int(rng.integers(len(pal)))]
    jitter = rng.integers(-10, 11, size=6)
    a = tuple(int(np.clip(a[i] + jitter[i], 0, 255)) for i in range(3))
    b = tuple(int(np.clip(b[i] + jitter[3 + i], 0, 255)) for i in range(3))
    direction = float(rng.uniform(0, 2 * math.pi))
    sigma = 0.0
    if kind == "plain":
        b = a
    elif kind == "floor_wall":
        direction = float(rng.uniform(0.35, 0.6))  # horizon height
    elif kind == "noise":
        sigma = float(rng.uniform(4.0, 10.0))
        if rng.random() < 0.5:
            b = a  # noise on a plain colour, else on a gradient
    return Background(kind, a, b, direction, sigma, int(rng.integers(2**31)))  # type: ignore[arg-type]


def _column_x(position: str, width: int, rng: np.random.Generator) -> float:
    """Centres stay well inside their third, so the position name is never ambiguous."""
    centre = {"left": 1 / 6, "centre": 1 / 2, "right": 5 / 6}[position]
    return (centre + float(rng.uniform(-0.06, 0.06))) * width


def _object(rng: np.random.Generator, shape: str, colour: str, size: str, position: str, width: int,
            height: int) -> SceneObject:
    lo, hi = _RADIUS[size]
    r = float(rng.uniform(lo, hi)) * _frame_scale(width, height)
    cx = _column_x(position, width, rng)
    cx = float(np.clip(cx, r + 2, width - r - 2))
    cy = float(rng.uniform(r + 2, height - r - 2))
    # Small tilts only: a square turned 45 degrees would read as a diamond.
    angle = float(rng.uniform(-15, 15)) if shape != "star" else float(rng.uniform(-36, 36))
    base = COLOURS[colour]
    jit = rng.integers(-_COLOUR_JITTER, _COLOUR_JITTER + 1, size=3)
    rgb = tuple(int(np.clip(base[i] + jit[i], 0, 255)) for i in range(3))
    return SceneObject(shape, colour, size, position, cx, cy, r, angle, rgb)  # type: ignore[arg-type]


def _specs(rng: np.random.Generator) -> list[tuple[str, str, str, str]]:
    """(shape, colour, size, position) per object: 1-3 objects, each third holding one kind (1-3 alike).

    Alike objects share size too; three in one third are small (three large ones do not fit).
    """
    layouts = [(1,), (2,), (1, 1), (3,), (2, 1), (1, 1, 1)]
    counts = layouts[int(rng.choice(len(layouts), p=[0.3, 0.1, 0.25, 0.05, 0.1, 0.2]))]
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


def _visible_enough(masks: list[np.ndarray]) -> bool:
    covered = np.zeros_like(masks[0])
    for m in reversed(masks):  # last drawn is on top
        area = int(m.sum())
        if area == 0 or int((m & ~covered).sum()) < MIN_VISIBLE * area:
            return False
        covered |= m
    return True


def generate_scene(seed: int, index: int = 0, width: int = 320, height: int = 240) -> Scene:
    """Scene number `index` of the stream `seed`, for a width x height frame. Deterministic."""
    if width < 64 or height < 48:
        raise ValueError(f"frame {width}x{height} is too small for the scene generator (at least 64x48)")
    rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, int(index) & 0xFFFFFFFF])
    for _ in range(100):
        bg = _background(rng)
        bg_image = _paint_background(bg, width, height)
        specs = _specs(rng)
        for _ in range(30):
            objects = [_object(rng, *s, width, height) for s in specs]
            masks = [_object_mask(o, width, height) for o in objects]
            if _visible_enough(masks) and all(_contrast_ok(bg_image, o, m) for o, m in zip(objects, masks,
                                                                                          strict=True)):
                return Scene(int(seed), int(index), width, height, bg, tuple(objects), caption_for(objects))
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
    """

    objects_right: tuple[bool, ...]
    count_named: int
    count_true: int
    exact: bool

    @property
    def n_right(self) -> int:
        return sum(self.objects_right)

    @property
    def count_right(self) -> bool:
        return self.count_named == self.count_true

    @property
    def all_right(self) -> bool:
        return self.count_right and all(self.objects_right)


def score(caption_text: str, scene: Scene) -> SceneScore:
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
    return SceneScore(tuple(right), sum(m.count for m in mentions), scene.n_objects,
                      caption_text.strip() == scene.caption)
