"""The node's question endpoints: the `ask` service (edgevlm_interfaces/srv/Ask) and the `describe`
action (edgevlm_interfaces/action/Describe, the text so far as feedback).

Both turn a request into a `questions.Question` (`question_from`, which refuses a bad request at
once with one line: unknown camera, empty or oversized question, too many tokens, bad choices or
schema), queue it (a full queue is refused at once), and wait for the worker's answer. The
service's callback and the action's execute callback each hold an executor thread while they wait
(the node's executor has one per queue place, `node.executor_for`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rclpy.action import ActionServer, CancelResponse, GoalResponse
from rclpy.callback_groups import CallbackGroup

from edgevlm_interfaces.action import Describe
from edgevlm_interfaces.srv import Ask

from .questions import Answer, Question, QueueFull

__all__ = ["MAX_QUESTION_BYTES", "create_endpoints", "fill", "question_from"]

MAX_QUESTION_BYTES = 4096
# How often a waiting action callback looks for a cancel request (cancel_callback acts at once;
# this only ends the wait).
WAIT_POLL_S = 0.05


class BadRequest(ValueError):
    """A question refused before it is queued; the message is for the caller as it is."""


def question_from(node: Any, req: Any, on_partial: Callable[[str, int], None] | None = None,
                  default_prompt: bool = False) -> Question:
    """The Question of an Ask request or Describe goal (same fields). An empty camera is the node's
    first camera; an empty question is refused, or with default_prompt (the action) is the node's
    `prompt`. Raises BadRequest."""
    cameras = node.params.camera_names
    camera = req.camera or cameras[0]
    if camera not in cameras:
        known = ", ".join(repr(c) for c in cameras)
        raise BadRequest(f"unknown camera '{req.camera}' (this node serves {known})")
    text = req.question
    if not text.strip() and default_prompt:
        text = node.params.prompt
    if not text.strip():
        raise BadRequest("the question is empty")
    if len(text.encode("utf-8", "surrogatepass")) > MAX_QUESTION_BYTES:
        raise BadRequest(f"the question is longer than {MAX_QUESTION_BYTES} bytes")
    max_tokens = int(req.max_tokens) or node.params.max_new_tokens
    n_ctx = node._n_ctx
    if n_ctx is not None and max_tokens > n_ctx:
        raise BadRequest(f"max_tokens {max_tokens} is more than the engine's context of {n_ctx}")
    choices = tuple(req.choices) or None
    schema = req.json_schema if req.json_schema.strip() else None
    if choices is not None and schema is not None:
        raise BadRequest("give choices or json_schema, not both")
    vlm = node._vlm
    if vlm is None:
        raise BadRequest("the engine is not loaded")
    try:  # built (and cached) here: a bad list or schema is refused at once
        if choices is not None:
            need, what = int(vlm.text.constraint(choices=choices).longest), "the longest choice's"
        elif schema is not None:
            need, what = int(vlm.text.constraint(schema=schema).min_tokens), "the schema's shortest answer's"
        else:
            need, what = 1, ""
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    if max_tokens < need:
        if req.max_tokens:
            raise BadRequest(f"max_tokens {max_tokens} is fewer than {what} {need} tokens")
        max_tokens = need  # the node's default budget grows to what the constraint needs
    timeout = float(req.frame_timeout_s) if req.frame_timeout_s > 0 else node.params.question_frame_timeout_s
    return Question(camera=camera, text=text, max_tokens=max_tokens, choices=choices, schema=schema,
                    frame_timeout_s=min(timeout, 3600.0), on_partial=on_partial)


def fill(out: Any, answer: Answer) -> Any:
    """Copies an Answer into an Ask response or a Describe result (same fields)."""
    out.success = answer.success
    out.message = answer.message
    out.answer = answer.text
    if answer.stamp is not None:
        out.stamp = answer.stamp
    out.frame_id = answer.frame_id
    for stage in ("preprocess", "vision", "prefill", "decode", "total"):
        setattr(out, f"{stage}_ms", float(answer.ms.get(stage, 0.0)))
    out.stop_reason = answer.stop_reason
    out.tokens = int(answer.tokens)
    return out


def _ask(node: Any, request: Any, response: Any) -> Any:
    try:
        q = question_from(node, request)
        node.submit_question(q)
    except (BadRequest, QueueFull) as exc:
        node.get_logger().warning(f"question refused: {exc}")
        return fill(response, Answer(False, str(exc)))
    answer = q.wait()
    return fill(response, answer if answer is not None else Answer(False, "no answer"))


class _DescribeAction:
    def __init__(self, node: Any) -> None:
        self.node = node
        self.running: dict[bytes, Question] = {}  # goal id -> its question

    def goal(self, goal_request: Any) -> GoalResponse:
        return GoalResponse.ACCEPT  # a bad goal is aborted with its reason (a rejection carries none)

    def cancel(self, goal_handle: Any) -> CancelResponse:
        q = self.running.get(bytes(goal_handle.goal_id.uuid))
        if q is not None:
            self.node.cancel_question(q)  # decoding stops before its next token
        return CancelResponse.ACCEPT

    def execute(self, goal_handle: Any) -> Any:
        def feedback(text: str, tokens: int) -> None:
            goal_handle.publish_feedback(Describe.Feedback(partial=text, tokens=tokens))

        result = Describe.Result()
        try:
            q = question_from(self.node, goal_handle.request, on_partial=feedback, default_prompt=True)
            key = bytes(goal_handle.goal_id.uuid)
            self.running[key] = q
            self.node.submit_question(q)
        except (BadRequest, QueueFull) as exc:
            self.node.get_logger().warning(f"describe goal refused: {exc}")
            goal_handle.abort()
            return fill(result, Answer(False, str(exc)))
        try:
            answer = None
            while answer is None:
                answer = q.wait(WAIT_POLL_S)
                if answer is None and goal_handle.is_cancel_requested:
                    self.node.cancel_question(q)
        finally:
            self.running.pop(key, None)
        fill(result, answer)
        if goal_handle.is_cancel_requested:  # the text so far is the result (stop_reason "cancelled")
            goal_handle.canceled()
        elif answer.success:
            goal_handle.succeed()
        else:
            goal_handle.abort()
        return result


def create_endpoints(node: Any, group: CallbackGroup) -> list[Any]:
    """The `ask` service and the `describe` action of node, in group (reentrant)."""
    service = node.create_service(Ask, "ask", lambda req, resp: _ask(node, req, resp), callback_group=group)
    action = _DescribeAction(node)
    server = ActionServer(node, Describe, "describe", execute_callback=action.execute,
                          goal_callback=action.goal, cancel_callback=action.cancel, callback_group=group)
    return [service, server]
