"""The node's scheduling in plain Python (no ROS, no engine): several cameras' newest-frame slots
served round robin (frame_slot.CameraSlots), the bounded question queue and the worker's choice
between a question and a description (questions.next_work), and the camera parameters."""

from __future__ import annotations

import threading
import time

import pytest

from edgevlm_ros.ros.frame_slot import CameraSlots
from edgevlm_ros.ros.node_params import ParamError, camera_topic, validate
from edgevlm_ros.ros.questions import Answer, Question, QuestionQueue, QueueFull, next_work


def _serve(slots: CameraSlots[int], n: int, timeout: float = 0.1) -> list[str]:
    served = []
    for _ in range(n):
        got = slots.take(timeout=timeout)
        if got is None:
            break
        name, _ = got
        served.append(name)
        slots.slot(name).finish(described=True)
    return served


def test_round_robin_serves_every_camera_with_a_waiting_frame_in_turn() -> None:
    slots: CameraSlots[int] = CameraSlots(("a", "b", "c"))
    for name in ("a", "b", "c"):
        slots.slot(name).put(0)
    assert _serve(slots, 3) == ["a", "b", "c"]
    # A fast camera refilled after every frame cannot take the slow one's turn.
    slots.slot("c").put(1)
    order = []
    for _ in range(4):
        slots.slot("a").put(2)
        order += _serve(slots, 1)
    assert order == ["a", "c", "a", "a"]


def test_a_30_hz_camera_does_not_starve_a_1_hz_one() -> None:
    slots: CameraSlots[int] = CameraSlots(("fast", "slow"))
    stop = threading.Event()

    def fast() -> None:
        while not stop.is_set():
            slots.slot("fast").put(0)
            time.sleep(1 / 300)

    t = threading.Thread(target=fast)
    t.start()
    waits = []
    try:
        for _ in range(5):
            put_at = time.monotonic()
            slots.slot("slow").put(1)
            while True:  # the worker, each "description" 10 ms
                name, _ = slots.take(timeout=1.0)  # type: ignore[misc]
                time.sleep(0.01)
                slots.slot(name).finish(described=True)
                if name == "slow":
                    waits.append(time.monotonic() - put_at)
                    break
    finally:
        stop.set()
        t.join()
    assert max(waits) < 0.1, waits  # at most one fast frame before it (two 10 ms descriptions)
    fast_counts, slow_counts = slots.slot("fast").counts(), slots.slot("slow").counts()
    assert slow_counts.described == 5 and slow_counts.balanced() and fast_counts.balanced()


def test_a_camera_held_by_its_period_waits_while_the_others_are_served() -> None:
    slots: CameraSlots[int] = CameraSlots(("a", "b"))
    slots.hold("a", time.monotonic() + 0.2)
    slots.slot("a").put(0)
    slots.slot("b").put(0)
    t0 = time.monotonic()
    assert _serve(slots, 1) == ["b"]
    assert _serve(slots, 1, timeout=2.0) == ["a"]
    assert time.monotonic() - t0 >= 0.18


def test_close_wakes_a_waiting_take() -> None:
    slots: CameraSlots[int] = CameraSlots(("a",))
    threading.Timer(0.1, slots.close).start()
    t0 = time.monotonic()
    assert slots.take(timeout=5.0) is None
    assert time.monotonic() - t0 < 2.0


def _question(camera: str = "a", timeout: float = 1.0) -> Question:
    return Question(camera=camera, text="Is it red?", max_tokens=4, frame_timeout_s=timeout)


def test_questions_alternate_with_descriptions_and_use_the_newest_frame() -> None:
    slots: CameraSlots[int] = CameraSlots(("a", "b"))
    questions = QuestionQueue(slots.cond, 4)
    q1, q2 = _question("a"), _question("b")
    slots.slot("a").put(10)
    slots.slot("b").put(20)
    questions.submit(q1)
    questions.submit(q2)
    w = next_work(slots, questions, prefer_question=False, timeout=0.1)  # frames first...
    assert w is not None and w.question is None and (w.camera, w.frame) == ("a", 10)
    slots.slot("a").finish(described=True)
    w = next_work(slots, questions, prefer_question=True, timeout=0.1)  # ...then the oldest question
    assert w is not None and w.question is q1 and w.frame == 10  # a's newest frame, described already
    w = next_work(slots, questions, prefer_question=False, timeout=0.1)
    assert w is not None and w.question is None and w.camera == "b"
    slots.slot("b").put(21)  # a newer frame arrives while b's is described
    slots.slot("b").finish(described=True)
    w = next_work(slots, questions, prefer_question=True, timeout=0.1)
    assert w is not None and w.question is q2 and w.frame == 21


def test_a_question_waits_for_its_cameras_first_frame_then_is_refused() -> None:
    slots: CameraSlots[int] = CameraSlots(("a", "b"))
    questions = QuestionQueue(slots.cond, 4)
    waits, late = _question("b", timeout=0.5), _question("b", timeout=0.05)
    questions.submit(late)
    questions.submit(waits)
    threading.Timer(0.2, slots.slot("b").put, args=(5,)).start()
    t0 = time.monotonic()
    w = next_work(slots, questions, prefer_question=True, timeout=2.0)
    assert w is not None and w.question is waits and w.frame == 5
    assert 0.15 < time.monotonic() - t0 < 1.5
    answer = late.wait(0)
    assert answer is not None and not answer.success and "no frame from camera 'b' within 0.05 s" in answer.message
    assert questions.refused == 1


def test_a_full_queue_refuses_at_once_and_cancel_removes_a_waiting_question() -> None:
    slots: CameraSlots[int] = CameraSlots(("a",))
    questions = QuestionQueue(slots.cond, 2)
    first, second = _question(), _question()
    questions.submit(first)
    questions.submit(second)
    t0 = time.monotonic()
    with pytest.raises(QueueFull, match=r"question queue full \(2 waiting\)"):
        questions.submit(_question())
    assert time.monotonic() - t0 < 0.1
    assert questions.cancel(first) and len(questions) == 1
    questions.fail_all("the node is stopping")
    assert second.wait(0) == Answer(False, "the node is stopping")


def test_camera_parameters() -> None:
    assert validate({}).camera_names == ("",)
    assert validate({"cameras": None}).camera_names == ("",)  # an empty YAML list
    p = validate({"cameras": ["front", "rear_left"]})
    assert p.camera_names == ("front", "rear_left")
    assert camera_topic("front", "image") == "front/image" and camera_topic("", "image") == "image"
    for bad, message in ((["front", "front"], "names 'front' twice"), (["2nd"], "'2nd' is not a camera name"),
                         ([""], "'' is not a camera name"), (["a/b"], "not a camera name"),
                         ([f"c{i}" for i in range(17)], "at most 16"), ("front", "must be a list of strings")):
        with pytest.raises(ParamError, match=message):
            validate({"cameras": bad})
    with pytest.raises(ParamError, match="'question_queue' must be >= 1"):
        validate({"question_queue": 0})
