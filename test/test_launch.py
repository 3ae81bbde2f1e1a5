"""launch/edgevlm.launch.py, config/edgevlm.yaml and config/fastdds_shm.xml.

`launch` and `launch_ros` do not install here, so the launch file is loaded with the stand-in in
ros_helpers, which builds the command line launch_ros builds and refuses anything it does not
know; the command is then started as a real process. test_node.py starts every node this way.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from ros_helpers import (
    CONFIG_FILE,
    NODE_COMMAND,
    ROOT,
    SHM_PROFILE,
    LaunchError,
    _RosNode,
    launched_node,
    python_child,
    random_domain_id,
    ros_env,
    run_launch_file,
)

from edgevlm_ros.ros.node_params import PARAMS, defaults, validate


def test_config_holds_every_parameter_with_its_default() -> None:
    config = yaml.safe_load(CONFIG_FILE.read_text())
    assert list(config) == ["/**"], "parameters must apply whatever the node's name and namespace"
    values = config["/**"]["ros__parameters"]
    assert values == defaults()
    for spec in PARAMS:  # typed as declared: a double written as 0 would be refused by rclpy
        kind = list if spec.kind is tuple else spec.kind  # a string array is a YAML list
        assert type(values[spec.name]) is kind, spec.name
    validate(values)


def test_default_command_line(tmp_path: Path) -> None:
    (node,) = run_launch_file({}, tmp_path)
    assert node.cmd == [*NODE_COMMAND, "--ros-args", "--log-level", "info", "--ros-args", "-r", "__node:=edgevlm",
                        "-r", "__ns:=/", "--params-file", str(CONFIG_FILE), "-r", "image:=image",
                        "-r", "image/compressed:=image/compressed"]
    assert node.fqn == "/edgevlm"


def test_arguments_override_the_params_file_only_when_given(tmp_path: Path) -> None:
    own = tmp_path / "mine.yaml"
    own.write_text(yaml.safe_dump({"/**": {"ros__parameters": {"prompt": "What is on the floor?"}}}))
    args = {"image": "/camera/image_raw", "namespace": "robot1", "model": "m.gguf", "mmproj": "p.gguf",
            "threads": "2", "transport": "compressed", "params_file": str(own), "log_level": "debug"}
    (node,) = run_launch_file(args, tmp_path)
    assert node.fqn == "/robot1/edgevlm"
    cmd = node.cmd
    assert cmd[cmd.index("__ns:=/robot1") - 1] == "-r"
    assert ["-r", "image:=/camera/image_raw", "-r", "image/compressed:=/camera/image_raw/compressed"] == cmd[-4:]
    assert ["--log-level", "debug"] == cmd[cmd.index("--log-level"):cmd.index("--log-level") + 2]
    files = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--params-file"]
    assert files[0] == str(own) and len(files) == 2
    # As launch_ros writes a dict: keyed by the node's full name, so it wins over `/**` entries.
    overrides = yaml.safe_load(Path(files[1]).read_text())
    assert overrides == {"/robot1/edgevlm": {"ros__parameters": {"model": "m.gguf", "mmproj": "p.gguf",
                                                                 "threads": 2, "transport": "compressed"}}}

    (node,) = run_launch_file({"model": "m.gguf"}, tmp_path)
    files = [node.cmd[i + 1] for i, a in enumerate(node.cmd) if a == "--params-file"]
    assert yaml.safe_load(Path(files[1]).read_text()) == {"/edgevlm": {"ros__parameters": {"model": "m.gguf"}}}


def test_the_stand_in_refuses_what_it_does_not_know(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="not declared by the launch file"):
        run_launch_file({"imgae": "/camera"}, tmp_path)
    with pytest.raises(TypeError, match="unexpected keyword argument 'node_executable'"):
        _RosNode(executable="edgevlm_node", node_executable="edgevlm_node")  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="threads:=two is not an integer"):
        run_launch_file({"threads": "two"}, tmp_path)


def test_the_launched_command_reaches_the_node(tmp_path: Path) -> None:
    """The command line really starts the node, and a launch argument (threads, in the overrides
    file) beats the params file's `/**` entry: -1 must come back as the node's own refusal."""
    with launched_node(tmp_path, random_domain_id(), {"threads": "-1", "namespace": "robot9"}) as child:
        rc = child.wait(60)
        out = child.output()
    assert rc == 2, out
    assert "edgevlm_node: error: parameter 'threads' must be >= 0, got -1" in out
    assert "Traceback" not in out


def test_setup_installs_the_executable_launch_file_and_config() -> None:
    setup = (ROOT / "setup.py").read_text()
    assert re.search(r"""["']edgevlm_node\s*=\s*edgevlm_ros\.ros\.node:main["']""", setup), \
        "setup.py must declare the console script edgevlm_node = edgevlm_ros.ros.node:main"
    assert 'glob.glob("launch/*.py")' in setup and 'glob.glob("config/*")' in setup


def test_fastdds_shm_profile_carries_a_30hz_vga_stream_best_effort(tmp_path: Path) -> None:
    """640x480 rgb8 at 30 Hz between two processes, best effort, both with the profile: Fast DDS
    parses it without complaint and at most a few frames of the 3 s window are lost (with the
    defaults, 6 of 92 arrived on 2026-11-30)."""
    env = ros_env(random_domain_id(), tmp_path / "log", {"FASTDDS_DEFAULT_PROFILES_FILE": str(SHM_PROFILE)})
    seconds, rate = 3.0, 30.0
    with python_child(["count", "--topic", "image", "--seconds", str(seconds)], env, "count") as counter, \
            python_child(["camera", "--topic", "image", "--rate", str(rate), "--count", str(int(rate * (seconds + 2))),
                          "--width", "640", "--height", "480"], env, "camera") as camera:
        counter.wait_for_line(r'"received"', 60)
        camera.kill()
    out = counter.output() + "\n" + camera.output()
    assert "XMLPARSER" not in out and "Error" not in out, out
    result = json.loads(counter.output().splitlines()[-1])
    expected = rate * seconds
    assert result["received"] >= 0.9 * expected, result
    assert result["p50_ms"] < 100.0, result
