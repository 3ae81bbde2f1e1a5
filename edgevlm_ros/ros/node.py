"""The ROS 2 node `edgevlm` (executable `edgevlm_node`; `edgevlm_lifecycle_node` is the same node
as a managed lifecycle node): camera frames in, descriptions, answers and per-stage latencies out.

The node classes declare the parameters (`node_params`), create the publishers, subscriptions,
the `ask` service and the `describe` action, and hand every piece of work to plain functions
tested without ROS: frame conversion and description (`frame_work`, `frames`), the newest-frame
slots and their round robin (`frame_slot`), the question queue (`questions`), model-file watching
(`model_files`) and the diagnostics it publishes (`diagnostics`).

Threads: executor threads run the subscription callbacks, which only put the message into the
camera's one-frame slot (`frame_slot.CameraSlots`) and return, the parameter services, a 1 Hz
diagnostics heartbeat, and the `ask` / `describe` callbacks, which queue a question and wait for
its answer. One worker thread serves, round robin, the cameras with a fresh frame and, between two
descriptions, the oldest question whose camera has a frame (`questions.next_work`): it converts
the frame to RGB, runs the engine (`vlm.describe`, which releases the GIL), and publishes. Frames
that arrive while the worker is busy replace the waiting one of their camera and are counted as
dropped, so memory and latency stay bounded whatever the cameras' rates.

Topics (relative, so a namespace or a remap moves them all); C/ is a camera's name and a slash,
nothing for the one unnamed camera of an empty `cameras` list:
  in   C/image (sensor_msgs/Image) or, with transport=compressed, C/image/compressed
  out  C/description (std_msgs/String); C/description/partial (the text so far while describing);
       C/description/json (with description_schema: the JSON answer); C/latency/<stage>_ms
       (std_msgs/Float64) for stage in engine.latency.REPORTED_STAGES and AGE;
       /diagnostics (diagnostic_msgs/DiagnosticArray)
  srv  ask (edgevlm_interfaces/srv/Ask); action describe (edgevlm_interfaces/action/Describe)

Faults are reported once and survived: a frame that cannot be converted or that the engine fails
on gives one ERROR log line and one ERROR diagnostic stamped with that frame's stamp, publishes no
description, and the worker goes on with the next frame (the engine restores its KV state for
every frame, so a generation that failed half-way leaves nothing behind). The model files are
mapped at start and watched by the heartbeat: deleted, replaced or modified on disk, the node
says so once and keeps serving what it loaded.
"""

from __future__ import annotations

import signal
import sys


def _exit_quietly(signum: int, frame: object) -> None:
    raise SystemExit(0)


# Ctrl-C or SIGTERM while the imports below run (half a second): leave as quietly as at any
# other moment, not with a traceback from inside some import. main() hands over to rclpy.
signal.signal(signal.SIGINT, _exit_quietly)
signal.signal(signal.SIGTERM, _exit_quietly)

import contextlib  # noqa: E402
import gc  # noqa: E402
import os  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections import deque  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any  # noqa: E402

import rclpy  # noqa: E402
from diagnostic_msgs.msg import DiagnosticArray  # noqa: E402
from rcl_interfaces.msg import ParameterDescriptor, SetParametersResult  # noqa: E402
from rclpy.callback_groups import ReentrantCallbackGroup  # noqa: E402
from rclpy.exceptions import ParameterException  # noqa: E402
from rclpy.executors import ExternalShutdownException  # noqa: E402
from rclpy.node import Node  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402
from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy  # noqa: E402
from rclpy.time import Time  # noqa: E402
from sensor_msgs.msg import CompressedImage, Image  # noqa: E402
from std_msgs.msg import Float64, String  # noqa: E402

from ..engine.generation import DRAFT_HISTORY  # noqa: E402
from ..engine.latency import AGE, REPORTED_STAGES, TOTAL, LatencyWindow  # noqa: E402
from . import ask, diagnostics, model_files  # noqa: E402
from .executor import OnceQueuedExecutor  # noqa: E402
from .frame_slot import CameraSlots, NewestFrameSlot  # noqa: E402
from .frame_work import FrameFailure, describe_frame, describe_message, report  # noqa: E402
from .node_params import PARAMS, NodeParams, ParamError, apply_changes, camera_topic, validate  # noqa: E402
from .questions import Answer, Question, QuestionQueue, next_work  # noqa: E402

