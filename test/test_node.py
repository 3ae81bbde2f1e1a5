"""The ROS node, for real: node processes started from the launch file (through the stand-in in
ros_helpers), frames published over DDS by a camera process or by this pytest process, outputs
received over DDS. No mocks of ROS or of the engine; the model is a small random SmolVLM (its
text is meaningless but deterministic, which is what these tests compare).

Also the node's plain-Python parts (node_params, frame_slot, engine.latency), which need no ROS.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ros_helpers import (  # noqa: F401 - vlm_pair_fixture provides the vlm_pair fixture
    ROOT,
    Child,
    Inbox,
    RosPeer,
    diag_values,
    encode_compressed,
    exact_picture,
    frame_status,
    grey_picture,
    launched_node,
    make_compressed,
    make_image,
    python_child,
    random_domain_id,
    ros_env,
    vlm_pair_fixture,
    worker_status,
)
from sensor_msgs.msg import Image

from edgevlm_ros.engine.latency import LatencyWindow, percentile
from edgevlm_ros.ros import frames
from edgevlm_ros.ros.frame_slot import FrameCounts, NewestFrameSlot
from edgevlm_ros.ros.node_params import PARAMS, ParamError, apply_changes, as_values, defaults, validate

STAGES = ("preprocess", "vision", "prefill", "decode", "total", "age")
FRAME_KEYS = {"text", "tokens", "tokens_per_s", "stop_reason", "preprocess_ms", "vision_ms", "prefill_ms",
              "decode_ms", "total_ms", "age_ms", "frames_received", "frames_described", "frames_failed",
              "frames_dropped", "frames_in_flight", "deadline_misses", "total_ms_p50", "total_ms_p99"}
MAX_NEW_TOKENS = 8  # short answers keep every frame fast; the text only has to be deterministic


# == plain Python: parameters ===================================================================
def test_defaults_validate() -> None:
    p = validate({})
    assert p.model is None and p.mmproj is None and p.system_prompt is None and p.prefix_cache_dir is None
    assert p.threads is None and p.deadline_ms is None and p.period_s == 0.0
    assert (p.image_mode, p.transport, p.qos_depth, p.qos_reliability) == ("single", "raw", 1, "best_effort")
    assert p.image_topic == "image"
    assert validate({"transport": "compressed"}).image_topic == "image/compressed"
    assert validate(as_values(p)) == p


@pytest.mark.parametrize(("values", "message"), [
    ({"max_new_tokens": -5}, "parameter 'max_new_tokens' must be >= 1, got -5"),
    ({"max_new_tokens": 0}, "parameter 'max_new_tokens' must be >= 1, got 0"),
    ({"max_new_tokens": "many"}, "parameter 'max_new_tokens' must be an integer, got str 'many'"),
    ({"max_new_tokens": True}, "parameter 'max_new_tokens' must be an integer, got bool True"),
    ({"image_mode": "panorama"}, "parameter 'image_mode' must be one of single, tiled; got 'panorama'"),
    ({"transport": "theora"}, "parameter 'transport' must be one of raw, compressed; got 'theora'"),
    ({"qos_reliability": "sometimes"}, "parameter 'qos_reliability' must be one of best_effort, reliable"),
    ({"qos_depth": 0}, "parameter 'qos_depth' must be >= 1, got 0"),
    ({"threads": -1}, "parameter 'threads' must be >= 0, got -1"),
    ({"threads": 1000}, "parameter 'threads' must be <= 256, got 1000"),
    ({"deadline_ms": -1.0}, "parameter 'deadline_ms' must be >= 0.0, got -1.0"),
    ({"deadline_ms": float("nan")}, "parameter 'deadline_ms' must be a finite number, got nan"),
    ({"period_s": "soon"}, "parameter 'period_s' must be a number, got str 'soon'"),
    ({"prompt": "   "}, "parameter 'prompt' must not be empty"),
    ({"model": 3}, "parameter 'model' must be a string, got int 3"),
    ({"max_image_pixels": 0}, "parameter 'max_image_pixels' must be >= 1, got 0"),
    ({"max_tokens": 5}, "unknown parameter 'max_tokens'"),
    ({"kv_type": "q4_0"}, "parameter 'kv_type' must be one of f32, f16, q8_0; got 'q4_0'"),
])
def test_bad_values_are_refused_with_the_parameter_named(values: dict[str, Any], message: str) -> None:
    with pytest.raises(ParamError) as info:
        validate(values)
    assert message in str(info.value)


def test_integers_are_accepted_for_doubles_and_zero_means_none() -> None:
    p = validate({"deadline_ms": 500, "period_s": 2, "threads": 0, "model": "  "})
    assert p.deadline_ms == 500.0 and isinstance(p.deadline_ms, float) and p.period_s == 2.0
    assert p.threads is None and p.model is None
    assert validate({"deadline_ms": 0}).deadline_ms is None


def test_runtime_changes() -> None:
    p = validate({"model": "m.gguf"})
    q = apply_changes(p, {"prompt": "What is on the floor?", "max_new_tokens": 4, "deadline_ms": 250})
    assert (q.prompt, q.max_new_tokens, q.deadline_ms, q.model) == ("What is on the floor?", 4, 250.0, "m.gguf")
    for name, value in (("model", "x.gguf"), ("image_mode", "tiled"), ("threads", 1), ("transport", "raw")):
        with pytest.raises(ParamError, match=f"parameter '{name}' can only be set at start"):
            apply_changes(p, {name: value})
    with pytest.raises(ParamError, match="'max_new_tokens' must be >= 1"):
        apply_changes(p, {"max_new_tokens": -1})
    runtime = {s.name for s in PARAMS if s.runtime}
    assert runtime == {"prompt", "max_new_tokens", "period_s", "deadline_ms", "question_frame_timeout_s",
                       "partial_every", "description_schema", "speculation"}
    assert set(defaults()) == {s.name for s in PARAMS}


# == plain Python: counters and percentiles ========================================================
def test_percentiles_match_numpy() -> None:
    values = list(np.random.default_rng(0).exponential(100.0, size=301))
    for q in (0, 1, 50, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert math.isnan(percentile([], 50))
    window = LatencyWindow(size=10)
    for v in range(100):
        window.add(float(v))
    assert len(window) == 10 and window.count == 100
    assert window.p50 == pytest.approx(94.5) and window.p99 == pytest.approx(98.91)


def test_newest_frame_slot_counts_add_up_under_contention() -> None:
    slot: NewestFrameSlot[int] = NewestFrameSlot()
    taken: list[int] = []

    def worker() -> None:
        while True:
            item = slot.take(timeout=1.0)
            if item is None:
                return
            taken.append(item)
            time.sleep(0.001)
            slot.finish(described=item % 7 != 0, deadline_miss=item % 5 == 0)

    thread = threading.Thread(target=worker)
    thread.start()
    for i in range(1, 3001):
        slot.put(i)
        counts = slot.counts()
        assert counts.balanced(), counts
        assert counts.in_flight <= 2
    time.sleep(0.05)
    slot.close()
    thread.join(5)
    c = slot.counts()
    assert c.received == 3000 and c.balanced() and c.in_flight == 0
    assert c.described + c.failed == len(taken) and c.dropped == 3000 - len(taken)
    assert taken == sorted(taken) and taken[-1] == 3000  # always the newest, never an old one
    assert FrameCounts(received=3, described=1, dropped=1, waiting=1).balanced()


# == the node over DDS ==========================================================================
@dataclass
class RunningNode:
    """A node process and what the pytest process sees of it."""

    child: Child
    fqn: str
    peer: RosPeer
    diag: Inbox
    pub: Any
    description: Inbox | None = None
    latency: dict[str, Inbox] | None = None

    def statuses(self, start: int = 0) -> list[tuple[Any, Any]]:
        """(DiagnosticArray, status) of this node, frame and heartbeat alike, from index start."""
        out = []
        for array in self.diag.messages(start):
            for status in array.status:
                if status.hardware_id == self.fqn:
                    out.append((array, status))
        return out

    def latest_values(self) -> dict[str, str]:
        statuses = self.statuses()
        return diag_values(statuses[-1][1]) if statuses else {}

    def received(self) -> int:
        return int(self.latest_values().get("frames_received", 0))

    def heartbeat(self, predicate: Any, timeout: float) -> dict[str, str]:
        """Values of the first heartbeat from now on for which predicate(values) holds."""
        start = len(self.diag)

        def match(array: Any) -> bool:
            s = worker_status(array)
            return s is not None and s.hardware_id == self.fqn and predicate(diag_values(s))

        return diag_values(worker_status(self.diag.wait_for(match, timeout, start=start, what="(heartbeat)")))

    def describe(self, msg: Any, timeout: float = 120.0) -> tuple[Any, Any]:
        """Publishes msg and returns (DiagnosticArray, frame status) for it, matched by stamp.
        Best effort can lose a frame while discovery settles: it is sent again if the node's
        received counter (1 Hz heartbeats) shows nothing arrived."""
        stamp = msg.header.stamp
        start = len(self.diag)
        before = self.received()

        def match(array: Any) -> bool:
            s = frame_status(array)
            return s is not None and s.hardware_id == self.fqn and array.header.stamp == stamp

        self.pub.publish(msg)
        deadline = time.monotonic() + timeout
        resend_at = time.monotonic() + 3.0
        while True:
            try:
                array = self.diag.wait_for(match, 0.5, start=start)
                return array, frame_status(array)
            except AssertionError:
                if self.child.proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"no result for the frame stamped {stamp}; node output:\n"
                                         f"{self.child.tail()}") from None
            if time.monotonic() > resend_at and self.received() <= before:
                self.pub.publish(msg)
                resend_at = time.monotonic() + 3.0


def start_node(peer: RosPeer, tmp: Path, domain: int, namespace: str, diag: Inbox, vlm_pair: tuple[Path, Path],
               params: dict[str, Any], launch: dict[str, str] | None = None, with_outputs: bool = False,
               stack: Any = None) -> RunningNode:
    """Starts the node from the launch file and waits until it subscribes (a log line) and our
    publisher is matched with it."""
    from rclpy.qos import QoSProfile, ReliabilityPolicy
    from sensor_msgs.msg import CompressedImage, Image
    from std_msgs.msg import Float64, String

    text, mmproj = vlm_pair
    args = {"namespace": namespace, "model": str(text), "mmproj": str(mmproj), "image": f"/{namespace}_camera",
            "threads": "2", **(launch or {})}
    child = stack.enter_context(launched_node(tmp / namespace, domain, args, params, name=namespace))
    fqn = f"/{namespace}/edgevlm"
    compressed = args.get("transport") == "compressed"
    msg_type, topic = (CompressedImage, f"{args['image']}/compressed") if compressed else (Image, args["image"])
    pub = peer.publisher(msg_type, topic, QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE))
    node = RunningNode(child, fqn, peer, diag, pub)
    if with_outputs:
        node.description = peer.inbox(String, f"/{namespace}/description")
        node.latency = {s: peer.inbox(Float64, f"/{namespace}/latency/{s}_ms") for s in STAGES}
    return node


def wait_ready(node: RunningNode, timeout: float = 120.0) -> None:
    node.child.wait_for_line(r"describing frames from", timeout)
    RosPeer.wait_subscribers(node.pub)


@dataclass
class System:
    domain: int
    peer: RosPeer
    diag: Inbox
    raw: RunningNode
    compressed: RunningNode
    tmp: Path
    pair: tuple[Path, Path]


@pytest.fixture(scope="module")
def system(vlm_pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    """Two nodes on one random domain: raw transport in /robot1, compressed in /robot2 (the
    transport is fixed at start). Both start at once so their loading overlaps."""
    from diagnostic_msgs.msg import DiagnosticArray

    tmp = tmp_path_factory.mktemp("node")
    domain = random_domain_id()
    peer = RosPeer(domain)
    with contextlib.ExitStack() as stack:
        stack.callback(peer.close)
        diag = peer.inbox(DiagnosticArray, "/diagnostics", qos=500)
        params = {"max_new_tokens": MAX_NEW_TOKENS}
        raw = start_node(peer, tmp, domain, "robot1", diag, vlm_pair, params, with_outputs=True, stack=stack,
                         launch={"image": "/camera/image_raw"})
        comp = start_node(peer, tmp, domain, "robot2", diag, vlm_pair, params, launch={"transport": "compressed"},
                          stack=stack)
        wait_ready(raw)
        wait_ready(comp)
        # One frame each before the tests: discovery settled both ways, the engine warm.
        picture = exact_picture()
        _, status = raw.describe(make_image(picture, "rgb8", peer.now().to_msg()))
        assert status.level == b"\x00", status.message
        _, status = comp.describe(make_compressed(encode_compressed(picture, "png"), "png", peer.now().to_msg()))
        assert status.level == b"\x00", status.message
        yield System(domain, peer, diag, raw, comp, tmp, vlm_pair)


def test_camera_process_to_description_latencies_and_diagnostics(system: System) -> None:
    """A camera process streams 640x480 rgb8 frames to /camera/image_raw (remapped by the launch
    file); the node describes them and publishes every latency topic and /diagnostics stamped
    with the frames' own stamps."""
    node = system.raw
    assert node.description is not None and node.latency is not None
    start_desc = len(node.description)
    start_lat = {s: len(box) for s, box in node.latency.items()}
    first_diag = start_diag = len(system.diag)
    env = ros_env(system.domain, system.tmp / "camera_log")
    def is_frame(array: Any) -> bool:
        s = frame_status(array)
        return s is not None and s.hardware_id == node.fqn

    with python_child(["camera", "--topic", "/camera/image_raw", "--rate", "5", "--count", "1000", "--verbose"],
                      env, "camera") as camera:
        camera.wait_for_line(r'"ready"', 30)
        for _ in range(3):  # three frames described, one after the other
            start_diag = system.diag.wait_index(is_frame, 120, start=start_diag) + 1
        camera.kill()
    stamps = {(d["sec"], d["nanosec"]) for d in map(json.loads, camera.output().splitlines()) if "frame" in d}
    texts = [m.data for m in node.description.wait_count(3, 10, start=start_desc)]

    # The same picture in every frame: the same text every time.
    assert len(set(texts)) == 1, texts
    frames_described = [(a, s) for a, s in node.statuses(first_diag) if s.name.endswith(": frame")]
    assert len(frames_described) >= 3
    for array, status in frames_described:
        assert status.level == b"\x00", status.message
        assert (array.header.stamp.sec, array.header.stamp.nanosec) in stamps  # the image's own stamp
        values = diag_values(status)
        assert FRAME_KEYS <= set(values), FRAME_KEYS - set(values)
        assert values["text"] == texts[0]
        assert 1 <= int(values["tokens"]) <= MAX_NEW_TOKENS
        assert values["image"] == "640x480 rgb8" and array.header.frame_id == "camera"
        c = {k: int(values[f"frames_{k}"]) for k in ("received", "described", "failed", "dropped", "in_flight")}
        assert c["received"] == c["described"] + c["failed"] + c["dropped"] + c["in_flight"], c
        assert float(values["total_ms_p50"]) <= float(values["total_ms_p99"])

    latencies = {s: [m.data for m in box.wait_count(3, 30, start=start_lat[s])] for s, box in node.latency.items()}
    for stage, values in latencies.items():
        assert all(math.isfinite(v) and v >= 0.0 for v in values), (stage, values)
    for i in range(3):
        parts = sum(latencies[s][i] for s in ("preprocess", "vision", "prefill", "decode"))
        total, age = latencies["total"][i], latencies["age"][i]
        assert 0 < parts <= total * 1.05 + 1.0, (parts, total)
        # age runs from the image stamp to the publication: at least the work, and not absurd.
        assert total * 0.95 - 5.0 <= age < total + 10_000.0, (total, age)
    assert latencies["vision"][0] > 0.0


