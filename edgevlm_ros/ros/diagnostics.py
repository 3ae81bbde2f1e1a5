"""What the node puts on /diagnostics, built from plain values: the status of one frame, of the
worker (the 1 Hz heartbeat) and of the model files, each with the frame counters. The node decides
when to publish and stamps the arrays; these functions only build them.

Levels are written "ok" / "warn" / "error" by the plain-Python side (frame_work, model_files)
and become DiagnosticStatus levels here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from diagnostic_msgs.msg import DiagnosticStatus, KeyValue

from ..engine.latency import LatencyWindow
from .frame_slot import FrameCounts
from .model_files import WatchedFile
from .node_params import NodeParams

__all__ = ["LEVELS", "counter_values", "heartbeat", "key_value", "status", "worker_state"]

LEVELS: dict[str, bytes] = {"ok": DiagnosticStatus.OK, "warn": DiagnosticStatus.WARN,
                            "error": DiagnosticStatus.ERROR}

Values = Iterable[tuple[str, Any]]


def key_value(key: str, value: Any) -> KeyValue:
    """A diagnostic key/value; floats with one decimal ("nan" for none)."""
    if isinstance(value, float):
        value = "nan" if math.isnan(value) else f"{value:.1f}"
    return KeyValue(key=key, value=str(value))


def counter_values(counts: FrameCounts, totals: LatencyWindow) -> list[tuple[str, Any]]:
    """The frame counters and total-latency percentiles that every status of the node carries."""
    return [
        ("frames_received", counts.received),
        ("frames_described", counts.described),
        ("frames_failed", counts.failed),
        ("frames_dropped", counts.dropped),
        ("frames_in_flight", counts.in_flight),
        ("deadline_misses", counts.deadline_misses),
        ("total_ms_p50", totals.p50),
        ("total_ms_p99", totals.p99),
    ]


def status(level: str, name: str, message: str, hardware_id: str, values: Values) -> DiagnosticStatus:
    """One DiagnosticStatus; level is "ok", "warn" or "error"."""
    return DiagnosticStatus(level=LEVELS[level], name=name, message=message, hardware_id=hardware_id,
                            values=[key_value(k, v) for k, v in values])


def worker_state(busy_since: float | None, now: float, received: int, topic: str,
                 last_message: str) -> tuple[str, str]:
    """(state, message) of the worker: describing (since busy_since), waiting (no frame yet) or idle."""
    if busy_since is not None:
        return "describing", f"describing a frame for {now - busy_since:.1f} s"
    if received == 0:
        return "waiting", f"no frame received yet on {topic}"
    return "idle", f"waiting for the next frame; last: {last_message}"


def heartbeat(name: str, hardware_id: str, state: str, message: str, last_level: str, counters: Values,
              prefix_status: str, p: NodeParams, topic: str, files: Iterable[WatchedFile]) -> DiagnosticStatus:
    """The worker's status: OK while it works or waits, the last frame's level when idle."""
    return status(
        last_level if state == "idle" else "ok", name, message, hardware_id,
        [("state", state), *counters, ("prefix_cache", prefix_status), ("image_mode", p.image_mode),
         ("max_new_tokens", p.max_new_tokens), ("deadline_ms", p.deadline_ms or 0.0), ("period_s", p.period_s),
         ("topic", topic), *((f"{f.label}_file", f.state) for f in files)],
    )
