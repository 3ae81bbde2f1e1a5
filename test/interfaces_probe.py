"""A child process for the edgevlm_interfaces tests: `python test/interfaces_probe.py` imports the
package as its environment gives it, makes rclpy load its type support (an Ask service and client, a
Describe action server) and prints, one per line: the package's `__init__.py`, a Describe feedback
message, then every file of ours mapped into the process (/proc/self/maps: the libraries loaded)."""

from __future__ import annotations

from pathlib import Path


def main() -> int:
    import rclpy
    from rclpy.action import ActionServer

    import edgevlm_interfaces.srv
    from edgevlm_interfaces.action import Describe
    from edgevlm_interfaces.srv import Ask

    rclpy.init()
    node = rclpy.create_node("interfaces_probe")
    node.create_service(Ask, "ask", lambda request, response: response)
    node.create_client(Ask, "ask")
    ActionServer(node, Describe, "describe", lambda goal: Describe.Result())
    print(edgevlm_interfaces.__file__)
    print(Describe.Feedback(partial="x", tokens=1))
    maps = Path("/proc/self/maps").read_text().splitlines()
    for path in sorted({line.split()[-1] for line in maps if "edgevlm_interfaces" in line}):
        print(path)
    node.destroy_node()
    rclpy.try_shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
