"""A slowly changing view, as a robot's camera has: the scene of one stream holds for seconds while
its objects move a little from frame to frame, then one third's objects vanish or a new kind of
object appears in a free third. Every frame is a `scenes.Scene` with its caption (the ground
truth), drawn by the scene generator's own code and keeping its rules (one kind of object per
third, every object at least ``MIN_VISIBLE`` in view and ``MIN_CONTRAST`` from the background).

    stream = DriftStream(seed=42, width=320, height=240, fps=5.0)
    scene = stream.scene(17)   # frame 17: deterministic, whatever was asked before

Timeline: segment 0 is scene (seed, 0) of the scene stream (its background, camera effects and
objects). Each segment lasts ``hold_s`` seconds (drawn per segment); at the start of the next one
an object group appears (a third's objects taken from a later scene of the stream, kept only when
the rules still hold) or vanishes. Within a segment each object wobbles around where it appeared
(a few percent of the frame, a few degrees, periods of seconds), its centre staying in its third;
sensor noise is new in every frame. The background and its colour stay: a robot looking around a
room sees new objects more often than new walls.

Used by the camera (`edgevlm camera --source drift`) and, for speculative decoding (issue 19),
by the bench: consecutive descriptions of such a stream mostly repeat.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from .scenes import (
    POSITIONS,
    THIRD_MARGIN,
    Scene,
    SceneObject,
    _paint_background,
    caption_for,
    generate_scene,
    placement_ok,
)

__all__ = ["DRIFT_HOLD_S", "MAX_OBJECTS", "DriftStream"]

DRIFT_HOLD_S = (2.0, 6.0)  # how long one set of objects stays, seconds (uniform)
_WOBBLE = 0.02  # an object's centre moves up to this fraction of the frame's width / height
_TURN_DEG = 8.0  # and turns up to this many degrees
_PERIOD_S = (3.0, 9.0)  # over these periods
_TAG = 0x64726966  # "drif": the drift stream's own random draws never meet the scene stream's
_APPEAR_TRIES = 24  # later scenes looked at for a group that fits into a free third
MAX_OBJECTS = 3  # as in the scene stream (scenes._LAYOUTS): the demo model never saw more


class DriftStream:
    """The frames of one slowly changing view (see the module docstring). Deterministic per
    (seed, width, height, fps, hold_s): frame i is the same whatever was asked before."""

    def __init__(self, seed: int, width: int = 320, height: int = 240, fps: float = 5.0,
                 hold_s: tuple[float, float] = DRIFT_HOLD_S) -> None:
        if not fps > 0:
            raise ValueError(f"fps must be positive, got {fps}")
        if not 0 < hold_s[0] <= hold_s[1]:
            raise ValueError(f"hold_s must be 0 < low <= high, got {hold_s}")
        self.seed, self.width, self.height, self.fps, self.hold_s = int(seed), width, height, float(fps), hold_s
        self._first = generate_scene(self.seed, 0, width, height)  # refuses a frame too small, now
        self._bg_image = _paint_background(self._first.background, width, height)
        # Segments worked out so far: (first frame, objects); the next one starts where the last ends.
        self._segments: list[tuple[int, tuple[SceneObject, ...]]] = [(0, self._first.objects)]
        self._ends: list[int] = [self._length(0)]

    # -- the timeline ------------------------------------------------------------------------------
    def _rng(self, *key: int) -> np.random.Generator:
        return np.random.default_rng([self.seed & 0xFFFFFFFF, _TAG, *(k & 0xFFFFFFFF for k in key)])

    def _length(self, k: int) -> int:
        lo, hi = self.hold_s
        return max(1, round(float(self._rng(k, 0).uniform(lo, hi)) * self.fps))

    def segment_of(self, index: int) -> tuple[int, int]:
        """(segment number, its first frame) of frame `index`."""
        if index < 0:
            raise ValueError(f"frame index must be >= 0, got {index}")
        while self._ends[-1] <= index:
            k = len(self._segments)
            self._segments.append((self._ends[-1], self._next_objects(k, self._segments[-1][1])))
            self._ends.append(self._ends[-1] + self._length(k))
        k = int(np.searchsorted(self._ends, index, side="right"))
        return k, self._segments[k][0]

    def _next_objects(self, k: int, objects: tuple[SceneObject, ...]) -> tuple[SceneObject, ...]:
        """Segment k's objects: segment k-1's with one third's group gone or a new group added."""
        rng = self._rng(k, 1)
        occupied = sorted({o.position for o in objects}, key=POSITIONS.index)
        free = [p for p in POSITIONS if p not in occupied]
        appear = bool(free) and (not occupied or rng.random() < 0.5)
        if appear:
            for j in range(_APPEAR_TRIES):
                donor = generate_scene(self.seed, 1_000_000 + k * _APPEAR_TRIES + j, self.width, self.height)
                groups = [p for p in free if any(o.position == p for o in donor.objects)]
                if not groups or len(donor.objects) < 2:  # a lone object may be larger than one that shares
                    continue
                third = groups[int(rng.integers(len(groups)))]
                added = [o for o in donor.objects if o.position == third]
                if len(objects) + len(added) <= MAX_OBJECTS and placement_ok(self._bg_image, [*objects, *added]):
                    return (*objects, *added)
        if not occupied:
            return objects  # nothing fitted: the view stays empty one more segment
        gone = occupied[int(rng.integers(len(occupied)))]
        return tuple(o for o in objects if o.position != gone)

    # -- frames ------------------------------------------------------------------------------------
    def _moved(self, o: SceneObject, n: int, t: float) -> SceneObject:
        """Object number n of its segment, t seconds into the segment."""
        rng = self._rng(int(o.cx * 16), int(o.cy * 16), n, 2)  # its own wobble, fixed for the segment
        px, py, pa = rng.uniform(*_PERIOD_S, size=3)
        fx, fy, fa = rng.uniform(0, 2 * math.pi, size=3)
        dx = _WOBBLE * self.width * (math.sin(2 * math.pi * t / px + fx) - math.sin(fx))
        dy = _WOBBLE * self.height * (math.sin(2 * math.pi * t / py + fy) - math.sin(fy))
        third = POSITIONS.index(o.position)
        lo = (third / 3 + THIRD_MARGIN) * self.width
        hi = ((third + 1) / 3 - THIRD_MARGIN) * self.width
        cx = min(max(o.cx + dx, lo), hi) if lo <= o.cx <= hi else o.cx
        angle = o.angle + _TURN_DEG * (math.sin(2 * math.pi * t / pa + fa) - math.sin(fa))
        return replace(o, cx=cx, cy=o.cy + dy, angle=angle)

    def scene(self, index: int) -> Scene:
        """Frame `index` of the view."""
        k, first = self.segment_of(index)
        base = self._segments[k][1]
        t = (index - first) / self.fps
        moved = [self._moved(o, n, t) for n, o in enumerate(base)]
        # A pose that would break a rule keeps the object where it appeared.
        objects = tuple(moved) if moved and placement_ok(self._bg_image, moved) else base
        fx = replace(self._first.effects, seed=int(self._rng(index, 3).integers(2**31)))
        return Scene(self.seed, int(index), self.width, self.height, self._first.background, objects,
                     caption_for(objects), fx)
