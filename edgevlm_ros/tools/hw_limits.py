"""What bounds a benchmark on this machine: the CPU and its SIMD features, memory read bandwidth,
and the bytes a decoded token must read (so the bandwidth floor of a decode step). Shared by
`edgevlm bench` (tools/bench.py) and its speculation bench (tools/bench_speculation.py).
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["bandwidth_floors", "highest_bandwidth", "machine_info", "measure_bandwidth", "weight_bytes_per_token"]


def machine_info() -> dict[str, Any]:
    """CPU model (as lscpu names it), cores and the SIMD features that matter here."""
    model = platform.processor() or platform.machine()
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name":
                model = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = set(value.split())
    except OSError:
        pass
    interesting = ["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16",
                   "amx_int8", "amx_bf16", "asimd", "asimddp", "i8mm"]
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return {"cpu": model, "cores": cores, "arch": platform.machine(),
            "features": [f for f in interesting if f in flags]}


def measure_bandwidth(mib: float, threads: int, repeats: int = 3) -> dict[str, float]:
    """Memory read bandwidth in GB/s: numpy sums over a `mib` MiB float32 array, best of `repeats`,
    on one thread and on `threads` threads (each summing its own slice; numpy drops the GIL)."""
    n = max(1, int(mib * (1 << 20)) // 4)
    a = np.ones(n, dtype=np.float32)  # written once, so every page is resident
    nbytes = a.nbytes

    def best(fn: Callable[[], object]) -> float:
        fn()  # warm-up
        times = []
        for _ in range(max(1, repeats)):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return nbytes / min(times) / 1e9

    single = best(lambda: a.sum())
    parts = np.array_split(a, threads)
    if threads > 1:
        with ThreadPoolExecutor(threads) as pool:
            multi = best(lambda: list(pool.map(np.sum, parts)))
    else:
        multi = single
    return {"mib": float(mib), "single_gbs": single, "all_gbs": multi, "threads": float(threads)}


def bandwidth_floors(weight_bytes: int, model_sized: dict[str, float], dram: dict[str, float]) -> dict[str, Any]:
    """The two decode floors (ms per token): the bytes a token reads over the read bandwidth of a
    buffer of that size (as cache-resident as the model can be: these VMs report a 300 MB L3) and
    of the large DRAM-only buffer. The higher bandwidth gives the lower floor: that one binds (a
    decode cannot beat it), the other is only a bound for a model that misses the cache."""
    floors = {}
    for key, bw in (("model_sized", model_sized), ("dram", dram)):
        floors[key] = {"mib": bw["mib"], "gbs": bw["all_gbs"], "floor_ms": weight_bytes / (bw["all_gbs"] * 1e9) * 1e3}
    binds = min(floors, key=lambda k: floors[k]["floor_ms"])
    return {**floors, "binds": binds, "floor_ms": floors[binds]["floor_ms"]}


def highest_bandwidth(runs: Sequence[dict[str, float]]) -> dict[str, float]:
    """The highest single- and multi-thread bandwidth of several measure_bandwidth() runs, with
    every run's all-thread figure kept (`all_runs_gbs`)."""
    best = dict(runs[0])
    best["single_gbs"] = max(r["single_gbs"] for r in runs)
    best["all_gbs"] = max(r["all_gbs"] for r in runs)
    best["all_runs_gbs"] = [r["all_gbs"] for r in runs]  # type: ignore[assignment]
    return best


def weight_bytes_per_token(gguf_path: Path, recurrent_floats: int = 0) -> dict[str, Any]:
    """Bytes one decoded token reads: every layer tensor, the output norm, the output head (the
    token embedding when tied) and one embedding row, plus the recurrent state (float32, read and
    written back once per token: 2 x 4 bytes a float; Qwen3.5-0.8B's 5 M floats are 40 MB) of a
    model that carries one. The KV cache read is left out (small at the bench's context lengths)."""
    from .. import _engine

    tensors = _engine.GGUFFile(str(gguf_path)).tensors()
    by_name = {t["name"]: t for t in tensors}
    layers = sum(t["nbytes"] for t in tensors if t["name"].startswith("blk."))
    head_t = by_name.get("output.weight") or by_name.get("token_embd.weight")
    head = head_t["nbytes"] if head_t else 0
    norm = by_name["output_norm.weight"]["nbytes"] if "output_norm.weight" in by_name else 0
    emb = by_name.get("token_embd.weight")
    emb_row = emb["nbytes"] // emb["shape"][-1] if emb else 0
    layer_types = sorted({t["type"] for t in tensors if t["name"].startswith("blk.") and len(t["shape"]) == 2})
    state = 2 * 4 * recurrent_floats
    return {"total": layers + head + norm + emb_row + state, "layers": layers, "head": head,
            "head_type": head_t["type"] if head_t else None, "layer_types": layer_types, "recurrent_state": state}
