"""Fault injection and resource bounds, each against a real node process over DDS (issue 7, items 4
and 6). No mocks of ROS or of the engine; the one artificial fault is the test's fault injection
(EDGEVLM_TEST_FAULT, see test/fault_node.py: the node started here is that wrapper, which patches it
into the production node before its main()), which makes a named frame's generation fail half-way.

Two nodes share one random domain:
- /fault1 (raw images): the test hook set, its model pair copied to a temporary folder (the
  deletion test removes the copies), max_image_pixels 20000 (160x125 frames pass, 160x126 do not);
- /fault2 (compressed images): no hook, default limits.

Every fault must be reported once (one ERROR log line + one ERROR diagnostic stamped with the
frame's own stamp), survived (the next good frame is described), and must never put a description
on the wrong frame: `check_ties` compares the node's whole history of frame diagnostics with what
it published on `description`, after every test.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import signal
import struct
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fault_node import fault_node_command
from ros_helpers import (  # noqa: F401 - vlm_pair_fixture provides the vlm_pair fixture
    Child,
    Inbox,
    RosPeer,
    diag_values,
    encode_compressed,
    exact_picture,
    frame_status,
    make_compressed,
    make_image,
    random_domain_id,
    ros_env,
    run_launch_file,
    vlm_pair_fixture,
    worker_status,
    write_params_file,
)
from test_node import RunningNode, wait_ready

FAULT_FRAME_ID = "edgevlm-test-fault"  # frames with this frame_id fail in /fault1's decoder
MAX_PIXELS = 20000
MAX_NEW_TOKENS = 8
OK, WARN, ERROR = b"\x00", b"\x01", b"\x02"

# A /diagnostics subscriber process: prints "ready" once the node's diagnostics reach it (so it is
# matched), then listens until it is killed.
LISTENER = str(Path(__file__).resolve().parent / "diag_listener.py")


def stamp_key(stamp: Any) -> tuple[int, int]:
    return stamp.sec, stamp.nanosec


@dataclass
class FaultNode(RunningNode):
    description_sub: Any = None  # this process' reader of the node's description topic


@dataclass
class Faults:
    domain: int
    peer: RosPeer
    diag: Inbox
    raw: FaultNode
    compressed: FaultNode
    copies: tuple[Path, Path]  # /fault1's model pair
    tmp: Path


def start(peer: RosPeer, tmp: Path, domain: int, namespace: str, diag: Inbox, pair: tuple[Path, Path],
          params: dict[str, Any], stack: contextlib.ExitStack, transport: str = "raw",
          env: dict[str, str] | None = None) -> FaultNode:
    """The node as the launch file starts it (through the stand-in), with extra environment."""
    from rclpy.qos import QoSProfile, ReliabilityPolicy
    from sensor_msgs.msg import CompressedImage, Image
    from std_msgs.msg import String

    folder = tmp / namespace
    folder.mkdir(parents=True, exist_ok=True)
    image = f"/{namespace}_camera"
    args = {"namespace": namespace, "model": str(pair[0]), "mmproj": str(pair[1]), "image": image, "threads": "2",
            "transport": transport, "params_file": str(write_params_file(folder / "params.yaml", params))}
    (launched,) = run_launch_file(args, folder, resolve=fault_node_command)
    child = Child(launched.cmd, ros_env(domain, folder / "ros_log", {**launched.env, **(env or {})}), namespace)
    stack.callback(child.kill)
    msg_type, topic = (CompressedImage, f"{image}/compressed") if transport == "compressed" else (Image, image)
    pub = peer.publisher(msg_type, topic, QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE))
    description = Inbox(f"/{namespace}/description")
    subscription = peer.node.create_subscription(String, f"/{namespace}/description", description, 500)
    return FaultNode(child, launched.fqn, peer, diag, pub, description=description, description_sub=subscription)


def wait_outputs_matched(node: FaultNode, timeout: float = 30.0) -> None:
    """Until this process' description and /diagnostics readers are matched with the node's
    writers: a heartbeat has arrived, and the description subscription counts a publisher."""
    node.heartbeat(lambda v: True, timeout)
    node.peer.wait_publishers(node.description_sub, timeout=timeout)


@pytest.fixture(scope="module")
def faults(vlm_pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Faults]:
    from diagnostic_msgs.msg import DiagnosticArray

    tmp = tmp_path_factory.mktemp("faults")
    copies = (tmp / "models" / "text.gguf", tmp / "models" / "mmproj.gguf")
    copies[0].parent.mkdir()
    for src, dst in zip(vlm_pair, copies, strict=True):
        shutil.copyfile(src, dst)
    domain = random_domain_id()
    peer = RosPeer(domain)
    with contextlib.ExitStack() as stack:
        stack.callback(peer.close)
        diag = peer.inbox(DiagnosticArray, "/diagnostics", qos=1000)
        raw = start(peer, tmp, domain, "fault1", diag, copies,
                    {"max_new_tokens": MAX_NEW_TOKENS, "max_image_pixels": MAX_PIXELS}, stack,
                    env={"EDGEVLM_TEST_FAULT": f"raise_in_decode:{FAULT_FRAME_ID}"})
        comp = start(peer, tmp, domain, "fault2", diag, vlm_pair, {"max_new_tokens": MAX_NEW_TOKENS}, stack,
                     transport="compressed")
        wait_ready(raw)
        wait_ready(comp)
        wait_outputs_matched(raw)
        wait_outputs_matched(comp)
        raw.child.wait_for_line(r"\[WARN\].*TEST HOOK EDGEVLM_TEST_FAULT=raise_in_decode:" + FAULT_FRAME_ID, 5)
        picture = exact_picture()
        for node, msg in ((raw, make_image(picture, "rgb8", peer.now().to_msg())),
                          (comp, make_compressed(encode_compressed(picture, "png"), "png", peer.now().to_msg()))):
            _, status = node.describe(msg)  # discovery settled both ways, the engine warm
            assert status.level == OK, status.message
        yield Faults(domain, peer, diag, raw, comp, copies, tmp)


# -- checks shared by every test --------------------------------------------------------------------
def frame_statuses(node: RunningNode, start: int = 0) -> list[tuple[Any, Any]]:
    return [(a, s) for a, s in node.statuses(start) if s.name.endswith(": frame")]


def wait_idle(node: RunningNode) -> dict[str, str]:
    """A heartbeat saying the worker is idle with nothing waiting."""
    return node.heartbeat(lambda v: v["state"] != "describing" and v["frames_in_flight"] == "0", 120)


def check_ties(node: RunningNode) -> None:
    """Over the node's whole history: one description per described frame, in order, with that
    frame's text; no frame both failed and described; every failed frame's stamp without a
    description; the counters balanced."""
    values = wait_idle(node)
    assert node.description is not None
    described = [(stamp_key(a.header.stamp), diag_values(s)["text"]) for a, s in frame_statuses(node)
                 if s.level in (OK, WARN)]
    failed = {stamp_key(a.header.stamp) for a, s in frame_statuses(node) if s.level == ERROR}
    deadline = time.monotonic() + 10
    while len(node.description) < len(described) and time.monotonic() < deadline:
        time.sleep(0.05)  # the descriptions of the last frames are still on their way
    texts = [m.data for m in node.description.messages()]
    assert texts == [t for _, t in described], (texts, described)
    assert not failed & {k for k, _ in described}, "a failed frame was described too"
    c = {k: int(values[f"frames_{k}"]) for k in ("received", "described", "failed", "dropped", "in_flight")}
    assert c["received"] == c["described"] + c["failed"] + c["dropped"] + c["in_flight"], c
    assert c["described"] == len(described) and c["failed"] == len(failed), (c, len(described), len(failed))


def error_lines(node: RunningNode, fragment: str) -> list[str]:
    return [ln for ln in node.child.lines if "[ERROR]" in ln and fragment in ln]


def expect_one_failure(node: RunningNode, msg: Any, fragment: str) -> Any:
    """Sends msg; its frame diagnostic must be ERROR with fragment, stamped with msg's stamp, and
    logged once."""
    array, status = node.describe(msg)
    assert status.level == ERROR, (fragment, status.message)
    assert fragment in status.message, status.message
    assert array.header.stamp == msg.header.stamp
    node.child.wait_for_line(r"\[ERROR\].*" + re.escape(fragment), 10)
    assert len(error_lines(node, fragment)) == 1, node.child.tail()
    assert len([a for a, _ in frame_statuses(node) if a.header.stamp == msg.header.stamp]) == 1
    return status


def expect_described(node: RunningNode, msg: Any) -> dict[str, str]:
    array, status = node.describe(msg)
    assert status.level == OK, status.message
    assert array.header.stamp == msg.header.stamp
    return diag_values(status)


# -- faults -----------------------------------------------------------------------------------------------
def test_engine_raising_mid_generation_is_reported_once_and_leaves_nothing_behind(faults: Faults) -> None:
    node, now = faults.raw, faults.peer.now
    picture = exact_picture(seed=11)
    before = expect_described(node, make_image(picture, "rgb8", now().to_msg()))

    bad = make_image(exact_picture(seed=12), "rgb8", now().to_msg(), frame_id=FAULT_FRAME_ID)
    status = expect_one_failure(node, bad, "injected by the test hook EDGEVLM_TEST_FAULT")
    # Half the token budget was really decoded before the engine raised: a mid-generation failure.
    assert re.search(rf"InjectedFault: .* after {MAX_NEW_TOKENS // 2} decoded tokens", status.message), status.message
    assert "engine failure on a 160x96 frame" in status.message

    # The next frame restores the KV cache: the same picture gives exactly the text it gave before.
    after = expect_described(node, make_image(picture, "rgb8", now().to_msg()))
    assert after["text"] == before["text"] and after["tokens"] == before["tokens"]
    assert int(after["frames_failed"]) == int(before["frames_failed"]) + 1
    check_ties(node)


def corrupt_png(png: bytes) -> bytes:
    """The PNG with its pixel data (IDAT) replaced by noise under a valid CRC: every header check
    passes (signature, IHDR size, chunk CRCs), the decoder fails inside the deflate stream."""
    out = bytearray(png)
    pos = 8
    while pos < len(png):
        (n,) = struct.unpack(">I", png[pos:pos + 4])
        if png[pos + 4:pos + 8] == b"IDAT":
            out[pos + 10:pos + 8 + n] = np.random.default_rng(1).bytes(n - 2)  # keep the zlib header
            out[pos + 8 + n:pos + 12 + n] = struct.pack(">I", zlib.crc32(bytes(out[pos + 4:pos + 8 + n])))
            return bytes(out)
        pos += 12 + n
    raise AssertionError("no IDAT chunk")


def test_image_that_fails_in_the_decoder_is_reported_once(faults: Faults) -> None:
    """No RGB array makes preprocess() itself fail (it takes 1x1 up to 1x16M pixels), so the image
    that fails is one whose headers are all valid and whose pixel data is not."""
    node, now = faults.compressed, faults.peer.now
    picture = exact_picture(seed=13)
    png = encode_compressed(picture, "png")
    expect_one_failure(node, make_compressed(corrupt_png(png), "png", now().to_msg()),
                       "could not decode PNG data")
    expect_described(node, make_compressed(png, "png", now().to_msg()))
    check_ties(node)


def test_parameter_change_during_generation(faults: Faults) -> None:
    """Parameters set while a frame is inside the engine: the call answers at once, the frame in
    progress finishes with the values it started with, the next frame uses the new ones. A
    parameter change is no fault: one INFO line each, no ERROR; a bad value is refused with a
    WARN line and changes nothing."""
    node, peer = faults.raw, faults.peer
    # A generation long enough for the change to land in its middle on this machine, whatever its
    # speed: ~6 s of decoding at the rate a probe frame measured (a quiet machine decodes the small
    # test model ~10x faster than a loaded one), within the model's context.
    (ok,) = peer.set_parameters(node.fqn, {"max_new_tokens": 200})
    assert ok.successful, ok.reason
    probe = expect_described(node, make_image(exact_picture(seed=21), "rgb8", peer.now().to_msg()))
    assert probe["stop_reason"] == "max_tokens", probe
    ms_per_token = float(probe["decode_ms"]) / int(probe["tokens"])
    long_tokens = max(200, min(3000, int(6000 / max(ms_per_token, 1e-3))))
    first_line = len(node.child.lines)
    (ok,) = peer.set_parameters(node.fqn, {"max_new_tokens": long_tokens})
    assert ok.successful, ok.reason
    try:
        start = len(faults.diag)
        msg = make_image(exact_picture(), "rgb8", peer.now().to_msg())
        deadline = time.monotonic() + 30
        while True:  # best effort can lose a frame: sent again until a heartbeat says it is in the engine
            node.pub.publish(msg)
            try:
                node.heartbeat(lambda v: v["state"] == "describing", 2.5)
                break
            except AssertionError:
                assert time.monotonic() < deadline, node.child.tail()
        t0 = time.monotonic()
        results = peer.set_parameters(node.fqn, {"max_new_tokens": 3, "prompt": "What colour is the floor?"})
        answered_s = time.monotonic() - t0
        assert all(r.successful for r in results), [r.reason for r in results]
        (refused,) = peer.set_parameters(node.fqn, {"max_new_tokens": -1})
        assert not refused.successful and "'max_new_tokens' must be >= 1" in refused.reason
        mine = [(a, s) for a, s in frame_statuses(node, start) if a.header.stamp == msg.header.stamp]
        assert not mine, "the frame was already described: the change did not land during its generation"
        assert answered_s < 2.0, f"set_parameters waited {answered_s:.1f} s for the worker"

        array = faults.diag.wait_for(lambda a: (s := frame_status(a)) is not None and s.hardware_id == node.fqn
                                     and a.header.stamp == msg.header.stamp, 120, start=start)
        values = diag_values(frame_status(array))
        assert frame_status(array).level == OK, frame_status(array).message
        assert (values["stop_reason"], values["tokens"]) == ("max_tokens", str(long_tokens)), values

        following = expect_described(node, make_image(exact_picture(), "rgb8", peer.now().to_msg()))
        assert int(following["tokens"]) <= 3, following
        again = expect_described(node, make_image(exact_picture(), "rgb8", peer.now().to_msg()))
        assert again["text"] == following["text"]  # the new prompt, deterministically
    finally:
        results = peer.set_parameters(node.fqn, {"max_new_tokens": MAX_NEW_TOKENS,
                                                 "prompt": "Describe the image in one sentence."})
        assert all(r.successful for r in results)
    lines = node.child.lines[first_line:]
    # endswith: the long generation's own line can read "set to 3xx"
    assert sum(ln.endswith("parameter 'max_new_tokens' set to 3") for ln in lines) == 1, lines
    assert sum("parameter 'prompt' set to 'What colour is the floor?'" in ln for ln in lines) == 1, lines
    assert sum("[WARN]" in ln and "parameter change refused" in ln for ln in lines) == 1, lines
    assert not [ln for ln in lines if "[ERROR]" in ln], lines
    check_ties(node)


def test_model_files_deleted_while_running(faults: Faults) -> None:
    """The node has its model files mapped: deleted, it says so once per file (a restart would
    fail) and goes on describing, with the same text as before."""
    node, peer = faults.raw, faults.peer
    picture = exact_picture(seed=14)
    before = expect_described(node, make_image(picture, "rgb8", peer.now().to_msg()))

    def file_status(label: str, state: str) -> Any:
        def match(array: Any) -> bool:
            return any(s.hardware_id == node.fqn and s.name.endswith(": model files")
                       and s.message.startswith(f"{label} file ") and state in s.message for s in array.status)
        return match

    for path, label in zip(faults.copies, ("model", "mmproj"), strict=True):
        start = len(faults.diag)
        path.unlink()
        array = faults.diag.wait_for(file_status(label, "was deleted"), 10, start=start)
        (status,) = [s for s in array.status if s.name.endswith(": model files")]
        assert status.level == ERROR and str(path) in status.message, status.message
        node.child.wait_for_line(rf"\[ERROR\].*{label} file .* was deleted", 5)

    after = expect_described(node, make_image(picture, "rgb8", peer.now().to_msg()))
    assert after["text"] == before["text"]
    # Reported once: three heartbeats later still one line and one diagnostic per file.
    values = {}
    for _ in range(3):
        values = node.heartbeat(lambda v: True, 10)
    assert (values["model_file"], values["mmproj_file"]) == ("deleted", "deleted"), values
    for label in ("model", "mmproj"):
        assert len(error_lines(node, f"]: {label} file ")) == 1, node.child.tail()
        reports = [s for a in faults.diag.messages() if file_status(label, "was deleted")(a)
                   for s in a.status if s.name.endswith(": model files") and s.message.startswith(f"{label} file ")]
        assert len(reports) == 1, reports
    check_ties(node)


def test_diagnostics_subscribers_coming_and_going(faults: Faults) -> None:
    """While frames stream in at 10 Hz, /diagnostics readers join and leave: processes killed
    with SIGKILL (their DDS endpoints linger until their lease runs out) or ended with SIGTERM,
    and readers in this process created and destroyed. Nothing of it is the node's fault: it
    logs no error and describes every frame it takes."""
    from diagnostic_msgs.msg import DiagnosticArray

    node, peer = faults.raw, faults.peer
    first_line = len(node.child.lines)
    start = len(faults.diag)
    described_before = int(wait_idle(node)["frames_described"])
    stop = False
    sent: set[tuple[int, int]] = set()

    def stream() -> None:
        picture = exact_picture(seed=15)
        while not stop:
            msg = make_image(picture, "rgb8", peer.now().to_msg())
            sent.add(stamp_key(msg.header.stamp))
            node.pub.publish(msg)
            time.sleep(0.1)  # the camera's 10 Hz pacing, not a wait for a condition

    streamer = threading.Thread(target=stream, daemon=True)
    streamer.start()
    try:
        env = ros_env(faults.domain, faults.tmp / "listener_log")
        for round_ in range(2):
            listeners = [Child([sys.executable, LISTENER, f"{round_}_{i}", node.fqn], env, f"listener{i}")
                         for i in range(3)]
            try:
                for listener in listeners:
                    listener.wait_for_line(r"^ready$", 30)
                for i, listener in enumerate(listeners):
                    listener.signal(signal.SIGKILL if i % 2 == 0 else signal.SIGTERM)
                    listener.wait(10)
            finally:
                for listener in listeners:
                    listener.kill()
            for i in range(2):
                local = RosPeer(faults.domain, name=f"diag_peer_{round_}_{i}")
                try:
                    box = local.inbox(DiagnosticArray, "/diagnostics")
                    box.wait_for(lambda a: any(s.hardware_id == node.fqn for s in a.status), 30)
                finally:
                    local.close()
        # Still describing after the churn: two more frames taken and described.
        node.heartbeat(lambda v: int(v["frames_described"]) >= described_before + 2, 60)
        during = int(node.heartbeat(lambda v: True, 10)["frames_described"])
        node.heartbeat(lambda v: int(v["frames_described"]) >= during + 2, 60)
    finally:
        stop = True
        streamer.join(5)
    mine = frame_statuses(node, start)
    assert len(mine) >= 4
    assert all(s.level == OK for _, s in mine), [s.message for _, s in mine if s.level != OK]
    assert all(stamp_key(a.header.stamp) in sent for a, _ in mine)
    assert not [ln for ln in node.child.lines[first_line:] if "[ERROR]" in ln or "Traceback" in ln]
    check_ties(node)


def test_the_test_hook_is_inert_unless_set(faults: Faults) -> None:
    """/fault2 has no EDGEVLM_TEST_FAULT: a frame carrying the hook's frame_id is described."""
    node = faults.compressed
    png = encode_compressed(exact_picture(seed=16), "png")
    expect_described(node, make_compressed(png, "png", faults.peer.now().to_msg(), frame_id=FAULT_FRAME_ID))
    check_ties(node)