def test_every_encoding_gives_the_same_description(system: System) -> None:
    """One picture in every raw encoding (padded rows too) and both compressed formats. The
    picture's colours survive every conversion exactly (checked first), so the texts must match."""
    now = system.peer.now
    picture = exact_picture()
    raw_msgs = [make_image(picture, enc, now().to_msg()) for enc in
                ("rgb8", "bgr8", "rgba8", "bgra8", "yuv422", "uyvy", "yuv422_yuy2", "yuyv")]
    raw_msgs += [make_image(picture, "rgb8", now().to_msg(), pad=5), make_image(picture, "yuv422", now().to_msg(),
                                                                                pad=12)]
    comp_msgs = [make_compressed(encode_compressed(picture, fmt), fmt, now().to_msg()) for fmt in ("jpeg", "png")]
    for msg in raw_msgs + comp_msgs:
        np.testing.assert_array_equal(frames.to_rgb(msg), picture)

    grey = grey_picture()
    grey_msgs = [make_image(grey, "rgb8", now().to_msg()), make_image(grey, "mono8", now().to_msg()),
                 make_image(grey, "mono16", now().to_msg()),
                 make_image(grey, "mono16", now().to_msg(), big_endian=True, pad=4)]
    for msg in grey_msgs:
        np.testing.assert_array_equal(frames.to_rgb(msg), grey)

    def text(node: RunningNode, msg: Any) -> str:
        _, status = node.describe(msg)
        assert status.level == b"\x00", status.message
        return diag_values(status)["text"]

    texts = {f"{m.encoding}/{m.step}": text(system.raw, m) for m in raw_msgs}
    texts.update({m.format: text(system.compressed, m) for m in comp_msgs})
    assert len(set(texts.values())) == 1, texts
    grey_texts = {f"{m.encoding}/{m.is_bigendian}": text(system.raw, m) for m in grey_msgs}
    assert len(set(grey_texts.values())) == 1, grey_texts


