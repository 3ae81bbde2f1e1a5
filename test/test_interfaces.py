"""edgevlm_interfaces (Ask.srv, Describe.action) over real rclpy and DDS, between two processes.

The package is the one scripts/setup.sh builds from the PyPI ROS wheels and installs into the
venv (scripts/build_interfaces.py): it must import from the venv's python with no environment of
its own, and its type support libraries must load in rclpy and in Fast DDS. The servers run in a
child process (test/interfaces_peer.py), the clients in this one (RosPeer: its own Context and
domain); every value crosses the wire and is compared to what the other side set.
"""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from interfaces_peer import CANCEL_QUESTION, RESPONSE, WORDS
from ros_helpers import ROOT, Child, RosPeer, random_domain_id, ros_env

PEER = Path(__file__).resolve().parent / "interfaces_peer.py"
PROBE = Path(__file__).resolve().parent / "interfaces_probe.py"
TIMEOUT = 20.0  # discovery takes 0-3 s here; a loaded 2-core machine can take longer

# Every request field set to a value that is not its default, including the string array and
# characters beyond ASCII; 0.25 is exact in a float32.
REQUEST = {
    "camera": "front",
    "question": "Is the gripper open? Answer yes or no. «ÿ»",
    "max_tokens": 4_000_000_000,
    "choices": ["yes", "no", "can't tell", ""],
    "json_schema": '{"type": "object", "properties": {"open": {"type": "boolean"}}}',
    "frame_timeout_s": 0.25,
}


def _wait(done: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout} s")
        time.sleep(0.01)


def _json_lines(child: Child, key: str, timeout: float = TIMEOUT) -> dict[str, Any]:
    """The first JSON line of the child's output that has key."""
    line = child.wait_for_line(rf'^\{{"{key}"', timeout).string
    return json.loads(line)


def _result_dict(msg: Any) -> dict[str, Any]:
    return {name: ({"sec": msg.stamp.sec, "nanosec": msg.stamp.nanosec} if name == "stamp" else getattr(msg, name))
            for name in RESPONSE}


@pytest.fixture
def domain() -> int:
    return random_domain_id()


@pytest.fixture
def peer(domain: int) -> Iterator[RosPeer]:
    p = RosPeer(domain)
    try:
        yield p
    finally:
        p.close()


def _server(kind: str, domain: int, tmp_path: Path, *args: str) -> Child:
    child = Child([sys.executable, str(PEER), kind, *args], ros_env(domain, tmp_path / f"ros_log_{kind}"),
                  f"{kind} server")
    child.wait_for_line(r'^\{"ready"', TIMEOUT)
    return child


