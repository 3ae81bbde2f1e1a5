"""A child process for test_bench_tune.py: prints, as one JSON line, every choice the active
operator table makes (the table $EDGEVLM_OPTABLE names, else the default lookup). The test calls
choices() in its own process too, so both sides run the same code."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

SHAPES = [(96, 128), (576, 576), (49152, 576), (1536, 4096)]


def choices() -> dict[str, Any]:
    from edgevlm_ros import _engine
    from edgevlm_ros.engine import optable

    source = optable.ensure_active()
    matmul = {f"{fmt} {phase} {r}x{k}": _engine.choose_matmul(fmt, phase, r, k)
              for fmt in _engine.weight_formats() for phase in ("decode", "prefill") for r, k in SHAPES}
    ops = {op: _engine.choose(op) for op in _engine.operators()}
    return {"source": source, "matmul": matmul, "ops": ops}


def main() -> None:
    sys.path.append(str(Path(__file__).resolve().parents[1]))  # the checkout, after any PYTHONPATH
    print(json.dumps(choices()))


if __name__ == "__main__":
    main()