def _bad(msg: Any, **fields: Any) -> Any:
    for key, value in fields.items():
        setattr(msg, key, value)
    return msg


def test_bad_messages_give_one_error_each_and_the_node_goes_on(system: System) -> None:
    now = system.peer.now
    good = exact_picture()
    cases = [
        (system.raw, _bad(make_image(good, "rgb8", now().to_msg()), step=100), "step 100 is smaller than a row"),
        (system.raw, _bad(make_image(good, "rgb8", now().to_msg()), data=bytes(1000)), "data has 1000 bytes, fewer"),
        (system.raw, _bad(make_image(good, "rgb8", now().to_msg()), width=0), "has zero size (0x96)"),
        (system.raw, _bad(make_image(good, "rgb8", now().to_msg()), encoding="bayer_grbg8"),
         "unsupported image encoding 'bayer_grbg8'"),
        (system.raw, _bad(make_image(good, "rgb8", now().to_msg()), height=20000, width=20000, step=60000),
         "20000x20000 = 400000000 pixels is larger than the limit"),
        (system.compressed, make_compressed(np.random.default_rng(5).bytes(5000), "jpeg", now().to_msg()),
         "neither JPEG nor PNG"),
        (system.compressed, make_compressed(encode_compressed(good, "jpeg")[:400], "jpeg", now().to_msg()),
         "JPEG data is truncated"),
    ]
    for node, msg, fragment in cases:
        array, status = node.describe(msg)
        assert status.level == b"\x02", (fragment, status.message)
        assert fragment in status.message
        assert array.header.stamp == msg.header.stamp
        node.child.wait_for_line(r"\[ERROR\].*" + re.escape(fragment), 10)
        assert sum(fragment in ln for ln in node.child.lines) == 1, node.child.tail()
    for node, msg in ((system.raw, make_image(good, "bgr8", now().to_msg())),
                      (system.compressed, make_compressed(encode_compressed(good, "png"), "png", now().to_msg()))):
        _, status = node.describe(msg)
        assert status.level == b"\x00", status.message
        values = diag_values(status)
        assert int(values["frames_failed"]) >= 2 and values["text"]
    assert "Traceback" not in system.raw.child.output() + system.compressed.child.output()


