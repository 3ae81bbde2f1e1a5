"""Child processes for test_interfaces.py: an edgevlm_interfaces server in its own process.

`python test/interfaces_peer.py ask` serves `ask` (edgevlm_interfaces/srv/Ask): it prints every
request it receives as one JSON line (`{"request": {...}}`) and answers with RESPONSE below.
`python test/interfaces_peer.py describe` serves the `describe` action (Describe): a goal's
feedback is `WORDS` one word at a time, every `--period` seconds, then the result; a goal whose
question is "wait for cancel" streams until it is cancelled (at most `--max-seconds`) and prints
`{"cancel_requested": ...}` when the cancel reaches it. Each prints `{"ready": true}` once serving.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

# What the ask server answers, field by field (test_interfaces compares what its client receives).
RESPONSE: dict[str, Any] = {
    "success": True,
    "message": "",
    "answer": "a red cube on a table, ünïcode ✓",
    "stamp": {"sec": 1_764_633_600, "nanosec": 987_654_321},
    "frame_id": "front_camera_optical",
    "preprocess_ms": 1.25,
    "vision_ms": 512.5,
    "prefill_ms": 80.125,
    "decode_ms": 300.0625,
    "total_ms": 893.9375,
    "stop_reason": "complete",
    "tokens": 4_000_000_000,  # needs all 32 bits of the uint32
}
WORDS = ["a", "robot", "arm", "holds", "a", "cup"]
CANCEL_QUESTION = "wait for cancel"


def request_dict(msg: Any) -> dict[str, Any]:
    """The goal / request fields shared by Ask.Request and Describe.Goal, as plain JSON values."""
    return {"camera": msg.camera, "question": msg.question, "max_tokens": msg.max_tokens,
            "choices": list(msg.choices), "json_schema": msg.json_schema, "frame_timeout_s": msg.frame_timeout_s}


def fill_result(out: Any, values: dict[str, Any]) -> Any:
    """Sets the fields Ask.Response and Describe.Result share from a dict like RESPONSE."""
    from builtin_interfaces.msg import Time

    for name, value in values.items():
        setattr(out, name, Time(**value) if name == "stamp" else value)
    return out


def emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def serve_ask(node: Any) -> None:
    from edgevlm_interfaces.srv import Ask

    def on_ask(request: Ask.Request, response: Ask.Response) -> Ask.Response:
        emit(request=request_dict(request))
        return fill_result(response, RESPONSE)

    node.create_service(Ask, "ask", on_ask)


def serve_describe(node: Any, period: float, max_seconds: float) -> None:
    from rclpy.action import ActionServer, CancelResponse
    from rclpy.callback_groups import ReentrantCallbackGroup

    from edgevlm_interfaces.action import Describe

    def execute(goal_handle: Any) -> Describe.Result:
        goal = goal_handle.request
        emit(goal=request_dict(goal))
        endless = goal.question == CANCEL_QUESTION
        words: list[str] = []
        deadline = time.monotonic() + max_seconds
        while endless or len(words) < len(WORDS):
            if goal_handle.is_cancel_requested:
                goal_handle.canceled()
                emit(cancelled=True, tokens=len(words))
                return fill_result(Describe.Result(), {**RESPONSE, "answer": " ".join(words),
                                                       "stop_reason": "cancelled", "tokens": len(words)})
            if time.monotonic() > deadline:
                break
            words.append(WORDS[len(words) % len(WORDS)])
            goal_handle.publish_feedback(Describe.Feedback(partial=" ".join(words), tokens=len(words)))
            time.sleep(period)
        goal_handle.succeed()
        return fill_result(Describe.Result(), {**RESPONSE, "answer": " ".join(words), "stop_reason": "stop_token",
                                               "tokens": len(words)})

    def on_cancel(goal_handle: Any) -> CancelResponse:
        emit(cancel_requested=True)
        return CancelResponse.ACCEPT

    # Reentrant: the cancel request is served while execute() of the same goal is still running.
    node._describe_server = ActionServer(node, Describe, "describe", execute, cancel_callback=on_cancel,
                                         callback_group=ReentrantCallbackGroup())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="interfaces_peer.py")
    parser.add_argument("server", choices=["ask", "describe"])
    parser.add_argument("--period", type=float, default=0.05, help="seconds between feedback messages")
    parser.add_argument("--max-seconds", type=float, default=30.0, help="longest a goal streams")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)

    import rclpy
    from rclpy.executors import ExternalShutdownException, MultiThreadedExecutor

    rclpy.init()
    node = rclpy.create_node(f"test_{args.server}_server")
    if args.server == "ask":
        serve_ask(node)
    else:
        serve_describe(node, args.period, args.max_seconds)
    executor = MultiThreadedExecutor(num_threads=2)
    executor.add_node(node)
    emit(ready=True)
    try:
        executor.spin()
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        executor.shutdown()
        node.destroy_node()
        rclpy.try_shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
