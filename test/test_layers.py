"""The package's layers hold (issue 13, item 1): no import circles among the modules of
edgevlm_ros, rclpy and ROS messages imported only under edgevlm_ros/ros/, nothing imports the
CLI, and the CLI reaches ros/ only from inside functions (so `edgevlm generate` loads no ROS).

The import graph is read from the source (the AST of every module, imports inside functions
included), so a circle that only closes at run time, in a lazily imported branch, fails too.
The checks run on small packages written to tmp_path first, to show they can fail.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "edgevlm_ros"
ROS_ONLY = {"rclpy", "std_msgs", "sensor_msgs", "diagnostic_msgs", "rcl_interfaces", "builtin_interfaces",
            "lifecycle_msgs", "launch", "launch_ros"}


def _is_ros(module: str) -> bool:
    top = module.split(".")[0]
    return top in ROS_ONLY or top.endswith(("_msgs", "_srvs", "_interfaces"))


@dataclass(frozen=True)
class Import:
    importer: str  # dotted name of the importing module
    target: str  # dotted name of the imported module (a package's __init__ is the package name)
    line: int
    top_level: bool  # executed at import time (not inside a function)


def _module_name(package_dir: Path, path: Path) -> str:
    parts = [package_dir.name, *path.relative_to(package_dir).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# Native extensions of the package (setup.py builds them; a checkout need not have them built).
NATIVE = ("_engine",)


def _modules(package_dir: Path) -> dict[str, Path | None]:
    """Module name -> source file (None for a native extension: a leaf of the graph)."""
    found: dict[str, Path | None] = {_module_name(package_dir, p): p for p in sorted(package_dir.rglob("*.py"))}
    found.update({f"{package_dir.name}.{name}": None for name in NATIVE})
    return found


def _resolve(importer: str, is_package: bool, level: int, module: str | None) -> str:
    """The absolute name of `from <level dots><module> import ...` written in importer."""
    if level == 0:
        return module or ""
    base = importer.split(".")
    if not is_package:
        base = base[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join([*base, *([module] if module else [])])


def _function_nodes(tree: ast.AST) -> set[int]:
    """ids of the import nodes that sit inside a function (run only when it is called)."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            inside.update(id(n) for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom)))
    return inside


def _parsed(package_dir: Path) -> Iterator[tuple[str, Path, ast.Module]]:
    """(module name, source file, syntax tree) of every Python module of the package."""
    for name, path in _modules(package_dir).items():
        if path is not None:
            yield name, path, ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def imports(package_dir: Path) -> list[Import]:
    """Every import statement of every module of the package, resolved to module names."""
    modules = _modules(package_dir)
    found: list[Import] = []
    for name, path, tree in _parsed(package_dir):
        lazy = _function_nodes(tree)
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, is_package, node.level, node.module)
                # `from pkg import name`: the submodule pkg.name when there is one, else pkg itself.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for target in dict.fromkeys(targets):
                found.append(Import(name, target, node.lineno, id(node) not in lazy))
    return found


def cycles(package_dir: Path) -> list[list[str]]:
    """The import circles among the package's own modules (each as the path that closes it)."""
    modules = _modules(package_dir)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for imp in imports(package_dir):
        if imp.target in modules and imp.target != imp.importer:
            graph[imp.importer].add(imp.target)
    found: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                found.append([*path[path.index(n):], n])
            elif n not in state:
                visit(n)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return found


def ros_imports_outside(package_dir: Path, ros_package: str) -> list[str]:
    """'module:line imports X' for every ROS import of a module outside ros_package."""
    return [f"{i.importer}:{i.line} imports {i.target}" for i in imports(package_dir)
            if _is_ros(i.target) and not (i.importer == ros_package or i.importer.startswith(ros_package + "."))]


def _write_package(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root / next(iter(files)).split("/")[0]


# -- the checks can fail ---------------------------------------------------------------------------
def test_a_circle_through_a_function_level_import_is_found(tmp_path: Path) -> None:
    pkg = _write_package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/cli.py": "from .tools import bench\n",
        "pkg/tools/__init__.py": "",
        "pkg/tools/bench.py": "def main():\n    from ..cli import run\n    return run\n",
        "pkg/tools/tune.py": "from . import bench\n",
    })
    assert cycles(pkg) == [["pkg.cli", "pkg.tools.bench", "pkg.cli"]]


def test_a_ros_import_outside_ros_is_found(tmp_path: Path) -> None:
    pkg = _write_package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/ros/__init__.py": "",
        "pkg/ros/node.py": "import rclpy\nfrom std_msgs.msg import String\n",
        "pkg/demo/__init__.py": "",
        "pkg/demo/camera.py": "def run():\n    from sensor_msgs.msg import Image\n    import rclpy.qos\n",
    })
    assert ros_imports_outside(pkg, "pkg.ros") == ["pkg.demo.camera:2 imports sensor_msgs.msg",
                                                   "pkg.demo.camera:3 imports rclpy.qos"]