def test_parameters_change_at_run_time_and_bad_values_are_refused(system: System) -> None:
    node = system.raw
    picture = exact_picture(seed=3)
    set_params = system.peer.set_parameters

    (ok,) = set_params(node.fqn, {"max_new_tokens": 2})
    assert ok.successful, ok.reason
    _, status = node.describe(make_image(picture, "rgb8", system.peer.now().to_msg()))
    assert int(diag_values(status)["tokens"]) <= 2

    refused = {
        "max_new_tokens": (-1, "'max_new_tokens' must be >= 1"),
        "prompt": ("", "'prompt' must not be empty"),
        "deadline_ms": ("soon", "'deadline_ms' must be a number"),
        "image_mode": ("tiled", "read-only"),
        "model": ("other.gguf", "read-only"),
    }
    for name, (value, reason) in refused.items():
        (result,) = set_params(node.fqn, {name: value})
        assert not result.successful and reason in result.reason, (name, result.reason)

    # A deadline that cannot be met: the text so far is published, WARN, and the miss counted.
    misses_before = int(node.latest_values().get("deadline_misses", 0))
    start_desc = len(node.description) if node.description is not None else 0
    results = set_params(node.fqn, {"deadline_ms": 1, "max_new_tokens": MAX_NEW_TOKENS})  # an int for a double
    assert all(r.successful for r in results), [r.reason for r in results]
    _, status = node.describe(make_image(picture, "rgb8", system.peer.now().to_msg()))
    values = diag_values(status)
    assert status.level == b"\x01" and "deadline" in status.message, status.message
    assert values["stop_reason"] == "deadline"
    assert int(values["deadline_misses"]) == misses_before + 1
    assert node.description is not None
    assert node.description.wait_count(1, 10, start=start_desc)[-1].data == values["text"]
    (ok,) = set_params(node.fqn, {"deadline_ms": 0.0})
    assert ok.successful


