"""Soak (issue 7, item 3): two thousand frames through the running node over real DDS, with the node
process' memory, file descriptors and threads sampled from /proc the whole time.

The node runs as the launch file starts it, on the small random SmolVLM, 4 tokens per frame; the
frames are 160x120 rgb8 sent best effort (a camera's QoS) at 25 Hz, faster than the node
describes (about 2 frames/s here), so most frames are dropped by design and every path a frame
can take is exercised: received and replaced in the slot, taken and described. The bounds:

- Memory: the slope of the process' own resident memory (RssAnon + RssShmem: heap, stacks, DDS
  shared-memory segments) after warm-up (the first 20 % of the frames) below RSS_SLOPE_BOUND_MIB
  per 1000 frames sent, by least squares over ~260 samples. One frame is 56 KiB, so a leak of even
  one message in fifty, of 1 KiB per frame received, or of ~10 KiB per frame described (about 450
  of the 2000 are here) crosses it. 1000 frames (40 s) were the default until 2026-12-02: the
  multi-threaded node's memory swings by ~1 MiB with the buffers of the frames in flight, which
  moved a 32 s slope between -0.1 and +0.8; over 64 s it was +0.04 to +0.48. The file-backed
  part of VmRSS (the memory-mapped model) is printed but not bounded: it cannot leak (it is at
  most the files' size), and it moves with the page cache, not with the node: in a full test run
  the page cache holds ~15 GB of fixtures, the kernel evicts and refaults model pages, and VmRSS
  sloped +1.1 to +3.4 MiB per 1000 frames (2026-12-02) while reading 30 GB through the page
  cache during a run here made it -2.05; the anonymous part stayed within +0.4 in both.
  When the slope is out of bounds, the soak sends a confirmation window as long as the measured
  one (1600 frames more) and the bound applies to that window's slope: a leak goes on growing and
  fails it again, a one-time step does not. Two full fresh-clone runs of 2026-12-03 failed the
  bound (+1.86 and +2.24 MiB per 1000 frames: 158.4 MiB after warm-up, 161.9 at most, 160.7 at
  the end) where every run alone stayed inside it; which of the two it was, they could not tell.
- File descriptors and threads: the same count at the end as after warm-up, and never more than
  a few above it in between.
- Every frame accounted for: received = described + failed + dropped + in flight (0 at the
  end), received <= sent, nothing failed, one description per described frame, and each described
  frame's diagnostic stamped with a frame this test sent, in sending order.

EDGEVLM_SOAK_FRAMES and EDGEVLM_SOAK_RATE run a longer or faster soak (a longer run tightens what
the slope can detect); the figures are printed (pytest -s) for the README.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from ros_helpers import (  # noqa: F401 - vlm_pair_fixture provides the vlm_pair fixture
    Inbox,
    RosPeer,
    diag_values,
    exact_picture,
    frame_status,
    launched_node,
    make_image,
    random_domain_id,
    vlm_pair_fixture,
)
from test_node import RunningNode, wait_ready

FRAMES = int(os.environ.get("EDGEVLM_SOAK_FRAMES", "2000"))
RATE_HZ = float(os.environ.get("EDGEVLM_SOAK_RATE", "25"))
WARMUP = FRAMES // 5
WIDTH, HEIGHT = 160, 120
MAX_NEW_TOKENS = 4
SAMPLE_S = 0.25
# per 1000 frames sent, after warm-up, of RssAnon + RssShmem (see the docstring: VmRSS, with the
# mapped model's pages, moves with the page cache).
RSS_SLOPE_BOUND_MIB = 1.0
TRANSIENT_FDS = 4  # a socket or shared-memory segment DDS opens for a moment
TRANSIENT_THREADS = 2


def proc_memory(pid: int) -> tuple[float, float]:
    """(RssAnon + RssShmem, RssFile) of a live process in MiB: the memory it owns, and the
    file-backed pages (the mapped model) the page cache lends it."""
    kib = {k: int(v.split()[0]) for k, _, v in (line.partition(":") for line in
                                                Path(f"/proc/{pid}/status").read_text().splitlines())
           if k in ("RssAnon", "RssShmem", "RssFile")}
    return (kib["RssAnon"] + kib["RssShmem"]) / 1024, kib["RssFile"] / 1024


def proc_sample(pid: int) -> tuple[float, int, int]:
    """(RssAnon + RssShmem in MiB, open file descriptors, threads) of a live process."""
    return proc_memory(pid)[0], len(os.listdir(f"/proc/{pid}/fd")), len(os.listdir(f"/proc/{pid}/task"))


@dataclass
class Steady:
    """The samples after warm-up: the memory's least-squares slope (MiB per 1000 frames sent), the
    memory, descriptors and threads."""

    slope: float
    rss: np.ndarray
    fds: list[int]
    threads: list[int]

    @classmethod
    def of(cls, samples: list[tuple[int, float, int, int]]) -> Steady:
        assert len(samples) >= 20, f"only {len(samples)} samples after warm-up"
        sent_k = np.array([s[0] for s in samples], float) / 1000
        rss = np.array([s[1] for s in samples])
        return cls(float(np.polyfit(sent_k, rss, 1)[0]), rss, [s[2] for s in samples], [s[3] for s in samples])

    @property
    def flat(self) -> bool:
        return abs(self.slope) < RSS_SLOPE_BOUND_MIB

    def check(self, fds_end: int, threads_end: int) -> None:
        """The soak's bounds: memory slope, and no descriptor or thread growth."""
        assert abs(self.slope) < RSS_SLOPE_BOUND_MIB, f"RssAnon+RssShmem slope {self.slope:+.3f} MiB per 1000 frames"
        fds, threads = self.fds, self.threads
        assert fds_end <= fds[0] and max(fds) <= fds[0] + TRANSIENT_FDS, (fds, fds_end)
        assert threads_end <= threads[0] and max(threads) <= threads[0] + TRANSIENT_THREADS, (threads, threads_end)


