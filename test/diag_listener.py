"""A /diagnostics subscriber process for test_faults.py: `python test/diag_listener.py NAME HARDWARE_ID`
prints "ready" once a status of HARDWARE_ID reaches it (so it is matched), then listens until killed."""

from __future__ import annotations

import sys
from typing import Any


def main(argv: list[str]) -> None:
    import rclpy
    from diagnostic_msgs.msg import DiagnosticArray

    name, hardware_id = argv
    rclpy.init()
    node = rclpy.create_node("diag_listener_" + name)
    seen: list[int] = []

    def on_diag(msg: Any) -> None:
        if not seen and any(s.hardware_id == hardware_id for s in msg.status):
            print("ready", flush=True)
            seen.append(1)

    node.create_subscription(DiagnosticArray, "/diagnostics", on_diag, 10)
    rclpy.spin(node)


if __name__ == "__main__":
    main(sys.argv[1:])
