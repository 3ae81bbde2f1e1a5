"""frames.py: ROS image messages to RGB. Real sensor_msgs messages, references independent of the
code under test (numpy formulas for YUV, Pillow for JPEG/PNG), and the refusals."""

from __future__ import annotations

import io
import struct
import tracemalloc

import cv2
import numpy as np
import pytest
from PIL import Image as PILImage
from ros_helpers import encode_compressed, grey_picture, make_compressed, make_image
from sensor_msgs.msg import CompressedImage, Image

from edgevlm_ros.ros import frames


def noise_picture(width: int = 64, height: int = 48, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)


def smooth_picture(width: int = 64, height: int = 48) -> np.ndarray:
    """Gradients: 4:2:2 chroma subsampling loses almost nothing on them."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    rgb = np.stack([x / width * 255, y / height * 255, (x + y) / (width + height) * 255], axis=-1)
    return np.round(rgb).astype(np.uint8)


def yuv422_reference(rows: np.ndarray, order: str) -> np.ndarray:
    """Packed 4:2:2 to RGB with the BT.601 video-range formula in float64 (the standard, not OpenCV)."""
    h = rows.shape[0]
    quads = rows.reshape(h, -1, 4).astype(np.float64)
    if order == "uyvy":
        u, y0, v, y1 = quads[..., 0], quads[..., 1], quads[..., 2], quads[..., 3]
    else:
        y0, u, y1, v = quads[..., 0], quads[..., 1], quads[..., 2], quads[..., 3]
    y = np.stack([y0, y1], axis=-1).reshape(h, -1)
    u = np.repeat(u, 2, axis=1) - 128
    v = np.repeat(v, 2, axis=1) - 128
    c = 1.164 * (y - 16)
    rgb = np.stack([c + 1.596 * v, c - 0.392 * u - 0.813 * v, c + 2.017 * u], axis=-1)
    return np.clip(np.round(rgb), 0, 255).astype(np.uint8)


def max_diff(a: np.ndarray, b: np.ndarray) -> int:
    assert a.shape == b.shape, (a.shape, b.shape)
    return int(np.abs(a.astype(np.int32) - b.astype(np.int32)).max())


def assert_fresh_rgb(out: np.ndarray, msg: Image | CompressedImage, shape: tuple[int, int]) -> None:
    assert out.dtype == np.uint8 and out.shape == (*shape, 3)
    assert out.flags.c_contiguous
    # The caller may keep the array after the message is gone: no shared memory.
    assert not np.shares_memory(out, np.frombuffer(msg.data, np.uint8))


# -- raw encodings -------------------------------------------------------------------------------
@pytest.mark.parametrize("pad", [0, 1, 7, 64])
@pytest.mark.parametrize("encoding", ["rgb8", "bgr8", "rgba8", "bgra8"])
def test_colour_encodings_exact(encoding: str, pad: int) -> None:
    rgb = noise_picture()
    msg = make_image(rgb, encoding, pad=pad)
    out = frames.image_to_rgb(msg)
    np.testing.assert_array_equal(out, rgb)
    assert_fresh_rgb(out, msg, rgb.shape[:2])


@pytest.mark.parametrize("pad", [0, 3])
@pytest.mark.parametrize(("encoding", "big_endian"), [("mono8", False), ("mono16", False), ("mono16", True)])
def test_mono_encodings_exact(encoding: str, big_endian: bool, pad: int) -> None:
    grey = grey_picture(64, 48)
    msg = make_image(grey, encoding, pad=pad, big_endian=big_endian)
    out = frames.image_to_rgb(msg)
    np.testing.assert_array_equal(out, grey)
    assert_fresh_rgb(out, msg, grey.shape[:2])


@pytest.mark.parametrize("big_endian", [False, True])
def test_mono16_uses_the_high_byte_in_the_messages_byte_order(big_endian: bool) -> None:
    values = np.random.default_rng(3).integers(0, 65536, size=(6, 10), dtype=np.uint16)
    rows = values.astype(">u2" if big_endian else "<u2").view(np.uint8).reshape(6, 20)
    msg = Image(height=6, width=10, encoding="mono16", is_bigendian=int(big_endian), step=20)
    msg.data = rows.tobytes()
    out = frames.image_to_rgb(msg)
    expected = (values >> 8).astype(np.uint8)
    for c in range(3):
        np.testing.assert_array_equal(out[..., c], expected)


def test_is_bigendian_does_not_matter_for_8_bit_encodings() -> None:
    rgb = noise_picture()
    msg = make_image(rgb, "rgb8")
    msg.is_bigendian = 1
    np.testing.assert_array_equal(frames.image_to_rgb(msg), rgb)


@pytest.mark.parametrize("pad", [0, 6])
@pytest.mark.parametrize(("encoding", "order"), [("yuv422", "uyvy"), ("uyvy", "uyvy"),
                                                 ("yuv422_yuy2", "yuyv"), ("yuyv", "yuyv")])
def test_yuv422_matches_the_bt601_formula(encoding: str, order: str, pad: int) -> None:
    rgb = noise_picture()
    msg = make_image(rgb, encoding, pad=pad)
    out = frames.image_to_rgb(msg)
    assert_fresh_rgb(out, msg, rgb.shape[:2])
    rows = np.frombuffer(msg.data, np.uint8).reshape(msg.height, msg.step)[:, : msg.width * 2]
    # OpenCV works in fixed point: at most one level from the float formula.
    assert max_diff(out, yuv422_reference(rows, order)) <= 1
    # And the byte order matters: read as the other order, the picture is wrong.
    other = "yuyv" if order == "uyvy" else "uyvy"
    assert max_diff(out, yuv422_reference(rows, other)) > 40


@pytest.mark.parametrize("encoding", ["yuv422", "yuv422_yuy2"])
def test_yuv422_round_trip_of_a_smooth_picture(encoding: str) -> None:
    rgb = smooth_picture()
    out = frames.image_to_rgb(make_image(rgb, encoding))
    assert max_diff(out, rgb) <= 4  # quantisation of Y, U, V plus chroma averaged over two pixels
    assert np.abs(out.astype(int) - rgb).mean() < 1.0


def test_to_rgb_dispatches_on_the_message_type() -> None:
    rgb = noise_picture()
    np.testing.assert_array_equal(frames.to_rgb(make_image(rgb, "bgr8")), rgb)
    np.testing.assert_array_equal(frames.to_rgb(make_compressed(encode_compressed(rgb, "png"), "png")), rgb)


def test_max_pixels_boundary() -> None:
    rgb = noise_picture(16, 8)
    assert frames.image_to_rgb(make_image(rgb, "rgb8"), max_pixels=128).shape == (8, 16, 3)
    with pytest.raises(ValueError, match="larger than the limit of 127 pixels"):
        frames.image_to_rgb(make_image(rgb, "rgb8"), max_pixels=127)


# -- compressed ----------------------------------------------------------------------------------
def pil_decode(data: bytes) -> np.ndarray:
    return np.asarray(PILImage.open(io.BytesIO(data)).convert("RGB"))


@pytest.mark.parametrize("fmt_string", ["jpeg", "rgb8; jpeg compressed bgr8", ""])
def test_jpeg_matches_pillow(fmt_string: str) -> None:
    rgb = smooth_picture(96, 64)
    data = encode_compressed(rgb, "jpeg")
    msg = make_compressed(data, fmt_string)
    out = frames.compressed_to_rgb(msg)
    assert_fresh_rgb(out, msg, rgb.shape[:2])
    assert max_diff(out, pil_decode(data)) <= 2  # two libjpeg builds may round the IDCT apart
    assert max_diff(out, rgb) <= 6


def test_progressive_and_grey_jpeg() -> None:
    rgb = smooth_picture(80, 40)
    ok, data = cv2.imencode(".jpg", rgb[..., ::-1].copy(), [cv2.IMWRITE_JPEG_PROGRESSIVE, 1])
    assert ok
    assert frames.compressed_size(data.tobytes()) == ("jpeg", 80, 40)
    assert max_diff(frames.compressed_to_rgb(make_compressed(data.tobytes(), "jpeg")), pil_decode(data.tobytes())) <= 2
    ok, data = cv2.imencode(".jpg", rgb[..., 0].copy())
    out = frames.compressed_to_rgb(make_compressed(data.tobytes(), "jpeg"))
    assert out.shape == (40, 80, 3) and np.array_equal(out[..., 0], out[..., 2])


def test_png_variants_exact() -> None:
    rgb = noise_picture(33, 17)  # odd sizes
    np.testing.assert_array_equal(frames.compressed_to_rgb(make_compressed(encode_compressed(rgb, "png"), "png")), rgb)
    # RGBA: alpha is dropped.
    rgba = np.concatenate([rgb, np.full((17, 33, 1), 7, np.uint8)], axis=2)
    buf = io.BytesIO()
    PILImage.fromarray(rgba, "RGBA").save(buf, format="PNG")
    np.testing.assert_array_equal(frames.compressed_to_rgb(make_compressed(buf.getvalue(), "png")), rgb)
    # Grey.
    grey = rgb[..., 1].copy()
    ok, data = cv2.imencode(".png", grey)
    out = frames.compressed_to_rgb(make_compressed(data.tobytes(), "png"))
    for c in range(3):
        np.testing.assert_array_equal(out[..., c], grey)
    # 16 bits per sample: the high byte.
    wide = rgb.astype(np.uint16) * 257 + 100
    ok, data = cv2.imencode(".png", wide[..., ::-1].copy())
    np.testing.assert_array_equal(frames.compressed_to_rgb(make_compressed(data.tobytes(), "png")),
                                  (wide >> 8).astype(np.uint8))


# -- refusals ------------------------------------------------------------------------------------
def raw(height: int = 4, width: int = 6, encoding: str = "rgb8", step: int | None = None,
        data: bytes | None = None) -> Image:
    step = width * 3 if step is None else step
    msg = Image(height=height, width=width, encoding=encoding, step=step)
    msg.data = bytes(height * step) if data is None else data
    return msg


RAW_REFUSALS = [
    ("zero width", raw(width=0, step=0), r"zero size \(0x4\)"),
    ("zero height", raw(height=0), r"zero size \(6x0\)"),
    ("step smaller than a row", raw(step=17), r"step 17 is smaller than a row of 6 rgb8 pixels \(18 bytes\)"),
    ("data shorter than height x step", raw(step=20, data=bytes(79)),
     r"data has 79 bytes, fewer than height 4 x step 20 = 80"),
    ("no data", raw(data=b""), r"data has 0 bytes"),
    ("unknown encoding", raw(encoding="bayer_rggb8"), r"unsupported image encoding 'bayer_rggb8' \(supported: rgb8"),
    ("odd yuv width", raw(width=5, encoding="yuv422", step=10, data=bytes(40)), r"yuv422 image width 5 is odd"),
    ("huge header", raw(height=20000, width=20000, step=60000, data=bytes(16)),
     r"image of 20000x20000 = 400000000 pixels is larger than the limit of 16777216 pixels"),
]


@pytest.mark.parametrize(("case", "msg", "message"), RAW_REFUSALS, ids=[c[0] for c in RAW_REFUSALS])
def test_bad_raw_messages_are_refused(case: str, msg: Image, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        frames.image_to_rgb(msg)


def forged_png(width: int, height: int) -> bytes:
    """A PNG signature and IHDR claiming width x height, then nothing: nothing to decode."""
    ihdr = struct.pack(">II5B", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR" + ihdr + b"\0\0\0\0"


def forged_jpeg(width: int, height: int) -> bytes:
    """SOI, an APP0 segment, then a baseline SOF0 claiming width x height."""
    app0 = b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\0\x01\x01\0\0\x01\0\x01\0\0"
    sof = b"\xff\xc0" + struct.pack(">HBHHB", 17, 8, height, width, 3) + bytes(9)
    return b"\xff\xd8" + app0 + sof + b"\xff\xd9"


def real_jpeg() -> bytes:
    return encode_compressed(smooth_picture(32, 16), "jpeg")


COMPRESSED_REFUSALS = [
    ("garbage bytes", np.random.default_rng(0).bytes(2000), r"neither JPEG nor PNG \(it starts with "),
    ("empty", b"", r"has no data"),
    ("garbage after a JPEG header", real_jpeg()[:30] + np.random.default_rng(1).bytes(500) + b"\xff\xd9",
     r"JPEG data is corrupt|no frame header|could not decode"),
    ("truncated JPEG", real_jpeg()[: len(real_jpeg()) // 2], r"JPEG data is truncated"),
    ("JPEG without a frame header", b"\xff\xd8\xff\xd9", r"JPEG data has no frame header"),
    ("huge JPEG header", forged_jpeg(20000, 20000), r"JPEG image of 20000x20000 = 400000000 pixels is larger"),
    ("huge PNG header", forged_png(20000, 20000), r"PNG image of 20000x20000 = 400000000 pixels is larger"),
    ("zero-size PNG header", forged_png(0, 10), r"PNG image has zero size \(0x10\)"),
    ("PNG cut inside its header", forged_png(8, 8)[:20], r"PNG data has no IHDR header"),
    ("PNG with a bad body", forged_png(8, 8) + bytes(50), r"could not decode PNG data"),
]


@pytest.mark.parametrize(("case", "data", "message"), COMPRESSED_REFUSALS, ids=[c[0] for c in COMPRESSED_REFUSALS])
def test_bad_compressed_messages_are_refused(case: str, data: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        frames.compressed_to_rgb(make_compressed(data, "jpeg"))


@pytest.mark.parametrize("msg", [raw(height=20000, width=20000, step=60000, data=bytes(16)),
                                 make_compressed(forged_jpeg(20000, 20000), "jpeg"),
                                 make_compressed(forged_png(30000, 30000), "png")],
                         ids=["raw", "jpeg", "png"])
def test_huge_headers_are_refused_before_any_allocation(msg: Image | CompressedImage) -> None:
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="larger than the limit"):
            frames.to_rgb(msg)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 100_000, f"{peak} bytes allocated while refusing a header"