class Sampler:
    """Samples the process every SAMPLE_S seconds with the number of frames sent so far."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.sent = 0
        self.samples: list[tuple[int, float, int, int]] = []  # (sent, rss MiB, fds, threads)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.samples.append((self.sent, *proc_sample(self.pid)))

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def judged(self, window: list[tuple[int, float, int, int]], more: Callable[[], None]) -> tuple[Steady, Steady]:
        """(the window measured, the window the bounds apply to): the same one when its slope is
        within bounds; else `more()` runs a confirmation window, sampled apart (a leak goes on
        growing, a one-time step does not)."""
        first = Steady.of(window)
        if first.flat:
            return first, first
        mark = len(self.samples)
        more()
        return first, Steady.of(self.samples[mark:])


def test_soak(vlm_pair: tuple[Path, Path], tmp_path: Path) -> None:
    from diagnostic_msgs.msg import DiagnosticArray
    from rclpy.qos import QoSProfile, ReliabilityPolicy
    from sensor_msgs.msg import Image
    from std_msgs.msg import String

    assert FRAMES >= 1000 or "EDGEVLM_SOAK_FRAMES" in os.environ
    domain = random_domain_id()
    peer = RosPeer(domain)
    with contextlib.ExitStack() as stack:
        stack.callback(peer.close)
        diag = peer.inbox(DiagnosticArray, "/diagnostics", qos=1000)
        descriptions = Inbox("/soak/description")
        description_sub = peer.node.create_subscription(String, "/soak/description", descriptions, 1000)
        text, mmproj = vlm_pair
        child = stack.enter_context(launched_node(
            tmp_path, domain, {"namespace": "soak", "model": str(text), "mmproj": str(mmproj), "image": "/soak_camera",
                               "threads": "2"}, {"max_new_tokens": MAX_NEW_TOKENS}, name="soak"))
        pub = peer.publisher(Image, "/soak_camera", QoSProfile(depth=1, reliability=ReliabilityPolicy.BEST_EFFORT))
        node = RunningNode(child, "/soak/edgevlm", peer, diag, pub)
        wait_ready(node)
        node.heartbeat(lambda v: True, 30)  # /diagnostics matched
        peer.wait_publishers(description_sub, timeout=30)

        picture = np.ascontiguousarray(np.resize(exact_picture(), (HEIGHT, WIDTH, 3)))
        template = make_image(picture, "rgb8")
        _, status = node.describe(make_image(picture, "rgb8", peer.now().to_msg()))  # the engine warm
        assert status.level == b"\x00", status.message
        idle = node.heartbeat(lambda v: v["state"] != "describing" and v["frames_in_flight"] == "0", 60)
        before = {k: int(idle[f"frames_{k}"]) for k in ("received", "described", "failed", "dropped")}
        first_diag, first_description = len(diag), len(descriptions)
        rss_start, fds_start, threads_start = proc_sample(child.pid)
        file_start = proc_memory(child.pid)[1]

        sent_stamps: list[tuple[int, int]] = []

        def send(count: int, sampler: Sampler) -> None:
            """`count` more frames, paced to the camera's rate."""
            t0, first = time.monotonic(), len(sent_stamps)
            for i in range(count):
                delay = t0 + i / RATE_HZ - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                msg = Image(height=template.height, width=template.width, encoding="rgb8", step=template.step,
                            data=template.data)
                msg.header.frame_id = "camera"
                msg.header.stamp = peer.now().to_msg()
                pub.publish(msg)
                sent_stamps.append((msg.header.stamp.sec, msg.header.stamp.nanosec))
                sampler.sent = first + i + 1

        t0 = time.monotonic()
        with Sampler(child.pid) as sampler:
            send(FRAMES, sampler)
            first_window, steady = sampler.judged([s for s in sampler.samples if s[0] >= WARMUP],
                                                  lambda: send(FRAMES - WARMUP, sampler))
            send_s = time.monotonic() - t0
            after = node.heartbeat(lambda v: v["state"] != "describing" and v["frames_in_flight"] == "0", 60)
        rss_end, fds_end, threads_end = proc_sample(child.pid)
        file_end = proc_memory(child.pid)[1]
        sent = len(sent_stamps)

        # -- memory, descriptors, threads ---------------------------------------------------------
        rss, slope, fds, threads = first_window.rss, first_window.slope, steady.fds, steady.threads
        confirmation = "" if steady is first_window else (
            f"; out of bounds, so {sent - FRAMES} frames more: slope {steady.slope:+.3f} over their "
            f"{len(steady.rss)} samples (min {steady.rss.min():.1f}, max {steady.rss.max():.1f})")
        counts = {k: int(after[f"frames_{k}"]) - before[k] for k in before}
        in_flight = int(after["frames_in_flight"])
        print(f"\nsoak: {sent} frames {WIDTH}x{HEIGHT} rgb8 sent best effort at {RATE_HZ:g} Hz in {send_s:.1f} s; "
              f"node received {counts['received']}, described {counts['described']}, dropped {counts['dropped']}, "
              f"failed {counts['failed']}; RssAnon+RssShmem {rss_start:.1f} MiB before, {rss[0]:.1f} after warm-up, "
              f"{rss_end:.1f} at the end (min {rss.min():.1f}, max {rss.max():.1f}), slope after warm-up "
              f"{slope:+.3f} MiB per 1000 frames over {len(rss)} samples{confirmation} (RssFile {file_start:.1f} -> "
              f"{file_end:.1f}, not bounded); fds {fds_start} before, "
              f"{min(fds)}..{max(fds)} during, {fds_end} after; threads {threads_start} before, "
              f"{min(threads)}..{max(threads)} during, {threads_end} after")
        assert send_s < sent / RATE_HZ * 1.5, f"the publisher fell behind: {send_s:.1f} s"
        steady.check(fds_end, threads_end)

        # -- every frame accounted for -------------------------------------------------------------
        assert in_flight == 0
        assert counts["received"] == counts["described"] + counts["failed"] + counts["dropped"], counts
        assert counts["received"] <= sent, counts
        assert counts["received"] >= 0.8 * sent, f"best effort on localhost lost {sent - counts['received']}"
        assert counts["failed"] == 0
        assert counts["described"] >= 10, "the node stopped describing during the soak"
        described = [(a, s) for a in diag.messages(first_diag) if (s := frame_status(a)) is not None
                     and s.hardware_id == node.fqn]
        assert len(described) == counts["described"]
        assert all(s.level == b"\x00" for _, s in described), [s.message for _, s in described if s.level != b"\x00"]
        order = {stamp: i for i, stamp in enumerate(sent_stamps)}
        positions = [order.get((a.header.stamp.sec, a.header.stamp.nanosec)) for a, _ in described]
        assert None not in positions, "a diagnostic for a frame this test did not send"
        assert positions == sorted(positions) and len(set(positions)) == len(positions)
        deadline = time.monotonic() + 10
        while len(descriptions) - first_description < counts["described"] and time.monotonic() < deadline:
            time.sleep(0.05)  # the last description may still be on its way
        texts = [m.data for m in descriptions.messages(first_description)]
        assert texts == [diag_values(s)["text"] for _, s in described]
        assert len(set(texts)) == 1  # the same picture every time: the same text
        assert child.proc.poll() is None and "Traceback" not in child.output()