HEARTBEAT_S = 1.0
# Stopping cancels a generation in progress at its next token; a worker still inside the engine
# after this long (the vision encoder cannot be interrupted) is abandoned: the process exits
# without waiting for it (Ctrl-C must end the node within a second, even mid-generation).
STOP_GRACE_S = 0.5
# The same error on consecutive frames is logged at most this often (a broken camera at 30 Hz
# must not bury the log), with a count of the repeats.
REPEAT_LOG_S = 5.0

OUTPUT_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=10, reliability=ReliabilityPolicy.RELIABLE,
                        durability=DurabilityPolicy.VOLATILE)



Msg = Image | CompressedImage


@dataclass
class _Camera:
    """One camera's subscription, publishers and results."""

    name: str
    slot: NewestFrameSlot[Msg]
    description: Any
    partial: Any
    json: Any
    latency: dict[str, Any]
    sub: Any
    diag_name: str
    totals: LatencyWindow = field(default_factory=lambda: LatencyWindow(200))
    # The token ids of its last descriptions (speculation drafts from them), newest last.
    recent: deque[tuple[int, ...]] = field(default_factory=lambda: deque(maxlen=DRAFT_HISTORY))
    last_level: str = "ok"
    last_message: str = "no frame described yet"

    def topic(self, name: str) -> str:
        return camera_topic(self.name, name)


