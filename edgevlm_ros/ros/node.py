"""The ROS 2 node `edgevlm` (executable `edgevlm_node`): camera frames in, descriptions and
per-stage latencies out. The only module of the package that imports rclpy.

Threads: the executor thread runs the subscription callback, which only puts the message into a
one-frame slot (`latency_stats.NewestFrameSlot`) and returns, plus the parameter services and a
1 Hz diagnostics heartbeat. One worker thread takes the newest frame, converts it to RGB
(`frames`), runs the engine (`vlm.describe`, which releases the GIL), and publishes. Frames that
arrive while the worker is busy replace the waiting one and are counted as dropped, so memory
and latency stay bounded whatever the camera's rate.

Topics (relative, so a namespace or a remap moves them all):
  in   image (sensor_msgs/Image) or, with transport=compressed, image/compressed
  out  description (std_msgs/String), latency/<stage>_ms (std_msgs/Float64) for stage in
       preprocess, vision, prefill, decode, total, age; /diagnostics (diagnostic_msgs/DiagnosticArray)

Faults are reported once and survived: a frame that cannot be converted or that the engine fails
on gives one ERROR log line and one ERROR diagnostic stamped with that frame's stamp, publishes no
description, and the worker goes on with the next frame (the engine restores its KV state for
every frame, so a generation that failed half-way leaves nothing behind). The model files are
mapped at start and watched by the heartbeat: deleted, replaced or modified on disk, the node
says so once and keeps serving what it loaded.

Test hook (for test/test_faults.py only, inert unless set): the environment variable
EDGEVLM_TEST_FAULT=raise_in_decode:<frame_id> makes every frame whose header.frame_id is
<frame_id> fail in the middle of its generation (half its token budget decoded, then an
exception from the decoder). The node logs a warning at start while the hook is set.
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

import math  # noqa: E402
import os  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import rclpy  # noqa: E402
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue  # noqa: E402
from rcl_interfaces.msg import ParameterDescriptor, SetParametersResult  # noqa: E402
from rclpy.exceptions import ParameterException  # noqa: E402
from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor  # noqa: E402
from rclpy.node import Node  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402
from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy  # noqa: E402
from rclpy.time import Time  # noqa: E402
from sensor_msgs.msg import CompressedImage, Image  # noqa: E402
from std_msgs.msg import Float64, String  # noqa: E402

from ..engine.latency import AGE, REPORTED_STAGES, LatencyWindow  # noqa: E402
from . import frames  # noqa: E402
from .frame_slot import NewestFrameSlot  # noqa: E402
from .node_params import PARAMS, NodeParams, ParamError, apply_changes, validate  # noqa: E402

STAGES = REPORTED_STAGES
HEARTBEAT_S = 1.0
# Stopping cancels a generation in progress at its next token; a worker still inside the engine
# after this long (the vision encoder cannot be interrupted) is abandoned: the process exits
# without waiting for it (Ctrl-C must end the node within a second, even mid-generation).
STOP_GRACE_S = 0.5
# The same error on consecutive frames is logged at most this often (a broken camera at 30 Hz
# must not bury the log), with a count of the repeats.
REPEAT_LOG_S = 5.0

# The test hook's environment variable (see the module docstring); read by this module only.
TEST_FAULT_ENV = "EDGEVLM_TEST_FAULT"
TEST_FAULT_KINDS = ("raise_in_decode",)

OUTPUT_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=10, reliability=ReliabilityPolicy.RELIABLE,
                        durability=DurabilityPolicy.VOLATILE)


def _kv(key: str, value: Any) -> KeyValue:
    if isinstance(value, float):
        value = "nan" if math.isnan(value) else f"{value:.1f}"
    return KeyValue(key=key, value=str(value))


def _describe_message(msg: Image | CompressedImage) -> str:
    if isinstance(msg, Image):
        return f"{msg.width}x{msg.height} {msg.encoding}"
    return f"{msg.format or 'compressed'} ({len(msg.data)} bytes)"


def parse_test_fault(value: str) -> str:
    """The frame_id that EDGEVLM_TEST_FAULT=raise_in_decode:<frame_id> names. Raises ParamError."""
    kind, sep, frame_id = value.strip().partition(":")
    if kind not in TEST_FAULT_KINDS or not sep or not frame_id.strip():
        raise ParamError(f"{TEST_FAULT_ENV}={value!r} is not a test fault (expected raise_in_decode:<frame_id>); "
                         f"unset it outside tests")
    return frame_id.strip()


class InjectedFault(RuntimeError):
    """Raised by the test hook only."""


class _DecodeFaultHook:
    """TEST HOOK (EDGEVLM_TEST_FAULT), installed only when that variable is set: stands in for the
    engine's native decoder and passes every call through, except that a generation started while
    `armed` decodes half its token budget for real and then raises, as a decoder failing half-way
    would (the KV cache is left holding a half-finished answer)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.armed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def generate(self, prompt: Any, max_new_tokens: int, stop_ids: Any, max_ms: float = 0.0) -> Any:
        if not self.armed:
            return self._engine.generate(prompt, max_new_tokens, stop_ids, max_ms)
        partial = self._engine.generate(prompt, max(1, max_new_tokens // 2), stop_ids, max_ms)
        raise InjectedFault(f"injected by the test hook {TEST_FAULT_ENV} after {len(partial['tokens'])} "
                            f"decoded tokens")


@dataclass
class _WatchedFile:
    """A model file mapped at start, and what the heartbeat last saw on disk."""

    label: str  # "model" or "mmproj"
    path: Path
    identity: tuple[int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns at load
    state: str = "ok"  # ok | deleted | replaced | modified

    def look(self) -> str:
        try:
            st = os.stat(self.path)
        except OSError:
            return "deleted"
        if (st.st_dev, st.st_ino) != self.identity[:2]:
            return "replaced"
        return "ok" if (st.st_size, st.st_mtime_ns) == self.identity[2:] else "modified"


def _watch(label: str, path: str | os.PathLike[str]) -> _WatchedFile:
    resolved = Path(path).resolve()
    st = os.stat(resolved)
    return _WatchedFile(label, resolved, (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))


# What each state of a model file means for the node, and the level it is reported at.
_FILE_STATES: dict[str, tuple[bytes, str]] = {
    "ok": (DiagnosticStatus.OK, "is back as it was loaded"),
    "deleted": (DiagnosticStatus.ERROR, "was deleted while the node runs: still serving the copy mapped at start, "
                                        "but a restart will fail"),
    "replaced": (DiagnosticStatus.WARN, "was replaced on disk: still serving the file loaded at start; restart "
                                        "to load the new one"),
    "modified": (DiagnosticStatus.ERROR, "was modified in place while mapped: descriptions may be wrong from now "
                                         "on and reading a truncated file crashes the process; replace model files "
                                         "by renaming a new file over them, then restart"),
}


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
        self._last_level = DiagnosticStatus.OK
        self._last_message = "no frame described yet"
        self._last_error = ""
        self._last_error_logged = 0.0
        self._error_repeats = 0
        self._warned_zero_stamp = False
        self._n_ctx: int | None = None  # the engine's context size, once loaded: bounds max_new_tokens
        self._fault_hook: _DecodeFaultHook | None = None
        self._fault_frame_id: str | None = None
        self._model_files: list[_WatchedFile] = []
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
        fault = os.environ.get(TEST_FAULT_ENV)
        fault_frame_id = parse_test_fault(fault) if fault is not None else None  # a bad value fails before loading
        t0 = time.perf_counter()
        self._vlm = load_vlm(*resolve_pair(p.model, p.mmproj), threads=p.threads, image_mode=p.image_mode,
                             system_prompt=p.system_prompt, prefix_cache_dir=p.prefix_cache_dir)
        self._n_ctx = int(self._vlm.text.native.n_ctx)
        self._check_token_budget(p.max_new_tokens)
        self._model_files = [_watch("model", self._vlm.text.path), _watch("mmproj", self._vlm.mmproj_path)]
        if fault_frame_id is not None:
            self._fault_frame_id = fault_frame_id
            self._fault_hook = _DecodeFaultHook(self._vlm.text.native)
            self._vlm.text.native = self._fault_hook
            self.get_logger().warning(f"TEST HOOK {TEST_FAULT_ENV}={fault} is set: frames with frame_id "
                                      f"'{self._fault_frame_id}' will fail on purpose (never set it on a robot)")
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
                              for stage in (*STAGES, AGE)}
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
        t0 = time.perf_counter()
        try:
            rgb = frames.to_rgb(msg, p.max_image_pixels)
        except ValueError as exc:
            self._frame_failed(msg, f"bad image message ({_describe_message(msg)}): {exc}")
            return
        convert_ms = (time.perf_counter() - t0) * 1e3
        if self._fault_hook is not None:
            self._fault_hook.armed = msg.header.frame_id == self._fault_frame_id
        try:
            result = self._vlm.describe(rgb, p.prompt, p.max_new_tokens, deadline_ms=p.deadline_ms)
        except Exception as exc:  # an engine failure is reported per frame, not fatal
            if self._stop.is_set():
                return
            self._frame_failed(msg, f"engine failure on a {rgb.shape[1]}x{rgb.shape[0]} frame: "
                                    f"{type(exc).__name__}: {exc}")
            return
        if self._stop.is_set():
            return
        t = result.timings_ms
        ms = {stage: float(t.get(stage, math.nan)) for stage in STAGES}
        # The message-to-RGB conversion is part of this node's preprocessing and of its total.
        ms["preprocess"] += convert_ms
        ms["total"] += convert_ms
        age_ms = self._age_ms(msg)

        self._description_pub.publish(String(data=result.text))
        for stage, value in ms.items():
            self._latency_pubs[stage].publish(Float64(data=value))
        if age_ms is not None:
            self._latency_pubs[AGE].publish(Float64(data=age_ms))

        missed = result.stop_reason == "deadline"
        self._slot.finish(described=True, deadline_miss=missed)
        self._totals.add(ms["total"])
        n_tokens = len(result.token_ids)
        if missed:
            level = DiagnosticStatus.WARN
            message = f"deadline of {p.deadline_ms:.0f} ms missed: published the text after {n_tokens} tokens"
        else:
            level = DiagnosticStatus.OK
            message = f"described in {ms['total']:.0f} ms ({n_tokens} tokens, {result.stop_reason})"
        values = [
            _kv("text", result.text),
            _kv("tokens", n_tokens),
            _kv("tokens_per_s", float(result.tokens_per_s)),
            _kv("stop_reason", result.stop_reason),
            *(_kv(f"{stage}_ms", value) for stage, value in ms.items()),
            _kv("convert_ms", convert_ms),
            _kv("age_ms", math.nan if age_ms is None else age_ms),
            _kv("image", _describe_message(msg)),
            _kv("frame_id", msg.header.frame_id),
        ]
        self._publish_frame_status(msg, level, message, values)

    def _frame_failed(self, msg: Image | CompressedImage, text: str) -> None:
        if self._slot.working:  # not yet counted (an internal error can come after the count)
            self._slot.finish(described=False)
        self._log_error(text)
        self._publish_frame_status(msg, DiagnosticStatus.ERROR, text,
                                   [_kv("image", _describe_message(msg)), _kv("frame_id", msg.header.frame_id)])

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
    def _counter_values(self) -> list[KeyValue]:
        c = self._slot.counts()
        return [
            _kv("frames_received", c.received),
            _kv("frames_described", c.described),
            _kv("frames_failed", c.failed),
            _kv("frames_dropped", c.dropped),
            _kv("frames_in_flight", c.in_flight),
            _kv("deadline_misses", c.deadline_misses),
            _kv("total_ms_p50", self._totals.p50),
            _kv("total_ms_p99", self._totals.p99),
        ]

    def _publish_frame_status(self, msg: Image | CompressedImage, level: bytes, message: str,
                              values: list[KeyValue]) -> None:
        """One frame's result, stamped with the frame's own stamp (rqt shows which frame it was)."""
        self._last_level, self._last_message = level, message
        status = DiagnosticStatus(level=level, name=f"{self._diag_name}: frame", message=message,
                                  hardware_id=self.get_fully_qualified_name(),
                                  values=values + self._counter_values())
        self._publish_diagnostics(DiagnosticArray(header=msg.header, status=[status]))

    def _check_model_files(self) -> None:
        """Reports, once per change, a model file deleted, replaced or modified since it was loaded."""
        for f in self._model_files:
            state = f.look()
            if state == f.state:
                continue
            f.state = state
            level, meaning = _FILE_STATES[state]
            text = f"{f.label} file {f.path} {meaning}"
            log = {DiagnosticStatus.OK: self.get_logger().info, DiagnosticStatus.WARN: self.get_logger().warning}
            log.get(level, self.get_logger().error)(text)
            status = DiagnosticStatus(level=level, name=f"{self._diag_name}: model files", message=text,
                                      hardware_id=self.get_fully_qualified_name(),
                                      values=[*(_kv(f"{w.label}_file", f"{w.state}: {w.path}")
                                                for w in self._model_files), *self._counter_values()])
            array = DiagnosticArray(status=[status])
            array.header.stamp = self.get_clock().now().to_msg()
            self._publish_diagnostics(array)

    def _publish_heartbeat(self) -> None:
        """The worker's state once a second, so a monitor shows a stuck or starved node too."""
        self._check_model_files()
        busy_since = self._slot.busy_since
        counts = self._slot.counts()
        if busy_since is not None:
            state, message = "describing", f"describing a frame for {time.monotonic() - busy_since:.1f} s"
        elif counts.received == 0:
            state, message = "waiting", f"no frame received yet on {self._sub.topic_name}"
        else:
            state, message = "idle", f"waiting for the next frame; last: {self._last_message}"
        p = self.params
        status = DiagnosticStatus(
            level=self._last_level if state == "idle" else DiagnosticStatus.OK,
            name=f"{self._diag_name}: worker", message=message, hardware_id=self.get_fully_qualified_name(),
            values=[_kv("state", state), *self._counter_values(), _kv("prefix_cache", self._prefix_status),
                    _kv("image_mode", p.image_mode), _kv("max_new_tokens", p.max_new_tokens),
                    _kv("deadline_ms", p.deadline_ms or 0.0), _kv("period_s", p.period_s),
                    _kv("topic", self._sub.topic_name),
                    *(_kv(f"{f.label}_file", f.state) for f in self._model_files)],
        )
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