def test_model_file_states(tmp_path: Path) -> None:
    """What the heartbeat's watch of a mapped model file tells apart (plain Python, no node)."""
    from edgevlm_ros.ros.model_files import watch as _watch

    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + bytes(100))
    watched = _watch("model", path)
    assert watched.look() == "ok"
    with open(path, "r+b") as f:  # rewritten in place, as `cp new.gguf m.gguf` does
        f.write(b"GGUF" + bytes(50))
        f.truncate()
    assert watched.look() == "modified"
    new = tmp_path / "new.gguf"
    new.write_bytes(b"GGUF" + bytes(100))
    new.replace(path)  # the safe way: a new file renamed over the old one
    assert watched.look() == "replaced"
    path.unlink()
    assert watched.look() == "deleted"


def test_test_hook_values() -> None:
    from fault_node import parse_test_fault

    from edgevlm_ros.ros.node_params import ParamError

    assert parse_test_fault("raise_in_decode:cam-7") == "cam-7"
    for bad in ("", "raise_in_decode", "raise_in_decode:", "raise_in_vision:x", "1"):
        with pytest.raises(ParamError, match="is not a test fault"):
            parse_test_fault(bad)


# -- resource bounds ------------------------------------------------------------------------------------
def sized(width: int, height: int) -> np.ndarray:
    return np.ascontiguousarray(np.resize(exact_picture(), (height, width, 3)))