class VlmNodeCore:
    """The node's behaviour, shared by the plain node and the lifecycle node (mixed into a Node
    class): `load_engine()`, `start()`, `stop()` and `unload_engine()` are the four transitions."""

    def _init_core(self) -> None:
        self.params: NodeParams = self._declare_parameters()
        self._pending: NodeParams | None = None
        self.add_on_set_parameters_callback(self._check_parameters)
        self.add_post_set_parameters_callback(self._apply_parameters)

        self._vlm: Any = None
        self._prefix_status = "not loaded"
        self._slots: CameraSlots[Msg] = CameraSlots(self.params.camera_names)
        self._questions = QuestionQueue(self._slots.cond, self.params.question_queue)
        self._cameras: dict[str, _Camera] = {}
        self._stop = threading.Event()
        self._worker: threading.Thread | None = None
        self._diag_lock = threading.Lock()
        self._current: Question | None = None  # the question the worker answers now (cancel)
        self._current_lock = threading.Lock()
        self._last_error = ""
        self._last_error_logged = 0.0
        self._error_repeats = 0
        self._warned_zero_stamp = False
        self._n_ctx: int | None = None  # the engine's context size, once loaded: bounds max_new_tokens
        self._model_files: list[model_files.WatchedFile] = []
        self._entities: list[Any] = []  # what start() created and stop() destroys
        self._ask_group = ReentrantCallbackGroup()
        self._frame_group = ReentrantCallbackGroup()
        # "robot1/edgevlm: frame": the full name keeps several nodes apart in rqt_runtime_monitor.
        self._diag_name = self.get_fully_qualified_name().lstrip("/")

    # -- parameters --------------------------------------------------------------------------
    def _declare_parameters(self) -> NodeParams:
        values: dict[str, Any] = {}
        for spec in PARAMS:
            descriptor = ParameterDescriptor(
                description=spec.description,
                read_only=not spec.runtime,
                # `-p deadline_ms:=500` is an integer to ROS: doubles accept both, validate() converts.
                dynamic_typing=spec.kind is float,
            )
            # A string array is declared by type: an empty YAML list carries none ROS could infer.
            default = Parameter.Type.STRING_ARRAY if spec.kind is tuple else spec.default
            try:
                values[spec.name] = self.declare_parameter(spec.name, default, descriptor).value
            except ParameterException as exc:
                override = self._parameter_overrides.get(spec.name)
                got = f"{type(override.value).__name__} {override.value!r}" if override is not None else str(exc)
                kind = {str: "a string", int: "an integer", float: "a number", tuple: "a list of strings"}[spec.kind]
                raise ParamError(f"parameter '{spec.name}' must be {kind}, got {got}") from None
        known = {spec.name for spec in PARAMS} | {"use_sim_time", "start_type_description_service"}
        for name in sorted(set(self._parameter_overrides) - known):
            if not name.startswith("qos_overrides."):
                self.get_logger().warning(f"unknown parameter '{name}' is ignored")
        return validate(values)

    def _check_parameters(self, parameters: list[Parameter]) -> SetParametersResult:
        self._pending = None
        changes = {p.name: p.value for p in parameters if p.name in {s.name for s in PARAMS}}
        if not changes:
            return SetParametersResult(successful=True)
        try:
            pending = apply_changes(self.params, changes)
            self._check_token_budget(pending.max_new_tokens)
        except ParamError as exc:
            self.get_logger().warning(f"parameter change refused: {exc}")
            return SetParametersResult(successful=False, reason=str(exc))
        self._pending = pending
        return SetParametersResult(successful=True)

    def _check_token_budget(self, max_new_tokens: int, name: str = "max_new_tokens") -> None:
        """More tokens than the context holds can never be generated; the engine would also
        reserve room for all of them up front (10^12 tokens: an allocation failure per frame)."""
        if self._n_ctx is not None and max_new_tokens > self._n_ctx:
            raise ParamError(f"parameter '{name}' must be <= {self._n_ctx} (the engine's context size), "
                             f"got {max_new_tokens}")

    def _apply_parameters(self, parameters: list[Parameter]) -> None:
        if self._pending is not None:
            self.params, self._pending = self._pending, None  # one reference swap: the worker reads it whole
            for p in parameters:
                self.get_logger().info(f"parameter '{p.name}' set to {p.value!r}")

    # -- the four transitions ----------------------------------------------------------------
    def load_engine(self) -> None:
        """Loads the model pair and the system prompt's KV cache. Raises ValueError / OSError."""
        from ..demo.demo_model import resolve_pair  # here, so a bad parameter fails before the engine is imported
        from ..engine.vlm import load_vlm

        p = self.params
        t0 = time.perf_counter()
        self._vlm = load_vlm(*resolve_pair(p.model, p.mmproj), threads=p.threads, image_mode=p.image_mode,
                             system_prompt=p.system_prompt, prefix_cache_dir=p.prefix_cache_dir, kv_type=p.kv_type,
                             mtp=p.mtp, vision_int8=p.vision_int8)
        self._n_ctx = int(self._vlm.text.native.n_ctx)
        self._check_token_budget(p.max_new_tokens)
        self._model_files = [model_files.watch("model", self._vlm.text.path),
                             model_files.watch("mmproj", self._vlm.mmproj_path)]
        self._prefix_status = str(self._vlm.prefix_cache_status)
        if self._prefix_status.startswith("rebuilt"):
            self.get_logger().warning(f"prefix cache {self._prefix_status}")
        self.get_logger().info(
            f"engine loaded in {time.perf_counter() - t0:.1f} s (model {p.model or 'default'}, mmproj "
            f"{p.mmproj or 'default'}, image_mode {p.image_mode}, threads {p.threads or 'auto'}, "
            f"prefix cache: {self._prefix_status}{self._mtp_status()})"
        )
        if p.mtp and not self._vlm.text.native.has_mtp:
            self.get_logger().warning("mtp: the model file has no multi-token-prediction block; "
                                      "drafts come from earlier answers only")

    def _mtp_status(self) -> str:
        if not self.params.mtp or self._vlm is None:
            return ""
        return ", drafts from its MTP block" if self._vlm.text.native.has_mtp else ", no MTP block in the file"

    def unload_engine(self) -> None:
        """Drops the engine (the model files are unmapped, its buffers freed and handed back to the
        system: malloc keeps freed heap memory for reuse unless asked)."""
        self._vlm = None
        self._model_files = []
        self._prefix_status = "not loaded"
        gc.collect()
        _trim_malloc()

    def start(self) -> None:
        """Creates the publishers, subscriptions, service and action, and starts the worker."""
        p = self.params
        self._stop.clear()
        self._slots = CameraSlots(p.camera_names)
        self._questions = QuestionQueue(self._slots.cond, p.question_queue)
        if self._vlm is not None:
            self._vlm.text.native.cancel(False)  # a stop() before left it set
        self._diag_pub = self.create_publisher(DiagnosticArray, "/diagnostics", OUTPUT_QOS)
        reliability = ReliabilityPolicy.RELIABLE if p.qos_reliability == "reliable" else ReliabilityPolicy.BEST_EFFORT
        image_qos = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=p.qos_depth, reliability=reliability,
                               durability=DurabilityPolicy.VOLATILE)
        msg_type = CompressedImage if p.transport == "compressed" else Image
        self._cameras = {}
        for name in p.camera_names:
            slot = self._slots.slot(name)
            pub = self.create_publisher

            def topic(t: str, name: str = name) -> str:
                return camera_topic(name, t)

            cam = _Camera(
                name=name, slot=slot,
                description=pub(String, topic("description"), OUTPUT_QOS),
                partial=pub(String, topic("description/partial"), OUTPUT_QOS),
                json=pub(String, topic("description/json"), OUTPUT_QOS),
                latency={stage: pub(Float64, topic(f"latency/{stage}_ms"), OUTPUT_QOS)
                         for stage in (*REPORTED_STAGES, AGE)},
                sub=self.create_subscription(msg_type, topic(p.image_topic), slot.put, image_qos,
                                            callback_group=self._frame_group),
                diag_name=f"{self._diag_name}: {name}: frame" if name else f"{self._diag_name}: frame",
            )
            self._cameras[name] = cam
            self._entities += [cam.description, cam.partial, cam.json, *cam.latency.values(), cam.sub]
        self._entities.append(self._diag_pub)
        self._entities += ask.create_endpoints(self, self._ask_group)
        self._worker = threading.Thread(target=self._work, name="edgevlm-worker", daemon=True)
        self._worker.start()
        self._heartbeat = self.create_timer(HEARTBEAT_S, self._publish_heartbeat)
        self._entities.append(self._heartbeat)
        topics = ", ".join(c.sub.topic_name for c in self._cameras.values())
        self.get_logger().info(
            f"describing frames from {topics} ({msg_type.__name__}, {p.qos_reliability}, depth {p.qos_depth}); "
            f"questions on {self.resolve_service_name('ask')}")

    def busy(self) -> bool:
        """True while a camera's frame is being described."""
        return any(c.slot.busy_since is not None for c in self._cameras.values())

    def stop(self, timeout: float = STOP_GRACE_S) -> bool:
        """Stops the worker; False when it is still inside the engine after `timeout` seconds."""
        self._stop.set()
        self._slots.close()
        self._questions.fail_all("the node is stopping")
        if self._vlm is not None:
            self._vlm.cancel()  # a generation in progress ends at its next token
        if self._worker is None:
            return True
        self._worker.join(timeout)
        done = not self._worker.is_alive()
        if done:
            self._worker = None
        return done

    def destroy_entities(self) -> None:
        """Destroys what start() created (deactivate: nothing is published any more)."""
        for entity in self._entities:
            for destroy in ("destroy_publisher", "destroy_subscription", "destroy_timer", "destroy_service"):
                try:
                    if getattr(self, destroy)(entity):
                        break
                except (TypeError, AttributeError):
                    continue
            else:
                if hasattr(entity, "destroy"):
                    entity.destroy()
        self._entities = []

    # -- the worker --------------------------------------------------------------------------
    def _work(self) -> None:
        prefer_question = False
        while not self._stop.is_set():
            work = next_work(self._slots, self._questions, prefer_question, 0.5)
            if work is None or self._stop.is_set():
                if work is not None and work.question is not None:
                    work.question.finish(Answer(False, "the node is stopping"))
                continue
            if work.question is not None:
                prefer_question = False
                self._answer(work.question, work.frame)
                continue
            prefer_question = True
            # The period counts from the start of a description, per camera.
            self._slots.hold(work.camera, time.monotonic() + self.params.period_s)
            try:
                self._describe(work.frame, work.camera)
            except Exception as exc:  # the worker must outlive any one frame
                if self._stop.is_set():
                    return  # the node is being torn down under us: nothing left to report
                self._frame_failed(work.frame, f"internal error: {type(exc).__name__}: {exc}", work.camera)

    def _describe(self, msg: Msg, camera: str = "") -> None:
        p = self.params  # one consistent set for the whole frame
        cam = self._cameras[camera]

        def partial(text: str, tokens: int) -> None:
            cam.partial.publish(String(data=text))

        budget = None
        if p.description_schema is not None:  # the budget covers the schema's shortest answer
            try:
                budget = max(p.max_new_tokens, int(self._vlm.text.constraint(schema=p.description_schema).min_tokens))
            except ValueError as exc:
                self._frame_failed(msg, f"description_schema: {exc}", camera)
                return
        try:
            result = describe_frame(self._vlm, msg, p, max_new_tokens=budget, schema=p.description_schema,
                                    on_partial=partial if p.partial_every else None,
                                    drafts_from=list(cam.recent) if p.speculation else None)
        except FrameFailure as failure:
            if not (failure.in_engine and self._stop.is_set()):
                self._frame_failed(msg, str(failure), camera)
            return
        if self._stop.is_set():
            return
        age_ms = self._age_ms(msg)
        if result.stop_reason in ("stop_token", "max_tokens"):  # a whole description, worth drafting from
            cam.recent.append(result.token_ids)
        cam.description.publish(String(data=result.text))
        if p.description_schema is not None:
            cam.json.publish(String(data=result.text))
        for stage, value in result.ms.items():
            cam.latency[stage].publish(Float64(data=value))
        if age_ms is not None:
            cam.latency[AGE].publish(Float64(data=age_ms))
        cam.slot.finish(described=True, deadline_miss=result.deadline_miss)
        cam.totals.add(result.ms[TOTAL])
        self._publish_frame_status(cam, msg, *report(result, msg, p, age_ms))

    def _answer(self, q: Question, msg: Msg) -> None:
        """Answers a question about msg (its camera's newest frame) and finishes it."""
        with self._current_lock:
            if q.cancelled.is_set():
                q.finish(Answer(False, "cancelled before it was answered"))
                return
            self._current = q
            self._vlm.text.native.cancel(False)
        try:
            result = describe_frame(self._vlm, msg, self.params, prompt=q.text, max_new_tokens=q.max_tokens,
                                    choices=q.choices, schema=q.schema, on_partial=q.on_partial)
            answer = Answer(True, "", result.text, msg.header.stamp, msg.header.frame_id, dict(result.ms),
                            result.stop_reason, result.tokens)
            self._questions.answered += 1
        except FrameFailure as failure:
            answer = Answer(False, str(failure), stamp=msg.header.stamp, frame_id=msg.header.frame_id)
        except Exception as exc:  # the worker must outlive any one question
            answer = Answer(False, f"internal error: {type(exc).__name__}: {exc}")
        finally:
            with self._current_lock:
                self._current = None
        if self._stop.is_set() and answer.stop_reason == "cancelled":
            answer = Answer(False, "the node is stopping")
        q.finish(answer)

    def cancel_question(self, q: Question) -> None:
        """From any thread: q is not answered, or its decoding stops before the next token."""
        q.cancelled.set()
        if self._questions.cancel(q):
            q.finish(Answer(False, "cancelled before it was answered"))
            return
        with self._current_lock:
            if self._current is q and self._vlm is not None:
                self._vlm.text.native.cancel(True)

    def submit_question(self, q: Question) -> None:
        """Queues q for the worker (QueueFull when the queue is full)."""
        if self._worker is None or self._stop.is_set():
            q.finish(Answer(False, "the node is not active"))
            return
        self._questions.submit(q)

    def _frame_failed(self, msg: Msg, text: str, camera: str = "") -> None:
        cam = self._cameras[camera]
        if cam.slot.working:  # not yet counted (an internal error can come after the count)
            cam.slot.finish(described=False)
        self._log_error(text)
        self._publish_frame_status(cam, msg, "error", text,
                                   [("image", describe_message(msg)), ("frame_id", msg.header.frame_id)])

    def _log_error(self, text: str) -> None:
        now = time.monotonic()
        if text == self._last_error and now - self._last_error_logged < REPEAT_LOG_S:
            self._error_repeats += 1
            return
        if self._error_repeats:
            text += f" (the previous error was repeated {self._error_repeats} more times)"
        self.get_logger().error(text)
        self._last_error, self._last_error_logged, self._error_repeats = text, now, 0

    def _age_ms(self, msg: Msg) -> float | None:
        stamp = Time.from_msg(msg.header.stamp)
        if stamp.nanoseconds == 0:
            if not self._warned_zero_stamp:
                self._warned_zero_stamp = True
                self.get_logger().warning("image header stamps are zero: latency/age_ms is not published")
            return None
        return (self.get_clock().now().nanoseconds - stamp.nanoseconds) / 1e6

    # -- diagnostics -------------------------------------------------------------------------
    def _counters(self, cam: _Camera) -> list[tuple[str, Any]]:
        return diagnostics.counter_values(cam.slot.counts(), cam.totals)

    def _publish_frame_status(self, cam: _Camera, msg: Msg, level: str, message: str,
                              values: list[tuple[str, Any]]) -> None:
        """One frame's result, stamped with the frame's own stamp (rqt shows which frame it was)."""
        cam.last_level, cam.last_message = level, message
        camera = [("camera", cam.name)] if cam.name else []
        status = diagnostics.status(level, cam.diag_name, message, self.get_fully_qualified_name(),
                                    camera + values + self._counters(cam))
        self._publish_diagnostics(DiagnosticArray(header=msg.header, status=[status]))

    def _all_counters(self) -> list[tuple[str, Any]]:
        """Every camera's counters (prefixed with its name when it has one) and the questions'."""
        out: list[tuple[str, Any]] = []
        for cam in self._cameras.values():
            prefix = f"{cam.name}." if cam.name else ""
            out += [(prefix + k, v) for k, v in self._counters(cam)]
        q = self._questions
        out += [("questions_asked", q.asked), ("questions_answered", q.answered), ("questions_refused", q.refused),
                ("questions_waiting", len(q))]
        return out

    def _check_model_files(self) -> None:
        """Reports, once per change, a model file deleted, replaced or modified since it was loaded."""
        for _, level, text in model_files.changes(self._model_files):
            log = {"ok": self.get_logger().info, "warn": self.get_logger().warning}
            log.get(level, self.get_logger().error)(text)
            status = diagnostics.status(level, f"{self._diag_name}: model files", text,
                                        self.get_fully_qualified_name(),
                                        [*((f"{w.label}_file", f"{w.state}: {w.path}") for w in self._model_files),
                                         *self._all_counters()])
            self._publish_now(status)

    def _publish_heartbeat(self) -> None:
        """The worker's state once a second, so a monitor shows a stuck or starved node too."""
        self._check_model_files()
        cams = list(self._cameras.values())
        busy = [c.slot.busy_since for c in cams if c.slot.busy_since is not None]
        received = sum(c.slot.counts().received for c in cams)
        last = max(cams, key=lambda c: c.slot.counts().described + c.slot.counts().failed)
        topics = ", ".join(c.sub.topic_name for c in cams)
        state, message = diagnostics.worker_state(busy[0] if busy else None, time.monotonic(), received, topics,
                                                  last.last_message)
        self._publish_now(diagnostics.heartbeat(
            f"{self._diag_name}: worker", self.get_fully_qualified_name(), state, message, last.last_level,
            self._all_counters(), self._prefix_status, self.params, topics, self._model_files))

    def _publish_now(self, status: Any) -> None:
        array = DiagnosticArray(status=[status])
        array.header.stamp = self.get_clock().now().to_msg()
        self._publish_diagnostics(array)

    def _publish_diagnostics(self, array: DiagnosticArray) -> None:
        with self._diag_lock:  # the worker and the heartbeat timer share the publisher
            self._diag_pub.publish(array)


