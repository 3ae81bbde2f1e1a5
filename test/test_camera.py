"""`edgevlm camera`: its frame sources without ROS, and the publisher as a real ROS 2 process over DDS."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from edgevlm_ros.demo.scenes import generate_scene
from edgevlm_ros.demo.sources import (
    FolderSource,
    SceneSource,
    SourceError,
    VideoSource,
    caption_message,
    open_source,
    scene_from_caption,
)
from edgevlm_ros.ros.camera import split_ros_args


def test_scene_source_is_the_scene_stream() -> None:
    src = SceneSource(seed=8, size=(200, 150), start=5)
    for i in (5, 6, 7):
        f = src.read()
        assert f.index == i and f.scene == generate_scene(8, i, 200, 150)
        assert np.array_equal(f.rgb, f.scene.image())


def test_folder_source_reads_images_in_name_order_and_skips_bad_files(tmp_path: Path) -> None:
    import cv2

    colours = {"b.png": (0, 0, 255), "a.jpg": (0, 255, 0), "c.bmp": (255, 0, 0)}
    for name, rgb in colours.items():
        cv2.imwrite(str(tmp_path / name), np.full((20, 30, 3), rgb[::-1], np.uint8))  # OpenCV writes BGR
    (tmp_path / "d.png").write_bytes(b"not an image")
    (tmp_path / "notes.txt").write_text("ignored")
    grey = np.arange(20 * 30, dtype=np.uint16).reshape(20, 30) * 100
    cv2.imwrite(str(tmp_path / "e.png"), grey)  # 16-bit grey

    frames = list(FolderSource(tmp_path))
    assert [f.index for f in frames] == [0, 1, 2, 3]
    assert all(f.rgb.shape == (20, 30, 3) and f.rgb.dtype == np.uint8 for f in frames)
    assert np.abs(frames[0].rgb[0, 0].astype(int) - (0, 255, 0)).max() <= 4  # a.jpg (JPEG rounds)
    assert tuple(frames[1].rgb[0, 0]) == (0, 0, 255)  # b.png
    assert tuple(frames[2].rgb[0, 0]) == (255, 0, 0)  # c.bmp
    assert np.array_equal(frames[3].rgb[..., 0], (grey >> 8).astype(np.uint8))

    looped = FolderSource(tmp_path, loop=True, size=(16, 8))
    seq = [looped.read() for _ in range(9)]
    assert all(f is not None and f.rgb.shape == (8, 16, 3) for f in seq)
    assert np.array_equal(seq[4].rgb, seq[0].rgb)


def test_video_source_plays_and_loops(tmp_path: Path) -> None:
    import cv2

    path = tmp_path / "clip.avi"
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), 10.0, (64, 48))
    assert writer.isOpened()
    for i in range(5):
        writer.write(np.full((48, 64, 3), 40 * i, np.uint8))
    writer.release()

    frames = list(VideoSource(path))
    assert len(frames) == 5 and frames[0].rgb.shape == (48, 64, 3)
    assert [round(f.rgb.mean() / 40) for f in frames] == [0, 1, 2, 3, 4]
    src = VideoSource(path, loop=True, size=(32, 24))
    seq = [src.read() for _ in range(7)]
    assert all(f is not None and f.rgb.shape == (24, 32, 3) for f in seq)
    assert [f.index for f in seq] == list(range(7))
    src.close()


def test_open_source_names(tmp_path: Path) -> None:
    assert isinstance(open_source("scenes"), SceneSource)
    with pytest.raises(SourceError, match="no images"):
        open_source(str(tmp_path))
    with pytest.raises(SourceError, match="not 'scenes', 'drift', a folder"):
        open_source(str(tmp_path / "missing"))
    (tmp_path / "x.mp4").write_bytes(b"nonsense")
    with pytest.raises(SourceError, match="cannot open video file"):
        open_source(str(tmp_path / "x.mp4"))
    with pytest.raises(SourceError, match="cannot open V4L2 device"):
        open_source("/dev/video63")
    with pytest.raises(ValueError, match="too small"):
        open_source("scenes", size=(32, 32))


def test_caption_message_rebuilds_the_scene() -> None:
    scene = generate_scene(4, 12, 320, 240)
    text = caption_message(scene, 17, 5, "camera")
    assert json.loads(text)["caption"] == scene.caption
    stamp, again = scene_from_caption(text)
    assert stamp == (17, 5) and again == scene


def test_drift_view_changes_slowly_and_keeps_the_worlds_rules() -> None:
    """A drift view at 5 frames/s over 300 frames: captions hold for seconds and change when a group
    appears or vanishes (every 2-6 s); objects move between frames; every frame keeps the scene
    stream's rules; frame i is the same whether asked first or after the others."""
    from edgevlm_ros.demo.drift import DRIFT_HOLD_S, MAX_OBJECTS, DriftStream
    from edgevlm_ros.demo.scenes import POSITIONS, _paint_background, caption_for, placement_ok

    fps, n = 5.0, 300
    stream = DriftStream(7, 320, 240, fps=fps)
    frames = [stream.scene(i) for i in range(n)]
    assert DriftStream(7, 320, 240, fps=fps).scene(n - 1) == frames[-1]
    changes = [i for i in range(1, n) if frames[i].caption != frames[i - 1].caption]
    runs = np.diff([0, *changes, n])
    assert len(changes) >= n / fps / DRIFT_HOLD_S[1] - 1, changes
    assert min(runs[:-1]) >= DRIFT_HOLD_S[0] * fps - 1, runs  # a set of objects holds for seconds
    assert len({f.caption for f in frames}) >= 4
    moved = sum(f.objects != g.objects for f, g in zip(frames, frames[1:], strict=False) if f.objects and
                f.caption == g.caption)
    assert moved > n / 2, "objects should move a little from frame to frame"
    bg = _paint_background(frames[0].background, 320, 240)
    for f in frames[::3]:
        assert f.caption == caption_for(f.objects) and f.n_objects <= MAX_OBJECTS
        for third in POSITIONS:
            kinds = {(o.shape, o.colour, o.size) for o in f.objects if o.position == third}
            assert len(kinds) <= 1, (f.index, third, kinds)
        for o in f.objects:
            lo, hi = POSITIONS.index(o.position) / 3 * 320, (POSITIONS.index(o.position) + 1) / 3 * 320
            assert lo <= o.cx <= hi, (f.index, o)
        if f.objects:  # every object MIN_VISIBLE in view and MIN_CONTRAST from the background
            assert placement_ok(bg, f.objects), f.index
    with pytest.raises(ValueError, match="fps"):
        DriftStream(7, fps=0)


