"""The operator table's operators and the CPU features are listed once (kernels/op_list.h), and
every kernel variant lives in the file its name says.

What the extension reports (operators(), cpu_features(), list_variants(), kernel_variants()) is
generated from the X-macros, so these tests check the places that are not generated: the
registry's entries in the source, the compiled-in table, the Python side, and that no second list
of the names crept into the sources.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

from edgevlm_ros import _engine
from edgevlm_ros.tools import tune

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "kernels"


@cache
def registry_entries() -> list[tuple[str, str]]:
    """(operator, variant) of every registry entry in kernels/optable.cpp, every architecture's:
    the ones written out, and the reference of every operator of EVK_OPS (generated)."""
    text = (KERNELS / "optable.cpp").read_text(encoding="utf-8")
    written = [(op, v) for op, v in re.findall(r"\{EVK_V\((\w+), (\w+)\)", text) if op != "name"]
    return written + [(op, "ref") for op in _engine.operators()]


@cache
def definitions() -> dict[str, list[Path]]:
    """Function name -> the kernels/ library files that define it (a definition starts a line)."""
    found: dict[str, list[Path]] = {}
    head = re.compile(r'^(?:EV_\w+ |__attribute__\(\(target\("[^"]*"\)\)\) )?'
                      r'(?:void|float|int64_t) (\w+)\([^;]*?\)\s*\{', re.MULTILINE)
    for path in sorted(KERNELS.rglob("*.cpp")):
        if "tests" in path.parts:
            continue
        for name in head.findall(path.read_text(encoding="utf-8")):
            found.setdefault(name, []).append(path)
    return found


def test_the_registry_lists_a_reference_for_every_operator() -> None:
    entries = registry_entries()
    assert ("matmul", "ref") in entries
    refs = {v["op"] for v in _engine.list_variants() if v["name"] == "ref" and v["available"]}
    assert refs == {"matmul", *_engine.operators()}
    # The entries this build registers are the ones the extension lists (the others are another
    # architecture's, under #if).
    listed = {(v["op"], v["name"]) for v in _engine.list_variants()}
    assert listed <= set(entries)
    assert {op for op, _ in entries} == {"matmul", *_engine.operators()}


@pytest.mark.parametrize("op, variant", registry_entries())
def test_every_variant_lives_in_the_file_its_name_says(op: str, variant: str) -> None:
    """Variant V of operator O is the function O_V, defined in kernels/<folder>/<folder>_<isa>*.cpp:
    <folder> holds O's reference (<folder>_ref.cpp), <isa> is V's first word (avx2, avx512,
    avxvnni, avx512vnni, amx, neon, ref)."""
    defs = definitions()
    ref_files = defs.get(f"{op}_ref", [])
    assert len(ref_files) == 1, f"{op}_ref defined in {ref_files}"
    folder = ref_files[0].parent
    assert ref_files[0].name == f"{folder.name}_ref.cpp", ref_files[0]
    files = defs.get(f"{op}_{variant}", [])
    assert len(files) == 1, f"{op}_{variant} defined in {files}"
    path = files[0]
    isa = variant.split("_")[0]
    stem = f"{folder.name}_{isa}"
    assert path.parent == folder and (path.stem == stem or path.stem.startswith(stem + "_")), (
        f"{op}_{variant} is in {path.relative_to(ROOT)}, not kernels/{folder.name}/{stem}*.cpp")


def test_python_asks_the_extension_for_the_lists() -> None:
    assert ("attention", *tune.elementwise_ops()) == tuple(_engine.operators())
    assert tune.weight_formats() == tuple(_engine.weight_formats())
    matmuls = {f"matmul/{f}/{p}" for f in tune.weight_formats() for p in ("decode", "prefill")}
    assert set(_engine.kernel_variants()) == matmuls | set(_engine.operators())


def test_the_builtin_table_names_only_listed_operators_and_features() -> None:
    ops = {"matmul", *_engine.operators()}
    features = set(_engine.cpu_features())
    for line in _engine.builtin_optable().split(";"):
        cols = line.split()
        assert cols[0] in ops, line
        for feature in cols[4].split(","):
            assert feature == "-" or feature in features, line


def test_a_rule_with_an_unknown_operator_or_feature_is_rejected() -> None:
    """A table that does not parse leaves the active one unchanged (load_optable throws first)."""
    with pytest.raises(ValueError, match="unknown operator 'no_such_op'"):
        _engine.load_optable("no_such_op * * any - ref", "test")
    with pytest.raises(ValueError, match="unknown CPU feature 'avx3'"):
        _engine.load_optable("softmax * * any avx2,avx3 avx2", "test")
    with pytest.raises(ValueError, match="unknown element-wise operator 'rmsnorm'"):
        _engine.kernel_elementwise("rmsnorm", "ref", [1.0, 2.0])


def _quoted_names(line: str, names: set[str]) -> set[str]:
    return {m for m in re.findall(r"""["'](\w+)["']""", line) if m in names}


# Lines that name features of another vocabulary: the bench (tools/hw_limits.py) records the /proc/cpuinfo flags of the
# machine it measured on (the kernel's names: avx512_vnni, amx_int8, asimddp), not the engine's.
OTHER_VOCABULARY = {"hw_limits.py": "interesting = ["}


def test_no_second_list_of_operators_or_features_in_the_sources() -> None:
    """A line naming three or more operators (or CPU features) as separate strings is a list; the
    list lives in kernels/op_list.h only. Tests may enumerate what they expect."""
    ops = set(_engine.operators())
    features = set(_engine.cpu_features())
    offenders = []
    sources = [*ROOT.glob("edgevlm_ros/**/*.py"), *ROOT.glob("native/**/*.[ch]*"), *ROOT.glob("kernels/**/*.[ch]*"),
               *ROOT.glob("tools/**/*.py"), ROOT / "buildinfo.py", ROOT / "setup.py"]
    for path in sources:
        if "tests" in path.parts or not path.is_file():
            continue
        for i, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if OTHER_VOCABULARY.get(path.name, "\0") in line:
                continue
            if len(_quoted_names(line, ops)) >= 3 or len(_quoted_names(line, features)) >= 3:
                offenders.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
