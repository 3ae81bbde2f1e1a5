"""`edgevlm_node` with the fault injection of test/test_faults.py: the production node, patched
here before its main() runs, so the node itself has no test code path.

test_faults.py starts this file instead of `python -m edgevlm_ros.ros.node` (through the launch
stand-in, `run_launch_file(..., resolve=fault_node_command)`). Unless EDGEVLM_TEST_FAULT is set
it is the plain node. EDGEVLM_TEST_FAULT=raise_in_decode:<frame_id> makes every frame whose
header.frame_id is <frame_id> fail in the middle of its generation (half its token budget decoded,
then an exception from the decoder); the node logs a warning at start while it is set, and a bad
value is refused at start like a bad parameter (one line, exit 2).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from edgevlm_ros.ros.node_params import ParamError

TEST_FAULT_ENV = "EDGEVLM_TEST_FAULT"
TEST_FAULT_KINDS = ("raise_in_decode",)


def fault_node_command(package: str | None, executable: str) -> list[str]:
    """The launch stand-in's `resolve` for the node with this fault injection."""
    if (package, executable) != ("edgevlm_ros", "edgevlm_node"):
        raise ValueError(f"executable '{executable}' of package '{package}' is unknown to the stand-in")
    return [sys.executable, str(Path(__file__).resolve())]


def parse_test_fault(value: str) -> str:
    """The frame_id that EDGEVLM_TEST_FAULT=raise_in_decode:<frame_id> names. Raises ParamError."""
    kind, sep, frame_id = value.strip().partition(":")
    if kind not in TEST_FAULT_KINDS or not sep or not frame_id.strip():
        raise ParamError(f"{TEST_FAULT_ENV}={value!r} is not a test fault (expected raise_in_decode:<frame_id>); "
                         f"unset it outside tests")
    return frame_id.strip()


class InjectedFault(RuntimeError):
    """Raised by the fault injection only."""


class DecodeFault:
    """Stands in for the engine's native decoder and passes every call through, except that a
    generation started while `armed` decodes half its token budget for real and then raises, as a
    decoder failing half-way would (the KV cache is left holding a half-finished answer)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.armed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def generate(self, prompt: Any, max_new_tokens: int, *args: Any, **kwargs: Any) -> Any:
        if not self.armed:
            return self._engine.generate(prompt, max_new_tokens, *args, **kwargs)
        partial = self._engine.generate(prompt, max(1, max_new_tokens // 2), *args, **kwargs)
        raise InjectedFault(f"injected by the test hook {TEST_FAULT_ENV} after {len(partial['tokens'])} "
                            f"decoded tokens")


def main() -> int:
    """The node's main() with FaultInjectingNode in place of EdgeVlmNode. The node module is
    imported here, not above: importing it installs its signal handlers, which the tests that
    import this module for parse_test_fault() must not get."""
    from edgevlm_ros.ros import node as node_module

    class FaultInjectingNode(node_module.EdgeVlmNode):
        """The node with DecodeFault in front of its decoder when EDGEVLM_TEST_FAULT is set."""

        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self._fault: DecodeFault | None = None
            self._fault_frame_id: str | None = None

        def load_engine(self) -> None:
            value = os.environ.get(TEST_FAULT_ENV)
            frame_id = parse_test_fault(value) if value is not None else None  # a bad value fails before loading
            super().load_engine()
            if frame_id is None:
                return
            self._fault_frame_id = frame_id
            self._fault = DecodeFault(self._vlm.text.native)
            self._vlm.text.native = self._fault
            self.get_logger().warning(f"TEST HOOK {TEST_FAULT_ENV}={value} is set: frames with frame_id "
                                      f"'{frame_id}' will fail on purpose (never set it on a robot)")

        def _describe(self, msg: Any, camera: str = "") -> None:
            if self._fault is not None:
                self._fault.armed = msg.header.frame_id == self._fault_frame_id
            super()._describe(msg, camera)

    node_module.EdgeVlmNode = FaultInjectingNode  # type: ignore[misc]  # what node_module.main() starts
    return node_module.main()


if __name__ == "__main__":
    sys.exit(main())