class EdgeVlmNode(VlmNodeCore, Node):
    """Declares and validates the parameters; `load_engine()` and `start()` do the rest."""

    def __init__(self, **kwargs: Any) -> None:
        Node.__init__(self, "edgevlm", **kwargs)
        self._init_core()


def executor_for(params: NodeParams) -> OnceQueuedExecutor:
    """Threads for the callbacks: every waiting question holds one (it waits for its answer), and
    frames, parameters and the heartbeat need theirs."""
    return OnceQueuedExecutor(num_threads=params.question_queue + 4)


# glibc gives each thread that allocates its own malloc arena (up to 8 per core) and keeps what is
# freed there for that arena. The node's threads (executor, worker, the engine's stream poller, DDS)
# each hold some, and their RSS crept up without bound in the soak (+1.9 to +6 MiB per 1000 frames
# with streaming on; +0.05 with it off; +0.7 with two arenas, +0.4 with one). One arena costs
# nothing measurable here: the engine's own hot loops do not allocate.
MALLOC_ARENAS = 1
# glibc also raises its mmap threshold to the size of every mmapped block freed (up to 32 MiB), so
# after the first frame the per-frame buffers (a 56 KiB image, the preprocessing arrays) are
# carved from the heap, whose high-water mark then ratchets up whenever two frames' buffers
# overlap: the soak's anonymous RSS rose +0.3 to +0.9 MiB per 1000 frames after warm-up. Fixed
# thresholds (which also turn the dynamic one off) give those buffers back at free: -0.11 to
# +0.39 with streaming on or off, and RSS falls back after a peak (2026-12-02). The cost is
# a few hundred mmap/munmap pairs a second at 30 frames/s, none on the per-token path.
MALLOC_MMAP_THRESHOLD = 64 * 1024
MALLOC_TRIM_THRESHOLD = 128 * 1024
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # glibc's mallopt parameters