def test_the_package_imports_from_the_venv_python_alone(tmp_path: Path) -> None:
    """No PYTHONPATH, no AMENT_PREFIX_PATH, no LD_LIBRARY_PATH: as scripts/setup.sh leaves the venv."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "ROS_AUTOMATIC_DISCOVERY_RANGE": "LOCALHOST",
           "ROS_DOMAIN_ID": str(random_domain_id()), "ROS_LOG_DIR": str(tmp_path / "ros_log")}
    out = subprocess.run([sys.executable, str(PROBE)], env=env, cwd="/", capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    module, feedback, *loaded = out.stdout.splitlines()
    venv = Path(sys.prefix)
    assert Path(module) == Path(sysconfig.get_paths()["purelib"]) / "edgevlm_interfaces" / "__init__.py"
    assert not Path(module).is_relative_to(ROOT / "edgevlm_interfaces"), module  # not the source folder
    assert feedback == "edgevlm_interfaces.action.Describe_Feedback(partial='x', tokens=1)"
    # The type support libraries as the ros-* wheels' own: from <venv>/lib, found through the
    # LD_LIBRARY_PATH their ros_wheels_bootstrapper.pth sets.
    libraries = {Path(p).name for p in loaded if Path(p).parent == (venv / "lib").resolve()}  # maps: real paths
    assert {"libedgevlm_interfaces__rosidl_generator_py.so", "libedgevlm_interfaces__rosidl_typesupport_c.so",
            "libedgevlm_interfaces__rosidl_typesupport_fastrtps_c.so"} <= libraries, loaded


def test_ask_round_trips_every_field(domain: int, peer: RosPeer, tmp_path: Path) -> None:
    from builtin_interfaces.msg import Time

    from edgevlm_interfaces.srv import Ask

    with _server("ask", domain, tmp_path) as server:
        client = peer.node.create_client(Ask, "ask")
        # The request itself is the probe (this server answers at once and twice the same).
        response = RosPeer.call(client, Ask.Request(**REQUEST), TIMEOUT)
        # What the server received, field by field (it printed the request as it arrived).
        assert _json_lines(server, "request")["request"] == REQUEST
        assert _result_dict(response) == RESPONSE
        assert isinstance(response.stamp, Time)

        # The defaults: an empty request is the node's defaults (0 / empty everywhere).
        future = client.call_async(Ask.Request())
        _wait(future.done, TIMEOUT, "no second Ask response")
        server.wait_for_line(r'"camera": "", "question": "", "max_tokens": 0, "choices": \[\], "json_schema": "", '
                             r'"frame_timeout_s": 0\.0', TIMEOUT)


def test_describe_streams_feedback_then_the_result(domain: int, peer: RosPeer, tmp_path: Path) -> None:
    from action_msgs.msg import GoalStatus
    from rclpy.action import ActionClient

    from edgevlm_interfaces.action import Describe

    with _server("describe", domain, tmp_path) as server:
        client = ActionClient(peer.node, Describe, "describe")
        assert client.wait_for_server(timeout_sec=TIMEOUT), "describe action not discovered"
        # wait_for_server sees the server's goal service; its feedback and status writers are
        # announced about when its response writer is, so this also waits out most of the discovery
        # a goal's response needs (a full run on a loaded machine saw no answer in 20 s, 2026-12-02).
        for topic in ("/describe/_action/feedback", "/describe/_action/status"):
            _wait(lambda t=topic: peer.node.count_publishers(t) >= 1, TIMEOUT, f"{topic} not matched")
        feedback: list[tuple[str, int]] = []
        sent = client.send_goal_async(Describe.Goal(**REQUEST),
                                      feedback_callback=lambda m: feedback.append((m.feedback.partial,
                                                                                   m.feedback.tokens)))
        try:
            _wait(sent.done, TIMEOUT, "goal not answered")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the server said: {server.tail()!r}") from None
        goal = sent.result()
        assert goal.accepted
        result_future = goal.get_result_async()
        _wait(result_future.done, TIMEOUT, "no result")
        wrapped = result_future.result()
        assert wrapped.status == GoalStatus.STATUS_SUCCEEDED
        assert _json_lines(server, "goal")["goal"] == REQUEST
        text = " ".join(WORDS)
        assert _result_dict(wrapped.result) == {**RESPONSE, "answer": text, "stop_reason": "stop_token",
                                                "tokens": len(WORDS)}
        # Feedback is the text so far, growing one word at a time, in order, up to the whole text (the
        # last may arrive after the result). Reliable QoS loses none once matched, but the server's
        # feedback publisher can match this subscription a moment after the goal was accepted.
        _wait(lambda: bool(feedback) and feedback[-1][1] == len(WORDS), TIMEOUT, f"the last feedback ({feedback})")
        first = feedback[0][1]
        assert feedback == [(" ".join(WORDS[:n]), n) for n in range(first, len(WORDS) + 1)]
        assert first <= len(WORDS) - 2, feedback  # streamed, not only the end
        client.destroy()


def test_a_cancel_reaches_the_server_and_ends_the_goal(domain: int, peer: RosPeer, tmp_path: Path) -> None:
    from action_msgs.msg import GoalStatus
    from rclpy.action import ActionClient

    from edgevlm_interfaces.action import Describe

    with _server("describe", domain, tmp_path, "--period", "0.05", "--max-seconds", "30") as server:
        client = ActionClient(peer.node, Describe, "describe")
        assert client.wait_for_server(timeout_sec=TIMEOUT), "describe action not discovered"
        feedback: list[int] = []
        sent = client.send_goal_async(Describe.Goal(question=CANCEL_QUESTION, camera="left"),
                                      feedback_callback=lambda m: feedback.append(m.feedback.tokens))
        try:
            _wait(sent.done, TIMEOUT, "goal not answered")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the server said: {server.tail()!r}") from None
        goal = sent.result()
        assert goal.accepted
        _wait(lambda: len(feedback) >= 3, TIMEOUT, "3 feedback messages")
        cancel = goal.cancel_goal_async()
        _wait(cancel.done, TIMEOUT, "no cancel response")
        assert [g.goal_id.uuid.tolist() for g in cancel.result().goals_canceling] == [goal.goal_id.uuid.tolist()]
        _json_lines(server, "cancel_requested")  # the server's cancel callback ran
        result_future = goal.get_result_async()
        _wait(result_future.done, TIMEOUT, "no result after the cancel")
        wrapped = result_future.result()
        assert wrapped.status == GoalStatus.STATUS_CANCELED
        tokens = _json_lines(server, "cancelled")["tokens"]
        assert wrapped.result.stop_reason == "cancelled"
        assert wrapped.result.tokens == tokens >= 3
        assert wrapped.result.answer == " ".join(WORDS[i % len(WORDS)] for i in range(tokens))
        client.destroy()
