"""`edgevlm camera`: a camera for testing without one — publishes sensor_msgs/Image (rgb8) at a rate.

    edgevlm camera [--source SRC] [--rate HZ] [--frames N] [--size WxH] [--seed S] [--loop] ...

Sources (`--source`):
  scenes (default)     the synthetic world of `edgevlm_ros.demo.scenes` (what the demo model knows), frame i of
                       stream `--seed`, `--size` (default 320x240); the ground truth goes out beside it
  drift                a slowly changing view of that world, as a robot's camera has (`demo.drift`): stream
                       `--seed`'s first scene, objects moving a little, a group appearing or vanishing every
                       2-6 s at `--rate`; ground truth as for scenes
  DIR                  the images of a folder (png, jpg, bmp, ppm/pgm, tif, webp), in name order
  FILE                 a video file (anything OpenCV's FFmpeg backend reads)
  /dev/videoN, v4l2:N  a V4L2 device through OpenCV (`--size` asks the driver for that size)
Folder and video stop at their end unless `--loop`; `--frames N` stops after N frames (0: never).
`--size` resizes folder and video frames too (default: as they are).

Topics (relative, so `--ros-args -r __ns:=/robot1` or a remap moves them; `--topic` renames):
  image          sensor_msgs/Image, encoding rgb8, header.stamp = the node clock when the frame was
                 taken (so `use_sim_time` works), header.frame_id = `--frame-id` (default "camera").
                 QoS: best effort, keep last 1 (`--reliable`, `--depth` change it).
  image/caption  std_msgs/String, scenes and drift only, one per frame, reliable, transient local, keep-last
                 100 (a subscriber that joins late gets the recent ones): a JSON object
                 {"stamp": {"sec", "nanosec"}, "frame_id", "index", "seed", "width", "height",
                 "caption"} (drift adds "drift_fps") whose stamp equals the image's. A subscriber
                 joins the two on the stamp and can rebuild the whole scene (to score a description)
                 with `scene_from_caption()`.
                 The stamp identifies the frame; header.frame_id stays a coordinate frame name, as
                 REP 103 wants, rather than carrying text.

Nothing network-wide is set here: discovery follows the environment (the Makefile and the tests
set ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST). The frame sources are `demo/sources.py` (no ROS);
rclpy is imported only when the publisher starts, so `edgevlm --help` (which adds these arguments)
loads no ROS.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..demo.sources import (
    CAPTION_DEPTH,
    DEFAULT_SEED,
    DriftSource,
    FrameSource,
    SceneSource,
    SourceError,
    caption_message,
    open_source,
)
from ..engine.argtypes import non_negative_int

__all__ = ["add_camera_arguments", "main", "run_camera", "split_ros_args"]


# -- command line ------------------------------------------------------------------------------------


def _size(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)[xX](\d+)", text.strip())
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise argparse.ArgumentTypeError(f"'{text}' is not a size like 320x240")
    return int(m.group(1)), int(m.group(2))


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None
    if not 0 < value <= 1000:
        raise argparse.ArgumentTypeError(f"rate {value} must be in (0, 1000] Hz")
    return value


def add_camera_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the `camera` arguments to a (sub)parser (see the module docstring)."""
    parser.add_argument("--source", default="scenes",
                        help="scenes (default: the demo world), drift (a slowly changing view of it), a folder "
                        "of images, a video file, /dev/videoN or v4l2:N")
    parser.add_argument("--rate", type=_rate, default=5.0, help="frames per second (default 5)")
    parser.add_argument("--frames", type=non_negative_int, default=0,
                        help="stop after this many frames (default 0: never)")
    parser.add_argument("--size", type=_size, default=None,
                        help="WxH: scene size (default 320x240), resize for folder/video, requested from a device")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"scene stream (default {DEFAULT_SEED})")
    parser.add_argument("--start", type=non_negative_int, default=0, help="first scene index (default 0)")
    parser.add_argument("--loop", action="store_true", help="folder / video: start again at the end")
    parser.add_argument("--topic", default="image", help="image topic (default: image)")
    parser.add_argument("--caption-topic", default=None, help="ground-truth topic (default: <topic>/caption)")
    parser.add_argument("--frame-id", default="camera", help="header.frame_id (default: camera)")
    parser.add_argument("--reliable", action="store_true", help="reliable QoS for images (default: best effort)")
    parser.add_argument("--depth", type=non_negative_int, default=1, help="image QoS keep-last depth (default 1)")
    parser.add_argument("--wait-subscribers", type=non_negative_int, default=0,
                        help="before the first frame, wait until this many image subscribers matched (default 0)")
    parser.add_argument("--wait-caption-subscribers", type=non_negative_int, default=0,
                        help="scenes: also wait for this many ground-truth subscribers (default 0)")
    parser.add_argument("--node-name", default="edgevlm_camera", help="ROS node name (default: edgevlm_camera)")
    parser.add_argument("--quiet", action="store_true", help="no line per frame on stdout")
    # `--ros-args ...` cannot pass through argparse: split it off first (split_ros_args) and set this.
    parser.set_defaults(ros_args=[])
    return parser


