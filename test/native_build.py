"""Building the standalone native test programs (test_native.py, test_fuzz.py) from per-source objects.

Each source is compiled into its own object, cached under build/native-tests/obj by the hash of
the compiler, the flags, the source and every header (a header change rebuilds everything, as a
header may change any object), two compilers at a time (these machines have two cores). So the
programs that share sources share their objects: the x86 kernel check and the allocation check
compile the kernels once, and a program is relinked, not recompiled, when only its main changed.

The ASan + UBSan programs link against the objects of the sanitized extension build
(`sanitized_objects`, setup.py with EDGEVLM_SANITIZE=1, into build/asan): that build is made once
for test_native.py's checks and test_sanitized_extension.py's child pytest alike.

Built ahead: a test module lists the no-argument builders its tests call (decorated with
`@ahead`) in BUILD_AHEAD; conftest.py hands those of the selected tests to `build_ahead` when
collection ends, and a child process per builder, one after another at the lowest CPU priority
(nice 19), compiles them into the caches above while the tests before them run: on two cores the
suite leaves one core idle much of the time (single-threaded tests, ROS processes waiting on
DDS). A test calling a builder waits for its child if it is running (a builder not started yet
is dropped from the queue and built in the test at normal priority), then builds as usual, now
from the caches. A child that fails is ignored: the test's own build reports the error.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Appended, never first: test_sanitized_extension.py's child imports this module and must still
# find edgevlm_ros in the sanitized copy its PYTHONPATH names, not in the checkout.
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))
import buildinfo  # noqa: E402

BUILD = ROOT / "build" / "native-tests"
OBJECTS = BUILD / "obj"
ASAN = ROOT / "build" / "asan"
JOBS = max(2, os.cpu_count() or 2)


def common_flags(*extra: str) -> list[str]:
    """C++17, the warnings as errors, the include folders and the default operator table."""
    name, value = buildinfo.optable_define()
    return ["-std=c++17", *buildinfo.WARNINGS, "-Werror", *(f"-I{d}" for d in buildinfo.INCLUDE_DIRS),
            f"-D{name}={value}", "-pthread", *extra]


@functools.cache
def _headers_digest() -> bytes:
    h = hashlib.sha256()
    for f in buildinfo.headers():
        h.update(f.encode() + b"\0" + (ROOT / f).read_bytes())
    return h.digest()


def _digest(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update((p.encode() if isinstance(p, str) else p) + b"\0")
    return h.hexdigest()[:12]


def _compile(compiler: str, flags: Sequence[str], src: str) -> Path:
    key = _digest(compiler, *flags, src, (ROOT / src).read_bytes(), _headers_digest())
    obj = OBJECTS / f"{src.replace('/', '_')}-{key}.o"
    if not obj.exists():
        obj.parent.mkdir(parents=True, exist_ok=True)
        part = obj.with_name(f"{obj.name}.{os.getpid()}.part")
        p = subprocess.run([compiler, *flags, "-c", src, "-o", str(part)], cwd=ROOT, capture_output=True, text=True)
        assert p.returncode == 0, f"{src} did not compile:\n{p.stderr[-4000:]}"
        part.rename(obj)
    return obj


def compile_objects(sources: Sequence[str], compiler: str, flags: Sequence[str]) -> list[Path]:
    """The objects of `sources` (paths relative to the repo root), compiled where not cached."""
    with ThreadPoolExecutor(JOBS) as pool:
        return list(pool.map(lambda s: _compile(compiler, flags, s), sources))


def link(name: str, objects: Sequence[Path], compiler: str = "g++", flags: Sequence[str] = (),
         folder: Path = BUILD) -> Path:
    """`objects` linked into <folder>/<name>-<hash of the flags and objects> (an object by its
    path, size and time: the sanitized build rewrites its objects in place)."""
    stats = [f"{o}:{o.stat().st_size}:{o.stat().st_mtime_ns}" for o in objects]
    out = folder / f"{name}-{_digest(compiler, *flags, *stats)}"
    if not out.exists():
        folder.mkdir(parents=True, exist_ok=True)
        part = out.with_name(f"{out.name}.{os.getpid()}.part")
        p = subprocess.run([compiler, *map(str, objects), *flags, "-o", str(part)], cwd=ROOT, capture_output=True,
                           text=True)
        assert p.returncode == 0, f"{name} did not link:\n{p.stderr[-4000:]}"
        part.rename(out)
    return out


def build_program(name: str, main: str, sources: Sequence[str], compiler: str = "g++",
                  extra: Sequence[str] = ()) -> Path:
    """`main` and `sources` at -O2 (plus `extra`, compile and link flags both) as one program."""
    flags = common_flags("-O2", *extra)
    return link(name, compile_objects([main, *sources], compiler, flags), compiler, flags)


# --------------------------------------------------------------------------------------------
# Building ahead, in the background

AHEAD_LOG = BUILD / "ahead.log"


class _Ahead:
    """The queue of builders `build_ahead` was given and the child building the current one."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.queue: list[str] = []
        self.current: str | None = None
        self.child: subprocess.Popen[bytes] | None = None
        self.stopped = False
        self.thread: threading.Thread | None = None

    def run(self) -> None:
        BUILD.mkdir(parents=True, exist_ok=True)
        with open(AHEAD_LOG, "ab") as log:
            while True:
                with self.lock:
                    if self.stopped or not self.queue:
                        self.current = self.child = None
                        return
                    self.current = self.queue.pop(0)
                    # Its own process group, so that `stop_building_ahead` ends its compilers too.
                    self.child = subprocess.Popen(
                        ["nice", "-n", "19", sys.executable, str(Path(__file__).resolve()), "ahead", self.current],
                        cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, process_group=0)
                    child = self.child
                child.wait()

    def claim(self, key: str) -> None:
        """Returns once no child builds `key` and none will."""
        with self.lock:
            if key in self.queue:
                self.queue.remove(key)
            child = self.child if self.current == key else None
        if child is not None:
            if child.poll() is None:
                # A test waits for it now: normal priority (where allowed: raising it needs CAP_SYS_NICE).
                try:
                    os.setpriority(os.PRIO_PGRP, child.pid, 0)
                except OSError:
                    pass
            child.wait()


