"""The node's executor: rclpy's MultiThreadedExecutor, except that a task already handed to the
thread pool and not yet started is not handed over again.

Why: rclpy's executor yields every task that is neither executing nor done again on each pass
of its wait loop, and MultiThreadedExecutor submits every yield to its pool. When the pool's
threads are slow to get the GIL (a 100 Hz camera on 2 busy cores), the same image task was
queued thousands of times a second: measured 2026-12-03 with rclpy 9.1.2 (Kilted), ~6 000 passes
a second for ~25 frames taken; the duplicates and the spinning wait loop held the GIL, and the
node took 10-30% of the 1 000 frames DDS delivered in the flood test (test_node). Here a
duplicate yield waits (GIL released) up to 5 ms for a pool thread to start the queued task; the
same flood is taken whole (999 / 1000, ~2 passes a frame).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

from rclpy.executors import (
    ConditionReachedException,
    ExternalShutdownException,
    MultiThreadedExecutor,
    ShutdownException,
    TimeoutException,
)

__all__ = ["OnceQueuedExecutor"]

# How long a pass that found its task still queued waits for a pool thread to start it.
QUEUED_WAIT_S = 0.005


class OnceQueuedExecutor(MultiThreadedExecutor):
    """MultiThreadedExecutor that queues each task once (see the module docstring)."""

    def __init__(self, num_threads: int, *, context: Any = None) -> None:
        super().__init__(num_threads=num_threads, context=context)
        self._queued: set[int] = set()  # id() of the tasks in the pool's queue, not yet started
        self._queued_cond = threading.Condition()
        self._start_pool(num_threads)

    def _start_pool(self, n: int) -> None:
        """Starts every pool thread now. ThreadPoolExecutor starts them one at a time, when work finds
        none idle, so the node's thread count crept up over its first minutes (a soak counts threads:
        24 -> 25 after warm-up); a robot's node should have its threads from the start."""
        barrier = threading.Barrier(n + 1)

        def hold() -> None:
            with contextlib.suppress(threading.BrokenBarrierError):
                barrier.wait(5.0)

        for _ in range(n):
            self._executor.submit(hold)  # each blocks until all n run: every submit finds none idle
        with contextlib.suppress(threading.BrokenBarrierError):
            barrier.wait(5.0)

    def _spin_once_impl(self, timeout_sec: Any = None, wait_condition: Any = lambda: False) -> None:
        try:
            handler, _entity, _node = self.wait_for_ready_callbacks(timeout_sec, None, wait_condition)
        except (ExternalShutdownException, ShutdownException, TimeoutException, ConditionReachedException):
            return
        key = id(handler)
        with self._queued_cond:
            if key in self._queued:
                self._queued_cond.wait_for(lambda: key not in self._queued, timeout=QUEUED_WAIT_S)
                return
            self._queued.add(key)

        def run() -> None:
            with self._queued_cond:
                self._queued.discard(key)
                self._queued_cond.notify_all()
            handler()

        self._executor.submit(run)
        self._futures.append(handler)
        for future in self._futures[:]:
            if future.done():
                self._futures.remove(future)
                future.result()  # raise any exceptions
