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
    with pytest.raises(SourceError, match="not 'scenes', a folder"):
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


def test_publisher_over_dds(tmp_path: Path) -> None:
    from rclpy.qos import QoSProfile, ReliabilityPolicy
    from ros_helpers import Child, RosPeer, random_domain_id, ros_env
    from sensor_msgs.msg import Image
    from std_msgs.msg import String

    domain = random_domain_id()
    peer = RosPeer(domain)
    try:
        # Reliable here, so that every frame is checked; the default (best effort) is checked below.
        images = peer.inbox(Image, "/cam1/image", QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE))
        captions = peer.inbox(String, "/cam1/image/caption", QoSProfile(depth=10,
                                                                        reliability=ReliabilityPolicy.RELIABLE))
        cmd = [sys.executable, "-m", "edgevlm_ros.ros.camera", "--frames", "4", "--rate", "10", "--seed", "3",
               "--wait-subscribers", "1", "--wait-caption-subscribers", "1", "--frame-id", "cam_optical",
               "--reliable", "--depth", "10", "--ros-args", "-r", "__ns:=/cam1"]
        with Child(cmd, ros_env(domain, tmp_path / "log"), "camera") as cam:
            assert cam.wait(60) == 0, cam.tail()
            got = images.wait_count(4, timeout=10)
            caps = captions.wait_count(4, timeout=10)
            assert "published 4 frames" in cam.output()
        stamps = []
        for i, msg in enumerate(got):
            scene = generate_scene(3, i, 320, 240)
            assert (msg.encoding, msg.width, msg.height, msg.step) == ("rgb8", 320, 240, 960)
            assert msg.header.frame_id == "cam_optical"
            assert np.array_equal(np.frombuffer(bytes(msg.data), np.uint8).reshape(240, 320, 3), scene.image())
            stamps.append((msg.header.stamp.sec, msg.header.stamp.nanosec))
        assert stamps == sorted(stamps) and len(set(stamps)) == 4
        # Ground truth: one per frame, the same stamp, the same scene.
        for msg, stamp, i in zip(caps, stamps, range(4), strict=True):
            cap_stamp, scene = scene_from_caption(msg.data)
            assert cap_stamp == stamp and scene == generate_scene(3, i, 320, 240)
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