_AHEAD = _Ahead()


def _key(builder: Callable[[], object]) -> str:
    return f"{builder.__module__}:{builder.__qualname__}"


def ahead(builder: Callable[[], Path]) -> Callable[[], Path]:
    """Marks a no-argument builder as one `build_ahead` may run ahead: calling it first waits for
    (or cancels) its background child, then builds (from the caches, if the child finished)."""

    @functools.wraps(builder)
    def build() -> Path:
        _AHEAD.claim(_key(builder))
        return builder()

    build.ahead_key = _key(builder)  # type: ignore[attr-defined]
    return build


def build_ahead(builders: Sequence[Callable[[], Path]]) -> None:
    """Starts building `builders` (each marked with `ahead`), in order, each once, in the background."""
    keys = list(dict.fromkeys(b.ahead_key for b in builders))  # type: ignore[attr-defined]
    if not keys:
        return
    with _AHEAD.lock:
        _AHEAD.queue += [k for k in keys if k not in _AHEAD.queue and k != _AHEAD.current]
        if _AHEAD.thread is None or not _AHEAD.thread.is_alive():
            _AHEAD.stopped = False
            _AHEAD.thread = threading.Thread(target=_AHEAD.run, name="native-build-ahead", daemon=True)
            _AHEAD.thread.start()


def stop_building_ahead() -> None:
    """Drops what is queued and ends the running child with its compilers (at the session's end)."""
    with _AHEAD.lock:
        _AHEAD.stopped = True
        _AHEAD.queue.clear()
        child = _AHEAD.child
    if child is not None and child.poll() is None:
        try:
            os.killpg(child.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        child.wait()


def _run_ahead(key: str) -> None:
    """In the child: imports the builder's module (a test module, from test/) and runs it."""
    module, _, name = key.partition(":")
    test_dir = str(Path(__file__).resolve().parent)
    if test_dir not in sys.path:
        sys.path.insert(0, test_dir)
    getattr(importlib.import_module(module), name)()


# --------------------------------------------------------------------------------------------
# The sanitized extension (ASan + UBSan)

# -g1 (line tables: reports name function, file and line) as setup.py's sanitized build.
SANITIZE = ("-fsanitize=address,undefined", "-g1", "-fno-omit-frame-pointer")
# UBSan's reports are fatal in the programs as in the extension's child pytest (the extension's
# objects are built recoverable: setup.py's EDGEVLM_SANITIZE flags).
SANITIZED_RUN_ENV = {"UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1"}


@functools.cache
@ahead
def sanitized_build() -> Path:
    """setup.py's ASan + UBSan build of the extension into build/asan (lib/ and tmp/, the objects);
    setuptools rebuilds only when a source or header is newer than the built module. Once per process."""
    env = dict(os.environ, EDGEVLM_SANITIZE="1")
    p = subprocess.run([sys.executable, "setup.py", "--quiet", "build_ext", "--build-lib", str(ASAN / "lib"),
                        "--build-temp", str(ASAN / "tmp")], cwd=ROOT, env=env, capture_output=True, text=True)
    assert p.returncode == 0, f"the sanitized extension did not build:\n{p.stderr[-4000:]}"
    return ASAN


def sanitized_objects(sources: Sequence[str]) -> list[Path]:
    """The sanitized extension's objects of `sources` (library sources, as buildinfo lists them)."""
    tmp = sanitized_build() / "tmp"
    objs = [tmp / Path(s).with_suffix(".o") for s in sources]
    missing = [str(o) for o in objs if not o.exists()]
    assert not missing, f"the sanitized build has no {missing}"
    return objs


def build_sanitized_program(name: str, main: str, sources: Sequence[str]) -> Path:
    """`main` compiled with ASan + UBSan (-O1, as the extension) and linked with the sanitized
    extension's objects of `sources`."""
    flags = common_flags("-O1", *SANITIZE, "-fno-sanitize-recover=all")
    (main_obj,) = compile_objects([main], "g++", flags)
    return link(name, [main_obj, *sanitized_objects(sources)], "g++", flags)


def build_sanitized_package() -> Path:
    """build/asan/pkg: the package's Python files plus the ASan + UBSan _engine."""
    lib = sanitized_build() / "lib" / "edgevlm_ros"
    built = sorted(lib.glob("_engine*.so"))
    assert len(built) == 1, built
    dest = ASAN / "pkg" / "edgevlm_ros"
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(ROOT / "edgevlm_ros", dest, ignore=shutil.ignore_patterns("__pycache__", "_engine*.so"))
    shutil.copy2(built[0], dest / built[0].name)
    return ASAN / "pkg"


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "ahead":
        _run_ahead(sys.argv[2])
    else:
        sys.exit("usage: native_build.py ahead MODULE:BUILDER")
