"""Watching the model files the node mapped at start (plain Python, no ROS): what became of each on
disk since it was loaded, and what that means for the node. The node's heartbeat calls
`changes()` once a second and reports each change once (a log line and a diagnostic).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["FILE_STATES", "WatchedFile", "changes", "watch"]

# What each state of a model file means for the node, and the level it is reported at.
FILE_STATES: dict[str, tuple[str, str]] = {
    "ok": ("ok", "is back as it was loaded"),
    "deleted": ("error", "was deleted while the node runs: still serving the copy mapped at start, "
                         "but a restart will fail"),
    "replaced": ("warn", "was replaced on disk: still serving the file loaded at start; restart "
                         "to load the new one"),
    "modified": ("error", "was modified in place while mapped: descriptions may be wrong from now "
                          "on and reading a truncated file crashes the process; replace model files "
                          "by renaming a new file over them, then restart"),
}


@dataclass
class WatchedFile:
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


def watch(label: str, path: str | os.PathLike[str]) -> WatchedFile:
    """Starts watching a file as it is now (call right after loading it)."""
    resolved = Path(path).resolve()
    st = os.stat(resolved)
    return WatchedFile(label, resolved, (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))


def changes(files: Iterable[WatchedFile]) -> list[tuple[WatchedFile, str, str]]:
    """(file, level, text) for every file whose state changed since the last call; updates the
    files' states. level is "ok", "warn" or "error"."""
    found = []
    for f in files:
        state = f.look()
        if state == f.state:
            continue
        f.state = state
        level, meaning = FILE_STATES[state]
        found.append((f, level, f"{f.label} file {f.path} {meaning}"))
    return found