def test_a_node_with_a_q8_0_kv_cache_describes_frames(vlm_pair: tuple[Path, Path], tmp_path: Path) -> None:
    """kv_type q8_0 from the parameters file: the node loads the engine with the int8 cache and
    describes frames over DDS; the text is the engine's own with that cache."""
    from diagnostic_msgs.msg import DiagnosticArray

    from edgevlm_ros.engine.vlm import load_vlm

    domain = random_domain_id()
    peer = RosPeer(domain)
    with contextlib.ExitStack() as stack:
        stack.callback(peer.close)
        diag = peer.inbox(DiagnosticArray, "/diagnostics", qos=500)
        node = start_node(peer, tmp_path, domain, "robot3", diag, vlm_pair,
                          {"max_new_tokens": MAX_NEW_TOKENS, "kv_type": "q8_0"}, stack=stack)
        wait_ready(node)
        picture = exact_picture(seed=3)
        _, status = node.describe(make_image(picture, "rgb8", peer.now().to_msg()))
        assert status.level == b"\x00", status.message
        vlm = load_vlm(*vlm_pair, threads=2, kv_type="q8_0")
        assert vlm.text.native.kv_type == "q8_0"
        prompt = str(defaults()["prompt"])
        assert diag_values(status)["text"] == vlm.describe(picture, prompt, MAX_NEW_TOKENS).text
        assert "Traceback" not in node.child.output()


def test_unstamped_frames_are_described_without_an_age(system: System) -> None:
    node = system.raw
    assert node.latency is not None
    ages_before = len(node.latency["age"])
    totals_before = len(node.latency["total"])
    msg = make_image(exact_picture(seed=6), "rgb8")  # header.stamp left at zero
    _, status = node.describe(msg)
    assert status.level == b"\x00", status.message
    assert diag_values(status)["age_ms"] == "nan"
    node.latency["total"].wait_count(1, 10, start=totals_before)
    assert len(node.latency["age"]) == ages_before
    node.child.wait_for_line(r"\[WARN\].*image header stamps are zero", 10)


def test_period_limits_how_often_frames_are_described(system: System) -> None:
    node = system.raw
    period = 3.0
    (ok,) = system.peer.set_parameters(node.fqn, {"period_s": period})
    assert ok.successful, ok.reason
    try:
        picture = exact_picture(seed=4)
        start = len(system.diag)
        t_end = time.monotonic() + 2 * period + 0.5
        while time.monotonic() < t_end:  # 20 Hz for 6.5 s
            node.pub.publish(make_image(picture, "rgb8", system.peer.now().to_msg()))
            time.sleep(0.05)
        described = [a for a, s in node.statuses(start) if s.name.endswith(": frame")]
        stamps = [a.header.stamp.sec + a.header.stamp.nanosec * 1e-9 for a in described]
        assert 2 <= len(stamps) <= 3, stamps
        assert all(b - a >= period - 0.2 for a, b in zip(stamps, stamps[1:], strict=False)), stamps
    finally:
        (ok,) = system.peer.set_parameters(node.fqn, {"period_s": 0.0})
        assert ok.successful


