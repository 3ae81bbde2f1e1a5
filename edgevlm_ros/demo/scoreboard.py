"""The demo's scoreboard, without ROS: described frames matched to their ground truth by stamp,
scored (`scenes.score`), with the latency of every reported stage and the node's frame counters.

`ros/demo.py` feeds it from the camera's caption topic (`add_truth`) and the node's frame
diagnostics (`add_description`) and prints the lines they return.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..engine.latency import REPORTED_STAGES, TOTAL, LatencyWindow
from .scenes import Scene, score

__all__ = ["DemoStats", "KEEP"]

Stamp = tuple[int, int]  # (sec, nanosec) of the frame's header
KEEP = 500  # ground truths and unmatched descriptions kept (the recent ones)


@dataclass
class DemoStats:
    described: int = 0
    objects: int = 0
    objects_right: int = 0
    counts_right: int = 0
    exact: int = 0
    empty: int = 0  # frames without a known object ...
    empty_said: int = 0  # ... described as such
    unmatched: int = 0  # descriptions whose ground truth never arrived
    pending: dict[Stamp, str] = field(default_factory=dict)  # stamp -> text, truth not yet here
    truths: dict[Stamp, Scene] = field(default_factory=dict)
    latency: dict[str, LatencyWindow] = field(
        default_factory=lambda: {s: LatencyWindow(10_000) for s in REPORTED_STAGES})
    counters: dict[str, int] = field(default_factory=dict)
    closed: bool = False  # the --frames target was reached: later descriptions are not counted

    def score(self, text: str, scene: Scene) -> str:
        """Counts one description against its scene; the verdict as text."""
        sc = score(text, scene)
        self.objects += sc.count_true
        self.objects_right += sc.n_right
        self.counts_right += int(sc.count_right)
        self.exact += int(sc.exact)
        if sc.count_true == 0:
            self.empty += 1
            self.empty_said += int(sc.all_right)
            return f"no known objects: {'said so' if sc.all_right else 'WRONG'}"
        return f"objects {sc.n_right}/{sc.count_true} count {'ok' if sc.count_right else 'WRONG'}"

    def add_truth(self, stamp: Stamp, scene: Scene) -> str | None:
        """A frame's ground truth arrived; the line to print when it completes a waiting description."""
        self.truths[stamp] = scene
        if len(self.truths) > KEEP:
            del self.truths[next(iter(self.truths))]
        text = self.pending.pop(stamp, None)
        if text is None:
            return None
        # Described before its ground truth got here (a late match).
        return f"       (late ground truth) {scene.caption!r} {self.score(text, scene)}"

    def add_description(self, stamp: Stamp, text: str, ms: dict[str, float]) -> str:
        """A frame's description with its stage latencies; the lines to print."""
        self.described += 1
        for s in REPORTED_STAGES:
            self.latency[s].add(ms[s])
        scene = self.truths.get(stamp)
        if scene is None:
            self.pending[stamp] = text
            if len(self.pending) > KEEP:  # never coming: count it as unmatched
                del self.pending[next(iter(self.pending))]
                self.unmatched += 1
            verdict = "(ground truth not here yet)"
        else:
            verdict = self.score(text, scene)
        return self.line(text, scene.caption if scene else None, verdict, ms)

    def line(self, text: str, truth: str | None, verdict: str, ms: dict[str, float]) -> str:
        lat = " ".join(f"{s} {ms.get(s, float('nan')):.0f}" for s in REPORTED_STAGES)
        tot = self.latency[TOTAL]
        dropped = self.counters.get("frames_dropped", 0)
        return (f"[{self.described:4d}] {text!r}\n       truth: {truth!r} {verdict}\n"
                f"       ms: {lat} | total p50 {tot.p50:.0f} p99 {tot.p99:.0f} | dropped {dropped}")

    def summary(self) -> dict[str, Any]:
        unmatched = self.unmatched + len(self.pending)
        n = max(self.described - unmatched, 1)
        return {
            "frames_described": self.described,
            "frames_unmatched": unmatched,
            "objects_fully_right": self.objects_right / max(self.objects, 1),
            "count_right": self.counts_right / n,
            "exact_captions": self.exact / n,
            "frames_without_objects": self.empty,
            "frames_without_objects_said_so": self.empty_said / self.empty if self.empty else None,
            "latency_ms": {s: {"p50": w.p50, "p99": w.p99} for s, w in self.latency.items()},
            "node_counters": self.counters,
        }