# -- the package ----------------------------------------------------------------------------------
def test_the_package_has_the_four_layers() -> None:
    subpackages = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))
    assert subpackages == ["demo", "engine", "ros", "tools"]
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert top == ["__init__.py", "cli.py"], top


def test_no_import_circles() -> None:
    assert cycles(PACKAGE) == []


def test_rclpy_and_ros_messages_only_under_ros() -> None:
    assert ros_imports_outside(PACKAGE, "edgevlm_ros.ros") == []


def test_nothing_imports_the_cli() -> None:
    back = [f"{i.importer}:{i.line}" for i in imports(PACKAGE) if i.target == "edgevlm_ros.cli"]
    assert back == []


def test_the_cli_reaches_ros_only_lazily() -> None:
    eager = [f"line {i.line}: {i.target}" for i in imports(PACKAGE) if i.importer == "edgevlm_ros.cli"
             and i.top_level and (i.target.startswith("edgevlm_ros.ros") or _is_ros(i.target))]
    assert eager == []


@pytest.mark.parametrize("layer", ["engine", "demo", "tools"])
def test_lower_layers_do_not_import_ros(layer: str) -> None:
    """engine/, demo/ and tools/ work without ROS: none of them imports edgevlm_ros.ros."""
    up = [f"{i.importer}:{i.line} imports {i.target}" for i in imports(PACKAGE)
          if i.importer.startswith(f"edgevlm_ros.{layer}") and i.target.startswith("edgevlm_ros.ros")]
    assert up == []


def test_the_engine_imports_no_other_layer() -> None:
    """engine/ is the bottom of the package: it imports nothing of demo/, tools/, ros/ or the CLI."""
    up = [f"{i.importer}:{i.line} imports {i.target}" for i in imports(PACKAGE)
          if i.importer.startswith("edgevlm_ros.engine") and i.target.startswith("edgevlm_ros.")
          and not i.target.startswith(("edgevlm_ros.engine", "edgevlm_ros._engine"))]
    assert up == []


def source_run_with_c(paths: list[Path]) -> list[str]:
    """'file:line' of every `[sys.executable, "-c", ...]`: a child program kept as source in a string."""
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, (ast.List, ast.Tuple)):
                continue
            for first, second in zip(node.elts, node.elts[1:], strict=False):
                if (isinstance(first, ast.Attribute) and first.attr == "executable"
                        and isinstance(first.value, ast.Name) and first.value.id == "sys"
                        and isinstance(second, ast.Constant) and second.value == "-c"):
                    found.append(f"{path.relative_to(path.parents[1])}:{node.lineno}")
    return found


def test_a_child_program_in_a_string_is_found(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    bad = tmp_path / "pkg" / "bench.py"
    bad.write_text('import subprocess, sys\nCODE = "print(1)"\nsubprocess.run([sys.executable, "-c", CODE])\n')
    assert source_run_with_c([bad]) == ["pkg/bench.py:3"]


def test_child_programs_are_modules() -> None:
    """The package and the tests start child Pythons as modules or files (`-m edgevlm_ros.ros.node`,
    `test/fault_node.py`), never as source kept in a string."""
    assert source_run_with_c(sorted(PACKAGE.rglob("*.py")) + sorted((ROOT / "test").glob("*.py"))) == []


def unresolved_imports(package_dir: Path) -> list[str]:
    """`from <relative> import name` statements (function-level ones included, which only fail when
    called) whose module does not exist, or whose name is neither a submodule nor in its source."""
    modules = _modules(package_dir)
    bad: list[str] = []
    for importer, path, tree in _parsed(package_dir):
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or node.level == 0:
                continue
            target = _resolve(importer, path.name == "__init__.py", node.level, node.module)
            where = f"{path.relative_to(package_dir.parent)}:{node.lineno}"
            if target not in modules:
                bad.append(f"{where}: no module {target}")
                continue
            source = modules[target]
            text = source.read_text(encoding="utf-8") if source is not None else ""
            for alias in node.names:
                if f"{target}.{alias.name}" not in modules and alias.name not in text:
                    bad.append(f"{where}: {target} has no {alias.name}")
    return bad


def test_a_relative_import_that_no_longer_resolves_is_found(tmp_path: Path) -> None:
    pkg = _write_package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/engine/__init__.py": "",
        "pkg/engine/paths.py": "ROOT = 1\n",
        "pkg/demo/__init__.py": "",
        "pkg/demo/model.py": "def f():\n    from .paths import ROOT\n    from ..engine.paths import HOME\n"
                             "    from ..engine.paths import ROOT\n    return ROOT\n",
    })
    assert unresolved_imports(pkg) == ["pkg/demo/model.py:2: no module pkg.demo.paths",
                                       "pkg/demo/model.py:3: pkg.engine.paths has no HOME"]


def test_every_relative_import_resolves() -> None:
    """A module moved to another layer keeps no import of its old neighbours (even inside a function)."""
    assert unresolved_imports(PACKAGE) == []
