"""Helpers for the tests that run real ROS 2 processes over DDS (no mocks of ROS or the engine).

- `vlm_pair` (import `vlm_pair_fixture` to use it): session fixture, a small random SmolVLM
  converted to a text GGUF + mmproj pair;
- `ros_env`, `random_domain_id`: every child process talks on localhost only, on a per-run domain;
- `Child`: a subprocess whose output is collected line by line, killed in `finally`;
- `RosPeer`: rclpy in the pytest process (its own Context and domain), publishers and inboxes;
- the launch stand-in: loads `launch/edgevlm.launch.py` with small classes standing in for the
  `launch` / `launch_ros` API it uses (neither installs here), builds the command line
  launch_ros would build, and refuses any keyword or argument it does not know;
- test pictures and their encodings as ROS messages, encoded independently of `frames.py`;
- a command line for child processes: `python test/ros_helpers.py camera|count ...`.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
LAUNCH_FILE = ROOT / "launch" / "edgevlm.launch.py"
CONFIG_FILE = ROOT / "config" / "edgevlm.yaml"
SHM_PROFILE = ROOT / "config" / "fastdds_shm.xml"
MODEL_CACHE = Path(os.environ.get("EDGEVLM_TEST_MODEL_CACHE", "/tmp/edgevlm_test_models"))
# How the stand-in runs `edgevlm_node` from the source tree (colcon would install a console script).
NODE_COMMAND = [sys.executable, "-m", "edgevlm_ros.ros.node"]
LIFECYCLE_NODE_COMMAND = [sys.executable, "-m", "edgevlm_ros.ros.lifecycle_node"]

# The random VLM the node tests run: SmolVLM-256M's widths, two layers in each tower, and a 256 px
# encoder tile (16 image tokens) instead of 512 px (64): the node tests describe ~50 frames, and a
# 512 px tile took 3.2 s on this 2-core machine (2026-11-30) against ~0.6 s for 256 px.
VLM_ARGS = {"text_layers": 2, "vision_layers": 2, "seed": 0, "image_size": 256}


# -- the model pair ----------------------------------------------------------------------------
# Pairs whose lock this process holds (shared) until the end of the test session.
_HELD_PAIRS: dict[Path, tuple[Path, Path]] = {}


@pytest.fixture(scope="session", name="vlm_pair")
def vlm_pair_fixture() -> Iterator[tuple[Path, Path]]:
    """(text GGUF, mmproj GGUF) of a random SmolVLM, built once and cached under MODEL_CACHE.

    The cache key hashes the fixture builder, the converter and the arguments, so a changed
    converter never serves stale files. EDGEVLM_TEST_VLM_PAIR=text.gguf:mmproj.gguf runs the
    tests on a given pair instead (a real SmolVLM, say).
    """
    given = os.environ.get("EDGEVLM_TEST_VLM_PAIR")
    if given:
        text, _, mmproj = given.partition(":")
        yield Path(text), Path(mmproj)
        return
    import hf_fixtures

    from edgevlm_ros.tools import convert as convert_module
    digest = hashlib.sha256(json.dumps(VLM_ARGS, sort_keys=True).encode())
    for module in (hf_fixtures, convert_module):
        digest.update(Path(module.__file__).read_bytes())
    out = MODEL_CACHE / f"smolvlm-{digest.hexdigest()[:16]}"
    if out in _HELD_PAIRS:
        # Every module that imports this fixture gets a session fixture of its own: the first one
        # built the pair and holds its lock for the session; taking it again would deadlock.
        yield _HELD_PAIRS[out]
        return
    out.mkdir(parents=True, exist_ok=True)
    marker = out / "pair.json"
    # Concurrent test runs on one machine build it once: the second waits for the first.
    with open(out / ".lock", "a") as lock:
        # Shared first: a pair another run built (and holds shared for its session) is used as it is;
        # only a missing pair takes the lock exclusively to build it.
        fcntl.flock(lock, fcntl.LOCK_SH)

        def built() -> list[str]:
            pair = json.loads(marker.read_text()) if marker.is_file() else []
            return pair if pair and all(Path(p).is_file() for p in pair) else []

        pair = built()
        if not pair:
            fcntl.flock(lock, fcntl.LOCK_EX)
            pair = built()
            if not pair:
                pair = [str(p) for p in _build_pair(out, hf_fixtures, convert_module)]
                marker.write_text(json.dumps(pair))
            # Held shared for the whole session: another run's pruning leaves these files alone.
            fcntl.flock(lock, fcntl.LOCK_SH)
        text, mmproj = pair
        _prune_stale_pairs(keep=out)
        _HELD_PAIRS[out] = (Path(text), Path(mmproj))
        try:
            yield Path(text), Path(mmproj)
        finally:
            del _HELD_PAIRS[out]


def _build_pair(out: Path, hf_fixtures: Any, convert_module: Any) -> tuple[Path, Path]:
    hf_dir = hf_fixtures.make_random_smolvlm(out / "hf", **VLM_ARGS)
    text, mmproj = convert_module.convert(hf_dir, out / "gguf", wtype="f16")
    shutil.rmtree(hf_dir)  # only the GGUF pair is used (and the float32 checkpoint is 220 MB)
    return Path(text), Path(mmproj)


def _prune_stale_pairs(keep: Path) -> None:
    """Removes pairs built for an older builder or converter, unless another run holds them."""
    for old in MODEL_CACHE.glob("smolvlm-" + "[0-9a-f]" * 16):
        if old == keep or not (old / ".lock").is_file():
            continue
        with open(old / ".lock") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # in use
            shutil.rmtree(old, ignore_errors=True)


# -- processes -----------------------------------------------------------------------------------
def random_domain_id() -> int:
    """A domain for one test run: concurrent runs on this machine must not see each other."""
    return random.SystemRandom().randint(1, 100)


def ros_env(domain_id: int, log_dir: str | Path, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a ROS child process: localhost discovery, the run's domain, the source
    tree on PYTHONPATH, unbuffered output, ROS logs under log_dir."""
    env = dict(os.environ)
    for name in ("FASTDDS_DEFAULT_PROFILES_FILE", "FASTRTPS_DEFAULT_PROFILES_FILE", "ROS_STATIC_PEERS",
                 "ROS_LOCALHOST_ONLY"):
        env.pop(name, None)
    python_path = [str(ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env.update({
        "ROS_DOMAIN_ID": str(domain_id),
        "ROS_AUTOMATIC_DISCOVERY_RANGE": "LOCALHOST",
        "ROS_LOG_DIR": str(log_dir),
        "PYTHONPATH": os.pathsep.join(python_path),
        "PYTHONUNBUFFERED": "1",
        "RCUTILS_COLORIZED_OUTPUT": "0",
    })
    env.update(extra or {})
    return env


class Child:
    """A child process with stdout and stderr collected together, line by line."""

    def __init__(self, cmd: Sequence[str], env: Mapping[str, str], name: str) -> None:
        self.name = name
        self.cmd = list(cmd)
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self.proc = subprocess.Popen(self.cmd, env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, text=True, bufsize=1, cwd=ROOT)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        with self._cond:
            return "\n".join(self.lines)

    def tail(self, n: int = 30) -> str:
        with self._cond:
            return "\n".join(self.lines[-n:])

    def wait_for_line(self, pattern: str, timeout: float, start: int = 0) -> re.Match[str]:
        """The first line (from index start) matching the regex; fails with the output if none
        comes within timeout or the process ends first."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._cond:
            i = start
            while True:
                while i < len(self.lines):
                    match = regex.search(self.lines[i])
                    if match:
                        return match
                    i += 1
                remaining = deadline - time.monotonic()
                if remaining <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    break
                self._cond.wait(min(remaining, 0.2))
        raise AssertionError(f"{self.name}: no line matching {pattern!r} within {timeout} s "
                             f"(exit code {self.proc.poll()}); output:\n{self.tail()}")

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        rc = self.proc.wait(timeout)
        self._reader.join(5)
        return rc

    def wait_exited(self, timeout: float) -> None:
        """Until the process has exited, leaving it unreaped: its /proc entry (main_thread_sched)
        stays readable until wait() reaps it."""
        deadline = time.monotonic() + timeout
        while os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.cmd, timeout)
            time.sleep(0.002)

    def main_thread_sched(self) -> tuple[float, float]:
        """(seconds on a CPU, seconds runnable but waiting for a CPU) of the process' main thread
        so far (the kernel's /proc/PID/schedstat)."""
        run_ns, wait_ns, _slices = Path(f"/proc/{self.pid}/schedstat").read_text().split()
        return int(run_ns) / 1e9, int(wait_ns) / 1e9

    def rss_mb(self) -> float:
        """Resident memory of the process (Linux /proc), in MiB."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


def python_child(args: Sequence[str], env: Mapping[str, str], name: str) -> Child:
    """`python test/ros_helpers.py ARGS` (the camera / count tools below) as a Child."""
    return Child([sys.executable, str(Path(__file__).resolve()), *args], env, name)


# -- rclpy in the pytest process ---------------------------------------------------------------
class Inbox:
    """Everything a subscription received, with the monotonic time it arrived."""

    def __init__(self, topic: str) -> None:
        self.topic = topic
        self.subscription: Any = None  # set by RosPeer.inbox
        self.items: list[tuple[float, Any]] = []
        self._cond = threading.Condition()

    def __call__(self, msg: Any) -> None:
        with self._cond:
            self.items.append((time.monotonic(), msg))
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self.items)

    def messages(self, start: int = 0) -> list[Any]:
        with self._cond:
            return [m for _, m in self.items[start:]]

    def wait_for(self, predicate: Callable[[Any], bool], timeout: float, start: int = 0, what: str = "") -> Any:
        """The first message (from index start) for which predicate holds."""
        deadline = time.monotonic() + timeout
        with self._cond:
            i = start
            while True:
                while i < len(self.items):
                    if predicate(self.items[i][1]):
                        return self.items[i][1]
                    i += 1
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(f"no message on {self.topic} {what} within {timeout} s "
                                         f"({len(self.items)} received)")
                self._cond.wait(remaining)

    def wait_index(self, predicate: Callable[[Any], bool], timeout: float, start: int = 0, what: str = "") -> int:
        """Like wait_for, but the index of the message."""
        msg = self.wait_for(predicate, timeout, start, what)
        with self._cond:
            return next(i for i in range(start, len(self.items)) if self.items[i][1] is msg)

    def wait_count(self, n: int, timeout: float, start: int = 0) -> list[Any]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while len(self.items) - start < n:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(f"{len(self.items) - start} of {n} messages on {self.topic} in {timeout} s")
                self._cond.wait(remaining)
            return [m for _, m in self.items[start:]]


class RosPeer:
    """A node in the pytest process, in its own rclpy Context on the given domain, spun by a
    background thread. close() in a finally block."""

    def __init__(self, domain_id: int, name: str | None = None) -> None:
        import rclpy
        from rclpy.executors import SingleThreadedExecutor
        from rclpy.signals import SignalHandlerOptions

        # rcl writes log files at the process' first init: into a temporary folder, not ~/.ros.
        os.environ.setdefault("ROS_LOG_DIR", str(Path(tempfile.gettempdir()) / "edgevlm_test_ros_logs"))
        self.context = rclpy.Context()
        rclpy.init(context=self.context, domain_id=domain_id, signal_handler_options=SignalHandlerOptions.NO)
        # A name of its own: two peers of one process must not share a rosout logger.
        self.node = rclpy.create_node(name or f"test_peer_{os.getpid()}_{id(self):x}", context=self.context)
        self.executor = SingleThreadedExecutor(context=self.context)
        self.executor.add_node(self.node)
        self._thread = threading.Thread(target=self._spin, daemon=True)
        self._thread.start()

    def _spin(self) -> None:
        with contextlib.suppress(Exception):  # ends with the context's shutdown
            self.executor.spin()

    def inbox(self, msg_type: Any, topic: str, qos: Any = 50) -> Inbox:
        box = Inbox(topic)
        box.subscription = self.node.create_subscription(msg_type, topic, box, qos)
        return box

    def publisher(self, msg_type: Any, topic: str, qos: Any = 10) -> Any:
        return self.node.create_publisher(msg_type, topic, qos)

    @staticmethod
    def _wait_matched(count: Callable[[], int], n: int, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while count() < n:
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} matched within {timeout} s")
            time.sleep(0.02)

    @staticmethod
    def wait_subscribers(publisher: Any, n: int = 1, timeout: float = 20.0) -> None:
        """Until the publisher is matched by n subscriptions (discovery takes 0-3 s here)."""
        RosPeer._wait_matched(publisher.get_subscription_count, n, timeout,
                              f"{publisher.topic_name}: no subscriber")

    @staticmethod
    def wait_publishers(subscription: Any, n: int = 1, timeout: float = 20.0) -> None:
        """Until the subscription is matched by n publishers."""
        RosPeer._wait_matched(subscription.get_publisher_count, n, timeout,
                              f"{subscription.topic_name}: no publisher")

    @staticmethod
    def wait_future(future: Any, timeout: float, what: str) -> Any:
        """The result of an rclpy future the peer's executor completes, or AssertionError after timeout."""
        deadline = time.monotonic() + timeout
        while not future.done():
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} did not answer within {timeout} s")
            time.sleep(0.005)
        return future.result()

    @staticmethod
    def connect(client: Any, probe: Any, timeout: float = 30.0, resend_s: float = 2.0) -> None:
        """Waits for the service, then until the server has answered probe once.

        wait_for_service sees discovery from the client's side only. Fast DDS's server waits 100 ms
        for its reply writer to match the client's reply reader and otherwise drops the response
        ("client will not receive response"): on a loaded machine the first call after discovery
        can go unanswered for ever (CI, 2026-12-06). probe must be a request the server answers at
        once and without side effects (for the node's Ask, an empty question: refused); it is resent
        every resend_s until one answer arrives. After that the server's writer knows this client (a
        server created anew, as a lifecycle node's on activation, needs a new probe: call() probes
        before every call, one round trip).
        """
        deadline = time.monotonic() + timeout
        if not client.wait_for_service(timeout_sec=timeout):
            raise AssertionError(f"{client.srv_name} is not available")
        futures: list[Any] = []
        while not any(f.done() for f in futures):
            if time.monotonic() > deadline:
                raise AssertionError(f"{client.srv_name} answered none of {len(futures)} probes in {timeout} s")
            futures.append(client.call_async(probe))
            resend = time.monotonic() + resend_s
            while not any(f.done() for f in futures) and time.monotonic() < resend:
                time.sleep(0.005)

    @staticmethod
    def call(client: Any, request: Any, timeout: float = 120.0, probe: Any = None) -> Any:
        """One service call, after connect(client, probe), then waits for the response. probe
        None sends the request itself first: only for a request that changes nothing and logs
        nothing (GetState); a request that does (set_parameters, Ask, a transition) needs its own
        side-effect-free probe."""
        RosPeer.connect(client, request if probe is None else probe, min(timeout, 30.0))
        return RosPeer.wait_future(client.call_async(request), timeout, client.srv_name)

    def set_parameters(self, node_name: str, values: Mapping[str, Any], timeout: float = 10.0) -> list[Any]:
        """Calls <node>/set_parameters; the list of SetParametersResult, one per value."""
        from rcl_interfaces.srv import SetParameters
        from rclpy.parameter import Parameter

        client = self.node.create_client(SetParameters, f"{node_name}/set_parameters")
        try:
            request = SetParameters.Request()
            request.parameters = [Parameter(k, value=v).to_parameter_msg() for k, v in values.items()]
            # The probe: no parameters (answered with no results, nothing logged or changed).
            return list(self.call(client, request, timeout, probe=SetParameters.Request()).results)
        finally:
            self.node.destroy_client(client)

    def now(self) -> Any:
        return self.node.get_clock().now()

    def close(self) -> None:
        import rclpy

        self.executor.shutdown(timeout_sec=2)
        self.node.destroy_node()
        rclpy.try_shutdown(context=self.context)
        self._thread.join(5)


def diag_values(status: Any) -> dict[str, str]:
    return {kv.key: kv.value for kv in status.values}


def frame_status(array: Any) -> Any | None:
    """The per-frame status of a DiagnosticArray from the node (None for heartbeats)."""
    for status in array.status:
        if status.name.endswith(": frame"):
            return status
    return None


def worker_status(array: Any) -> Any | None:
    for status in array.status:
        if status.name.endswith(": worker"):
            return status
    return None


# -- the launch stand-in -----------------------------------------------------------------------
class LaunchError(Exception):
    pass


class _LaunchConfiguration:
    """launch.substitutions.LaunchConfiguration (the part a launch file may use)."""

    def __init__(self, variable_name: str, *, default: str | None = None) -> None:
        self.variable_name = variable_name
        self.default = default

    def perform(self, context: _LaunchContext) -> str:
        value = context.launch_configurations.get(self.variable_name, self.default)
        if value is None:
            raise LaunchError(f"launch configuration '{self.variable_name}' does not exist")
        return value


class _DeclareLaunchArgument:
    def __init__(self, name: str, *, default_value: str | None = None, description: str | None = None,
                 choices: Sequence[str] | None = None) -> None:
        if default_value is not None and not isinstance(default_value, str):
            raise LaunchError(f"launch argument '{name}': the stand-in takes only plain string defaults")
        if choices is not None and default_value is not None and default_value not in choices:
            raise LaunchError(f"launch argument '{name}': default '{default_value}' is not one of {choices}")
        self.name, self.default_value, self.description, self.choices = name, default_value, description, choices


class _OpaqueFunction:
    def __init__(self, *, function: Callable[..., Any], args: Sequence[Any] | None = None,
                 kwargs: Mapping[str, Any] | None = None) -> None:
        self.function, self.args, self.kwargs = function, list(args or []), dict(kwargs or {})


class _LaunchDescription:
    def __init__(self, initial_entities: Sequence[Any] | None = None) -> None:
        self.entities = list(initial_entities or [])

    def add_action(self, action: Any) -> None:
        self.entities.append(action)


@dataclass
class _LaunchContext:
    launch_configurations: dict[str, str] = field(default_factory=dict)


class _RosNode:
    """launch_ros.actions.Node: the keywords of the real one this project may use, no others."""

    def __init__(self, *, executable: str, package: str | None = None, name: str | None = None,
                 namespace: str | None = None, parameters: Sequence[Any] | None = None,
                 remappings: Sequence[tuple[str, str]] | None = None, ros_arguments: Sequence[str] | None = None,
                 arguments: Sequence[str] | None = None, output: str = "log", emulate_tty: bool = False,
                 additional_env: Mapping[str, str] | None = None, respawn: bool = False,
                 sigterm_timeout: str | None = None) -> None:
        values = {"executable": executable, "package": package, "name": name, "namespace": namespace}
        for key, value in values.items():
            if value is not None and not isinstance(value, str):
                raise LaunchError(f"Node({key}=...) must be a string in the stand-in, got {value!r}")
        if output not in ("log", "screen", "both"):
            raise LaunchError(f"Node(output={output!r}) is not one of log, screen, both")
        self.executable, self.package, self.name, self.namespace = executable, package, name, namespace
        self.parameters = list(parameters or [])
        self.remappings = [tuple(r) for r in remappings or []]
        self.ros_arguments = list(ros_arguments or [])
        self.arguments = list(arguments or [])
        self.additional_env = dict(additional_env or {})
        self.output = output


@dataclass
class LaunchedNode:
    """What launch_ros would run for one Node action."""

    cmd: list[str]
    env: dict[str, str]
    fqn: str  # /namespace/name
    param_files: list[Path]


def _fake_launch_modules() -> dict[str, types.ModuleType]:
    def module(name: str, **attrs: Any) -> types.ModuleType:
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        return m

    actions = module("launch.actions", DeclareLaunchArgument=_DeclareLaunchArgument, OpaqueFunction=_OpaqueFunction)
    substitutions = module("launch.substitutions", LaunchConfiguration=_LaunchConfiguration)
    launch = module("launch", LaunchDescription=_LaunchDescription, LaunchContext=_LaunchContext,
                    actions=actions, substitutions=substitutions)
    ros_actions = module("launch_ros.actions", Node=_RosNode)
    launch_ros = module("launch_ros", actions=ros_actions)
    return {"launch": launch, "launch.actions": actions, "launch.substitutions": substitutions,
            "launch_ros": launch_ros, "launch_ros.actions": ros_actions}


def _absolute_namespace(namespace: str | None) -> str:
    ns = (namespace or "").strip()
    if not ns.startswith("/"):
        ns = "/" + ns
    return ns.rstrip("/") or "/"


def _node_command(node: _RosNode, tmp_dir: Path,
                  resolve: Callable[[str | None, str], list[str]]) -> LaunchedNode:
    """The command line launch_ros builds: executable, arguments, then one --ros-args section
    with ros_arguments, and one with the node name, namespace, parameter files and remaps."""
    cmd = [*resolve(node.package, node.executable), *node.arguments]
    if node.ros_arguments:
        cmd += ["--ros-args", *node.ros_arguments]
    cmd.append("--ros-args")
    ns = _absolute_namespace(node.namespace)
    if node.name is not None:
        cmd += ["-r", f"__node:={node.name}"]
    if node.namespace is not None:
        cmd += ["-r", f"__ns:={ns}"]
    fqn = (ns.rstrip("/") + "/" + (node.name or "<unnamed>")) if ns != "/" else "/" + (node.name or "<unnamed>")
    files: list[Path] = []
    for params in node.parameters:
        if isinstance(params, dict):
            # As launch_ros: a dict becomes a YAML file keyed by the node's full name when
            # name and namespace are given, else by the wildcard.
            key = fqn if node.name is not None and node.namespace is not None else "/**"
            fd, path = tempfile.mkstemp(prefix="launch_params_", suffix=".yaml", dir=tmp_dir)
            with os.fdopen(fd, "w") as f:
                yaml.safe_dump({key: {"ros__parameters": params}}, f)
            files.append(Path(path))
        elif isinstance(params, (str, Path)):
            if not Path(params).is_file():
                raise LaunchError(f"parameter file '{params}' does not exist")
            files.append(Path(params))
        else:
            raise LaunchError(f"parameters entry {params!r} is neither a dict nor a file path")
        cmd += ["--params-file", str(files[-1])]
    for src, dst in node.remappings:
        if not isinstance(src, str) or not isinstance(dst, str):
            raise LaunchError(f"remapping {(src, dst)!r} must be two strings")
        cmd += ["-r", f"{src}:={dst}"]
    return LaunchedNode(cmd, node.additional_env, fqn, files)


def run_launch_file(launch_args: Mapping[str, str], tmp_dir: Path, launch_file: Path = LAUNCH_FILE,
                    resolve: Callable[[str | None, str], list[str]] | None = None) -> list[LaunchedNode]:
    """Loads the launch file with the stand-in classes and returns the node command lines that
    `ros2 launch <file> name:=value ...` would start (in order). Raises LaunchError for an
    undeclared launch argument, a value outside a declared choice, or a required one missing."""

    def default_resolve(package: str | None, executable: str) -> list[str]:
        commands = {"edgevlm_node": NODE_COMMAND, "edgevlm_lifecycle_node": LIFECYCLE_NODE_COMMAND}
        if package != "edgevlm_ros" or executable not in commands:
            raise LaunchError(f"executable '{executable}' of package '{package}' is unknown to the stand-in")
        return list(commands[executable])

    resolve = resolve or default_resolve
    fakes = _fake_launch_modules()
    saved = {name: sys.modules.get(name) for name in fakes}
    sys.modules.update(fakes)
    try:
        spec = importlib.util.spec_from_file_location("edgevlm_launch_under_test", launch_file)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        description = module.generate_launch_description()
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
    if not isinstance(description, _LaunchDescription):
        raise LaunchError("generate_launch_description() did not return a LaunchDescription")

    context = _LaunchContext()
    declared: set[str] = set()
    nodes: list[LaunchedNode] = []

    def visit(entity: Any) -> None:
        if isinstance(entity, _DeclareLaunchArgument):
            declared.add(entity.name)
            if entity.name in launch_args:
                value = launch_args[entity.name]
                if entity.choices is not None and value not in entity.choices:
                    raise LaunchError(f"argument '{entity.name}' got '{value}', expected one of {entity.choices}")
            elif entity.default_value is not None:
                value = entity.default_value
            else:
                raise LaunchError(f"required launch argument '{entity.name}' was not given")
            context.launch_configurations[entity.name] = value
        elif isinstance(entity, _OpaqueFunction):
            for action in entity.function(context, *entity.args, **entity.kwargs) or []:
                visit(action)
        elif isinstance(entity, _RosNode):
            nodes.append(_node_command(entity, tmp_dir, resolve))
        else:
            raise LaunchError(f"the stand-in does not know {type(entity).__name__}")

    undeclared = set(launch_args)
    for entity in description.entities:
        visit(entity)
    undeclared -= declared
    if undeclared:
        raise LaunchError(f"launch arguments not declared by the launch file: {sorted(undeclared)}")
    return nodes


def write_params_file(path: Path, values: Mapping[str, Any]) -> Path:
    """config/edgevlm.yaml with values changed, as a new parameters file."""
    config = yaml.safe_load(CONFIG_FILE.read_text())
    config["/**"]["ros__parameters"].update(values)
    path.write_text(yaml.safe_dump(config))
    return path


@contextlib.contextmanager
def launched_node(tmp_dir: Path, domain_id: int, launch_args: Mapping[str, str],
                  params: Mapping[str, Any] | None = None, name: str = "edgevlm_node") -> Iterator[Child]:
    """The node started as `ros2 launch edgevlm_ros edgevlm.launch.py` would start it, with a
    parameters file made from config/edgevlm.yaml and `params`. Killed on exit."""
    tmp_dir.mkdir(parents=True, exist_ok=True)
    args = dict(launch_args)
    if params is not None:
        args["params_file"] = str(write_params_file(tmp_dir / f"{name}_params.yaml", params))
    (node,) = run_launch_file(args, tmp_dir)
    child = Child(node.cmd, ros_env(domain_id, tmp_dir / "ros_log", node.env), name)
    try:
        yield child
    finally:
        child.kill()


# -- pictures and messages -----------------------------------------------------------------------
def yuv422_from_rgb(rgb: np.ndarray, order: str) -> np.ndarray:
    """RGB to packed 4:2:2 bytes (BT.601, video range), chroma averaged over pixel pairs.

    order 'uyvy' (ROS yuv422) or 'yuyv' (ROS yuv422_yuy2). Independent of OpenCV on purpose.
    """
    f = rgb.astype(np.float64)
    r, g, b = f[..., 0], f[..., 1], f[..., 2]
    y = 16 + (65.481 * r + 128.553 * g + 24.966 * b) / 255
    u = 128 + (-37.797 * r - 74.203 * g + 112.0 * b) / 255
    v = 128 + (112.0 * r - 93.786 * g - 18.214 * b) / 255
    u = (u[:, 0::2] + u[:, 1::2]) / 2
    v = (v[:, 0::2] + v[:, 1::2]) / 2

    def q(x: np.ndarray) -> np.ndarray:
        return np.clip(np.round(x), 0, 255).astype(np.uint8)

    h, w = y.shape
    out = np.empty((h, w // 2, 4), np.uint8)
    if order == "uyvy":
        out[..., 0], out[..., 1], out[..., 2], out[..., 3] = q(u), q(y[:, 0::2]), q(v), q(y[:, 1::2])
    elif order == "yuyv":
        out[..., 0], out[..., 1], out[..., 2], out[..., 3] = q(y[:, 0::2]), q(u), q(y[:, 1::2]), q(v)
    else:
        raise ValueError(order)
    return out.reshape(h, w * 2)


def encode_raw(rgb: np.ndarray, encoding: str, big_endian: bool = False) -> np.ndarray:
    """The rows (H, W * bytes per pixel) of `rgb` in a ROS encoding; mono encodings take the
    first channel (pass a grey picture)."""
    h, w, _ = rgb.shape
    alpha = np.full((h, w, 1), 255, np.uint8)
    if encoding == "rgb8":
        px = rgb
    elif encoding == "bgr8":
        px = rgb[..., ::-1]
    elif encoding == "rgba8":
        px = np.concatenate([rgb, alpha], axis=2)
    elif encoding == "bgra8":
        px = np.concatenate([rgb[..., ::-1], alpha], axis=2)
    elif encoding == "mono8":
        px = rgb[..., :1]
    elif encoding == "mono16":
        wide = rgb[..., 0].astype(np.uint16) * 257  # v * 257: the full 16-bit range
        px = wide.astype(">u2" if big_endian else "<u2").view(np.uint8).reshape(h, w, 2)
    elif encoding in ("yuv422", "uyvy"):
        return yuv422_from_rgb(rgb, "uyvy")
    elif encoding in ("yuv422_yuy2", "yuyv"):
        return yuv422_from_rgb(rgb, "yuyv")
    else:
        raise ValueError(encoding)
    return np.ascontiguousarray(px).reshape(h, -1)


def make_image(rgb: np.ndarray, encoding: str, stamp: Any = None, pad: int = 0, big_endian: bool = False,
               frame_id: str = "camera") -> Any:
    """A sensor_msgs/Image of `rgb` in `encoding`; pad > 0 adds that many junk bytes per row."""
    from sensor_msgs.msg import Image

    rows = encode_raw(rgb, encoding, big_endian)
    if pad:
        junk = np.full((rows.shape[0], pad), 0xA5, np.uint8)  # must never show up in the picture
        rows = np.concatenate([rows, junk], axis=1)
    msg = Image(height=rgb.shape[0], width=rgb.shape[1], encoding=encoding, is_bigendian=int(big_endian),
                step=rows.shape[1])
    msg.data = rows.tobytes()
    msg.header.frame_id = frame_id
    if stamp is not None:
        msg.header.stamp = stamp
    return msg


def encode_compressed(rgb: np.ndarray, fmt: str) -> bytes:
    import cv2

    bgr = np.ascontiguousarray(rgb[..., ::-1])
    if fmt == "jpeg":
        ok, data = cv2.imencode(".jpg", bgr, [cv2.IMWRITE_JPEG_QUALITY, 100, cv2.IMWRITE_JPEG_SAMPLING_FACTOR,
                                              cv2.IMWRITE_JPEG_SAMPLING_FACTOR_444])
    elif fmt == "png":
        ok, data = cv2.imencode(".png", bgr)
    else:
        raise ValueError(fmt)
    assert ok
    return data.tobytes()


def make_compressed(data: bytes, fmt: str, stamp: Any = None, frame_id: str = "camera") -> Any:
    from sensor_msgs.msg import CompressedImage

    msg = CompressedImage(format=fmt)
    msg.data = data
    msg.header.frame_id = frame_id
    if stamp is not None:
        msg.header.stamp = stamp
    return msg


def exact_picture(width: int = 160, height: int = 96, block: int = 16, seed: int = 0) -> np.ndarray:
    """A picture of flat block x block colour squares whose colours survive every conversion
    exactly: 4:2:2 YUV (the test encoder above, then frames.py) and JPEG quality 100 4:4:4. With
    such a picture every encoding decodes to the same array, so the node must give the same
    description for each; the conversions' rounding itself is tested in test_frames.py."""
    from types import SimpleNamespace

    from edgevlm_ros.ros import frames

    levels = np.arange(0, 256, 15, dtype=np.uint8)
    candidates = np.stack(np.meshgrid(levels, levels, levels, indexing="ij"), -1).reshape(-1, 3)
    per_row = 64
    rows = -(-len(candidates) // per_row)
    swatch = np.zeros((rows * block, per_row * block, 3), np.uint8)
    for i, colour in enumerate(candidates):
        r, c = divmod(i, per_row)
        swatch[r * block:(r + 1) * block, c * block:(c + 1) * block] = colour
    h, w = swatch.shape[:2]
    limit = h * w
    decoded = []
    for encoding in ("yuv422", "yuv422_yuy2"):
        rows_ = encode_raw(swatch, encoding)
        decoded.append(frames.image_to_rgb(SimpleNamespace(height=h, width=w, encoding=encoding, is_bigendian=0,
                                                           step=rows_.shape[1], data=rows_.tobytes()), limit))
    decoded.append(frames.compressed_to_rgb(SimpleNamespace(format="jpeg", data=encode_compressed(swatch, "jpeg")),
                                            limit))
    exact = []
    for i, colour in enumerate(candidates):
        r, c = divmod(i, per_row)
        sl = (slice(r * block, (r + 1) * block), slice(c * block, (c + 1) * block))
        if all(np.array_equal(d[sl], swatch[sl]) for d in decoded):
            exact.append(colour)
    assert len(exact) >= 16, f"only {len(exact)} colours survive the conversions exactly"
    rng = np.random.default_rng(seed)
    grid = rng.integers(0, len(exact), size=(height // block, width // block))
    picture = np.asarray(exact, np.uint8)[grid]
    return np.ascontiguousarray(np.repeat(np.repeat(picture, block, axis=0), block, axis=1))


def grey_picture(width: int = 160, height: int = 96, seed: int = 1) -> np.ndarray:
    """A grey picture (R = G = B), for the mono encodings."""
    rng = np.random.default_rng(seed)
    grey = rng.integers(0, 256, size=(height // 16, width // 16), dtype=np.uint8)
    grey = np.repeat(np.repeat(grey, 16, axis=0), 16, axis=1)
    return np.ascontiguousarray(np.repeat(grey[..., None], 3, axis=2))


# -- command line for child processes ----------------------------------------------------------
def _camera(args: argparse.Namespace) -> int:
    """Publishes frames of one picture (so every description is the same) at a fixed rate and
    prints one JSON line per frame with its stamp."""
    import rclpy
    from rclpy.qos import QoSProfile, ReliabilityPolicy
    from sensor_msgs.msg import Image

    rclpy.init()
    node = rclpy.create_node("test_camera")
    reliability = ReliabilityPolicy.RELIABLE if args.reliable else ReliabilityPolicy.BEST_EFFORT
    pub = node.create_publisher(Image, args.topic, QoSProfile(depth=1, reliability=reliability))
    rgb = np.ascontiguousarray(np.resize(exact_picture(), (args.height, args.width, 3)))
    template = make_image(rgb, "rgb8")
    try:
        deadline = time.monotonic() + args.wait
        while pub.get_subscription_count() < args.subscribers:
            if time.monotonic() > deadline:
                print(json.dumps({"error": "no subscriber"}), flush=True)
                return 1
            time.sleep(0.02)
        print(json.dumps({"ready": True}), flush=True)
        period = 1.0 / args.rate
        start = time.monotonic()
        for i in range(args.count):
            # Pacing to the rate (not waiting for a condition): frame i leaves at start + i * period.
            delay = start + i * period - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            msg = Image(height=template.height, width=template.width, encoding="rgb8", step=template.step,
                        data=template.data)
            msg.header.frame_id = "camera"
            msg.header.stamp = node.get_clock().now().to_msg()
            pub.publish(msg)
            if args.verbose:
                print(json.dumps({"frame": i, "sec": msg.header.stamp.sec, "nanosec": msg.header.stamp.nanosec}),
                      flush=True)
        print(json.dumps({"sent": args.count, "seconds": time.monotonic() - start}), flush=True)
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        node.destroy_node()
        rclpy.try_shutdown()


def _count(args: argparse.Namespace) -> int:
    """Counts frames on a topic for --seconds after the first one, and their transport latency."""
    import rclpy
    from rclpy.qos import QoSProfile, ReliabilityPolicy
    from rclpy.time import Time
    from sensor_msgs.msg import Image

    rclpy.init()
    node = rclpy.create_node("test_counter")
    latencies: list[float] = []
    first: list[float] = []

    def on_image(msg: Image) -> None:
        if not first:
            first.append(time.monotonic())
        latencies.append((node.get_clock().now().nanoseconds - Time.from_msg(msg.header.stamp).nanoseconds) / 1e6)

    reliability = ReliabilityPolicy.RELIABLE if args.reliable else ReliabilityPolicy.BEST_EFFORT
    node.create_subscription(Image, args.topic, on_image, QoSProfile(depth=args.depth, reliability=reliability))
    print(json.dumps({"ready": True}), flush=True)
    try:
        end = time.monotonic() + args.timeout
        while time.monotonic() < end and not (first and time.monotonic() > first[0] + args.seconds):
            rclpy.spin_once(node, timeout_sec=0.05)
        lat = sorted(latencies)
        print(json.dumps({"received": len(lat), "p50_ms": lat[len(lat) // 2] if lat else None}), flush=True)
        return 0
    finally:
        node.destroy_node()
        rclpy.try_shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ros_helpers.py")
    sub = parser.add_subparsers(dest="command", required=True)
    cam = sub.add_parser("camera")
    cam.add_argument("--topic", default="image")
    cam.add_argument("--rate", type=float, default=5.0)
    cam.add_argument("--count", type=int, default=10)
    cam.add_argument("--width", type=int, default=640)
    cam.add_argument("--height", type=int, default=480)
    cam.add_argument("--reliable", action="store_true")
    cam.add_argument("--subscribers", type=int, default=1)
    cam.add_argument("--wait", type=float, default=30.0)
    cam.add_argument("--verbose", action="store_true")
    cnt = sub.add_parser("count")
    cnt.add_argument("--topic", default="image")
    cnt.add_argument("--seconds", type=float, default=3.0)
    cnt.add_argument("--timeout", type=float, default=30.0)
    cnt.add_argument("--depth", type=int, default=1)
    cnt.add_argument("--reliable", action="store_true")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    return {"camera": _camera, "count": _count}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