def test_flood_keeps_memory_and_queue_bounded_and_describes_the_newest(system: System) -> None:
    """100 frames/s for 10 s (the issue's figures) of 160x96 rgb8 into the raw node."""
    node = system.raw
    rate, seconds = 100.0, 10.0
    picture = exact_picture(seed=5)
    template = make_image(picture, "rgb8")
    idle = node.heartbeat(lambda v: v["state"] != "describing" and v["frames_in_flight"] == "0", 60)
    received_before = int(idle["frames_received"])
    rss_start = node.child.rss_mb()
    rss_peak = rss_start
    start = len(system.diag)
    sent = 0
    t0 = time.monotonic()
    while sent < rate * seconds:
        delay = t0 + sent / rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)  # pacing to 100 Hz
        msg = Image(height=template.height, width=template.width, encoding="rgb8", step=template.step,
                    data=template.data)
        msg.header.stamp = system.peer.now().to_msg()
        node.pub.publish(msg)
        sent += 1
        if sent % 50 == 0:
            rss_peak = max(rss_peak, node.child.rss_mb())
    flood_s = time.monotonic() - t0
    after = node.heartbeat(lambda v: v["state"] != "describing" and v["frames_in_flight"] == "0", 60)

    statuses = node.statuses(start)
    described = [diag_values(s) for _, s in statuses if s.name.endswith(": frame")]
    in_flight = [int(diag_values(s)["frames_in_flight"]) for _, s in statuses]
    received = int(after["frames_received"]) - received_before
    c = {k: int(after[f"frames_{k}"]) for k in ("received", "described", "failed", "dropped", "in_flight")}
    waits = [float(v["age_ms"]) - float(v["total_ms"]) for v in described]
    print(f"flood: sent {sent} in {flood_s:.1f} s, node received {received}, counters {c}, "
          f"{len(described)} described, hand-over waits {[round(w) for w in waits]} ms, "
          f"RSS {rss_start:.0f} -> peak {rss_peak:.0f} MiB")
    assert flood_s < seconds * 1.5, f"the publisher itself fell behind: {flood_s:.1f} s"
    # Best effort into a depth-1 reader: DDS itself may overwrite a frame the executor has not
    # taken yet on this loaded 2-core machine, but the executor must keep up with 100 Hz: rclpy's
    # own MultiThreadedExecutor took 10-30% here (2026-12-03), ours (ros/executor.py) 999-1000.
    assert 0.8 * sent <= received <= sent, (received, sent)
    assert c["received"] == c["described"] + c["failed"] + c["dropped"] + c["in_flight"], c
    assert max(in_flight) <= 2, in_flight  # one waiting + one being described, never a queue
    assert len(described) >= 3, "the node stopped describing during the flood"
    # The newest frame: while frames keep coming, the one the worker takes is at most a
    # publication period old, so its age exceeds the work on it only by the hand-over. Only the
    # flood's last frame waits longer, for the describe in progress: never a queue of older frames.
    longest = max(float(v["total_ms"]) for v in described)
    assert statistics.median(waits) < 250.0 and max(waits) < longest + 250.0, waits
    assert rss_peak - rss_start < 40.0, f"memory grew from {rss_start:.0f} to {rss_peak:.0f} MiB"
    assert node.child.rss_mb() - rss_start < 40.0


