"""The plain functions the node hands its work to (issue 13, item 7), tested without a node: one
frame's work (`ros/frame_work.py`), model-file watching (`ros/model_files.py`), the diagnostics it
publishes (`ros/diagnostics.py`), the demo's scoreboard (`demo/scoreboard.py`) and the latency
stages (`engine/latency.py`). The engine here is the real one, on the small random VLM pair."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from diagnostic_msgs.msg import DiagnosticStatus
from ros_helpers import exact_picture, make_image, vlm_pair_fixture  # noqa: F401 - provides vlm_pair

from edgevlm_ros.demo.scenes import generate_scene
from edgevlm_ros.demo.scoreboard import DemoStats
from edgevlm_ros.engine.latency import FIRST_TOKEN_STAGES, REPORTED_STAGES, LatencyWindow, first_token_ms
from edgevlm_ros.ros import diagnostics, model_files
from edgevlm_ros.ros.frame_slot import FrameCounts
from edgevlm_ros.ros.frame_work import FrameFailure, FrameResult, describe_frame, describe_message, report
from edgevlm_ros.ros.node_params import validate


@pytest.fixture(scope="module")
def vlm(vlm_pair: tuple[Path, Path]) -> Iterator[Any]:
    from edgevlm_ros.engine.vlm import load_vlm

    yield load_vlm(str(vlm_pair[0]), str(vlm_pair[1]), threads=2)


# -- one frame's work ----------------------------------------------------------------------------
def test_a_bad_message_fails_before_the_engine() -> None:
    msg = SimpleNamespace(height=4, width=4, encoding="rgb8", is_bigendian=0, step=12, data=b"\x00" * 10,
                          header=SimpleNamespace(frame_id="cam"))
    with pytest.raises(FrameFailure, match=r"^bad image message \(4x4 rgb8\): ") as failure:
        describe_frame(None, msg, validate({}))  # no engine: the message is refused first
    assert not failure.value.in_engine


def test_a_frame_is_described_as_the_engine_describes_its_pixels(vlm: Any) -> None:
    rgb = exact_picture()
    p = validate({"max_new_tokens": 6, "prompt": "What is this?"})
    result = describe_frame(vlm, make_image(rgb, "bgr8"), p)
    direct = vlm.describe(rgb, p.prompt, p.max_new_tokens)
    assert result.text == direct.text and result.tokens == len(direct.token_ids)
    assert tuple(result.ms) == REPORTED_STAGES
    assert result.convert_ms > 0 and result.ms["preprocess"] >= result.convert_ms
    assert result.ms["total"] >= sum(result.ms[s] for s in ("preprocess", "vision", "prefill", "decode"))


def test_report_of_a_described_frame() -> None:
    ms = {s: 10.0 for s in REPORTED_STAGES}
    msg = SimpleNamespace(format="png", data=b"12345", header=SimpleNamespace(frame_id="cam7"))
    ok = FrameResult("a red circle", ms, 1.5, 4, 20.0, "stop")
    level, message, values = report(ok, msg, validate({}), None)
    assert (level, message) == ("ok", "described in 10 ms (4 tokens, stop)")
    assert [k for k, _ in values] == ["text", "tokens", "tokens_per_s", "stop_reason", "drafts_accepted",
                                      *(f"{s}_ms" for s in REPORTED_STAGES), "convert_ms", "age_ms", "image",
                                      "frame_id"]
    assert dict(values)["image"] == "png (5 bytes)" and math.isnan(dict(values)["age_ms"])
    late = FrameResult("a red", ms, 1.5, 2, 20.0, "deadline")
    level, message, _ = report(late, msg, validate({"deadline_ms": 80}), 12.0)
    assert late.deadline_miss and level == "warn"
    assert message == "deadline of 80 ms missed: published the text after 2 tokens"
    assert describe_message(make_image(exact_picture(), "mono8")) == "160x96 mono8"


# -- model files ---------------------------------------------------------------------------------
def test_each_model_file_change_is_reported_once(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + bytes(10))
    files = [model_files.watch("model", path)]
    assert model_files.changes(files) == []
    path.unlink()
    ((f, level, text),) = model_files.changes(files)
    assert f is files[0] and level == "error" and text.startswith(f"model file {path.resolve()} was deleted")
    assert model_files.changes(files) == []  # once
    assert {lvl for lvl, _ in model_files.FILE_STATES.values()} <= set(diagnostics.LEVELS)


# -- diagnostics ---------------------------------------------------------------------------------
def test_key_values_and_levels() -> None:
    assert diagnostics.key_value("x", 1.25).value == "1.2"
    assert diagnostics.key_value("x", math.nan).value == "nan"
    assert diagnostics.key_value("n", 3).value == "3"
    status = diagnostics.status("warn", "robot/edgevlm: frame", "late", "/robot/edgevlm", [("a", 1)])
    assert status.level == DiagnosticStatus.WARN and [(kv.key, kv.value) for kv in status.values] == [("a", "1")]


def test_worker_state_and_heartbeat_level() -> None:
    assert diagnostics.worker_state(10.0, 12.5, 3, "/image", "x") == ("describing", "describing a frame for 2.5 s")
    assert diagnostics.worker_state(None, 1.0, 0, "/image", "x") == ("waiting", "no frame received yet on /image")
    assert diagnostics.worker_state(None, 1.0, 5, "/image", "ok") == ("idle", "waiting for the next frame; last: ok")
    counters = diagnostics.counter_values(FrameCounts(received=5, described=4, dropped=1), LatencyWindow())
    assert dict(counters)["frames_received"] == 5 and dict(counters)["frames_in_flight"] == 0
    p = validate({})
    idle = diagnostics.heartbeat("n: worker", "/n", "idle", "m", "error", counters, "built", p, "/image", [])
    busy = diagnostics.heartbeat("n: worker", "/n", "describing", "m", "error", counters, "built", p, "/image", [])
    assert idle.level == DiagnosticStatus.ERROR and busy.level == DiagnosticStatus.OK


# -- the demo's scoreboard -----------------------------------------------------------------------
def test_a_description_waits_for_its_ground_truth() -> None:
    stats = DemoStats()
    scene = generate_scene(3, 0)
    ms = {s: 5.0 for s in REPORTED_STAGES}
    line = stats.add_description((1, 2), scene.caption, ms)
    assert "(ground truth not here yet)" in line and stats.pending == {(1, 2): scene.caption}
    late = stats.add_truth((1, 2), scene)
    assert late is not None and late.startswith(f"       (late ground truth) {scene.caption!r} objects")
    other = generate_scene(3, 1)
    assert stats.add_truth((1, 3), other) is None
    line = stats.add_description((1, 3), other.caption, ms)
    assert line.startswith(f"[   2] {other.caption!r}\n       truth: {other.caption!r} objects")
    summary = stats.summary()
    assert summary["frames_described"] == 2 and summary["exact_captions"] == 1.0
    assert summary["latency_ms"]["total"] == {"p50": 5.0, "p99": 5.0}


def test_first_token_is_preprocess_vision_and_prefill() -> None:
    timings = {"preprocess": 1.0, "vision": 2.0, "prefill": 4.0, "decode": 8.0, "total": 15.0}
    assert FIRST_TOKEN_STAGES == ("preprocess", "vision", "prefill") and first_token_ms(timings) == 7.0
    assert np.isclose(first_token_ms({**timings, "vision": 0.5}), 5.5)
