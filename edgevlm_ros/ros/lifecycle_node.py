"""The node as a managed lifecycle node (executable `edgevlm_lifecycle_node`), driven over the
standard lifecycle_msgs services (`ros2 lifecycle set /edgevlm configure`, ...):

  configure   loads the model pair and the system prompt's KV cache (FAILURE, with one ERROR
              line, when they cannot load; the node stays unconfigured)
  activate    subscribes to the cameras, creates the publishers, the `ask` service and the
              `describe` action, and starts the worker
  deactivate  stops the worker (waiting for a frame being encoded) and destroys all of those;
              the engine stays loaded, so activate is quick
  cleanup     unloads the engine
  shutdown    all of the above, then the process exits 0

The behaviour is VlmNodeCore's, the same as the plain node's.
"""

from __future__ import annotations

from typing import Any

from rclpy.lifecycle import LifecycleNode, LifecycleState, TransitionCallbackReturn

from .node import VlmNodeCore

__all__ = ["DEACTIVATE_WAIT_S", "EdgeVlmLifecycleNode", "main"]

# Deactivation waits this long for a frame in the vision encoder (which cannot be interrupted) so
# that a later activate never starts a second worker beside one still in the engine.
DEACTIVATE_WAIT_S = 60.0


class EdgeVlmLifecycleNode(VlmNodeCore, LifecycleNode):
    def __init__(self, **kwargs: Any) -> None:
        LifecycleNode.__init__(self, "edgevlm", **kwargs)
        self._init_core()
        self.finalized = False

    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        try:
            self.load_engine()
        except (ValueError, OSError, RuntimeError) as exc:
            self.get_logger().error(f"configure failed: {str(exc).strip().splitlines()[0]}")
            self.unload_engine()
            return TransitionCallbackReturn.FAILURE
        return TransitionCallbackReturn.SUCCESS

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.start()
        return super().on_activate(state)

    def on_deactivate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._halt()
        return super().on_deactivate(state)

    def on_cleanup(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.unload_engine()
        return TransitionCallbackReturn.SUCCESS

    def on_shutdown(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._halt()
        self.unload_engine()
        self.finalized = True
        return TransitionCallbackReturn.SUCCESS

    def on_error(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._halt()
        return TransitionCallbackReturn.SUCCESS

    def _halt(self) -> None:
        if not self.stop(timeout=DEACTIVATE_WAIT_S):
            self.get_logger().error(f"the worker is still in the engine after {DEACTIVATE_WAIT_S:.0f} s")
        self.destroy_entities()


def main() -> int:
    from .node import main as node_main
    return node_main(lifecycle_class=EdgeVlmLifecycleNode)


if __name__ == "__main__":
    import sys
    sys.exit(main())
