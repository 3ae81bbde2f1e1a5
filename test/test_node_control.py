"""The node for control loops, for real over DDS (issue 17): several cameras served round robin, the
`ask` service and the `describe` action (edgevlm_interfaces, built by the set-up from the PyPI
rosidl wheels) called from this process and from a separate one, constrained answers, refusals,
and the managed lifecycle node driven over lifecycle_msgs. No mocks of ROS or of the engine.

Fast forms by default; EDGEVLM_TEST_CONTROL_FULL=1 runs the issue's full counts (100 questions per
model, a longer three-camera run).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ros_helpers import (  # noqa: F401 - vlm_pair_fixture provides the vlm_pair fixture
    Inbox,
    RosPeer,
    diag_values,
    exact_picture,
    frame_status,
    launched_node,
    make_image,
    python_child,
    random_domain_id,
    ros_env,
    vlm_pair_fixture,
    worker_status,
)

FULL = bool(os.environ.get("EDGEVLM_TEST_CONTROL_FULL"))
N_QUESTIONS = 100 if FULL else 12
CAMERA_SECONDS = 40.0 if FULL else 12.0
YES_NO = ["yes", "no"]


def _ask(peer: RosPeer, client: Any, camera: str, question: str, **fields: Any) -> Any:
    from edgevlm_interfaces.srv import Ask

    request = Ask.Request(camera=camera, question=question)
    for k, v in fields.items():
        setattr(request, k, v)
    return RosPeer.call(client, request, probe=Ask.Request())  # an empty question: refused at once


def _picture(i: int) -> np.ndarray:
    rng = np.random.default_rng(1000 + i)
    return np.ascontiguousarray(rng.integers(0, 256, (96, 128, 3), dtype=np.uint8))


@dataclass
class ControlNode:
    child: Any
    fqn: str
    peer: RosPeer
    diag: Inbox
    pubs: dict[str, Any]
    ask: Any

    def frame_statuses(self, camera: str, start: int = 0) -> list[tuple[Any, Any]]:
        out = []
        for array in self.diag.messages(start):
            s = frame_status(array)
            if s is not None and s.hardware_id == self.fqn and diag_values(s).get("camera") == camera:
                out.append((array, s))
        return out

    def publish(self, camera: str, rgb: np.ndarray) -> Any:
        msg = make_image(rgb, "rgb8", self.peer.now().to_msg())
        msg.header.frame_id = f"{camera}_optical"
        self.pubs[camera].publish(msg)
        return msg


@contextlib.contextmanager
def control_node(tmp: Path, vlm_pair: tuple[Path, Path] | None, params: dict[str, Any],
                 namespace: str = "ctl") -> Iterator[ControlNode]:
    from diagnostic_msgs.msg import DiagnosticArray
    from rclpy.qos import QoSProfile, ReliabilityPolicy
    from sensor_msgs.msg import Image

    from edgevlm_interfaces.srv import Ask

    domain = random_domain_id()
    peer = RosPeer(domain)
    try:
        diag = peer.inbox(DiagnosticArray, "/diagnostics", qos=1000)
        args = {"namespace": namespace, "threads": "2"}
        if vlm_pair is not None:
            args |= {"model": str(vlm_pair[0]), "mmproj": str(vlm_pair[1])}
        with launched_node(tmp, domain, args, params, name=namespace) as child:
            child.wait_for_line(r"describing frames from", 180)
            cams = params.get("cameras") or [""]
            qos = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE)
            pubs = {c: peer.publisher(Image, f"/{namespace}/{c}/image" if c else f"/{namespace}/image", qos)
                    for c in cams}
            for p in pubs.values():
                RosPeer.wait_subscribers(p)
            client = peer.node.create_client(Ask, f"/{namespace}/ask")
            RosPeer.connect(client, Ask.Request())  # the tests' own call_async calls come after it
            yield ControlNode(child, f"/{namespace}/edgevlm", peer, diag, pubs, client)
    finally:
        peer.close()


# -- several cameras ----------------------------------------------------------------------------
def test_three_cameras_at_30_10_and_1_hz_are_all_served(vlm_pair: tuple[Path, Path], tmp_path: Path) -> None:
    """Camera processes at 30, 10 and 1 Hz: every camera gets descriptions, the 1 Hz camera's frames
    are described within one description time of arriving (their age at publication is at most two
    description times, plus 0.25 s for DDS and the heartbeat's own work), the counters add up per
    camera, and each frame's diagnostic carries that frame's own stamp and frame_id."""
    params = {"cameras": ["fast", "mid", "slow"], "max_new_tokens": 6}
    with control_node(tmp_path, vlm_pair, params) as node:
        domain_env = ros_env(node.peer.context.get_domain_id(), tmp_path / "cam_logs")
        rates = {"fast": 30.0, "mid": 10.0, "slow": 1.0}
        children = []
        try:
            for cam, rate in rates.items():
                count = int(rate * CAMERA_SECONDS)
                child = python_child(["camera", "--topic", f"/ctl/{cam}/image", "--rate", str(rate), "--count",
                                      str(count), "--width", "160", "--height", "120", "--verbose"],
                                     domain_env, f"camera_{cam}")
                children.append((cam, child))
            for _, child in children:
                child.wait_for_line(r'"sent"', CAMERA_SECONDS + 60)
            time.sleep(3.0)  # the last frames described, a heartbeat after them
            heartbeat = diag_values(worker_status(node.diag.wait_for(
                lambda a: worker_status(a) is not None and worker_status(a).hardware_id == node.fqn, 5.0,
                start=len(node.diag))))
            sent: dict[str, dict[tuple[int, int], int]] = {}
            for cam, child in children:
                stamps = {}
                for line in child.output().splitlines():
                    with contextlib.suppress(ValueError):
                        d = json.loads(line)
                        if "frame" in d:
                            stamps[(d["sec"], d["nanosec"])] = d["frame"]
                sent[cam] = stamps
        finally:
            for _, child in children:
                child.kill()
        totals = []
        for cam in rates:
            statuses = node.frame_statuses(cam)
            assert statuses, f"camera {cam}: no description"
            for array, status in statuses:
                stamp = (array.header.stamp.sec, array.header.stamp.nanosec)
                assert stamp in sent[cam], f"camera {cam}: a diagnostic stamped {stamp}, not one of its frames"
                assert array.header.frame_id == "camera" and diag_values(status)["frame_id"] == "camera"
                totals.append(float(diag_values(status)["total_ms"]))
            received = int(heartbeat[f"{cam}.frames_received"])
            parts = sum(int(heartbeat[f"{cam}.frames_{k}"]) for k in ("described", "failed", "dropped", "in_flight"))
            assert received == parts, (cam, heartbeat)
            assert received >= 0.8 * len(sent[cam]), (cam, received, len(sent[cam]))  # best effort may lose a few
        slow = node.frame_statuses("slow")
        assert len(slow) >= 0.8 * len(sent["slow"]), "the 1 Hz camera was starved"
        worst = max(totals)
        for _, status in slow:
            age = float(diag_values(status)["age_ms"])
            assert age <= 2 * worst + 250, f"a 1 Hz frame waited {age:.0f} ms (worst description {worst:.0f} ms)"


# -- questions --------------------------------------------------------------------------------
@pytest.mark.parametrize("model", ["demo", "random_smolvlm"])
def test_yes_no_questions_answer_exactly_a_choice_about_the_newest_frame(
        model: str, vlm_pair: tuple[Path, Path], tmp_path: Path) -> None:
    """N frames, a yes/no question after each: every answer is exactly "yes" or "no", about the
    frame just sent (its stamp and frame_id), with per-stage times."""
    pair = None if model == "demo" else vlm_pair
    with control_node(tmp_path, pair, {"cameras": ["front"], "period_s": 1000.0}) as node:
        answers = []
        for i in range(N_QUESTIONS):
            deadline = time.monotonic() + 20.0
            while True:  # the question must be about this frame: ask once the node has it
                msg = node.publish("front", _picture(i))  # again if best effort lost it
                stamp = msg.header.stamp
                r = _ask(node.peer, node.ask, "front", "Is there a red object in the image?", choices=YES_NO,
                         frame_timeout_s=0.5)
                if (r.stamp.sec, r.stamp.nanosec) == (stamp.sec, stamp.nanosec) or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            assert r.success, r.message
            assert (r.stamp.sec, r.stamp.nanosec) == (stamp.sec, stamp.nanosec)
            assert r.frame_id == "front_optical"
            assert r.answer in YES_NO, r.answer
            assert r.stop_reason in ("complete", "stop_token") and r.total_ms > 0 and r.vision_ms > 0
            answers.append(r.answer)
        assert len(answers) == N_QUESTIONS


SCENE_SCHEMA = {
    "type": "object",
    "properties": {
        "red": {"type": "boolean"},
        "colour": {"type": "string", "enum": ["red", "green", "blue", "yellow", "white", "black"]},
        "count": {"type": "integer"},
        "objects": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["red", "colour", "count"],
}


@pytest.mark.parametrize("model", ["demo", "random_smolvlm"])
def test_json_schema_answers_parse_and_validate(model: str, vlm_pair: tuple[Path, Path], tmp_path: Path) -> None:
    """N frames, a question with a JSON schema after each: every answer parses and validates."""
    import jsonschema

    pair = None if model == "demo" else vlm_pair
    text = json.dumps(SCENE_SCHEMA)
    with control_node(tmp_path, pair, {"cameras": ["front"], "period_s": 1000.0}) as node:
        for i in range(N_QUESTIONS):
            deadline = time.monotonic() + 20.0
            while True:
                msg = node.publish("front", _picture(i))
                r = _ask(node.peer, node.ask, "front", "Describe the objects as JSON.", json_schema=text,
                         frame_timeout_s=0.5, max_tokens=96)
                stamp = msg.header.stamp
                if (r.stamp.sec, r.stamp.nanosec) == (stamp.sec, stamp.nanosec) or time.monotonic() > deadline:
                    break
            assert r.success, r.message
            jsonschema.validate(json.loads(r.answer), SCENE_SCHEMA)
            assert r.stop_reason in ("complete", "stop_token", "max_tokens"), r.stop_reason


def test_description_schema_publishes_json_descriptions(vlm_pair: tuple[Path, Path], tmp_path: Path) -> None:
    import jsonschema
    from std_msgs.msg import String

    schema = {"type": "object", "properties": {"busy": {"type": "boolean"}}, "required": ["busy"]}
    with control_node(tmp_path, vlm_pair, {"cameras": ["front"], "description_schema": json.dumps(schema)}) as node:
        box = node.peer.inbox(String, "/ctl/front/description/json")
        deadline = time.monotonic() + 60
        while not len(box) and time.monotonic() < deadline:
            node.publish("front", exact_picture())
            time.sleep(0.5)
        for msg in box.messages():
            jsonschema.validate(json.loads(msg.data), schema)
        assert len(box), "nothing on description/json"


def test_speculation_drafts_from_the_cameras_last_descriptions(vlm_pair: tuple[Path, Path], tmp_path: Path) -> None:
    """The same frame again and again (a camera that sees the same scene): with speculation on (the
    default) every description is the same text, and after the first ones most of its tokens came
    from drafts (drafts_accepted in the frame's diagnostic)."""
    from std_msgs.msg import String

    with control_node(tmp_path, vlm_pair, {"cameras": ["front"], "max_new_tokens": 24, "partial_every": 0}) as node:
        box = node.peer.inbox(String, "/ctl/front/description")
        start = len(node.diag)
        deadline = time.monotonic() + 90
        while len(box) < 5 and time.monotonic() < deadline:
            node.publish("front", exact_picture())
            time.sleep(0.3)
        texts = [m.data for m in box.messages()]
        assert len(texts) >= 5 and len(set(texts)) == 1, texts
        accepted = [int(diag_values(s)["drafts_accepted"]) for a in node.diag.messages(start)
                    for s in a.status if s.name.endswith("front: frame") and "drafts_accepted" in diag_values(s)]
        tokens = [int(diag_values(s)["tokens"]) for a in node.diag.messages(start)
                  for s in a.status if s.name.endswith("front: frame") and "tokens" in diag_values(s)]
        assert accepted and accepted[0] == 0, accepted  # nothing to draft from before the first description
        assert max(accepted) >= max(tokens) // 2, (accepted, tokens)


def test_bad_questions_and_a_full_queue_are_refused_at_once_and_the_node_serves_on(
        vlm_pair: tuple[Path, Path], tmp_path: Path) -> None:
    from edgevlm_interfaces.srv import Ask

    with control_node(tmp_path, vlm_pair, {"cameras": ["front"], "question_queue": 1, "max_new_tokens": 24}) as node:
        node.publish("front", exact_picture())
        bad = [
            ({"camera": "rear", "question": "Is it red?"}, "unknown camera 'rear'"),
            ({"camera": "front", "question": "  "}, "the question is empty"),
            ({"camera": "front", "question": "x" * 5000}, "longer than 4096 bytes"),
            ({"camera": "front", "question": "Red?", "choices": ["yes", ""]}, "choice"),
            ({"camera": "front", "question": "Red?", "choices": ["yes"], "json_schema": '{"type": "boolean"}'},
             "not both"),
            ({"camera": "front", "question": "Red?", "max_tokens": 10**9}, "context"),
        ]
        for fields, message in bad:
            r = _ask(node.peer, node.ask, **fields)
            assert not r.success and message in r.message, (fields, r.message)
        # A full queue: while one question is answered and one waits, a third is refused at once.
        futures = []
        node.ask.wait_for_service(timeout_sec=10)
        for _ in range(4):
            futures.append(node.ask.call_async(Ask.Request(camera="front", question="Describe the image.")))
        deadline = time.monotonic() + 120
        while not all(f.done() for f in futures) and time.monotonic() < deadline:
            time.sleep(0.01)
        results = [f.result() for f in futures]
        refused = [r for r in results if not r.success]
        assert refused and all("question queue full (1 waiting)" in r.message for r in refused)
        assert [r for r in results if r.success], "no question was answered"
        r = _ask(node.peer, node.ask, "front", "Describe the image.")  # still serving
        assert r.success and r.answer


def test_descriptions_go_on_while_questions_arrive(vlm_pair: tuple[Path, Path], tmp_path: Path) -> None:
    """Frames keep coming and six questions are queued at once: the worker alternates, so between two
    answers there is always a description of a waiting frame (the periodic rate drops to no less
    than half while the queue is full, when questions take as long as descriptions)."""
    from std_msgs.msg import String

    from edgevlm_interfaces.srv import Ask

    with control_node(tmp_path, vlm_pair, {"cameras": ["front"], "max_new_tokens": 8}) as node:
        events: list[tuple[float, str]] = []
        lock = threading.Lock()

        def description(msg: Any) -> None:
            with lock:
                events.append((time.monotonic(), "d"))

        node.peer.node.create_subscription(String, "/ctl/front/description", description, 50)
        stop = threading.Event()

        def frames() -> None:
            i = 0
            while not stop.is_set():
                node.publish("front", _picture(i))
                i += 1
                time.sleep(0.05)

        t = threading.Thread(target=frames)
        t.start()
        try:
            time.sleep(3.0)
            node.ask.wait_for_service(timeout_sec=10)
            futures = [node.ask.call_async(Ask.Request(camera="front", question="What do you see?"))
                       for _ in range(6)]
            for f in futures:
                f.add_done_callback(lambda _f: (lock.acquire(), events.append((time.monotonic(), "a")),
                                                lock.release()))
            deadline = time.monotonic() + 120
            while not all(f.done() for f in futures) and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(1.0)
        finally:
            stop.set()
            t.join()
        assert all(f.result().success for f in futures)
        with lock:
            kinds = "".join(k for _, k in sorted(events))
        first, last = kinds.index("a"), kinds.rindex("a")
        assert "aa" not in kinds[first:last + 1], kinds  # never two answers without a description between


# -- streaming --------------------------------------------------------------------------------
def test_description_partial_streams_the_text_so_far_by_default(vlm_pair: tuple[Path, Path], tmp_path: Path) -> None:
    """With the default parameters (partial_every 4), C/description/partial carries growing text while
    a frame is described, at most one message per 4 tokens, and its last message is exactly the
    description published on C/description."""
    from std_msgs.msg import String

    with control_node(tmp_path, vlm_pair, {"cameras": ["front"], "max_new_tokens": 24}) as node:
        partial = node.peer.inbox(String, "/ctl/front/description/partial", qos=100)
        final = node.peer.inbox(String, "/ctl/front/description", qos=100)
        for box in (partial, final):
            node.peer.wait_publishers(box.subscription, timeout=30)
        time.sleep(0.5)
        start = len(node.diag)
        node.publish("front", exact_picture())
        node.diag.wait_for(lambda a: (s := frame_status(a)) is not None and s.hardware_id == node.fqn, 120, start=start)
        description = final.wait_for(lambda m: True, 10).data
        deadline = time.monotonic() + 10
        while not (partial.messages() and partial.messages()[-1].data == description) and time.monotonic() < deadline:
            time.sleep(0.02)
        texts = [m.data for m in partial.messages()]
        values = diag_values(node.frame_statuses("front", start)[0][1])
        tokens = int(values["tokens"])
        assert tokens >= 8, values  # enough tokens for partial text before the end
        assert texts and texts[-1] == description, (texts, description)
        assert 2 <= len(texts) <= tokens // 4 + 1, (len(texts), tokens)
        assert all(len(a) <= len(b) for a, b in zip(texts, texts[1:], strict=False)), texts


# -- the action -------------------------------------------------------------------------------
def test_describe_action_streams_to_the_final_answer_and_cancels_within_a_token(
        vlm_pair: tuple[Path, Path], tmp_path: Path) -> None:
    from rclpy.action import ActionClient

    from edgevlm_interfaces.action import Describe

    with control_node(tmp_path, vlm_pair, {"cameras": ["front"], "partial_every": 1, "period_s": 1000.0}) as node:
        node.publish("front", exact_picture())
        client = ActionClient(node.peer.node, Describe, "/ctl/describe")
        assert client.wait_for_server(timeout_sec=30)
        feedback: list[Any] = []

        def run(goal: Any, cancel_after: int | None = None) -> tuple[Any, list[Any]]:
            feedback.clear()
            send = client.send_goal_async(goal, feedback_callback=lambda f: feedback.append(f.feedback))
            handle = RosPeer.wait_future(send, 60, "send_goal")
            deadline = time.monotonic() + 60
            assert handle.accepted
            if cancel_after is not None:
                while len(feedback) < cancel_after and time.monotonic() < deadline:
                    time.sleep(0.001)
                handle.cancel_goal_async()
            return RosPeer.wait_future(handle.get_result_async(), 60, "get_result"), list(feedback)

        time.sleep(1.0)  # the frame is there
        res, fb = run(Describe.Goal(camera="front", question="Describe the image.", max_tokens=24))
        assert res.result.success, res.result.message
        assert fb and fb[-1].partial == res.result.answer and fb[-1].tokens == res.result.tokens
        tokens = [f.tokens for f in fb]
        assert tokens == sorted(tokens)
        # Cancel after the first partial text: decoding stops within a token of the cancel arriving.
        res, fb = run(Describe.Goal(camera="front", question="Describe the image.", max_tokens=200), cancel_after=1)
        assert res.status == 5, res  # GoalStatus.STATUS_CANCELED
        assert res.result.stop_reason == "cancelled" and res.result.tokens < 200
        assert fb[-1].partial == res.result.answer
        # The node serves on, and a bad goal is aborted with its reason.
        res, _ = run(Describe.Goal(camera="rear"))
        assert res.status == 6 and "unknown camera 'rear'" in res.result.message  # STATUS_ABORTED
        res, _ = run(Describe.Goal(camera="front", max_tokens=4))
        assert res.result.success and res.result.tokens <= 4


# -- the lifecycle node -----------------------------------------------------------------------
def test_lifecycle_node_through_every_transition(vlm_pair: tuple[Path, Path], tmp_path: Path) -> None:
    """configure -> activate -> deactivate -> activate -> cleanup -> shutdown over lifecycle_msgs
    from this process: descriptions and answers only while active, the engine loaded from configure
    to cleanup, RSS after cleanup within 60 MiB of what it was before configure, exit 0."""
    from lifecycle_msgs.msg import Transition
    from lifecycle_msgs.srv import ChangeState, GetState
    from rclpy.qos import QoSProfile, ReliabilityPolicy
    from sensor_msgs.msg import Image
    from std_msgs.msg import String

    from edgevlm_interfaces.srv import Ask

    domain = random_domain_id()
    peer = RosPeer(domain)
    try:
        descriptions = peer.inbox(String, "/lc/front/description")
        args = {"namespace": "lc", "threads": "2", "model": str(vlm_pair[0]), "mmproj": str(vlm_pair[1]),
                "lifecycle": "true"}
        with launched_node(tmp_path, domain, args, {"cameras": ["front"]}, name="lc") as child:
            change = peer.node.create_client(ChangeState, "/lc/edgevlm/change_state")
            get = peer.node.create_client(GetState, "/lc/edgevlm/get_state")
            assert RosPeer.call(get, GetState.Request()).current_state.label == "unconfigured"
            rss0 = child.rss_mb()

            def transition(t: int) -> None:
                # The probe: a transition label that does not exist (answered "no", nothing changes).
                r = RosPeer.call(change, ChangeState.Request(transition=Transition(id=t)),
                                 probe=ChangeState.Request(transition=Transition(label="no such transition")))
                assert r.success, (t, child.tail())

            pub = peer.publisher(Image, "/lc/front/image", QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE))
            ask = peer.node.create_client(Ask, "/lc/ask")
            transition(Transition.TRANSITION_CONFIGURE)
            rss_loaded = child.rss_mb()
            for _ in range(2):
                transition(Transition.TRANSITION_ACTIVATE)
                RosPeer.wait_subscribers(pub)
                start = len(descriptions)
                pub.publish(make_image(exact_picture(), "rgb8", peer.now().to_msg()))
                descriptions.wait_count(1, 60, start=start)
                r = _ask(peer, ask, "front", "Is it red?", choices=YES_NO)
                assert r.success and r.answer in YES_NO
                transition(Transition.TRANSITION_DEACTIVATE)
                assert RosPeer.call(get, GetState.Request()).current_state.label == "inactive"
                n = len(descriptions)
                pub.publish(make_image(exact_picture(), "rgb8", peer.now().to_msg()))
                time.sleep(1.5)
                assert len(descriptions) == n, "described a frame while inactive"
                assert not ask.service_is_ready() or not ask.wait_for_service(timeout_sec=0.5)
            transition(Transition.TRANSITION_CLEANUP)
            rss_clean = child.rss_mb()
            assert rss_clean <= rss0 + 60, (rss0, rss_loaded, rss_clean)
            transition(Transition.TRANSITION_UNCONFIGURED_SHUTDOWN)
            assert child.wait(30) == 0, child.tail()
    finally:
        peer.close()


# -- soak -------------------------------------------------------------------------------------
# 30 s ends inside the warm-up plateau. 60 s (1803 frames) is too short a window for the slope: a
# fresh-clone run of 2026-12-03 measured +1.86 MiB per 1000 frames (a step of ~1 MiB fitted as a
# slope); the same test at 120 s (3603 frames) right after: +0.09 (earlier 60 s runs: +0.29, -0.02).
# When the slope is out of bounds the soak goes on for a confirmation window of SOAK_SECONDS * 0.8
# and judges the memory on that (test_soak's rule: a leak goes on growing, a step does not). So 60 s
# (2026-12-05, for the suite's 30-minute budget) costs 60 s when the first window is clean and
# 108 s when a step needs the confirmation; EDGEVLM_CONTROL_SOAK_S=600 is the long form.
SOAK_SECONDS = float(os.environ.get("EDGEVLM_CONTROL_SOAK_S", "60"))


def test_soak_three_cameras_and_a_question_a_second(vlm_pair: tuple[Path, Path], tmp_path: Path) -> None:
    """Three cameras at 10 Hz each and one question a second for SOAK_SECONDS: RSS, descriptors and
    threads stay flat (test_soak's bounds and memory measure, after a fifth of the run as warm-up), every camera's
    counters add up with nothing in flight at the end, and every question is answered."""
    from test_soak import Sampler, proc_sample

    from edgevlm_interfaces.srv import Ask

    cams = ["a", "b", "c"]
    with control_node(tmp_path, vlm_pair, {"cameras": cams, "max_new_tokens": 4}) as node:
        picture = np.ascontiguousarray(np.resize(exact_picture(), (120, 160, 3)))
        r = None
        for _ in range(50):  # warm: a frame of each camera there, one answer
            for c in cams:
                node.publish(c, picture)
            r = _ask(node.peer, node.ask, "a", "What is it?", frame_timeout_s=0.5)
            if r.success:
                break
        assert r is not None and r.success, r.message
        rss0, fds0, threads0 = proc_sample(node.child.pid)
        answers: list[Any] = []
        futures: list[Any] = []
        n_frames = 0

        def run(seconds: float, sampler: Sampler) -> None:
            """Every camera at 10 Hz and a question a second for `seconds`."""
            nonlocal n_frames
            t0, i = time.monotonic(), 0
            while time.monotonic() - t0 < seconds:
                delay = t0 + i / 10 - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                for c in cams:
                    node.publish(c, picture)
                    n_frames += 1
                if i % 10 == 0:
                    futures.append(node.ask.call_async(Ask.Request(camera=cams[(i // 10) % 3], question="Red?",
                                                                   choices=YES_NO)))
                sampler.sent = n_frames
                i += 1

        with Sampler(node.child.pid) as sampler:
            run(SOAK_SECONDS, sampler)
            first_window, steady = sampler.judged(sampler.samples[len(sampler.samples) // 5:],
                                                  lambda: run(SOAK_SECONDS * 0.8, sampler))
            deadline = time.monotonic() + 60
            while not all(f.done() for f in futures) and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(2.5)  # the last frames described, a heartbeat after them
            heartbeat = diag_values(worker_status(node.diag.wait_for(
                lambda a: worker_status(a) is not None and worker_status(a).hardware_id == node.fqn, 5.0,
                start=len(node.diag))))
        answers = [f.result() for f in futures]
        rss1, fds1, threads1 = proc_sample(node.child.pid)
        confirmation = "" if steady is first_window else (
            f", out of bounds, so {SOAK_SECONDS * 0.8:g} s more: slope {steady.slope:+.3f} over them")
        print(f"\ncontrol soak: {n_frames} frames on 3 cameras, {len(answers)} questions; "
              f"RssAnon+RssShmem {rss0:.1f} -> {rss1:.1f} MiB, slope {first_window.slope:+.3f} MiB per 1000 frames"
              f" over the last 4/5 of {SOAK_SECONDS:g} s{confirmation}; "
              f"fds {fds0} -> {fds1}; threads {threads0} -> {threads1}; {heartbeat}")
        assert all(a.success and a.answer in YES_NO for a in answers), [a.message for a in answers if not a.success]
        assert int(heartbeat["questions_waiting"]) == 0
        steady.check(fds1, threads1)
        for c in cams:
            received = int(heartbeat[f"{c}.frames_received"])
            parts = sum(int(heartbeat[f"{c}.frames_{k}"]) for k in ("described", "failed", "dropped"))
            assert int(heartbeat[f"{c}.frames_in_flight"]) == 0 and received == parts, (c, heartbeat)
            assert int(heartbeat[f"{c}.frames_failed"]) == 0 and int(heartbeat[f"{c}.frames_described"]) >= 5
        assert node.child.proc.poll() is None and "Traceback" not in node.child.output()


def _fuzz_requests(seed: int, n: int) -> list[dict[str, Any]]:
    """Bad requests of every kind the node must refuse one by one: huge or empty questions, empty
    choices, choices that tokenize to nothing, huge and deeply nested schemas, schemas that are not
    JSON or not objects, unsupported keywords, both constraints, unknown cameras, huge budgets."""
    rng = np.random.default_rng(seed)
    nested: Any = {"type": "boolean"}
    for _ in range(40):
        nested = {"type": "object", "properties": {"x": nested}, "required": ["x"]}
    kinds = [
        {"question": "q" * int(rng.integers(4097, 20000))},
        {"question": ""},
        {"question": " \n\t "},
        {"choices": ["yes", ""]},
        {"choices": [""]},
        {"choices": ["x" * 5000]},
        {"choices": [f"c{i}" for i in range(300)]},
        {"json_schema": json.dumps(nested)},
        {"json_schema": json.dumps({"type": "object", "properties": {f"k{i}": {"type": "integer"}
                                                                      for i in range(2000)}})},
        {"json_schema": "{not json"},
        {"json_schema": "[1, 2, 3]"},
        {"json_schema": json.dumps({"type": "string", "pattern": "^a+$"})},
        {"json_schema": json.dumps({"$ref": "#/definitions/x"})},
        {"json_schema": json.dumps({"type": "banana"})},
        {"json_schema": '{"type": "string", "enum": []}'},
        {"json_schema": '{"type": "boolean"}', "choices": ["yes", "no"]},
        {"camera": "nowhere"},
        {"camera": "\u00e9\u00e8\ufffd"},
        {"max_tokens": 4_000_000_000},
    ]
    out = []
    for _ in range(n):
        fields = {"camera": "front", "question": "Is it red?", **kinds[int(rng.integers(len(kinds)))]}
        out.append(fields)
    return out


def test_a_fuzzed_stream_of_bad_questions_is_refused_one_by_one(vlm_pair: tuple[Path, Path], tmp_path: Path) -> None:
    """Each refused at once with one line; the node answers a good question after all of them and
    its heartbeat counts them."""
    requests = _fuzz_requests(7, 120 if FULL else 40)
    with control_node(tmp_path, vlm_pair, {"cameras": ["front"]}) as node:
        for _ in range(50):
            node.publish("front", exact_picture())
            r = _ask(node.peer, node.ask, "front", "Describe it.", frame_timeout_s=0.5)
            if r.success:
                break
        assert r.success
        for fields in requests:
            r = _ask(node.peer, node.ask, **fields)
            assert not r.success, fields
            assert r.message and "\n" not in r.message and len(r.message) < 400, (fields, r.message)
        r = _ask(node.peer, node.ask, "front", "Is it red?", choices=YES_NO)
        assert r.success and r.answer in YES_NO
        assert node.child.proc.poll() is None and "Traceback" not in node.child.output()
