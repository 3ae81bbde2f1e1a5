"""`edgevlm demo`: the main job on a laptop with no robot, camera or downloaded VLM.

Starts, as real ROS 2 processes talking over DDS (discovery kept on this machine):
  1. the camera publisher (`edgevlm camera`, generated scenes with their ground truth),
  2. the node (`edgevlm_node`) with the embedded demo model: our trained mmproj on the real,
     frozen SmolLM2-135M-Instruct,
and monitors them from this process: every described frame's text beside its ground truth, the
per-stage latencies with running p50/p99, dropped frames. Ctrl-C stops everything; with
`--frames N` it stops after N described frames and prints a summary (accuracy, latency
percentiles, dropped frames). This module is the ROS part (the children and the monitor node); the
matching and scoring are `demo/scoreboard.py`, without ROS.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ..demo.scoreboard import DemoStats
from ..engine.argtypes import non_negative_int, positive_int
from ..engine.latency import REPORTED_STAGES

ROOT = Path(__file__).resolve().parents[2]


def add_demo_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--frames", type=non_negative_int, default=0,
                        help="stop after this many described frames (0: run until Ctrl-C)")
    parser.add_argument("--rate", type=float, default=2.0, help="camera frames per second (default 2)")
    parser.add_argument("--threads", type=non_negative_int, default=0, help="engine threads (0: the machine's cores)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=32, help="token budget per frame (32)")
    parser.add_argument("--seed", type=int, default=None, help="scene stream seed (default: the camera's)")
    parser.add_argument("--source", choices=("scenes", "drift"), default="scenes",
                        help="scenes: a new scene every frame (default); drift: a slowly changing view, as a "
                        "robot's camera has")
    parser.add_argument("--timeout", type=float, default=0.0, help="give up after this many seconds (0: never)")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    return parser


GROUND_TRUTH_WAIT_S = 15.0  # after the last counted description, for ground truth still on its way


def _ros_env() -> dict[str, str]:
    env = dict(os.environ)
    env["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"  # nothing leaves this machine
    env.setdefault("ROS_DOMAIN_ID", str(random.randint(1, 100)))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _start_children(args: argparse.Namespace, text_model: Path, mmproj: Path, env: dict[str, str],
                    log_dir: Path) -> list[Any]:
    """The node and the camera as process groups of their own; their stderr goes to files in
    log_dir (a pipe nobody reads would fill and stop a child that logs for hours)."""
    py = sys.executable
    camera = [py, "-m", "edgevlm_ros.cli", "camera", "--rate", str(args.rate), "--source", args.source]
    if args.seed is not None:
        camera += ["--seed", str(args.seed)]
    node = [py, "-m", "edgevlm_ros.ros.node", "--ros-args", "-r", "__node:=edgevlm",
            "--params-file", str(ROOT / "config" / "edgevlm.yaml"),
            "-p", f"model:={text_model}", "-p", f"mmproj:={mmproj}",
            "-p", f"max_new_tokens:={args.max_new_tokens}", "-p", f"threads:={args.threads}"]
    procs = []
    for name, cmd in (("node", node), ("camera", camera)):
        with open(log_dir / f"{name}.log", "w", encoding="utf-8") as err:
            p = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err,
                                 start_new_session=True)
        p.log_path = log_dir / f"{name}.log"  # type: ignore[attr-defined]
        procs.append(p)
    return procs


def _stop(procs: list[Any]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGINT)
    deadline = time.monotonic() + 5
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def run_demo(args: argparse.Namespace) -> int:
    from ..demo.demo_model import DEMO_MMPROJ_PATH, ensure_demo_text_model

    if not DEMO_MMPROJ_PATH.exists():
        raise FileNotFoundError(f"the embedded demo mmproj {DEMO_MMPROJ_PATH} is missing")
    text_model = ensure_demo_text_model()
    env = _ros_env()
    os.environ.update({k: env[k] for k in ("ROS_AUTOMATIC_DISCOVERY_RANGE", "ROS_DOMAIN_ID")})

    import rclpy
    from diagnostic_msgs.msg import DiagnosticArray
    from rclpy.executors import ExternalShutdownException
    from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
    from std_msgs.msg import String

    from ..demo.sources import CAPTION_DEPTH, scene_from_caption

    stats = DemoStats()
    log_dir = Path(tempfile.mkdtemp(prefix="edgevlm_demo_"))
    procs = _start_children(args, text_model, DEMO_MMPROJ_PATH, env, log_dir)
    rclpy.init()
    node = rclpy.create_node("edgevlm_demo_monitor")

    def on_caption(msg: String) -> None:
        line = stats.add_truth(*scene_from_caption(msg.data))
        if line is not None and not args.json:
            print(line, flush=True)

    def on_diagnostics(msg: DiagnosticArray) -> None:
        for status in msg.status:
            values = {kv.key: kv.value for kv in status.values}
            if "frames_received" in values:
                stats.counters = {k: int(float(values[k])) for k in values if k.startswith("frames_")}
            if not status.name.endswith(": frame") or "text" not in values or stats.closed:
                continue
            ms = {s: float(values.get(f"{s}_ms", "nan")) for s in REPORTED_STAGES}
            line = stats.add_description((msg.header.stamp.sec, msg.header.stamp.nanosec), values["text"], ms)
            if not args.json:
                print(line, flush=True)

    # Transient local, as the camera publishes it: the ground truth of frames published before this
    # monitor matched (the children start first) still arrives.
    node.create_subscription(String, "image/caption", on_caption, QoSProfile(
        depth=CAPTION_DEPTH, reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.TRANSIENT_LOCAL))
    node.create_subscription(DiagnosticArray, "/diagnostics", on_diagnostics, 50)
    if not args.json:
        print(f"edgevlm demo: camera at {args.rate} fps -> node ({text_model.name} + {DEMO_MMPROJ_PATH.name}); "
              "Ctrl-C to stop", flush=True)
    start = time.monotonic()
    code = 0
    try:
        while rclpy.ok():
            rclpy.spin_once(node, timeout_sec=0.2)
            if args.frames and stats.described >= args.frames:
                # A description can overtake its ground truth: DDS delivers the caption topic's
                # history to this late-joining monitor on its own schedule (seconds on a loaded
                # machine). Wait a while for the pending ones before summarising.
                stats.closed = True
                deadline = time.monotonic() + GROUND_TRUTH_WAIT_S
                while stats.pending and time.monotonic() < deadline and rclpy.ok():
                    rclpy.spin_once(node, timeout_sec=0.1)
                break
            if args.timeout and time.monotonic() - start > args.timeout:
                print("edgevlm demo: timed out", file=sys.stderr)
                code = 1
                break
            dead = [p for p in procs if p.poll() is not None]
            if dead:
                err = dead[0].log_path.read_text(encoding="utf-8", errors="replace").strip().splitlines()
                print(f"edgevlm demo: a child process exited ({err[-1] if err else dead[0].returncode}; "
                      f"log: {dead[0].log_path})", file=sys.stderr)
                code = 1
                break
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        _stop(procs)
        node.destroy_node()
        if rclpy.ok():
            rclpy.shutdown()
    summary = stats.summary()
    if args.json:
        print(json.dumps(summary))
    else:
        lat = ", ".join(f"{s} p50 {v['p50']:.0f} / p99 {v['p99']:.0f} ms" for s, v in summary["latency_ms"].items())
        print(f"\nsummary: {stats.described} frames described ({summary['frames_unmatched']} without ground "
              f"truth); objects fully right "
              f"{summary['objects_fully_right']:.1%}, count right {summary['count_right']:.1%}"
              + (f", frames without objects said so {summary['frames_without_objects_said_so']:.1%}"
                 if summary["frames_without_objects"] else "") + f"; {lat}; "
              f"node counters {summary['node_counters']}")
    return code
