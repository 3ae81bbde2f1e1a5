"""The ROS 2 node `edgevlm` (executable `edgevlm_node`): camera frames in, descriptions and
per-stage latencies out.

The node class declares the parameters (`node_params`), creates the publishers and the
subscription, and hands every piece of work to plain functions tested without ROS: frame
conversion and description (`frame_work`, `frames`), the newest-frame slot (`frame_slot`),
model-file watching (`model_files`) and the diagnostics it publishes (`diagnostics`).

Threads: the executor thread runs the subscription callback, which only puts the message into a
one-frame slot (`frame_slot.NewestFrameSlot`) and returns, plus the parameter services and a
1 Hz diagnostics heartbeat. One worker thread takes the newest frame, converts it to RGB, runs
the engine (`vlm.describe`, which releases the GIL), and publishes. Frames that arrive while the
worker is busy replace the waiting one and are counted as dropped, so memory and latency stay
bounded whatever the camera's rate.

Topics (relative, so a namespace or a remap moves them all):
  in   image (sensor_msgs/Image) or, with transport=compressed, image/compressed
  out  description (std_msgs/String), latency/<stage>_ms (std_msgs/Float64) for stage in
       engine.latency.REPORTED_STAGES and AGE; /diagnostics (diagnostic_msgs/DiagnosticArray)

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

import os  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

import rclpy  # noqa: E402
from diagnostic_msgs.msg import DiagnosticArray  # noqa: E402
from rcl_interfaces.msg import ParameterDescriptor, SetParametersResult  # noqa: E402
from rclpy.exceptions import ParameterException  # noqa: E402
from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor  # noqa: E402
from rclpy.node import Node  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402
from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy  # noqa: E402
from rclpy.time import Time  # noqa: E402
from sensor_msgs.msg import CompressedImage, Image  # noqa: E402
from std_msgs.msg import Float64, String  # noqa: E402

from ..engine.latency import AGE, REPORTED_STAGES, TOTAL, LatencyWindow  # noqa: E402
from . import diagnostics, model_files  # noqa: E402
from .frame_slot import NewestFrameSlot  # noqa: E402
from .frame_work import FrameFailure, describe_frame, describe_message, report  # noqa: E402
from .node_params import PARAMS, NodeParams, ParamError, apply_changes, validate  # noqa: E402

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


class EdgeVlmNode(Node):
    """Declares and validates the parameters; `load_engine()` and `start()` do the rest."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__("edgevlm", **kwargs)
        self.params: NodeParams = self._declare_parameters()
        self._pending: NodeParams | None = None
        self.add_on_set_parameters_callback(self._check_parameters)
        self.add_post_set_parameters_callback(self._apply_parameters)

        self._vlm: Any = None
        self._prefix_status = "not loaded"
        self._slot: NewestFrameSlot[Image | CompressedImage] = NewestFrameSlot()
        self._totals = LatencyWindow(200)
        self._stop = threading.Event()
        self._worker: threading.Thread | None = None
        self._diag_lock = threading.Lock()
        self._last_level = "ok"
        self._last_message = "no frame described yet"
        self._last_error = ""
        self._last_error_logged = 0.0
        self._error_repeats = 0
        self._warned_zero_stamp = False
        self._n_ctx: int | None = None  # the engine's context size, once loaded: bounds max_new_tokens
        self._model_files: list[model_files.WatchedFile] = []
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
            try:
                values[spec.name] = self.declare_parameter(spec.name, spec.default, descriptor).value
            except ParameterException as exc:
                override = self._parameter_overrides.get(spec.name)
                got = f"{type(override.value).__name__} {override.value!r}" if override is not None else str(exc)
                kind = {str: "a string", int: "an integer", float: "a number"}[spec.kind]
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

    def _check_token_budget(self, max_new_tokens: int) -> None:
        """More tokens than the context holds can never be generated; the engine would also
        reserve room for all of them up front (10^12 tokens: an allocation failure per frame)."""
        if self._n_ctx is not None and max_new_tokens > self._n_ctx:
            raise ParamError(f"parameter 'max_new_tokens' must be <= {self._n_ctx} (the engine's context size), "
                             f"got {max_new_tokens}")

    def _apply_parameters(self, parameters: list[Parameter]) -> None:
        if self._pending is not None:
            self.params, self._pending = self._pending, None  # one reference swap: the worker reads it whole
            for p in parameters:
                self.get_logger().info(f"parameter '{p.name}' set to {p.value!r}")

    # -- start and stop ----------------------------------------------------------------------
    def load_engine(self) -> None:
        """Loads the model pair and the system prompt's KV cache. Raises ValueError / OSError."""
        from ..demo.demo_model import resolve_pair  # here, so a bad parameter fails before the engine is imported
        from ..engine.vlm import load_vlm

        p = self.params
        t0 = time.perf_counter()
        self._vlm = load_vlm(*resolve_pair(p.model, p.mmproj), threads=p.threads, image_mode=p.image_mode,
                             system_prompt=p.system_prompt, prefix_cache_dir=p.prefix_cache_dir)
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
            f"prefix cache: {self._prefix_status})"
        )

    def start(self) -> None:
        """Creates the publishers and the subscription and starts the worker thread."""
        p = self.params
        self._description_pub = self.create_publisher(String, "description", OUTPUT_QOS)
        self._latency_pubs = {stage: self.create_publisher(Float64, f"latency/{stage}_ms", OUTPUT_QOS)
                              for stage in (*REPORTED_STAGES, AGE)}
        self._diag_pub = self.create_publisher(DiagnosticArray, "/diagnostics", OUTPUT_QOS)
        reliability = ReliabilityPolicy.RELIABLE if p.qos_reliability == "reliable" else ReliabilityPolicy.BEST_EFFORT
        image_qos = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=p.qos_depth, reliability=reliability,
                               durability=DurabilityPolicy.VOLATILE)
        msg_type = CompressedImage if p.transport == "compressed" else Image
        self._sub = self.create_subscription(msg_type, p.image_topic, self._slot.put, image_qos)
        self._worker = threading.Thread(target=self._work, name="edgevlm-worker", daemon=True)
        self._worker.start()
        self._heartbeat = self.create_timer(HEARTBEAT_S, self._publish_heartbeat)
        self.get_logger().info(
            f"describing frames from {self._sub.topic_name} ({msg_type.__name__}, {p.qos_reliability}, "
            f"depth {p.qos_depth})"
        )

    def stop(self, timeout: float = STOP_GRACE_S) -> bool:
        """Stops the worker; False when it is still inside the engine after `timeout` seconds."""
        self._stop.set()
        self._slot.close()
        if self._vlm is not None:
            self._vlm.cancel()  # a generation in progress ends at its next token
        if self._worker is None:
            return True
        self._worker.join(timeout)
        return not self._worker.is_alive()

    # -- the worker --------------------------------------------------------------------------
    def _work(self) -> None:
        next_start = 0.0
        while not self._stop.is_set():
            wait = next_start - time.monotonic()
            if wait > 0 and self._stop.wait(wait):
                break
            msg = self._slot.take(timeout=0.5)
            if msg is None:
                continue
            next_start = time.monotonic() + self.params.period_s
            try:
                self._describe(msg)
            except Exception as exc:  # the worker must outlive any one frame
                if self._stop.is_set():
                    return  # the node is being torn down under us: nothing left to report
                self._frame_failed(msg, f"internal error: {type(exc).__name__}: {exc}")

    def _describe(self, msg: Image | CompressedImage) -> None:
        p = self.params  # one consistent set for the whole frame
        try:
            result = describe_frame(self._vlm, msg, p)
        except FrameFailure as failure:
            if not (failure.in_engine and self._stop.is_set()):
                self._frame_failed(msg, str(failure))
            return
        if self._stop.is_set():
            return
        age_ms = self._age_ms(msg)
        self._description_pub.publish(String(data=result.text))
        for stage, value in result.ms.items():
            self._latency_pubs[stage].publish(Float64(data=value))
        if age_ms is not None:
            self._latency_pubs[AGE].publish(Float64(data=age_ms))
        self._slot.finish(described=True, deadline_miss=result.deadline_miss)
        self._totals.add(result.ms[TOTAL])
        self._publish_frame_status(msg, *report(result, msg, p, age_ms))

    def _frame_failed(self, msg: Image | CompressedImage, text: str) -> None:
        if self._slot.working:  # not yet counted (an internal error can come after the count)
            self._slot.finish(described=False)
        self._log_error(text)
        self._publish_frame_status(msg, "error", text,
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

    def _age_ms(self, msg: Image | CompressedImage) -> float | None:
        stamp = Time.from_msg(msg.header.stamp)
        if stamp.nanoseconds == 0:
            if not self._warned_zero_stamp:
                self._warned_zero_stamp = True
                self.get_logger().warning("image header stamps are zero: latency/age_ms is not published")
            return None
        return (self.get_clock().now().nanoseconds - stamp.nanoseconds) / 1e6

    # -- diagnostics -------------------------------------------------------------------------
    def _counters(self) -> list[tuple[str, Any]]:
        return diagnostics.counter_values(self._slot.counts(), self._totals)

    def _publish_frame_status(self, msg: Image | CompressedImage, level: str, message: str,
                              values: list[tuple[str, Any]]) -> None:
        """One frame's result, stamped with the frame's own stamp (rqt shows which frame it was)."""
        self._last_level, self._last_message = level, message
        status = diagnostics.status(level, f"{self._diag_name}: frame", message, self.get_fully_qualified_name(),
                                    values + self._counters())
        self._publish_diagnostics(DiagnosticArray(header=msg.header, status=[status]))

    def _check_model_files(self) -> None:
        """Reports, once per change, a model file deleted, replaced or modified since it was loaded."""
        for _, level, text in model_files.changes(self._model_files):
            log = {"ok": self.get_logger().info, "warn": self.get_logger().warning}
            log.get(level, self.get_logger().error)(text)
            status = diagnostics.status(level, f"{self._diag_name}: model files", text,
                                        self.get_fully_qualified_name(),
                                        [*((f"{w.label}_file", f"{w.state}: {w.path}") for w in self._model_files),
                                         *self._counters()])
            self._publish_now(status)

    def _publish_heartbeat(self) -> None:
        """The worker's state once a second, so a monitor shows a stuck or starved node too."""
        self._check_model_files()
        counts = self._slot.counts()
        state, message = diagnostics.worker_state(self._slot.busy_since, time.monotonic(), counts.received,
                                                  self._sub.topic_name, self._last_message)
        self._publish_now(diagnostics.heartbeat(
            f"{self._diag_name}: worker", self.get_fully_qualified_name(), state, message, self._last_level,
            self._counters(), self._prefix_status, self.params, self._sub.topic_name, self._model_files))

    def _publish_now(self, status: Any) -> None:
        array = DiagnosticArray(status=[status])
        array.header.stamp = self.get_clock().now().to_msg()
        self._publish_diagnostics(array)

    def _publish_diagnostics(self, array: DiagnosticArray) -> None:
        with self._diag_lock:  # the worker and the heartbeat timer share the publisher
            self._diag_pub.publish(array)


def _error(message: str) -> None:
    first = message.strip().splitlines()[0] if message.strip() else "unknown error"
    print(f"edgevlm_node: error: {first}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """`edgevlm_node [--ros-args ...]`. 0 after Ctrl-C / SIGTERM, 2 for bad parameters, 1 when the
    engine cannot load; errors are one line on stderr."""
    args = list(sys.argv if argv is None else argv)
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

    node: EdgeVlmNode | None = None
    code = 0
    worker_done = True
    try:
        node = EdgeVlmNode()
        node.load_engine()
        if rclpy.ok():  # a signal during loading: leave quietly
            node.start()
            executor = SingleThreadedExecutor()
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
            worker_done = node.stop()
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
