"""The node's newest-frame slots, in plain Python (no ROS): one one-slot frame queue with its counters
per camera, and the round-robin scheduler the worker takes frames from (`CameraSlots`).

The queue is the node's back-pressure policy: the subscription callback puts every frame into a
single slot and returns at once; a frame still waiting there when the next one arrives is
replaced and counted as dropped. So memory holds at most one waiting frame plus the one being
described, whatever the camera's rate, and the worker always describes the newest frame.

Counters add up at every instant (checked under one lock):
    received = described + failed + dropped + in_flight
where in_flight is the waiting frame (0 or 1) plus the frame being worked on (0 or 1).

Several cameras share one worker: `CameraSlots` holds a slot per camera under one condition and
hands the worker the next camera after the last one served that has a frame waiting (and whose
period has passed), so a 30 Hz camera cannot starve a 1 Hz one: between two descriptions of any
camera, every other camera with a fresh frame is served once.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["CameraSlots", "FrameCounts", "NewestFrameSlot"]

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

    def __init__(self, cond: threading.Condition | None = None) -> None:
        # A condition shared by several slots lets one worker wait for any of them (CameraSlots).
        self._cond = cond if cond is not None else threading.Condition()
        self._item: T | None = None
        self._has_item = False
        self._working = False
        self._closed = False
        self._received = self._described = self._failed = self._dropped = self._misses = 0
        self.busy_since: float | None = None  # time.monotonic() when the current work began
        # The newest item ever put and when (time.monotonic()), taken or not: what a question about
        # this camera looks at.
        self._latest: T | None = None
        self._latest_at: float | None = None

    def put(self, item: T) -> bool:
        """Stores item as the waiting one; True when it replaced (dropped) an older one."""
        with self._cond:
            self._received += 1
            replaced = self._has_item
            if replaced:
                self._dropped += 1
            self._item, self._has_item = item, True
            self._latest, self._latest_at = item, time.monotonic()
            self._cond.notify_all()
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
            return self._take_locked()

    def _take_locked(self) -> T:
        item, self._item, self._has_item = self._item, None, False
        self._working = True
        self.busy_since = time.monotonic()
        return item  # type: ignore[return-value]

    @property
    def has_item(self) -> bool:
        with self._cond:
            return self._has_item

    def latest(self) -> tuple[T | None, float | None]:
        """(the newest item ever put, its time.monotonic()), or (None, None) before the first."""
        with self._cond:
            return self._latest, self._latest_at

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
            self._cond.notify_all()  # a worker waiting on a shared condition sees the slot free

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


class CameraSlots(Generic[T]):
    """One NewestFrameSlot per camera under one condition, served round robin. Thread-safe.

    The subscription of camera `name` calls `slot(name).put(msg)`; the worker calls `take()`,
    which returns (name, item) of the next camera, in the configured order starting after the
    last one served, that has a frame waiting and is not held back by its period; then
    `slot(name).finish(...)` as for a single slot.
    """

    def __init__(self, names: tuple[str, ...]) -> None:
        if not names or len(set(names)) != len(names):
            raise ValueError(f"camera names must be unique and at least one, got {list(names)}")
        self.cond = threading.Condition()
        self.names = names
        self._slots: dict[str, NewestFrameSlot[T]] = {n: NewestFrameSlot(self.cond) for n in names}
        self._next = 0
        self._not_before = dict.fromkeys(names, 0.0)  # time.monotonic() a camera may be served again
        self._closed = False

    def slot(self, name: str) -> NewestFrameSlot[T]:
        return self._slots[name]

    def hold(self, name: str, until: float) -> None:
        """Camera `name` is not served before time.monotonic() `until` (its period)."""
        with self.cond:
            self._not_before[name] = until

    def ready_locked(self, now: float) -> tuple[str | None, float | None]:
        """(the camera take() would serve now or None, the earliest time one held back is due).
        The caller holds `cond`."""
        due: float | None = None
        n = len(self.names)
        for k in range(n):
            name = self.names[(self._next + k) % n]
            s = self._slots[name]
            if not s._has_item or s._working:
                continue
            if self._not_before[name] > now:
                due = self._not_before[name] if due is None else min(due, self._not_before[name])
                continue
            return name, None
        return None, due

    def take_locked(self, name: str) -> T:
        """Takes camera `name`'s waiting frame (ready_locked chose it); the caller holds `cond`."""
        self._next = (self.names.index(name) + 1) % len(self.names)
        return self._slots[name]._take_locked()

    def take(self, timeout: float | None = None) -> tuple[str, T] | None:
        """(camera, frame) of the next camera to serve, or None on timeout or after close()."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            while not self._closed:
                now = time.monotonic()
                name, due = self.ready_locked(now)
                if name is not None:
                    return name, self.take_locked(name)
                ends = [t for t in (deadline, due) if t is not None]
                if deadline is not None and now >= deadline:
                    return None
                self.cond.wait(min(ends) - now if ends else None)
            return None

    def close(self) -> None:
        with self.cond:
            self._closed = True
            for s in self._slots.values():
                s._closed = True
            self.cond.notify_all()

    @property
    def closed(self) -> bool:
        with self.cond:
            return self._closed