def test_max_image_pixels_is_checked_from_the_header(faults: Faults) -> None:
    """/fault1 runs with max_image_pixels 20000: a frame of exactly that many pixels is described,
    one pixel row more is refused, and so is a forged 4000x4000 header over 10 bytes of data: the
    size is refused from the header, before the data is even looked at. /fault2 (the default
    limit, 16 MP) refuses a PNG whose header claims 100000x100000 before decoding it."""
    raw, comp, now = faults.raw, faults.compressed, faults.peer.now
    expect_described(raw, make_image(sized(160, 125), "rgb8", now().to_msg()))
    expect_one_failure(raw, make_image(sized(160, 126), "rgb8", now().to_msg()),
                       "160x126 = 20160 pixels is larger than the limit of 20000 pixels")
    forged = make_image(sized(160, 96), "rgb8", now().to_msg())
    forged.width, forged.height, forged.step, forged.data = 4000, 4000, 12000, bytes(10)
    expect_one_failure(raw, forged, "4000x4000 = 16000000 pixels is larger than the limit of 20000 pixels")
    expect_described(raw, make_image(sized(160, 96), "rgb8", now().to_msg()))

    png = bytearray(encode_compressed(sized(160, 96), "png"))
    png[16:24] = struct.pack(">II", 100000, 100000)  # IHDR width, height (its CRC now wrong: never read)
    expect_one_failure(comp, make_compressed(bytes(png), "png", now().to_msg()),
                       "PNG image of 100000x100000 = 10000000000 pixels is larger than the limit")
    check_ties(raw)
    check_ties(comp)


