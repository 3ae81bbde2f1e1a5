"""Questions on demand, in plain Python (no ROS): the bounded queue the `Ask` service and the
`Describe` action put questions into, and the worker's choice between a question and the next
periodic description.

A question names a camera and runs on that camera's newest frame (described or not). When the
camera has sent no frame yet, the question waits, at most its `frame_timeout_s`, then is refused.
Questions are served in arrival order among those whose camera has a frame; the worker alternates
between them and the periodic descriptions (a question, then a description if a camera has a frame
waiting, then a question, ...), so neither can starve the other. A full queue is refused at once.

The worker completes each question exactly once (`Question.finish`); the caller waits on it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from .frame_slot import CameraSlots

__all__ = ["Answer", "Question", "QuestionQueue", "QueueFull", "Work", "next_work"]

T = TypeVar("T")


class QueueFull(Exception):
    """The question queue holds its maximum; the message says so for the caller as it is."""


@dataclass
class Answer:
    """What the worker hands back for a question (success False: message says why)."""

    success: bool
    message: str = ""
    text: str = ""
    stamp: Any = None  # the header stamp of the frame answered about
    frame_id: str = ""
    ms: dict[str, float] = field(default_factory=dict)
    stop_reason: str = ""
    tokens: int = 0


@dataclass(eq=False)
class Question:
    camera: str
    text: str
    max_tokens: int
    choices: tuple[str, ...] | None = None
    schema: str | None = None
    frame_timeout_s: float = 1.0
    # Called by the worker with (text so far, tokens so far) while decoding (the action's feedback).
    on_partial: Callable[[str, int], None] | None = None
    submitted_at: float = field(default_factory=time.monotonic)
    cancelled: threading.Event = field(default_factory=threading.Event)
    _done: threading.Event = field(default_factory=threading.Event)
    answer: Answer | None = None

    @property
    def frame_deadline(self) -> float:
        return self.submitted_at + self.frame_timeout_s

    def finish(self, answer: Answer) -> None:
        if not self._done.is_set():
            self.answer = answer
            self._done.set()

    def wait(self, timeout: float | None = None) -> Answer | None:
        return self.answer if self._done.wait(timeout) else None

    @property
    def done(self) -> bool:
        return self._done.is_set()


class QuestionQueue:
    """Questions in arrival order, at most `limit` waiting. Shares the frame slots' condition so
    that the worker's one wait covers frames and questions."""

    def __init__(self, cond: threading.Condition, limit: int) -> None:
        self._cond = cond
        self.limit = limit
        self._items: deque[Question] = deque()
        self.asked = self.answered = self.refused = 0

    def submit(self, q: Question) -> None:
        """Queues q; QueueFull when `limit` questions are already waiting."""
        with self._cond:
            if len(self._items) >= self.limit:
                self.refused += 1
                raise QueueFull(f"question queue full ({self.limit} waiting): try again later")
            self.asked += 1
            self._items.append(q)
            self._cond.notify_all()

    def cancel(self, q: Question) -> bool:
        """Removes q if it is still waiting (True); a question being answered is cancelled by the
        engine's cancel instead."""
        with self._cond:
            try:
                self._items.remove(q)
            except ValueError:
                return False
            return True

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)

    def pop_ready_locked(self, has_frame: Callable[[str], bool], now: float) -> tuple[Question | None, float | None]:
        """(the first waiting question whose camera has a frame, or None; the earliest frame deadline
        of those still waiting). Questions past their frame deadline, or cancelled, are finished
        here with a refusal. The caller holds the condition."""
        due: float | None = None
        for q in list(self._items):
            if q.cancelled.is_set():
                self._items.remove(q)
                q.finish(Answer(False, "cancelled before it was answered"))
                continue
            if has_frame(q.camera):
                self._items.remove(q)
                return q, None
            if now >= q.frame_deadline:
                self._items.remove(q)
                self.refused += 1
                q.finish(Answer(False, f"no frame from camera '{q.camera}' within {q.frame_timeout_s:g} s"))
                continue
            due = q.frame_deadline if due is None else min(due, q.frame_deadline)
        return None, due

    def fail_all(self, message: str) -> None:
        """Finishes every waiting question with a refusal (the node stops)."""
        with self._cond:
            while self._items:
                self._items.popleft().finish(Answer(False, message))


@dataclass(frozen=True)
class Work(Generic[T]):
    """One piece of the worker's work: a camera's frame to describe, or a question."""

    camera: str
    frame: T | None = None
    question: Question | None = None


def next_work(slots: CameraSlots[T], questions: QuestionQueue, prefer_question: bool,
              timeout: float) -> Work[T] | None:
    """The worker's next piece of work, waiting at most `timeout` s (None: nothing to do, or closed).

    prefer_question: the last piece was a description, so a ready question goes first; otherwise
    a camera with a frame waiting goes first. A question's frame is the newest its camera sent.
    """
    deadline = time.monotonic() + timeout
    with slots.cond:
        while not slots.closed:
            now = time.monotonic()
            q, q_due = questions.pop_ready_locked(lambda cam: slots.slot(cam)._latest is not None, now)
            name, f_due = (None, None) if (q is not None and prefer_question) else slots.ready_locked(now)
            if q is not None and (prefer_question or name is None):
                return Work(q.camera, slots.slot(q.camera)._latest, q)
            if name is not None:
                if q is not None:  # served after this description, still first in line
                    questions._items.appendleft(q)
                return Work(name, slots.take_locked(name))
            if now >= deadline:
                return None
            waits = [t for t in (deadline, q_due, f_due) if t is not None]
            slots.cond.wait(max(min(waits) - now, 0.0))
        return None