def test_sigterm_when_idle_exits_at_once_with_0(system: System) -> None:
    """The last test of the module: stops the compressed node (idle) with SIGTERM."""
    child = system.compressed.child
    t0 = time.monotonic()
    child.signal(signal.SIGTERM)
    rc = child.wait(5)
    elapsed = time.monotonic() - t0
    # Idle, it stops at once; tearing down the DDS participant alone took up to ~1.2 s on this busy
    # 2-core machine (a fresh-clone run), so the bound leaves room for that, not for a hang.
    assert rc == 0 and elapsed < 2.5, (rc, elapsed, child.tail())
    assert "Traceback" not in child.output()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_during_generation_ends_within_a_second_with_0(vlm_pair: tuple[Path, Path], tmp_path: Path,
                                                              sig: int) -> None:
    """A node generating a long answer (3000 tokens: tens of seconds) gets the signal while it is
    inside the engine."""
    from diagnostic_msgs.msg import DiagnosticArray

    domain = random_domain_id()
    peer = RosPeer(domain)
    with contextlib.ExitStack() as stack:
        stack.callback(peer.close)
        diag = peer.inbox(DiagnosticArray, "/diagnostics", qos=100)
        node = start_node(peer, tmp_path, domain, "robot3", diag, vlm_pair, {"max_new_tokens": 3000}, stack=stack)
        wait_ready(node)
        msg = make_image(exact_picture(), "rgb8", peer.now().to_msg())
        deadline = time.monotonic() + 60
        while True:  # until a heartbeat says the worker is inside the engine
            node.pub.publish(msg)
            try:
                node.heartbeat(lambda v: v["state"] == "describing", 2.5)
                break
            except AssertionError:
                assert time.monotonic() < deadline, node.child.tail()
        _, waited0 = node.child.main_thread_sched()
        t0 = time.monotonic()
        node.child.signal(sig)
        node.child.wait_exited(10)
        elapsed = time.monotonic() - t0
        _, waited1 = node.child.main_thread_sched()
        rc = node.child.wait(10)
        assert rc == 0, (rc, node.child.tail())
        # The second is the node's own: the answer in progress is cancelled and the worker has
        # left the engine within it, as the node reports (measured from its stop request).
        line = re.search(r"cancelled the answer in progress \(worker ended after (\d+) ms\)", node.child.output())
        assert line, node.child.tail()
        assert int(line.group(1)) < 1000, line.group(0)
        # The whole exit also tears down the DDS participant, which alone took up to ~1.2 s on this
        # busy 2-core machine (test_sigterm_when_idle_exits_at_once_with_0; a fresh-clone run measured 1.21 s here
        # with 0.01 s of the main thread's time waiting for a CPU): the bound leaves room for that,
        # not for a hang. Time the main thread was ready to run but waited for a CPU that other
        # processes held is not counted.
        cpu_wait = waited1 - waited0
        assert elapsed - cpu_wait < 2.5, f"{elapsed:.2f} s to stop, {cpu_wait:.2f} s of it waiting for a CPU"
        assert "Traceback" not in node.child.output()
        assert not [s for a in diag.messages() for s in a.status if s.name.endswith(": frame")], \
            "the frame finished before the signal: the test did not interrupt a generation"


# == failing at start =============================================================================
BAD_START = [
    ({"max_new_tokens": -5}, 2, "parameter 'max_new_tokens' must be >= 1, got -5"),
    ({"image_mode": "panorama"}, 2, "parameter 'image_mode' must be one of single, tiled; got 'panorama'"),
    ({"transport": "theora"}, 2, "parameter 'transport' must be one of raw, compressed"),
    ({"max_new_tokens": "lots"}, 2, "parameter 'max_new_tokens' must be an integer, got str 'lots'"),
    ({"model": "/nonexistent/model.gguf"}, 1, "/nonexistent/model.gguf"),
    ({"kv_type": "int4"}, 2, "parameter 'kv_type' must be one of f32, f16, q8_0; got 'int4'"),
]


@pytest.mark.parametrize(("params", "code", "message"), BAD_START,
                         ids=["negative_max_new_tokens", "unknown_image_mode", "unknown_transport",
                              "string_max_new_tokens", "missing_model", "unknown_kv_type"])
def test_bad_parameters_fail_at_start_with_one_line(params: dict[str, Any], code: int, message: str,
                                                    tmp_path: Path) -> None:
    domain = random_domain_id()
    with launched_node(tmp_path, domain, {"log_level": "warn"}, params) as child:
        rc = child.wait(60)
        out = child.output()
    assert rc == code, out
    errors = [line for line in out.splitlines() if line.startswith("edgevlm_node: error:")]
    assert len(errors) == 1 and message in errors[0], out
    assert "Traceback" not in out


# == the prefix cache benchmark ====================================================================
def test_prefix_cache_lowers_time_to_first_token_with_identical_text(vlm_pair: tuple[Path, Path]) -> None:
    text, mmproj = vlm_pair
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_prefix_cache.py"), "--model", str(text), "--mmproj",
           str(mmproj), "--runs", "3", "--threads", "2", "--max-new-tokens", "4", "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(report, indent=1))
    assert report["text_identical"] is True
    status = report["prefix_cache_status"]
    assert status["first_load"] == "built" and status["second_load"].startswith("loaded from ")
    assert status["off"] == "disabled"
    # The ~300-token system prompt is prefilled per frame only without the cache.
    assert report["prefill_ratio"] > 1.5, report
    assert report["ttft_ratio"] > 1.0, report


# == a MiniCPM-V 4.6 pair ===========================================================================
@pytest.fixture(scope="module")
def minicpmv_pair() -> tuple[Path, Path]:
    """A random MiniCPM-V 4.6 (real vision widths, 2 vision and 4 text layers; minicpmv_fixtures):
    our converter's text GGUF and 4x mmproj (no window merger: the cheaper encoder)."""
    from minicpmv_fixtures import cached_minicpmv, cached_minicpmv_pair

    files = cached_minicpmv_pair(cached_minicpmv())
    return files["text"], files["4x"]