def _tune_malloc() -> None:
    """mallopt(M_ARENA_MAX, MALLOC_ARENAS) and fixed mmap / trim thresholds on glibc, before any
    thread starts; glibc's own environment knobs (MALLOC_ARENA_MAX, MALLOC_MMAP_THRESHOLD_,
    MALLOC_TRIM_THRESHOLD_) win."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    settings = [("MALLOC_ARENA_MAX", _M_ARENA_MAX, MALLOC_ARENAS),
                ("MALLOC_MMAP_THRESHOLD_", _M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD),
                ("MALLOC_TRIM_THRESHOLD_", _M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD)]
    try:
        libc = ctypes.CDLL(None)
        for env, param, value in settings:
            if not os.environ.get(env):
                libc.mallopt(ctypes.c_int(param), ctypes.c_int(value))
    except (OSError, AttributeError):  # not glibc (musl has no mallopt): nothing to tune
        pass


def _trim_malloc() -> None:
    """malloc_trim(0) on glibc: freed heap pages go back to the system (RSS drops after cleanup)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(ctypes.c_size_t(0))
    except (OSError, AttributeError):  # not glibc
        pass


def _error(message: str) -> None:
    first = message.strip().splitlines()[0] if message.strip() else "unknown error"
    print(f"edgevlm_node: error: {first}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None, lifecycle_class: type | None = None) -> int:
    """`edgevlm_node [--ros-args ...]`. 0 after Ctrl-C / SIGTERM, 2 for bad parameters, 1 when the
    engine cannot load; errors are one line on stderr. lifecycle_class: the managed node
    (`edgevlm_lifecycle_node` passes EdgeVlmLifecycleNode), which starts unconfigured and loads,
    starts, stops and unloads on the lifecycle_msgs transitions; it exits 0 after shutdown."""
    args = list(sys.argv if argv is None else argv)
    _tune_malloc()
    try:
        # rclpy.init installs rclpy's SIGINT / SIGTERM handlers (spin then ends with
        # ExternalShutdownException); Python's own SIGINT handler stays behind them.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        rclpy.init(args=args)
    except KeyboardInterrupt:
        return 0
    except Exception as exc:  # e.g. an unreadable --params-file: one line, no traceback
        _error(f"bad command line or parameters file: {exc}")
        return 2

    node: Any = None
    code = 0
    worker_done = True
    try:
        if lifecycle_class is not None:
            node = lifecycle_class()
            executor = executor_for(node.params)
            executor.add_node(node)
            while rclpy.ok() and not node.finalized:
                executor.spin_once(timeout_sec=0.2)
        else:
            node = EdgeVlmNode()
            node.load_engine()
            if rclpy.ok():  # a signal during loading: leave quietly
                node.start()
                executor = executor_for(node.params)
                executor.add_node(node)
                executor.spin()
    except (KeyboardInterrupt, ExternalShutdownException):
        code = 0
    except ParamError as exc:
        _error(str(exc))
        code = 2
    except (ValueError, OSError, RuntimeError) as exc:
        if rclpy.ok():
            _error(str(exc))
            code = 1
    finally:
        if node is not None:
            t0 = time.monotonic()
            busy = node.busy()
            worker_done = node.stop()
            if busy:  # a user sees that the answer in progress was cut, and how soon the engine let go
                with contextlib.suppress(Exception):
                    node.get_logger().info(f"stopping: cancelled the answer in progress (worker "
                                           f"{'ended' if worker_done else 'still inside the engine'} "
                                           f"after {(time.monotonic() - t0) * 1e3:.0f} ms)")
            node.destroy_node()
        rclpy.try_shutdown()
    if not worker_done:
        # The worker is inside the engine (native code, GIL released). Waiting would break the
        # one-second promise, and a daemon thread woken during interpreter finalisation can abort
        # the process; everything worth keeping is already published and flushed.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
