"""A child process for test_text_model.py: loads the default text model with three threads and prints,
as one JSON line, the CPUs each engine worker thread (evk-worker-N) may run on and those the
process may use."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main() -> None:
    sys.path.append(str(Path(__file__).resolve().parents[1]))  # the checkout, after any PYTHONPATH
    from edgevlm_ros.engine.text_model import load

    model = load(threads=3)  # alive while its worker threads are looked at
    workers = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            name = f.read().strip()
        if name.startswith("evk-worker-"):
            workers[name] = sorted(os.sched_getaffinity(int(tid)))
    print(json.dumps({"workers": workers, "allowed": sorted(os.sched_getaffinity(0))}))
    del model


if __name__ == "__main__":
    main()
