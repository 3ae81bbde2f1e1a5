"""The node's newest-frame slot, in plain Python (no ROS): the one-slot frame queue with its counters.

The queue is the node's back-pressure policy: the subscription callback puts every frame into a
single slot and returns at once; a frame still waiting there when the next one arrives is
replaced and counted as dropped. So memory holds at most one waiting frame plus the one being
described, whatever the camera's rate, and the worker always describes the newest frame.

Counters add up at every instant (checked under one lock):
    received = described + failed + dropped + in_flight
where in_flight is the waiting frame (0 or 1) plus the frame being worked on (0 or 1).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["FrameCounts", "NewestFrameSlot"]

T = TypeVar("T")


@dataclass(frozen=True)
class FrameCounts:
    """One consistent snapshot of the frame counters."""

    received: int = 0
    described: int = 0  # a description was published (deadline misses included)
    failed: int = 0  # bad message or engine failure: nothing published but a diagnostic
    dropped: int = 0  # replaced in the slot by a newer frame before the worker took it
    waiting: int = 0  # 0 or 1
    working: int = 0  # 0 or 1
    deadline_misses: int = 0

    @property
    def in_flight(self) -> int:
        return self.waiting + self.working

    def balanced(self) -> bool:
        return self.received == self.described + self.failed + self.dropped + self.in_flight


class NewestFrameSlot(Generic[T]):
    """A queue of length one that keeps the newest item. Thread-safe.

    put() never blocks (it is called from the subscription callback); take() blocks the worker
    until an item is there, the timeout passes or close() is called; finish() ends the work on
    the item take() returned.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._item: T | None = None
        self._has_item = False
        self._working = False
        self._closed = False
        self._received = self._described = self._failed = self._dropped = self._misses = 0
        self.busy_since: float | None = None  # time.monotonic() when the current work began

    def put(self, item: T) -> bool:
        """Stores item as the waiting one; True when it replaced (dropped) an older one."""
        with self._cond:
            self._received += 1
            replaced = self._has_item
            if replaced:
                self._dropped += 1
            self._item, self._has_item = item, True
            self._cond.notify()
            return replaced

    def take(self, timeout: float | None = None) -> T | None:
        """The waiting item (now being worked on), or None on timeout or after close()."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            if self._working:
                raise RuntimeError("take() called again before finish()")
            while not self._has_item and not self._closed:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._cond.wait(remaining)
            if self._closed:
                return None
            item, self._item, self._has_item = self._item, None, False
            self._working = True
            self.busy_since = time.monotonic()
            return item

    def finish(self, described: bool, deadline_miss: bool = False) -> None:
        """Ends the work on the taken item: described (published) or failed."""
        with self._cond:
            if not self._working:
                raise RuntimeError("finish() without take()")
            self._working = False
            self.busy_since = None
            if described:
                self._described += 1
                self._misses += int(deadline_miss)
            else:
                self._failed += 1

    @property
    def working(self) -> bool:
        """Whether an item was taken and not yet finished."""
        with self._cond:
            return self._working

    def close(self) -> None:
        """Wakes a waiting take(), which then returns None, as do all later calls."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def counts(self) -> FrameCounts:
        with self._cond:
            return FrameCounts(
                received=self._received,
                described=self._described,
                failed=self._failed,
                dropped=self._dropped,
                waiting=int(self._has_item),
                working=int(self._working),
                deadline_misses=self._misses,
            )
