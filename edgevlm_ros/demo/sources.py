"""Frame sources for the camera, without ROS: the synthetic scenes of `demo.scenes` (with their ground
truth), the images of a folder, a video file, a V4L2 device; and the ground-truth caption message
that goes out beside a generated frame. `ros/camera.py` publishes what these yield.

Sources (`open_source(spec)`):
  scenes               frame i of scene stream `seed`, `size` (default 320x240); endless
  drift                a slowly changing view (`demo.drift`): stream `seed`'s first scene, objects
                       moving a little, one group appearing or vanishing every 2-6 s at `rate`; endless
  DIR                  the images of a folder (png, jpg, bmp, ppm/pgm, tif, webp), in name order
  FILE                 a video file (anything OpenCV's FFmpeg backend reads)
  /dev/videoN, v4l2:N  a V4L2 device through OpenCV (`size` asks the driver for that size)
Folder and video stop at their end unless `loop`; `size` resizes folder and video frames too.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .drift import DriftStream
from .scenes import Scene, generate_scene

__all__ = [
    "CAPTION_DEPTH",
    "DEFAULT_SEED",
    "DEFAULT_SIZE",
    "DeviceSource",
    "DriftSource",
    "FolderSource",
    "Frame",
    "FrameSource",
    "SceneSource",
    "SourceError",
    "VideoSource",
    "caption_message",
    "open_source",
    "scene_from_caption",
]

log = logging.getLogger("edgevlm.camera")

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".ppm", ".pgm", ".pnm", ".tif", ".tiff", ".webp")
DEFAULT_SEED = 42  # a stream the demo model never saw in training (tools/train_demo_vlm.py)
DEFAULT_SIZE = (320, 240)  # 230 KB per rgb8 frame: fits Fast DDS's default 512 KB shared-memory segment


class SourceError(RuntimeError):
    """A source that cannot be opened or read: the message says which and why."""


@dataclass
class Frame:
    """One frame: RGB uint8 (H, W, 3), and for generated scenes what it shows."""

    rgb: np.ndarray
    index: int
    scene: Scene | None = None


class FrameSource:
    """Yields frames until the source ends (None)."""

    name = "source"

    def read(self) -> Frame | None:
        raise NotImplementedError

    def close(self) -> None:
        """Releases the device or file (idempotent)."""

    def __iter__(self) -> Iterator[Frame]:
        while (f := self.read()) is not None:
            yield f


def _resize(rgb: np.ndarray, size: tuple[int, int] | None) -> np.ndarray:
    import cv2

    if size is None or (rgb.shape[1], rgb.shape[0]) == size:
        return rgb
    return np.ascontiguousarray(cv2.resize(rgb, size, interpolation=cv2.INTER_AREA))


def _bgr_to_rgb(image: np.ndarray) -> np.ndarray:
    """OpenCV's BGR / BGRA / grey frames -> RGB uint8."""
    import cv2

    if image.dtype != np.uint8:  # 16-bit PNG / TIFF: keep the high byte
        image = (image >> 8).astype(np.uint8) if image.dtype == np.uint16 else image.astype(np.uint8)
    if image.ndim == 2:
        return cv2.cvtColor(image, cv2.COLOR_GRAY2RGB)
    if image.shape[2] == 4:
        return cv2.cvtColor(image, cv2.COLOR_BGRA2RGB)
    return cv2.cvtColor(image, cv2.COLOR_BGR2RGB)


class SceneSource(FrameSource):
    """Frames start, start + 1, ... of a scene stream; endless."""

    name = "scenes"

    def __init__(self, seed: int = DEFAULT_SEED, size: tuple[int, int] = DEFAULT_SIZE, start: int = 0) -> None:
        self.seed, self.size, self.next_index = int(seed), size, int(start)
        generate_scene(self.seed, self.next_index, *size)  # refuses a size too small, now

    def read(self) -> Frame:
        scene = generate_scene(self.seed, self.next_index, *self.size)
        self.next_index += 1
        return Frame(scene.image(), scene.index, scene)


class DriftSource(FrameSource):
    """Frames start, start + 1, ... of a slowly changing view (demo.drift) at `rate` frames a second;
    endless."""

    name = "drift"

    def __init__(self, seed: int = DEFAULT_SEED, size: tuple[int, int] = DEFAULT_SIZE, start: int = 0,
                 rate: float = 5.0) -> None:
        self.stream = DriftStream(int(seed), *size, fps=rate)
        self.next_index = int(start)

    def read(self) -> Frame:
        scene = self.stream.scene(self.next_index)
        self.next_index += 1
        return Frame(scene.image(), scene.index, scene)


class FolderSource(FrameSource):
    """The images of a folder in name order; unreadable files are skipped with a warning."""

    name = "folder"

    def __init__(self, folder: str | Path, loop: bool = False, size: tuple[int, int] | None = None) -> None:
        self.folder = Path(folder)
        self.files = sorted(p for p in self.folder.iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())
        if not self.files:
            raise SourceError(f"folder '{folder}' has no images ({', '.join(IMAGE_EXTENSIONS)})")
        self.loop, self.size = loop, size
        self._pos = 0
        self._next_index = 0
        self._readable_this_pass = 0

    def read(self) -> Frame | None:
        import cv2

        while True:
            if self._pos == len(self.files):
                if not self.loop or self._readable_this_pass == 0:
                    return None
                self._pos, self._readable_this_pass = 0, 0
            path = self.files[self._pos]
            self._pos += 1
            image = cv2.imread(str(path), cv2.IMREAD_UNCHANGED)
            if image is None:
                log.warning("skipping '%s': not a readable image", path)
                continue
            self._readable_this_pass += 1
            frame = Frame(_resize(_bgr_to_rgb(image), self.size), self._next_index)
            self._next_index += 1
            return frame