def test_max_new_tokens_is_bounded_by_the_context(faults: Faults) -> None:
    """More tokens than the context holds can never come out (and the engine would reserve room
    for all of them per frame): such values are refused at run time with the reason."""
    node, peer = faults.raw, faults.peer
    for value in (4097, 10**12):
        (result,) = peer.set_parameters(node.fqn, {"max_new_tokens": value})
        assert not result.successful, value
        assert f"'max_new_tokens' must be <= 4096 (the engine's context size), got {value}" in result.reason
    (ok,) = peer.set_parameters(node.fqn, {"max_new_tokens": 2})
    assert ok.successful, ok.reason
    try:
        values = expect_described(node, make_image(exact_picture(seed=17), "rgb8", peer.now().to_msg()))
        assert int(values["tokens"]) <= 2 and values["stop_reason"] in ("max_tokens", "stop_token"), values
    finally:
        (ok,) = peer.set_parameters(node.fqn, {"max_new_tokens": MAX_NEW_TOKENS})
        assert ok.successful
    check_ties(node)


def test_deadline_bounds_the_time_of_a_long_generation(faults: Faults) -> None:
    """3000 tokens would take over a minute here; with deadline_ms the frame ends on time (within
    one decode step and the detokenizer), publishes the text so far and counts the miss."""
    node, peer = faults.raw, faults.peer
    probe = expect_described(node, make_image(exact_picture(), "rgb8", peer.now().to_msg()))
    before_decode = sum(float(probe[f"{s}_ms"]) for s in ("preprocess", "vision", "prefill"))
    deadline = before_decode + 1000.0
    results = peer.set_parameters(node.fqn, {"max_new_tokens": 3000, "deadline_ms": deadline})
    assert all(r.successful for r in results), [r.reason for r in results]
    try:
        msg = make_image(exact_picture(), "rgb8", peer.now().to_msg())
        array, status = node.describe(msg)
        values = diag_values(status)
        assert status.level == WARN and values["stop_reason"] == "deadline", status.message
        tokens = int(values["tokens"])
        assert 2 <= tokens < 3000
        step_ms = float(values["decode_ms"]) / tokens
        total = float(values["total_ms"])
        print(f"deadline {deadline:.0f} ms: {tokens} tokens in {total:.0f} ms (a decode step {step_ms:.0f} ms)")
        # One decode step past the deadline at most, plus the detokenizer; slack for this loaded machine.
        assert total <= deadline + max(3 * step_ms, 50.0) + 250.0, (total, deadline, step_ms)
        assert total >= deadline - 50.0, (total, deadline)
    finally:
        results = peer.set_parameters(node.fqn, {"max_new_tokens": MAX_NEW_TOKENS, "deadline_ms": 0.0})
        assert all(r.successful for r in results)
    check_ties(node)


