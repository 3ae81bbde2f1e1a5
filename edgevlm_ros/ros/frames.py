"""ROS image messages to RGB uint8 arrays, without ROS: sensor_msgs/Image and CompressedImage.

The functions read only the message fields (`height`, `width`, `encoding`, `is_bigendian`,
`step`, `data` of an Image; `format`, `data` of a CompressedImage), so they take the real
messages or anything shaped like them. The result is always a new C-contiguous (H, W, 3) uint8
array in RGB order that shares no memory with the message.

Every check that can be made from the header is made before any pixel memory is touched or
allocated: a hostile 20000 x 20000 header is refused from its numbers, and a compressed image's
size is read from its own JPEG / PNG header before the decoder runs. Every refusal is a
`ValueError` whose message says what is wrong with which field.

Encodings (names of ROS' sensor_msgs/image_encodings.hpp):
- rgb8, bgr8, rgba8, bgra8, mono8; mono16 (either byte order, `is_bigendian`; scaled to 8 bits
  by its high byte, so a mono8 value v stored as v * 257 or v << 8 comes back as v);
- yuv422 = uyvy (byte order U Y0 V Y1) and yuv422_yuy2 = yuyv (Y0 U Y1 V), 4:2:2, decoded with
  OpenCV's BT.601 video-range conversion; the width must be even.
Rows may be padded: `step` is the row stride in bytes and may exceed width x bytes per pixel.
Compressed: JPEG and PNG (recognised by their signatures, whatever `format` says), decoded by
OpenCV straight to RGB; 16-bit PNGs are reduced to 8 bits and alpha is dropped.
"""

from __future__ import annotations

import struct
from typing import Protocol

import cv2
import numpy as np

__all__ = [
    "DEFAULT_MAX_PIXELS",
    "RAW_ENCODINGS",
    "compressed_size",
    "compressed_to_rgb",
    "image_to_rgb",
    "to_rgb",
]

# 16 megapixels: a 4K camera (8.3 MP) passes, a forged 20000 x 20000 header (400 MP) does not.
DEFAULT_MAX_PIXELS = 1 << 24

# encoding -> (bytes per pixel, OpenCV conversion to RGB or None for the numpy paths below)
RAW_ENCODINGS: dict[str, tuple[int, int | None]] = {
    "rgb8": (3, None),
    "bgr8": (3, cv2.COLOR_BGR2RGB),
    "rgba8": (4, cv2.COLOR_RGBA2RGB),
    "bgra8": (4, cv2.COLOR_BGRA2RGB),
    "mono8": (1, cv2.COLOR_GRAY2RGB),
    "mono16": (2, cv2.COLOR_GRAY2RGB),
    # ROS' "yuv422" is UYVY and "yuv422_yuy2" is YUYV; "uyvy" / "yuyv" are their newer names.
    "yuv422": (2, cv2.COLOR_YUV2RGB_UYVY),
    "uyvy": (2, cv2.COLOR_YUV2RGB_UYVY),
    "yuv422_yuy2": (2, cv2.COLOR_YUV2RGB_YUY2),
    "yuyv": (2, cv2.COLOR_YUV2RGB_YUY2),
}
_YUV422 = {"yuv422", "uyvy", "yuv422_yuy2", "yuyv"}

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_JPEG_SOI = b"\xff\xd8\xff"
# JPEG start-of-frame markers carry the image size: SOF0..SOF15 except DHT (C4), JPG (C8), DAC (CC).
_JPEG_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
# Markers without a length field: TEM, RST0..RST7, SOI.
_JPEG_STANDALONE = {0x01, *range(0xD0, 0xD8), 0xD8}
# IMREAD_COLOR_RGB (OpenCV >= 4.10) decodes straight to RGB; older builds decode to BGR.
_IMREAD_RGB = getattr(cv2, "IMREAD_COLOR_RGB", None)


class ImageLike(Protocol):
    height: int
    width: int
    encoding: str
    is_bigendian: int
    step: int
    data: bytes


class CompressedImageLike(Protocol):
    format: str
    data: bytes


def _check_size(width: int, height: int, max_pixels: int, what: str = "image") -> None:
    if width <= 0 or height <= 0:
        raise ValueError(f"{what} has zero size ({width}x{height})")
    if width * height > max_pixels:
        raise ValueError(
            f"{what} of {width}x{height} = {width * height} pixels is larger than the limit of {max_pixels} pixels"
        )


