"""Shared fixtures. Loading models is slow, so each is loaded once per session."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

# Nothing leaves this machine: any ROS process a test starts discovers peers on localhost only.
os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "models"
TEXT_MODEL = MODELS / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def text_model_path() -> Path:
    assert TEXT_MODEL.exists(), f"{TEXT_MODEL} is missing: run scripts/setup.sh (make test does)"
    return TEXT_MODEL


@pytest.fixture(scope="session")
def engine(text_model_path: Path) -> Any:
    """Our engine on the real SmolLM2 weights, two threads (this machine's cores)."""
    import edgevlm_ros

    return edgevlm_ros.load(text_model_path, threads=2)


@pytest.fixture(scope="session")
def hf_model(text_model_path: Path) -> Any:
    """transformers' LlamaForCausalLM loading the same GGUF, dequantized to float32."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(
        str(text_model_path.parent), gguf_file=text_model_path.name, dtype=torch.float32
    )
    model.eval()
    return model


INT8_VISION_VARIANTS = ("avxvnni_q8act_gemm", "avx512vnni_q8act_gemm_ymm", "neon_q8act_gemm")


def int8_kernel(wtype: str) -> str | None:
    """The kernel the active table gives a tower weight when int8 products are allowed, or None
    where it has no int8 rule for this CPU (the float kernel serves it then)."""
    from edgevlm_ros import _engine
    from edgevlm_ros.engine import optable

    optable.ensure_active()
    chosen = _engine.choose_matmul(wtype, "int8", 1152, 1152)
    return None if chosen == _engine.choose_matmul(wtype, "prefill", 1152, 1152) else str(chosen)


@pytest.fixture
def int8_vision_table() -> Any:
    """A function that puts products allowed int8 (vision_int8) on an int8 kernel wherever this CPU
    has one and returns the kernel's name (None where the CPU has none). Where the built-in table
    gives such products to AMX's float GEMM (an AMX CPU also has AVX-VNNI), it activates a table with
    an int8 rule for that kernel above the built-in rules, so the kernel runs through the models
    there too; the default lookup comes back after the test."""
    from edgevlm_ros import _engine
    from edgevlm_ros.engine import optable

    changed = False

    def enable() -> str | None:
        nonlocal changed
        chosen = int8_kernel("F16")
        if chosen is not None:
            return chosen
        have = {v["name"] for v in _engine.list_variants() if v["op"] == "matmul" and v["available"]}
        kernel = next((v for v in INT8_VISION_VARIANTS if v in have), None)
        if kernel is not None:
            optable.activate_text(f"matmul  *  int8  any  -  {kernel}\n" + optable._builtin_text(),
                                  f"built-in default with {kernel} first for int8 products (test)")
            changed = True
        return kernel

    try:
        yield enable
    finally:
        if changed:
            optable.activate()


def pytest_collection_finish(session: pytest.Session) -> None:
    """The native programs the selected tests build (their modules' BUILD_AHEAD), started in the
    background now (native_build.build_ahead: lowest CPU priority, so only idle CPU time)."""
    builders = [b for item in session.items for b in getattr(getattr(item, "module", None), "BUILD_AHEAD", ())]
    if builders:
        import native_build

        native_build.build_ahead(builders)


def pytest_sessionfinish(session: pytest.Session) -> None:
    nb = sys.modules.get("native_build")
    if nb is not None:
        nb.stop_building_ahead()


# A skip because a reference or a model file is missing is a set-up failure where the set-up is
# ours to trust: CI (.ci/run) sets EDGEVLM_STRICT_REFERENCES=1, and such a skip fails there.
_MISSING = ("not installed", "is missing", "is absent", "not fetched", "could not import")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("EDGEVLM_STRICT_REFERENCES") != "1" or not report.skipped:
        return
    reason = str(report.longrepr[2]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if any(m in reason for m in _MISSING):
        report.outcome = "failed"
        report.longrepr = f"EDGEVLM_STRICT_REFERENCES=1: skipped for a missing reference or file: {reason}"