def test_minicpmv_pair_over_dds_with_prefix_cache_and_deadline(minicpmv_pair: tuple[Path, Path],
                                                               tmp_path: Path) -> None:
    """The node takes a MiniCPM-V 4.6 pair as it takes a SmolVLM one: frames over DDS are described,
    the system prompt's state (the hybrid decoder's recurrent state with it) comes from the prefix
    cache and the text equals the engine's without any cache; a deadline that cannot be met
    publishes the text so far; the counters add up."""
    from diagnostic_msgs.msg import DiagnosticArray

    from edgevlm_ros.engine.vlm import load_vlm

    system_prompt, prompt = "You are a robot's eyes.", "What is in front of the robot?"
    params = {"max_new_tokens": MAX_NEW_TOKENS, "system_prompt": system_prompt, "prompt": prompt,
              "prefix_cache_dir": str(tmp_path / "cache")}
    domain = random_domain_id()
    peer = RosPeer(domain)
    pictures = [exact_picture(seed=5), exact_picture(width=320, height=240, seed=6)]
    with contextlib.ExitStack() as stack:
        stack.callback(peer.close)
        diag = peer.inbox(DiagnosticArray, "/diagnostics", qos=500)
        node = start_node(peer, tmp_path, domain, "mcv", diag, minicpmv_pair, params, with_outputs=True,
                          stack=stack)
        wait_ready(node, timeout=300)
        assert "prefix cache: built" in node.child.output()
        texts = []
        for picture in pictures:
            _, status = node.describe(make_image(picture, "rgb8", peer.now().to_msg()), timeout=300)
            assert status.level == b"\x00", status.message
            values = diag_values(status)
            assert int(values["tokens"]) > 0
            texts.append(values["text"])
        assert node.heartbeat(lambda v: "prefix_cache" in v, 10)["prefix_cache"] == "built"
        assert node.description is not None
        assert [m.data for m in node.description.wait_count(2, 10)][-2:] == texts

        # A deadline that cannot be met: the text so far, WARN, the miss counted.
        (ok,) = peer.set_parameters(node.fqn, {"deadline_ms": 1.0})
        assert ok.successful, ok.reason
        _, status = node.describe(make_image(pictures[0], "rgb8", peer.now().to_msg()), timeout=300)
        values = diag_values(status)
        assert status.level == b"\x01" and values["stop_reason"] == "deadline", status.message
        assert int(values["deadline_misses"]) == 1 and int(values["tokens"]) < MAX_NEW_TOKENS
        assert texts[0].startswith(values["text"])
        counts = {k: int(values[k]) for k in ("frames_received", "frames_described", "frames_failed",
                                              "frames_dropped", "frames_in_flight")}
        assert counts["frames_described"] == 3 and counts["frames_failed"] == 0, counts
        assert counts["frames_received"] == sum(v for k, v in counts.items() if k != "frames_received"), counts

    # The same frames through the engine with no prefix cache at all: the same text.
    vlm = load_vlm(*minicpmv_pair, threads=2, system_prompt=system_prompt, prefix_cache=False)
    assert [vlm.describe(p, prompt, MAX_NEW_TOKENS).text for p in pictures] == texts


def test_mtp_parameter_over_dds_gives_the_same_text(minicpmv_pair: tuple[Path, Path], tmp_path: Path) -> None:
    """mtp:=true with a text file that carries a multi-token-prediction block (the MiniCPM-V pair's
    text with a Qwen3.5 block appended, llama.cpp's layout): the node loads the block, says so, and
    describes frames with the text plain greedy gives (the engine without the block or a cache)."""
    from diagnostic_msgs.msg import DiagnosticArray
    from minicpmv_fixtures import cached_text_with_mtp_block
    from qwen35_fixtures import cached_qwen35_mtp_llama_cpp_gguf

    from edgevlm_ros.engine.vlm import load_vlm

    text = cached_text_with_mtp_block(minicpmv_pair[0], cached_qwen35_mtp_llama_cpp_gguf(4))
    pair = (text, minicpmv_pair[1])
    prompt = "What is in front of the robot?"
    params = {"max_new_tokens": MAX_NEW_TOKENS, "prompt": prompt, "prefix_cache_dir": str(tmp_path / "cache"),
              "mtp": True}
    domain = random_domain_id()
    peer = RosPeer(domain)
    picture = exact_picture(seed=5)
    with contextlib.ExitStack() as stack:
        stack.callback(peer.close)
        diag = peer.inbox(DiagnosticArray, "/diagnostics", qos=500)
        node = start_node(peer, tmp_path, domain, "mtp", diag, pair, params, with_outputs=True, stack=stack)
        wait_ready(node, timeout=300)
        assert "drafts from its MTP block" in node.child.output()
        _, status = node.describe(make_image(picture, "rgb8", peer.now().to_msg()), timeout=300)
        assert status.level == b"\x00", status.message
        text_over_dds = diag_values(status)["text"]
    plain = load_vlm(*minicpmv_pair, threads=2, prefix_cache=False)
    assert plain.describe(picture, prompt, MAX_NEW_TOKENS).text == text_over_dds