def image_to_rgb(msg: ImageLike, max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """A sensor_msgs/Image as a new (height, width, 3) uint8 RGB array. Raises ValueError."""
    height, width, step = int(msg.height), int(msg.width), int(msg.step)
    _check_size(width, height, max_pixels)
    encoding = str(msg.encoding).strip().lower()
    if encoding not in RAW_ENCODINGS:
        raise ValueError(f"unsupported image encoding '{msg.encoding}' (supported: {', '.join(RAW_ENCODINGS)})")
    bpp, conversion = RAW_ENCODINGS[encoding]
    if encoding in _YUV422 and width % 2:
        raise ValueError(f"{encoding} image width {width} is odd: two pixels share one U/V pair")
    row_bytes = width * bpp
    if step < row_bytes:
        raise ValueError(f"step {step} is smaller than a row of {width} {encoding} pixels ({row_bytes} bytes)")
    # The last row needs only its pixels, but ROS messages carry height * step bytes; a shorter
    # buffer means the publisher got the size or the step wrong, so it is refused.
    needed = height * step
    data = msg.data
    if len(data) < needed:
        raise ValueError(f"data has {len(data)} bytes, fewer than height {height} x step {step} = {needed}")

    # A read-only view of the message buffer, one row per line, padding cut off: no copy yet.
    rows = np.frombuffer(data, dtype=np.uint8, count=needed).reshape(height, step)[:, :row_bytes]
    if encoding == "rgb8":
        return np.array(rows.reshape(height, width, 3), order="C")  # the one copy
    if encoding == "mono16":
        order = ">" if msg.is_bigendian else "<"
        # Contiguous bytes, viewed as 16-bit samples in the message's byte order; the high byte is
        # the 8-bit value (rounding by the high byte keeps v * 257 and v << 8 exactly v).
        gray16 = np.ascontiguousarray(rows).view(f"{order}u2")
        gray = (gray16 >> 8).astype(np.uint8)
        return cv2.cvtColor(gray, conversion)
    if encoding in _YUV422:
        pixels = np.ascontiguousarray(rows).reshape(height, width, 2)
    elif bpp == 1:
        pixels = np.ascontiguousarray(rows)
    else:
        pixels = np.ascontiguousarray(rows).reshape(height, width, bpp)
    assert conversion is not None
    # cvtColor writes a new array, so the result never aliases the message.
    return cv2.cvtColor(pixels, conversion)


def compressed_size(data: bytes) -> tuple[str, int, int]:
    """(kind, width, height) from the JPEG or PNG header in `data`, without decoding.

    Raises ValueError when the data is neither, or its header is cut short or inconsistent.
    """
    head = bytes(data[:32])
    if head.startswith(_PNG_SIGNATURE):
        # Signature, then the IHDR chunk: length (13), type, width, height (big-endian uint32).
        if len(data) < 24 or head[12:16] != b"IHDR":
            raise ValueError("PNG data has no IHDR header")
        width, height = struct.unpack(">II", head[16:24])
        return "png", width, height
    if head.startswith(_JPEG_SOI):
        return ("jpeg", *_jpeg_size(memoryview(data)))
    first = " ".join(f"{b:02x}" for b in head[:8]) or "nothing"
    raise ValueError(f"compressed data is neither JPEG nor PNG (it starts with {first})")


def _jpeg_size(data: memoryview) -> tuple[int, int]:
    """Walks the JPEG marker segments up to the first start-of-frame and reads its size."""
    pos, n = 2, len(data)
    while pos < n:
        if data[pos] != 0xFF:
            raise ValueError(f"JPEG data is corrupt: expected a marker at byte {pos}")
        while pos < n and data[pos] == 0xFF:  # fill bytes before a marker
            pos += 1
        if pos >= n:
            break
        marker = data[pos]
        pos += 1
        if marker in _JPEG_STANDALONE:
            continue
        if marker in (0xD9, 0xDA):  # end of image, or scan data before any frame header
            break
        if pos + 2 > n:
            break
        length = (data[pos] << 8) | data[pos + 1]
        if length < 2:
            raise ValueError(f"JPEG data is corrupt: segment length {length} at byte {pos}")
        if marker in _JPEG_SOF:
            if pos + 7 > n:
                break
            # length (2), sample precision (1), height (2), width (2)
            height = (data[pos + 3] << 8) | data[pos + 4]
            width = (data[pos + 5] << 8) | data[pos + 6]
            if height == 0:
                raise ValueError("JPEG frame header gives no height (DNL-sized images are not supported)")
            return width, height
        pos += length
    raise ValueError("JPEG data has no frame header (truncated or corrupt)")


def compressed_to_rgb(msg: CompressedImageLike, max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """A sensor_msgs/CompressedImage (JPEG or PNG) as a new (height, width, 3) uint8 RGB array.

    The size in the file's header is checked against max_pixels before the decoder allocates
    anything. Raises ValueError.
    """
    data = msg.data
    if len(data) == 0:
        raise ValueError(f"compressed image (format '{msg.format}') has no data")
    kind, width, height = compressed_size(data)
    _check_size(width, height, max_pixels, what=f"{kind.upper()} image")
    if kind == "jpeg" and b"\xff\xd9" not in bytes(data[-64:]):
        # libjpeg would pad a cut-off image with grey and only print a warning.
        raise ValueError(f"JPEG data is truncated: no end-of-image marker in its {len(data)} bytes")
    buf = np.frombuffer(data, dtype=np.uint8)
    # EXIF orientation is ignored, as for raw images: the pixels are described as the camera sent them.
    flags = (_IMREAD_RGB if _IMREAD_RGB is not None else cv2.IMREAD_COLOR) | cv2.IMREAD_IGNORE_ORIENTATION
    try:
        image = cv2.imdecode(buf, flags)
    except cv2.error as exc:
        raise ValueError(f"could not decode {kind.upper()} data ({len(data)} bytes): {exc}") from None
    if image is None:
        raise ValueError(f"could not decode {kind.upper()} data ({len(data)} bytes)")
    if image.shape[:2] != (height, width):
        raise ValueError(f"{kind.upper()} decoded to {image.shape[1]}x{image.shape[0]}, header said {width}x{height}")
    if _IMREAD_RGB is None:
        image = cv2.cvtColor(image, cv2.COLOR_BGR2RGB)
    return np.ascontiguousarray(image)


def to_rgb(msg: ImageLike | CompressedImageLike, max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """Either message type as RGB: a CompressedImage has `format`, an Image has `encoding`."""
    if hasattr(msg, "encoding"):
        return image_to_rgb(msg, max_pixels)  # type: ignore[arg-type]
    return compressed_to_rgb(msg, max_pixels)  # type: ignore[arg-type]