def split_ros_args(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(our arguments, `--ros-args ...` and everything after it) — for rclpy.init."""
    argv = list(argv)
    if "--ros-args" in argv:
        i = argv.index("--ros-args")
        return argv[:i], argv[i:]
    return argv, []


@dataclass
class _Stats:
    published: int = 0
    started: float = field(default_factory=time.monotonic)


def _publish_loop(node: Any, source: FrameSource, args: argparse.Namespace, stats: _Stats) -> None:
    """Publishes frames at args.rate until the source ends, args.frames are out, or shutdown."""
    import rclpy
    from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy
    from sensor_msgs.msg import Image
    from std_msgs.msg import String

    reliability = ReliabilityPolicy.RELIABLE if args.reliable else ReliabilityPolicy.BEST_EFFORT
    image_pub = node.create_publisher(Image, args.topic, QoSProfile(history=HistoryPolicy.KEEP_LAST,
                                                                    depth=max(args.depth, 1),
                                                                    reliability=reliability))
    caption_pub = None
    if isinstance(source, (SceneSource, DriftSource)):
        caption_topic = args.caption_topic or f"{args.topic}/caption"
        # Transient local: a monitor that joins late (slow discovery on a busy machine) still gets
        # the ground truth of the frames published before it matched.
        caption_pub = node.create_publisher(String, caption_topic, QoSProfile(
            history=HistoryPolicy.KEEP_LAST, depth=CAPTION_DEPTH, reliability=ReliabilityPolicy.RELIABLE,
            durability=DurabilityPolicy.TRANSIENT_LOCAL))
    deadline = time.monotonic() + 60.0
    waits = [(image_pub, args.wait_subscribers)]
    if caption_pub is not None:
        waits.append((caption_pub, getattr(args, "wait_caption_subscribers", 0)))
    for pub, n in waits:
        while n and pub.get_subscription_count() < n:
            if time.monotonic() > deadline:
                raise SourceError(f"no {n} subscriber(s) on {pub.topic_name} after 60 s")
            rclpy.spin_once(node, timeout_sec=0.05)
    node.get_logger().info(f"publishing {source.name} frames on {image_pub.topic_name} at {args.rate:g} Hz"
                           + (f" (ground truth on {caption_pub.topic_name})" if caption_pub else ""))
    period = 1.0 / args.rate
    start = time.monotonic()
    i = 0
    while rclpy.ok() and (args.frames == 0 or i < args.frames):
        # Frame i leaves at start + i * period: a slow frame does not shift the ones after it.
        delay = start + i * period - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        elif delay < -period:  # fell behind by more than a frame (a slow source): pace from now on
            start = time.monotonic() - i * period
        frame = source.read()
        if frame is None:
            break
        rgb = np.ascontiguousarray(frame.rgb)
        stamp = node.get_clock().now().to_msg()
        msg = Image(height=rgb.shape[0], width=rgb.shape[1], encoding="rgb8", is_bigendian=0,
                    step=rgb.shape[1] * 3, data=rgb.tobytes())
        msg.header.stamp = stamp
        msg.header.frame_id = args.frame_id
        image_pub.publish(msg)
        if caption_pub is not None and frame.scene is not None:
            drift_fps = source.stream.fps if isinstance(source, DriftSource) else None
            caption_pub.publish(String(data=caption_message(frame.scene, stamp.sec, stamp.nanosec, args.frame_id,
                                                            drift_fps)))
        stats.published += 1
        i += 1
        if not args.quiet:
            truth = f"  {frame.scene.caption}" if frame.scene is not None else ""
            print(f"frame {frame.index} {stamp.sec}.{stamp.nanosec:09d} {rgb.shape[1]}x{rgb.shape[0]}{truth}",
                  flush=True)
    # At the end of the source: give reliable subscribers the chance to receive (or have resent)
    # the last frames before this process, and its writer, go away.
    from rclpy.duration import Duration

    for pub in (image_pub, caption_pub):
        if pub is not None and pub.qos_profile.reliability == ReliabilityPolicy.RELIABLE:
            pub.wait_for_all_acked(Duration(seconds=3.5))  # > one Fast DDS heartbeat (3 s)


def run_camera(args: argparse.Namespace) -> int:
    """Runs a parsed `camera` command. 0 at the end of the source / after --frames / on Ctrl-C or
    SIGTERM; 2 for a source that cannot be opened; 1 when it fails while running. Errors are one
    line on stderr."""
    import signal

    try:
        source = open_source(args.source, seed=args.seed, size=args.size, start=args.start, loop=args.loop,
                             rate=args.rate)
    except (SourceError, ValueError, OSError) as exc:
        print(f"edgevlm camera: error: {exc}", file=sys.stderr)
        return 2

    import rclpy
    from rclpy.executors import ExternalShutdownException

    ros_args = list(args.ros_args or [])
    stats = _Stats()
    node = None
    code = 0
    try:
        signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM ends as quietly as Ctrl-C
        rclpy.init(args=["edgevlm_camera", *ros_args])
        node = rclpy.create_node(args.node_name)
        _publish_loop(node, source, args, stats)
    except (KeyboardInterrupt, ExternalShutdownException):
        code = 0
    except (SourceError, ValueError, OSError, RuntimeError) as exc:
        # A signal shuts the context down from rclpy's handler: a publish caught in the middle of
        # it fails ("publisher's context is invalid") before KeyboardInterrupt is raised. That
        # is the Ctrl-C / SIGTERM ending, not an error.
        if isinstance(exc, RuntimeError) and not rclpy.ok():
            code = 0
        else:
            print(f"edgevlm camera: error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
                  file=sys.stderr)
            code = 1
    finally:
        source.close()
        if node is not None:
            node.destroy_node()
        rclpy.try_shutdown()
    seconds = time.monotonic() - stats.started
    print(f"edgevlm camera: published {stats.published} frames in {seconds:.1f} s", file=sys.stderr, flush=True)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="edgevlm camera", description=__doc__.split("\n\n")[0])
    add_camera_arguments(parser)
    ours, ros = split_ros_args(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(ours)
    args.ros_args = ros
    return run_camera(args)


if __name__ == "__main__":
    sys.exit(main())