def test_drift_source_and_its_caption_message() -> None:
    from edgevlm_ros.demo.sources import DriftSource

    src = open_source("drift", seed=3, rate=10.0, start=40)
    assert isinstance(src, DriftSource)
    frame = src.read()
    assert frame.index == 40 and frame.scene is not None and frame.rgb.shape == (240, 320, 3)
    text = caption_message(frame.scene, 1, 2, "camera", drift_fps=10.0)
    stamp, again = scene_from_caption(text)
    assert stamp == (1, 2) and again == frame.scene
    assert np.array_equal(again.image(), frame.rgb)


def test_split_ros_args() -> None:
    assert split_ros_args(["--rate", "2", "--ros-args", "-r", "__ns:=/a"]) == (["--rate", "2"],
                                                                              ["--ros-args", "-r", "__ns:=/a"])
    assert split_ros_args(["--frames", "3"]) == (["--frames", "3"], [])


def test_bad_source_is_one_line_and_exit_2(tmp_path: Path) -> None:
    import subprocess

    r = subprocess.run([sys.executable, "-m", "edgevlm_ros.ros.camera", "--source", str(tmp_path / "nope")],
                       capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1], timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and r.stderr.startswith("edgevlm camera: error: source")


# -- over DDS -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["scenes", "drift"])
def test_publisher_over_dds(tmp_path: Path, source: str) -> None:
    from rclpy.qos import QoSProfile, ReliabilityPolicy
    from ros_helpers import Child, RosPeer, random_domain_id, ros_env
    from sensor_msgs.msg import Image
    from std_msgs.msg import String

    from edgevlm_ros.demo.drift import DriftStream

    domain = random_domain_id()
    peer = RosPeer(domain)
    try:
        # Reliable here, so that every frame is checked; the default (best effort) is checked below.
        images = peer.inbox(Image, "/cam1/image", QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE))
        captions = peer.inbox(String, "/cam1/image/caption", QoSProfile(depth=10,
                                                                        reliability=ReliabilityPolicy.RELIABLE))
        expected = (lambda i: generate_scene(3, i, 320, 240)) if source == "scenes" else DriftStream(3, fps=10).scene
        cmd = [sys.executable, "-m", "edgevlm_ros.ros.camera", "--source", source, "--frames", "4", "--rate", "10",
               "--seed", "3",
               "--wait-subscribers", "1", "--wait-caption-subscribers", "1", "--frame-id", "cam_optical",
               "--reliable", "--depth", "10", "--ros-args", "-r", "__ns:=/cam1"]
        with Child(cmd, ros_env(domain, tmp_path / "log"), "camera") as cam:
            assert cam.wait(60) == 0, cam.tail()
            got = images.wait_count(4, timeout=10)
            caps = captions.wait_count(4, timeout=10)
            assert "published 4 frames" in cam.output()
        stamps = []
        for i, msg in enumerate(got):
            scene = expected(i)
            assert (msg.encoding, msg.width, msg.height, msg.step) == ("rgb8", 320, 240, 960)
            assert msg.header.frame_id == "cam_optical"
            assert np.array_equal(np.frombuffer(bytes(msg.data), np.uint8).reshape(240, 320, 3), scene.image())
            stamps.append((msg.header.stamp.sec, msg.header.stamp.nanosec))
        assert stamps == sorted(stamps) and len(set(stamps)) == 4
        # Ground truth: one per frame, the same stamp, the same scene.
        for msg, stamp, i in zip(caps, stamps, range(4), strict=True):
            cap_stamp, scene = scene_from_caption(msg.data)
            assert cap_stamp == stamp and scene == expected(i)
            assert json.loads(msg.data)["frame_id"] == "cam_optical"
    finally:
        peer.close()


def test_publisher_defaults_best_effort_and_stops_on_sigint(tmp_path: Path) -> None:
    from rclpy.qos import ReliabilityPolicy
    from ros_helpers import Child, RosPeer, random_domain_id, ros_env

    domain = random_domain_id()
    peer = RosPeer(domain)
    try:
        cmd = [sys.executable, "-m", "edgevlm_ros.ros.camera", "--rate", "20"]
        with Child(cmd, ros_env(domain, tmp_path / "log"), "camera") as cam:
            cam.wait_for_line(r"^frame 3 ", timeout=60)
            # The graph can know the endpoint before the name of the node behind it: ask until it does.
            deadline = time.monotonic() + 10
            while True:
                infos = peer.node.get_publishers_info_by_topic("/image")
                if [i.node_name for i in infos] == ["edgevlm_camera"] or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            assert [i.qos_profile.reliability for i in infos] == [ReliabilityPolicy.BEST_EFFORT]
            assert [i.node_name for i in infos] == ["edgevlm_camera"]
            cam.signal(signal.SIGINT)
            assert cam.wait(10) == 0, cam.tail()
            assert "Traceback" not in cam.output()
    finally:
        peer.close()