# -- at start -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("params", "env", "message"), [
    ({"max_new_tokens": 100000}, {}, "parameter 'max_new_tokens' must be <= 4096 (the engine's context size), "
                                     "got 100000"),
    ({}, {"EDGEVLM_TEST_FAULT": "explode"}, "EDGEVLM_TEST_FAULT='explode' is not a test fault"),
], ids=["max_new_tokens_above_context", "bad_test_hook"])
def test_refused_at_start_with_one_line(vlm_pair: tuple[Path, Path], tmp_path: Path, params: dict[str, Any],
                                        env: dict[str, str], message: str) -> None:
    args = {"model": str(vlm_pair[0]), "mmproj": str(vlm_pair[1]), "threads": "2", "log_level": "warn",
            "params_file": str(write_params_file(tmp_path / "params.yaml", params))}
    (launched,) = run_launch_file(args, tmp_path, resolve=fault_node_command)
    with Child(launched.cmd, ros_env(random_domain_id(), tmp_path / "ros_log", {**launched.env, **env}),
               "node") as child:
        rc = child.wait(120)
    out = child.output()
    errors = [ln for ln in out.splitlines() if ln.startswith("edgevlm_node: error:")]
    assert rc == 2 and len(errors) == 1 and message in errors[0], out
    assert "Traceback" not in out


def test_both_nodes_survived_every_fault(faults: Faults) -> None:
    """The last test of the module: the nodes are still up, balanced, and stop cleanly."""
    for node in (faults.raw, faults.compressed):
        values = wait_idle(node)
        print(f"{node.fqn}: received {values['frames_received']}, described {values['frames_described']}, "
              f"failed {values['frames_failed']}, dropped {values['frames_dropped']}")
        check_ties(node)
        beats = [diag_values(worker_status(a)) for a in faults.diag.messages()
                 if worker_status(a) is not None and worker_status(a).hardware_id == node.fqn]
        assert beats and all("model_file" in b and "mmproj_file" in b for b in beats)
        assert node.child.proc.poll() is None
        node.child.signal(signal.SIGTERM)
        assert node.child.wait(10) == 0, node.child.tail()
        assert "Traceback" not in node.child.output()

