"""edgevlm_ros: a ROS 2 package (ament_python) with a native VLM engine built as a pybind11 module."""
import glob
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import find_packages, setup

import buildinfo  # noqa: E402

PACKAGE = "edgevlm_ros"

# Compile the native sources in parallel (the machine's cores).
ParallelCompile("EDGEVLM_BUILD_JOBS", default=0).install()

sources = buildinfo.sources() + buildinfo.binding_sources()

# Baseline x86-64 (or armv8-a) code everywhere; ISA-specific kernels carry their own target
# attributes and are picked at run time by the operator table, so one build runs on any CPU.
cflags = ["-O3", *buildinfo.WARNINGS, "-fvisibility=hidden", "-fno-math-errno"]
ldflags: list[str] = []
if os.environ.get("EDGEVLM_SANITIZE"):
    # ASan + UBSan build for the test suite (run with LD_PRELOAD of libasan, see Makefile). -g1:
    # line tables only, so reports name function, file and line; full -g costs ~1.7x the compile time.
    cflags = ["-O1", "-g1", "-fno-omit-frame-pointer", "-fsanitize=address,undefined", "-Wall", "-Wextra"]
    ldflags = ["-fsanitize=address,undefined"]

ext = Pybind11Extension(
    f"{PACKAGE}._engine",
    sources,
    include_dirs=buildinfo.INCLUDE_DIRS,
    # kernels/optable.tsv is the engine's default operator table, compiled in; a tuned table
    # written by `edgevlm tune` replaces it at run time.
    depends=buildinfo.headers() + ["kernels/optable.tsv"],
    define_macros=[buildinfo.optable_define()],
    cxx_std=17,
    extra_compile_args=cflags,
    extra_link_args=ldflags,
)

setup(
    name=PACKAGE,
    version="0.1.0",
    packages=find_packages(exclude=["test"]),
    package_data={PACKAGE: ["data/*.gguf", "data/*.json"]},  # the embedded demo mmproj and its record
    ext_modules=[ext],
    cmdclass={"build_ext": build_ext},
    data_files=[
        ("share/ament_index/resource_index/packages", [f"resource/{PACKAGE}"]),
        (f"share/{PACKAGE}", ["package.xml"]),
        (f"share/{PACKAGE}/launch", glob.glob("launch/*.py")),
        (f"share/{PACKAGE}/config", glob.glob("config/*")),
    ],
    install_requires=["setuptools", "numpy", "tokenizers", "jinja2", "pyyaml", "opencv-python-headless", "pillow"],
    zip_safe=False,
    maintainer="edgevlm_ros developers",
    maintainer_email="edgevlm@localhost",
    description="Camera topic in, VLM description and per-stage latency out: a native VLM engine for ROS 2",
    license="Apache-2.0",
    entry_points={
        "console_scripts": [
            "edgevlm = edgevlm_ros.cli:main",
            "edgevlm_node = edgevlm_ros.ros.node:main",
            "edgevlm_lifecycle_node = edgevlm_ros.ros.lifecycle_node:main",
        ],
    },
)