class VideoSource(FrameSource):
    """A video file, or (device=True) a V4L2 device, through OpenCV."""

    name = "video"

    def __init__(self, target: str | int, loop: bool = False, size: tuple[int, int] | None = None,
                 device: bool = False) -> None:
        import cv2

        self.target, self.loop, self.size, self.device = target, loop, size, device
        if device:
            self.name = "v4l2"
            self.cap = cv2.VideoCapture(target, cv2.CAP_V4L2)
            if self.cap.isOpened() and size is not None:
                # Ask the driver; frames it sends in another size are resized below.
                self.cap.set(cv2.CAP_PROP_FRAME_WIDTH, size[0])
                self.cap.set(cv2.CAP_PROP_FRAME_HEIGHT, size[1])
        else:
            self.cap = cv2.VideoCapture(str(target))
        if not self.cap.isOpened():
            what = "V4L2 device" if device else "video file"
            raise SourceError(f"cannot open {what} '{target}'")
        self._next_index = 0

    def read(self) -> Frame | None:
        import cv2

        ok, image = self.cap.read()
        if not ok and self.loop and not self.device and self._next_index > 0:
            self.cap.set(cv2.CAP_PROP_POS_FRAMES, 0)
            ok, image = self.cap.read()
        if not ok:
            if self.device:
                raise SourceError(f"V4L2 device '{self.target}' stopped delivering frames")
            return None
        frame = Frame(_resize(_bgr_to_rgb(image), self.size), self._next_index)
        self._next_index += 1
        return frame

    def close(self) -> None:
        self.cap.release()


def DeviceSource(target: str | int, size: tuple[int, int] | None = None) -> VideoSource:  # noqa: N802
    """A V4L2 camera: `/dev/video0`, or its index."""
    return VideoSource(target, size=size, device=True)


_V4L2 = re.compile(r"^(?:v4l2:(?P<n>\d+)|(?P<dev>/dev/video\d+))$")


def open_source(spec: str, *, seed: int = DEFAULT_SEED, size: tuple[int, int] | None = None, start: int = 0,
                loop: bool = False, rate: float = 5.0) -> FrameSource:
    """`scenes`, `drift`, a folder, a video file, `/dev/videoN` or `v4l2:N` (see the module docstring);
    rate: frames per second (drift's motion is in seconds)."""
    m = _V4L2.match(spec)
    if m:
        return DeviceSource(int(m.group("n")) if m.group("n") else m.group("dev"), size=size)
    if spec == "scenes":
        return SceneSource(seed, size or DEFAULT_SIZE, start)
    if spec == "drift":
        return DriftSource(seed, size or DEFAULT_SIZE, start, rate)
    path = Path(spec)
    if path.is_dir():
        return FolderSource(path, loop=loop, size=size)
    if path.is_file():
        return VideoSource(path, loop=loop, size=size)
    raise SourceError(f"source '{spec}' is not 'scenes', 'drift', a folder, a video file, /dev/videoN or v4l2:N")


# -- the caption message ------------------------------------------------------------------------------
CAPTION_DEPTH = 100  # image/caption history kept for late subscribers (transient local)



def caption_message(scene: Scene, sec: int, nanosec: int, frame_id: str, drift_fps: float | None = None) -> str:
    """The JSON text published on image/caption for a generated frame; drift_fps: the frame is one
    of a drift view at that rate (the message says so: "drift_fps")."""
    data = {"stamp": {"sec": sec, "nanosec": nanosec}, "frame_id": frame_id, "index": scene.index,
            "seed": scene.seed, "width": scene.width, "height": scene.height, "caption": scene.caption}
    if drift_fps is not None:
        data["drift_fps"] = drift_fps
    return json.dumps(data, separators=(",", ":"))


@functools.lru_cache(maxsize=1)
def _drift_stream(seed: int, width: int, height: int, fps: float) -> DriftStream:
    """One drift view kept: a monitor's frames all come from the same one, whose timeline is then
    worked out once."""
    return DriftStream(seed, width, height, fps=fps)


def scene_from_caption(text: str) -> tuple[tuple[int, int], Scene]:
    """((sec, nanosec), scene) from an image/caption message: the scene is generated again, exactly."""
    data = json.loads(text)
    seed, index, width, height = int(data["seed"]), int(data["index"]), int(data["width"]), int(data["height"])
    if "drift_fps" in data:
        scene = _drift_stream(seed, width, height, float(data["drift_fps"])).scene(index)
    else:
        scene = generate_scene(seed, index, width, height)
    if scene.caption != data["caption"]:
        raise ValueError("caption message does not match its scene (another scenes.py version?)")
    return (int(data["stamp"]["sec"]), int(data["stamp"]["nanosec"])), scene
