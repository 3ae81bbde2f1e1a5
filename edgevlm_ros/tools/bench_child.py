"""The child processes of `edgevlm bench`, each a fresh interpreter so that what it measures is its own:

    python -m edgevlm_ros.tools.bench_child rss CONFIG_JSON   one engine ("ours" or "peer") loads
        the model, prefills and decodes; prints {"base_kib", "peak_kib", "ru_maxrss_kib"}
    python -m edgevlm_ros.tools.bench_child probe MODEL THREADS   llama.cpp with its extra buffer
        types prefills and decodes a few tokens; prints "ok" (it may crash instead: that is the answer)
"""

from __future__ import annotations

import json
import resource
import sys
from collections.abc import Sequence
from pathlib import Path


def peak_kib() -> int:
    """VmHWM: this process's own high-water mark. ru_maxrss would start at the parent's peak,
    which exec() carries over into the child."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def rss(cfg: dict) -> int:
    from edgevlm_ros.tools import bench

    base = peak_kib()  # Python + numpy, before the engine
    if cfg["engine"] == "ours":
        eng = bench._Ours(Path(cfg["model"]), cfg["threads"], cfg["n_ctx"])
    else:
        import llama_cpp

        from edgevlm_ros.tools.llama_peer import LlamaPeer

        eng = LlamaPeer(llama_cpp, Path(cfg["model"]), cfg["threads"], cfg["n_ctx"], cfg["flash_attn"],
                        cfg["extra_bufts"])
    eng.prefill(cfg["ids"])
    eng.decode(cfg["ids"][:8], cfg["decode"])
    print(json.dumps({"base_kib": base, "peak_kib": peak_kib(),
                      "ru_maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
    return 0


def probe(model: str, threads: int) -> int:
    import llama_cpp

    from edgevlm_ros.tools.llama_peer import LlamaPeer

    eng = LlamaPeer(llama_cpp, Path(model), threads, 256, False, True)
    eng.prefill(list(range(100, 164)))
    eng.decode([100, 101], 2)
    print("ok")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["rss"] and len(args) == 2:
        return rss(json.loads(args[1]))
    if args[:1] == ["probe"] and len(args) == 3:
        return probe(args[1], int(args[2]))
    print("usage: python -m edgevlm_ros.tools.bench_child rss CONFIG_JSON | probe MODEL THREADS", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
