"""`edgevlm bench`: our engine and llama.cpp side by side, in one process run.

Same GGUF, same thread count, same token ids for both engines. Every measure is repeated
(--repeats, default 3) with the two engines alternating (ours first on even rounds, the peer
first on odd ones) so that both share whatever else the machine is doing, and the median is
reported. Absolute numbers on shared machines drift; the ratios ours / llama.cpp hold.

Measures (rows of the table):
  * prefill tokens/s at 64 and 512 tokens (one forward over the prompt, logits of the last token);
  * decode tokens/s over 128 greedy tokens (single-token forwards after a short prompt);
  * time to first token of a chat prompt with a system prompt, without and with the prefix cache
    (ours: KV snapshot restore; llama.cpp: the system prompt's KV kept, the rest re-evaluated, or
    for a recurrent / hybrid model, whose state cannot be cut back, its sequence state restored);
  * vision encode ms of one 512x512 tile of a SmolVLM-256M-shaped mmproj (random weights; the
    peer only when a `llama-mtmd-cli` binary is found); with --mmproj of a MiniCPM-V 4.6 pair
    (clip.projector_type minicpmv4_6, --model its text GGUF): the encode of one 448 slice, its share
    of the FP32 GEMM peak measured here (flops from the mmproj: tools/vision_cost.py), and the time to
    first token of a 640x480 frame through load_vlm, each against llama-mtmd-cli on the same files
    (docs/kernels/vision-flops.md);
  * peak RSS of a process that loads the model, prefills and decodes (one child process per
    engine, resource.getrusage);
  * the decode roofline: bytes a token reads (its weights, and for a hybrid decoder such as
    Qwen3.5 its recurrent state, read and written once per token) / the read bandwidth measured here
    (numpy sum, --threads threads) of two buffers: one the size of those bytes (partly cache-
    resident, as the model is) and one of --bandwidth-mib MiB (DRAM only); the higher bandwidth
    is the lower floor, the one that binds.

--profile robot runs both engines as on an x86 robot computer (AVX2 + AVX-VNNI, no AVX-512, no
AMX): ours with that operator table (engine/optable.robot_table(); --optable FILE loads any
table), llama.cpp from the libllama built for it (scripts/install_bench_extra.sh --robot), loaded
through llama-cpp-python's LLAMA_CPP_LIB_PATH (--peer-lib DIR names another build).

llama.cpp is `llama-cpp-python` (optional: scripts/install_bench_extra.sh). Without it the bench
prints our numbers and says the peer is missing.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from ..engine import optable
from ..engine.argtypes import command_main, positive_int
from . import vision_cost
from .hw_limits import (
    bandwidth_floors,
    highest_bandwidth,
    machine_info,
    measure_bandwidth,
    weight_bytes_per_token,
)
from .llama_peer import LlamaPeer, import_peer, loaded_llama_libraries

ROOT = Path(__file__).resolve().parents[2]

# A system prompt of the kind a robot keeps fixed for its whole run (~150 tokens).
SYSTEM_PROMPT = (
    "You are the perception assistant of a wheeled warehouse robot. You receive short questions "
    "about what the robot's front camera shows and answer in one or two plain sentences. Name "
    "people, forklifts, pallets, boxes, shelves, doors, spills and cables when you see them, say "
    "where they are (left, centre, right, near, far) and whether they block the aisle. Never guess "
    "about things you cannot see; say that you are unsure instead. Do not give advice on driving, "
    "speed or routes: the planner decides those. Keep numbers short, use metres for distances, and "
    "do not repeat the question. If the image is dark, blurred or covered, say so first."
)
USER_PROMPT = "Is the aisle ahead clear?"
USER_PROMPT_ALT = "What is on the left shelf?"

# Prompt text for the prefill measures (repeated until long enough).
PREFILL_TEXT = (
    "The robot left its charging dock at seven and followed the painted line along aisle four. "
    "Near the third shelf a pallet of boxes stood half in the lane, so it slowed, logged the "
    "obstacle with its position and a photo, and waited for the planner to choose a way around. "
    "A forklift crossed at the far end; the robot stopped until the lidar reported the crossing "
    "empty again. At the loading bay it scanned 42 labels, found two that did not match the "
    "order list, and sent both codes to the supervisor's tablet before returning to the dock. "
)
DECODE_PROMPT = "List three safety rules for robots working near people."


def default_cache_dir() -> Path:
    """Where the bench keeps its random-weight vision model (built once)."""
    return Path.home() / ".cache" / "edgevlm_ros" / "bench"


# -- small helpers ------------------------------------------------------------------------------


def _median(values: Sequence[float]) -> float | None:
    return float(statistics.median(values)) if values else None


def _ratio(ours: float | None, peer: float | None) -> float | None:
    if ours is None or peer is None or peer == 0:
        return None
    return ours / peer


def _loadavg() -> list[float] | None:
    """1/5/15-minute load averages: how busy the (shared) machine was while measuring."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


# -- profiles -----------------------------------------------------------------------------------

PROFILES = ("native", "robot")


def default_robot_lib() -> Path:
    """Where scripts/install_bench_extra.sh --robot puts libllama: $EDGEVLM_ROBOT_LLAMA_LIB, else
    ${XDG_CACHE_HOME:-~/.cache}/edgevlm/llama-robot."""
    env = os.environ.get("EDGEVLM_ROBOT_LLAMA_LIB")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "edgevlm" / "llama-robot"


def choose_peer_lib(lib: Path, profile: str, cpu: Mapping[str, bool]) -> tuple[Path | None, str]:
    """The libllama folder llama.cpp is to load (None: the one llama-cpp-python installed) and why.

    A robot build on a CPU without the profile's features would stop at its first AVX-VNNI
    instruction, so it is only used where the CPU has them (cpu: _engine.cpu_features(), the
    features the robot build of llama.cpp compiles in, scripts/install_bench_extra.sh, are the
    profile's)."""
    if not (lib / "libllama.so").is_file():
        return None, (f"no libllama.so in {lib} (scripts/install_bench_extra.sh --robot builds it): "
                      "llama.cpp is the installed build")
    missing = [f for f in optable.ROBOT_FEATURES.split(",") if not cpu.get(f)] if profile == "robot" else []
    if missing:
        return None, (f"this CPU lacks {','.join(missing)}, which the robot build of llama.cpp in {lib} uses: "
                      "llama.cpp is the installed build (compiled for this CPU)")
    if sys.modules.get("llama_cpp") is not None:
        return None, "llama_cpp was already loaded in this process: llama.cpp is the build it loaded"
    return lib, f"llama.cpp: libllama from {lib} (LLAMA_CPP_LIB_PATH)"


def peer_dir(cfg: BenchConfig) -> Path | None:
    """Where the profile's llama.cpp lives: --peer-lib, else the robot build's folder for the robot
    profile, else none (the installed llama_cpp and llama-mtmd-cli)."""
    return cfg.peer_lib or (default_robot_lib() if cfg.profile == "robot" else None)


def apply_profile(cfg: BenchConfig) -> dict[str, Any]:
    """Makes our operator table and llama.cpp's library those of cfg.profile (and --optable /
    --peer-lib); returns what was done. Runs before either engine is loaded."""
    info: dict[str, Any] = {"name": cfg.profile}
    if cfg.optable is not None:
        info["optable"] = optable.activate(cfg.optable)
    elif cfg.profile == "robot":
        info["optable"] = optable.activate_text(
            optable.robot_table(), f"robot profile (built-in rules needing only {optable.ROBOT_FEATURES})")
    lib = peer_dir(cfg)
    if lib is not None and cfg.peer:
        from .. import _engine

        chosen, info["peer_lib_note"] = choose_peer_lib(lib, cfg.profile, _engine.cpu_features())
        if chosen is not None:
            os.environ["LLAMA_CPP_LIB_PATH"] = str(chosen)  # read when llama_cpp is imported; children inherit it
        info["peer_lib"] = str(chosen) if chosen else None
    return info


# -- the two engines ----------------------------------------------------------------------------


class _Ours:
    """Our engine through its public Python API."""

    def __init__(self, path: Path, threads: int, n_ctx: int) -> None:
        from ..engine.text_model import TextModel

        self.model = TextModel(path, threads=threads, n_ctx=n_ctx)
        self.native = self.model.native

    def prefill(self, ids: Sequence[int]) -> float:
        arr = np.asarray(ids, dtype=np.int32)
        self.native.reset()
        t0 = time.perf_counter()
        self.native.forward(arr)
        return time.perf_counter() - t0

    def decode(self, prompt: Sequence[int], n: int) -> tuple[float, list[int]]:
        """Seconds for n single-token forwards after the prompt, and the n + 1 greedy tokens."""
        self.native.reset()
        r = self.native.generate(np.asarray(prompt, dtype=np.int32), n + 1, [])
        return r["decode_ms"] / 1e3, list(r["tokens"])

    def ttft(self, ids: Sequence[int]) -> float:
        arr = np.asarray(ids, dtype=np.int32)
        self.native.reset()
        t0 = time.perf_counter()
        self.native.generate(arr, 1, [])
        return time.perf_counter() - t0

    def make_prefix(self, prefix_ids: Sequence[int]) -> Any:
        return self.model.prefix(prefix_ids)

    def ttft_cached(self, prefix: Any, ids: Sequence[int]) -> float:
        rest = np.asarray(ids[len(prefix.token_ids):], dtype=np.int32)
        t0 = time.perf_counter()
        self.native.restore(prefix.snapshot)
        self.native.generate(rest, 1, [])
        return time.perf_counter() - t0


def _peer_omp_policy(cfg: BenchConfig) -> str:
    """Sets OMP_WAIT_POLICY for llama.cpp (an OpenMP build: llama_cpp and llama-mtmd-cli) before it
    is loaded; returns what was done. llama.cpp's idle OpenMP threads spin between graph nodes: on a
    quiet machine that is its fastest setting, on a busy one (more runnable threads than cores) a thread spinning at a
    barrier for a descheduled partner costs it ~10x (measured here: decode 1.7 vs 18 tokens/s at
    load 5 on 2 cores). 'auto' picks PASSIVE when the 1-minute load average is >= the core count."""
    if "OMP_WAIT_POLICY" in os.environ:
        return f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']} (from the environment)"
    choice = cfg.peer_omp_wait
    why = f"--peer-omp-wait {choice}"
    if choice == "auto":
        load = _loadavg()
        cores = machine_info()["cores"]
        busy = load is not None and load[0] >= cores
        choice = "passive" if busy else "default"
        why = f"auto: 1-min load {load[0] if load else '?'} {'>=' if busy else '<'} {cores} cores"
    if choice == "passive":
        # Read by llama_cpp when it is loaded and by llama-mtmd-cli (a child process), which runs
        # whether llama_cpp is importable or not.
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        if sys.modules.get("llama_cpp") is not None:
            return (f"OMP_WAIT_POLICY=PASSIVE ({why}) for llama-mtmd-cli only: llama_cpp was already loaded "
                    "in this process")
        return f"OMP_WAIT_POLICY=PASSIVE ({why})"
    return f"OpenMP default ({why})"


# -- measures -----------------------------------------------------------------------------------


@dataclass
class Row:
    """One line of the table: a measure for both engines."""

    key: str
    label: str
    unit: str
    higher_is_better: bool
    ours: float | None = None
    peer: float | None = None
    note: str = ""
    samples: dict[str, list[float]] = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        return _ratio(self.ours, self.peer)

    @property
    def better(self) -> str:
        r = self.ratio
        if r is None:
            return ""
        if abs(r - 1.0) < 0.02:
            return "even"
        return "ours" if (r > 1.0) == self.higher_is_better else "llama.cpp"

    def as_dict(self) -> dict[str, Any]:
        return {"key": self.key, "label": self.label, "unit": self.unit, "higher_is_better": self.higher_is_better,
                "ours": self.ours, "peer": self.peer, "ratio_ours_over_peer": self.ratio, "better": self.better,
                "note": self.note, "samples": self.samples}


def _alternate(repeats: int, ours: Callable[[], float], peer: Callable[[], float] | None,
               pause_s: float = 0.05) -> tuple[list[float], list[float]]:
    """Runs both `repeats` times, alternating which goes first; returns (ours, peer) samples."""
    a: list[float] = []
    b: list[float] = []
    for i in range(repeats):
        order: list[tuple[Callable[[], float], list[float]]] = [(ours, a)]
        if peer is not None:
            order = [(ours, a), (peer, b)] if i % 2 == 0 else [(peer, b), (ours, a)]
        for fn, out in order:
            out.append(fn())
            time.sleep(pause_s)  # let the other engine's idle workers go to sleep
    return a, b


@dataclass
class BenchConfig:
    """Everything a bench run needs; built from the command line by config_from_args()."""

    model: Path
    threads: int = 2
    repeats: int = 3
    prefill_tokens: tuple[int, ...] = (64, 512)
    decode_tokens: int = 128
    peer: bool = True
    peer_flash_attn: bool = False
    peer_extra_bufts: str = "auto"
    peer_omp_wait: str = "auto"
    vision: bool = True
    vision_layers: int = 12
    vision_int8: bool = False  # our encode on int8 products (vision_int8) where the table has an int8 kernel
    mmproj: Path | None = None
    cache_dir: Path = field(default_factory=default_cache_dir)
    bandwidth_mib: int = 1024
    profile: str = "native"
    optable: Path | None = None
    peer_lib: Path | None = None
    rss: bool = True
    mtmd_cli: str | None = None
    peak_shape: tuple[int, int, int] = vision_cost.PEAK_SHAPE  # the GEMM the FP32 peak is measured on
    n_ctx: int = 2048
    log: Callable[[str], None] = field(default=lambda s: print(s, file=sys.stderr, flush=True))


def _prefill_ids(model: Any, n: int) -> list[int]:
    text = PREFILL_TEXT
    ids = model.tokenizer.encode(text)
    while len(ids) < n:
        text += PREFILL_TEXT
        ids = model.tokenizer.encode(text)
    return [int(t) for t in ids[:n]]


def _chat_ids(model: Any, prompt: str, system: str | None = None) -> list[int]:
    """A chat prompt's ids; a model without a chat template (a base model such as Gemma 3 270M)
    gets the text as it is, the system prompt first."""
    if model.chat_template is None:
        return model.encode_prompt(prompt if system is None else f"{system}\n\n{prompt}", raw=True)
    return model.encode_prompt(prompt, system=system)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# -- vision -------------------------------------------------------------------------------------


def build_vision_model(cache_dir: Path, vision_layers: int, log: Callable[[str], None]) -> tuple[Path, Path]:
    """A random-weight SmolVLM-256M-shaped checkpoint (12 vision layers by default, 2 text layers),
    converted to F16 GGUF by our converter; built once into cache_dir (only the GGUF files are
    kept). Returns (text, mmproj).

    Needs the source checkout's test/hf_fixtures.py and torch + transformers."""
    fixtures = ROOT / "test" / "hf_fixtures.py"
    if not fixtures.is_file():
        raise RuntimeError(f"needs {fixtures} (a source checkout) to build a random SmolVLM")
    for mod in ("torch", "transformers"):
        if importlib.util.find_spec(mod) is None:
            raise RuntimeError(f"needs {mod} to build a random SmolVLM (requirements-test.txt)")
    name = f"smolvlm-random-t2-v{vision_layers}"
    hf_dir = cache_dir / name
    out_dir = cache_dir / f"{name}-gguf"
    text_path = out_dir / f"{name}-f16.gguf"
    mmproj_path = out_dir / f"mmproj-{name}-f16.gguf"
    marker = out_dir / ".done"
    if marker.is_file() and text_path.is_file() and mmproj_path.is_file():
        return text_path, mmproj_path
    log(f"[bench] building a random SmolVLM-256M-shaped model ({vision_layers} vision layers) in {cache_dir} "
        "(once)")
    spec = importlib.util.spec_from_file_location("_edgevlm_hf_fixtures", fixtures)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot import {fixtures}")
    hf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hf)
    hf.make_random_smolvlm(hf_dir, text_layers=2, vision_layers=vision_layers)
    from .convert import convert

    text_path, mmproj_path = convert(hf_dir, out_dir, "f16", name=name)
    marker.write_text("ok\n", encoding="utf-8")
    shutil.rmtree(hf_dir, ignore_errors=True)  # the float32 checkpoint (~0.6 GB) is not needed again
    return text_path, mmproj_path


def find_mtmd_cli(explicit: str | None = None, peer_dir: Path | None = None) -> str | None:
    """llama.cpp's multimodal CLI: --mtmd-cli, $EDGEVLM_LLAMA_MTMD_CLI, the profile's peer folder
    (the robot build's, scripts/install_bench_extra.sh --robot --with-mtmd), the venv, or $PATH."""
    candidates = [explicit, os.environ.get("EDGEVLM_LLAMA_MTMD_CLI"),
                  str(peer_dir / "llama-mtmd-cli") if peer_dir else None,
                  str(Path(sys.executable).parent / "llama-mtmd-cli"), shutil.which("llama-mtmd-cli")]
    for c in candidates:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return c
    return None


# llama-mtmd-cli prints one line per encoded image chunk; the wording changed between versions.
_SLICE_RE = re.compile(r"(?:slice encoded in|batch encoding done in)\s+(\d+(?:\.\d+)?)\s*ms")


def peer_mmproj(mmproj: Path, tile: int) -> Path:
    """A copy of mmproj for llama.cpp whose clip.vision.preproc_image_size is one tile.

    llama.cpp preprocesses idefics3 images llava-uhd style to that longest edge (SmolVLM's 2048):
    a 512x512 frame would become a 4x4 grid of tiles plus a global view, 17 encodes. With one
    tile it encodes the frame (and its global view) like our single-tile mode. The u32 value is
    patched in place in the copy; nothing else changes."""
    out = mmproj.with_name(mmproj.stem + f"-llamacpp-{tile}.gguf")
    if out.is_file() and out.stat().st_mtime >= mmproj.stat().st_mtime:
        return out
    data = bytearray(mmproj.read_bytes())
    key = b"clip.vision.preproc_image_size"
    at = data.find(key)
    if at < 8 or int.from_bytes(data[at - 8:at], "little") != len(key):
        raise ValueError(f"{mmproj.name} has no clip.vision.preproc_image_size to patch")
    vtype = int.from_bytes(data[at + len(key):at + len(key) + 4], "little")
    if vtype != 4:  # GGUF_TYPE_UINT32
        raise ValueError(f"{mmproj.name}: clip.vision.preproc_image_size is not a u32 (type {vtype})")
    value_at = at + len(key) + 4
    data[value_at:value_at + 4] = int(tile).to_bytes(4, "little")
    tmp = out.with_suffix(".part")
    tmp.write_bytes(bytes(data))
    os.replace(tmp, out)
    return out


def _peer_vision_once(cli: str, text: Path, mmproj: Path, image: Path, threads: int) -> tuple[list[float], str]:
    """Runs llama-mtmd-cli once; returns the encode times of every image slice it printed."""
    cmd = [cli, "-m", str(text), "--mmproj", str(mmproj), "--image", str(image), "-p", "Describe.", "-n", "1",
           "-t", str(threads), "--temp", "0", "-c", "2048"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    out = proc.stdout + proc.stderr
    times = [float(m) for m in _SLICE_RE.findall(out)]
    if proc.returncode != 0 or not times:
        tail = " | ".join(out.strip().splitlines()[-3:])
        return [], f"llama-mtmd-cli exited {proc.returncode} with no encode time ({tail})"
    return times, ""


# -- peak RSS (one child process per engine) ----------------------------------------------------

CHILD = [sys.executable, "-m", "edgevlm_ros.tools.bench_child"]  # see bench_child.py


def _child_env(extra_paths: Sequence[str]) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(ROOT), *extra_paths]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def _peak_rss(cfg: dict[str, Any], extra_paths: Sequence[str]) -> tuple[float | None, float | None, str]:
    """(peak RSS MiB, RSS MiB before the engine was loaded, error) of a child process that loads
    one engine (cfg["engine"]), prefills and decodes."""
    try:
        proc = subprocess.run([*CHILD, "rss", json.dumps(cfg)], capture_output=True, text=True,
                              timeout=600, env=_child_env(extra_paths), check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, None, str(exc)
    for line in reversed(proc.stdout.strip().splitlines()):
        try:
            d = json.loads(line)
            return d["peak_kib"] / 1024.0, d["base_kib"] / 1024.0, ""
        except (ValueError, KeyError, TypeError):
            continue
    tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-2:])
    return None, None, f"child exited {proc.returncode}: {tail}"


def _peer_extra_bufts(cfg: BenchConfig, peer_mod: ModuleType) -> tuple[bool, str]:
    """Whether llama.cpp runs with its extra buffer types (weight repacking, AMX). 'auto' tries them
    in a child process first: on some machines (this KVM guest with AMX) they crash."""
    if cfg.peer_extra_bufts in ("on", "off"):
        return cfg.peer_extra_bufts == "on", "--peer-extra-bufts " + cfg.peer_extra_bufts
    paths = [str(Path(peer_mod.__file__ or "").resolve().parent.parent)]
    try:
        proc = subprocess.run([*CHILD, "probe", str(cfg.model), str(cfg.threads)], capture_output=True,
                              text=True, timeout=300, env=_child_env(paths), check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"probe failed ({exc})"
    if proc.returncode == 0 and "ok" in proc.stdout:
        return True, "llama.cpp default"
    if proc.returncode < 0:
        return False, f"with them llama.cpp crashed here (signal {-proc.returncode})"
    return False, f"with them llama.cpp failed here (exit {proc.returncode})"


# -- the run ------------------------------------------------------------------------------------


def run(cfg: BenchConfig) -> dict[str, Any]:
    """Runs every measure; returns the raw results (what --json writes)."""
    from .. import __version__, _engine

    log = cfg.log
    t_start = time.perf_counter()
    result: dict[str, Any] = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_info(),
        "model": str(cfg.model),
        "threads": cfg.threads,
        "repeats": cfg.repeats,
        "edgevlm_version": __version__,
        "optable": None,
        "load_average_start": _loadavg(),
    }
    result["profile"] = apply_profile(cfg)
    peer_mod: ModuleType | None = None
    if cfg.peer:
        result["peer_omp_wait_policy"] = _peer_omp_policy(cfg)
        peer_mod, peer_status = import_peer()
        if result["profile"].get("peer_lib_note"):
            peer_status += f" ({result['profile']['peer_lib_note']})"
    else:
        peer_status = "not run (--no-peer)"
    result["peer_status"] = peer_status
    if peer_mod is not None:
        try:
            result["peer_system_info"] = peer_mod.llama_print_system_info().decode("utf-8", "replace").strip()
        except Exception:  # noqa: BLE001 - informational only
            result["peer_system_info"] = None
        result["peer_libraries"] = loaded_llama_libraries()
    rows: list[Row] = []

    log(f"[bench] loading {cfg.model.name} in our engine ({cfg.threads} threads)")
    ours = _Ours(cfg.model, cfg.threads, cfg.n_ctx)
    result["optable"] = _engine.optable_source()
    result["ours_variants"] = ours.native.variants()
    peer: LlamaPeer | None = None
    extra_bufts = False
    if peer_mod is not None:
        extra_bufts, why = _peer_extra_bufts(cfg, peer_mod)
        result["peer_extra_bufts"] = {"on": extra_bufts, "why": why}
        log(f"[bench] loading the same file in llama.cpp (extra buffer types {'on' if extra_bufts else 'off'}: {why})")
        try:
            peer = LlamaPeer(peer_mod, cfg.model, cfg.threads, cfg.n_ctx, cfg.peer_flash_attn, extra_bufts)
        except Exception as exc:  # noqa: BLE001 - any failure of the optional peer is reported, not fatal
            peer_status = f"llama.cpp failed to load the model: {exc}"
            result["peer_status"] = peer_status
            peer = None
    result["peer_flash_attn"] = cfg.peer_flash_attn if peer else None

    # Warm-up (page in the weights, start thread pools), not timed.
    warm = _prefill_ids(ours.model, 16)
    ours.prefill(warm)
    ours.decode(warm, 2)
    if peer:
        peer.prefill(warm)
        peer.decode(warm, 2)

    # Prefill.
    max_p = max(cfg.prefill_tokens)
    if max_p + 1 > cfg.n_ctx:
        raise ValueError(f"prefill of {max_p} tokens does not fit n_ctx {cfg.n_ctx}")
    long_ids = _prefill_ids(ours.model, max_p)
    for n in cfg.prefill_tokens:
        log(f"[bench] prefill {n} tokens x{cfg.repeats}")
        ids = long_ids[:n]
        a, b = _alternate(cfg.repeats, lambda ids=ids: ours.prefill(ids),
                          (lambda ids=ids: peer.prefill(ids)) if peer else None)
        row = Row(f"prefill_{n}", f"prefill {n} tokens", "tokens/s", True,
                  _median([n / s for s in a]), _median([n / s for s in b]) if b else None)
        row.samples = {"ours_s": a, "peer_s": b}
        rows.append(row)

    # Decode.
    prompt = _chat_ids(ours.model, DECODE_PROMPT)
    nd = cfg.decode_tokens
    log(f"[bench] decode {nd} tokens x{cfg.repeats}")
    ours_tokens: list[int] = []
    peer_tokens: list[int] = []

    def ours_decode() -> float:
        nonlocal ours_tokens
        s, ours_tokens = ours.decode(prompt, nd)
        return s

    def peer_decode() -> float:
        nonlocal peer_tokens
        assert peer is not None
        s, peer_tokens = peer.decode(prompt, nd)
        return s

    # The read bandwidth right before and right after the decode runs (and once more with the
    # roofline below): the host's other load moves it by a quarter within a minute, and the floor
    # uses the highest seen, so a quiet moment for the decode cannot look faster than memory.
    # Two buffers each time: one the size of the bytes a token reads, one of --bandwidth-mib.
    wb = weight_bytes_per_token(cfg.model, ours.native.state_shape["recurrent"])
    model_mib = wb["total"] / (1 << 20)
    bw_runs: list[dict[str, float]] = []
    bw_model_runs: list[dict[str, float]] = []

    def measure_both(when: str) -> None:
        log(f"[bench] memory read bandwidth {when} (numpy sum over {model_mib:.0f} MiB and {cfg.bandwidth_mib} MiB)")
        bw_model_runs.append(measure_bandwidth(model_mib, cfg.threads))
        bw_runs.append(measure_bandwidth(cfg.bandwidth_mib, cfg.threads))

    measure_both("before decode")
    a, b = _alternate(cfg.repeats, ours_decode, peer_decode if peer else None)
    measure_both("after decode")
    decode_row = Row(f"decode_{nd}", f"decode {nd} tokens", "tokens/s", True,
                     _median([nd / s for s in a]), _median([nd / s for s in b]) if b else None)
    decode_row.samples = {"ours_s": a, "peer_s": b}
    if peer:
        same = _common_prefix(ours_tokens, peer_tokens)
        decode_row.note = f"greedy tokens identical for the first {same} of {len(ours_tokens)}"
        result["greedy_agreement"] = {"identical_prefix": same, "n": len(ours_tokens)}
    rows.append(decode_row)

    # Time to first token with a system prompt, without and with the prefix cache.
    ids = _chat_ids(ours.model, USER_PROMPT, SYSTEM_PROMPT)
    alt = _chat_ids(ours.model, USER_PROMPT_ALT, SYSTEM_PROMPT)
    n_pre = _common_prefix(ids, alt)
    n_pre = min(n_pre, len(ids) - 1)
    log(f"[bench] time to first token: {len(ids)} prompt tokens, {n_pre} of them the cached system prompt")
    a, b = _alternate(cfg.repeats, lambda: ours.ttft(ids), (lambda: peer.ttft(ids)) if peer else None)
    row = Row("ttft_nocache", f"first token, no prefix cache ({len(ids)} tok)", "ms", False,
              _median([s * 1e3 for s in a]), _median([s * 1e3 for s in b]) if b else None)
    row.samples = {"ours_s": a, "peer_s": b}
    rows.append(row)
    ours_prefix = ours.make_prefix(ids[:n_pre])
    peer_prefix = peer.make_prefix(ids[:n_pre]) if peer else 0
    a, b = _alternate(cfg.repeats, lambda: ours.ttft_cached(ours_prefix, ids),
                      (lambda: peer.ttft_cached(peer_prefix, ids)) if peer else None)
    row = Row("ttft_cache", f"first token, prefix cache ({len(ids) - n_pre} new)", "ms", False,
              _median([s * 1e3 for s in a]), _median([s * 1e3 for s in b]) if b else None)
    row.samples = {"ours_s": a, "peer_s": b}
    row.note = "ours: KV snapshot restored; llama.cpp: " + (
        "the prefix's sequence state restored (llama_state_seq_set_data: a recurrent state cannot be cut back)"
        if peer is not None and peer.recurrent else "system prompt KV kept in its context")
    rows.append(row)
    result["ttft"] = {"prompt_tokens": len(ids), "prefix_tokens": n_pre}

    if peer:
        peer.close()
        peer = None

    # Vision encode.
    rows.extend(_vision_rows(cfg, result))

    # Peak RSS: a child process per engine (load, prefill, decode).
    rss_row = Row("peak_rss", "peak RSS (load + prefill + decode)", "MiB", False)
    if cfg.rss:
        log("[bench] peak RSS (one child process per engine)")
        child = {"model": str(cfg.model), "threads": cfg.threads, "n_ctx": cfg.n_ctx, "ids": long_ids,
                 "decode": nd, "flash_attn": cfg.peer_flash_attn, "extra_bufts": extra_bufts, "engine": "ours"}
        rss_ours, base_ours, err = _peak_rss(child, [])
        rss_row.ours = rss_ours
        notes = [f"ours: {err}"] if err else []
        rss_peer = base_peer = None
        if peer_mod is not None:
            peer_paths = [str(Path(peer_mod.__file__ or "").resolve().parent.parent)]
            rss_peer, base_peer, err = _peak_rss({**child, "engine": "peer"}, peer_paths)
            rss_row.peer = rss_peer
            if err:
                notes.append(f"llama.cpp: {err}")
        if base_ours is not None:
            notes.append(f"Python + numpy before loading {base_ours:.0f} MiB (VmHWM of a child process per engine)")
        rss_row.note = "; ".join(notes)
        result["rss_mib"] = {"ours": rss_ours, "ours_start": base_ours, "peer": rss_peer, "peer_start": base_peer}
    else:
        rss_row.note = "not measured (--no-rss)"
    rows.append(rss_row)

    # Decode roofline.
    measure_both("at the end")
    bw = highest_bandwidth(bw_runs)
    bw_model = highest_bandwidth(bw_model_runs)
    floors = bandwidth_floors(wb["total"], bw_model, bw)
    floor_ms = floors["floor_ms"]  # the binding one
    ours_ms = 1e3 / decode_row.ours if decode_row.ours else None
    peer_ms = 1e3 / decode_row.peer if decode_row.peer else None
    rows.append(Row("decode_ms", "decode time per token", "ms", False, ours_ms, peer_ms,
                    note=f"floor {floor_ms:.2f} ms ({_FLOOR_NAMES[floors['binds']]}, the lower one)"))
    rows.append(Row("decode_bound", "decode: bandwidth floor / time", "%", True,
                    floor_ms / ours_ms * 100 if ours_ms else None, floor_ms / peer_ms * 100 if peer_ms else None))
    result["roofline"] = {"weight_bytes_per_token": wb, "bandwidth": bw, "bandwidth_model_sized": bw_model,
                          "floors": floors, "floor_ms": floor_ms,
                          "ours_ms": ours_ms, "peer_ms": peer_ms}
    result["rows"] = [r.as_dict() for r in rows]
    result["bench_process_peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    result["wall_s"] = time.perf_counter() - t_start
    result["load_average_end"] = _loadavg()
    return result


MINICPMV = "minicpmv4_6"


def _vision_rows(cfg: BenchConfig, result: dict[str, Any]) -> list[Row]:
    """The vision encode of one tile (SmolVLM: a square tile through encode(); MiniCPM-V 4.6: one
    448 slice through encode_slice()), ours and llama-mtmd-cli's; for MiniCPM-V also the share of
    the GEMM peak the encode reaches (flops counted from the mmproj: tools/vision_cost.py)."""
    from .. import _engine

    row = Row("vision_encode", "vision encode, one 512x512 tile", "ms", False)
    if not cfg.vision:
        row.note = "not run (--no-vision)"
        return [row]
    log = cfg.log
    try:
        if cfg.mmproj is not None:
            mmproj, text = cfg.mmproj, cfg.model  # llama.cpp runs it with --model as its text half
        else:
            text, mmproj = build_vision_model(cfg.cache_dir, cfg.vision_layers, log)
    except (RuntimeError, ValueError, OSError, ImportError) as exc:
        row.note = f"skipped: {exc}"
        return [row]
    vis = _engine.VisionModel(_engine.GGUFFile(str(mmproj)), threads=cfg.threads, int8=cfg.vision_int8)
    vcfg = vis.config
    size = int(vcfg["image_size"])
    slices = vcfg["projector"] == MINICPMV
    row.label = f"vision encode, one {size}x{size} {'slice' if slices else 'tile'}"
    if cfg.vision_int8:
        row.label += " (ours: vision_int8)"
    rng = np.random.default_rng(0)
    pixels = rng.uniform(-1.0, 1.0, (3, size, size) if slices else (1, 3, size, size)).astype(np.float32)
    encode = vis.encode_slice if slices else vis.encode

    def ours_once() -> float:
        t0 = time.perf_counter()
        encode(pixels)
        return (time.perf_counter() - t0) * 1e3

    profile_dir = peer_dir(cfg)
    cli = find_mtmd_cli(cfg.mtmd_cli, profile_dir) if cfg.peer else None
    peer_samples: list[float] = []
    peer_note = ""
    cli_note = ""
    if cli is not None and profile_dir is not None and Path(cli).parent != profile_dir:
        cli_note = (
            f"llama.cpp: llama-mtmd-cli {cli} is not the {cfg.profile} profile's build (none in {profile_dir}: "
            "scripts/install_bench_extra.sh --robot --with-mtmd builds one): its vision runs with every "
            "instruction set this CPU has")
    image_path: Path | None = None
    if cfg.peer and cli is None:
        peer_note = "llama.cpp: no llama-mtmd-cli binary found (scripts/install_bench_extra.sh --with-mtmd builds one)"
    peer_proj = mmproj
    if cli is not None and not slices:  # MiniCPM-V's 448x448 frame is one view as it is: no copy needed
        try:
            peer_proj = peer_mmproj(mmproj, size)
        except (ValueError, OSError) as exc:
            peer_note = f"llama.cpp: {exc}"
            cli = None
    if cli is not None:
        image_path = _random_image(size, size, rng)

    def peer_once() -> float:
        nonlocal peer_note
        assert cli is not None and image_path is not None
        times, err = _peer_vision_once(cli, text, peer_proj, image_path, cfg.threads)
        if err:
            peer_note = err
            return float("nan")
        peer_samples.extend(times)
        return float(statistics.median(times))

    peak = _EncodePeak(cfg, mmproj, vcfg) if slices else None
    if peak is not None:
        peak.measure("before the encode")
    log(f"[bench] vision encode ({vcfg['n_layer']} layers, {size}x{size}) x{cfg.repeats}"
        + (f", llama.cpp via {cli}" if cli else ""))
    # No warm-up run: one encode costs seconds, and paging in the weights is a small part of it.
    a, b = _alternate(cfg.repeats, ours_once, peer_once if cli else None)
    row.ours = _median(a)
    good = [x for x in b if x == x]
    row.peer = _median(good) if good else None
    row.samples = {"ours_ms": a, "peer_ms": b, "peer_slices_ms": peer_samples}
    notes = [f"{vcfg['n_layer']} layers, width {vcfg['n_embd']}, random weights; ours: {vis.variants()}"]
    if cli_note:
        notes.append(cli_note)
    if peer_note:
        notes.append(peer_note)
    elif cli and slices:
        notes.append("llama.cpp: 'mtmd batch encoding done' of llama-mtmd-cli on a 448x448 image (its source "
                     "view, no slices: one 448 slice)")
    elif cli:
        notes.append("llama.cpp: median time per encoded tile printed by llama-mtmd-cli (its mmproj copy has "
                     "preproc_image_size = one tile, so a frame is one tile + llama.cpp's global view)")
    row.note = "; ".join(notes)
    result["vision"] = {"mmproj": str(mmproj), "config": dict(vcfg), "peer_cli": cli, "variants": vis.variants()}
    if image_path is not None:
        shutil.rmtree(image_path.parent, ignore_errors=True)
    if peak is None:
        return [row]
    peak.measure("after the encode")
    return [row, peak.row(row, result), _frame_ttft_row(cfg, result, text, mmproj, cli)]


def _random_image(width: int, height: int, rng: np.random.Generator) -> Path:
    """A random RGB PNG in a fresh temporary folder (the caller removes the folder)."""
    import cv2

    path = Path(tempfile.mkdtemp(prefix="edgevlm-bench-")) / f"frame-{width}x{height}.png"
    cv2.imwrite(str(path), rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    return path


class _EncodePeak:
    """The FP32 GEMM peak (in the active profile) measured right before and right after the encode
    runs, the higher kept (the host's other load moves it as it moves the bandwidth), and the row:
    flops of one 448 slice / encode time / that peak."""

    def __init__(self, cfg: BenchConfig, mmproj: Path, vcfg: Mapping[str, Any]) -> None:
        from .. import _engine

        self.cfg = cfg
        self.side = int(vcfg["image_size"]) // int(vcfg["patch_size"])
        shape = vision_cost.MiniCPMVShape.from_mmproj(mmproj, vcfg)
        self.flops = vision_cost.minicpmv_slice_flops(shape, self.side, self.side)
        tensors = _engine.GGUFFile(str(mmproj)).tensors()
        self.formats = ["F32", next(t["type"] for t in tensors if t["name"] == "v.blk.0.attn_q.weight")]
        self.runs: list[dict[str, Any]] = []

    def measure(self, when: str) -> None:
        shape = self.cfg.peak_shape
        kind = "int8" if self.cfg.vision_int8 else "FP32"
        self.cfg.log(f"[bench] {kind} GEMM peak {when} ({'x'.join(map(str, shape))}, "
                     f"{' and '.join(dict.fromkeys(self.formats))} weights)")
        self.runs.append(vision_cost.measure_gemm_peak(self.formats, self.cfg.threads, shape,
                                                       self.cfg.repeats, int8=self.cfg.vision_int8))

    def row(self, encode: Row, result: dict[str, Any]) -> Row:
        peak = max(self.runs, key=lambda r: r["gflops"])
        result["vision"]["flops"] = self.flops
        result["vision"]["gemm_peak"] = {**peak, "all_runs_gflops": [r["gflops"] for r in self.runs]}
        total = self.flops["total"]
        seen = "/".join(f"{r['gflops']:.0f}" for r in self.runs)

        def share(ms: float | None) -> float | None:
            return total / (ms / 1e3) / (peak["gflops"] * 1e9) * 100 if ms else None

        kind = "int8 GEMM (vision_int8)" if self.cfg.vision_int8 else "FP32 GEMM"
        row = Row("vision_encode_peak", f"vision encode: FLOP/s / {kind} peak", "%", True,
                  share(encode.ours), share(encode.peer))
        row.note = (f"{total / 1e9:.1f} GFLOP per {self.side}x{self.side}-patch slice (attention "
                    f"{self.flops['attention'] / 1e9:.1f}; docs/kernels/vision-flops.md); peak "
                    f"{peak['gflops']:.0f} GFLOP/s: {peak['variant']} on {peak['format']} weights, "
                    f"{'x'.join(map(str, peak['shape']))}, {self.cfg.threads} threads (the higher of "
                    f"{seen}, before and after the encode)")
        return row


FRAME = (640, 480)  # width x height: a camera frame (MiniCPM-V 4.6: its source view + a 1x2 grid of slices)


def _frame_ttft_row(cfg: BenchConfig, result: dict[str, Any], text: Path, mmproj: Path, cli: str | None) -> Row:
    """Time to first token of one 640x480 frame, tiled (source view + slices), no prefix cache: ours
    through load_vlm(...).describe(max_new_tokens=1) (preprocess + vision + prefill), llama.cpp's
    llama-mtmd-cli on the same pair and the same frame as a PNG (-n 0: from loading the image to the
    prompt's last logits, parse_mtmd_log)."""
    from ..engine.vlm import DEFAULT_PROMPT, load_vlm

    width, height = FRAME
    row = Row("frame_ttft", f"first token, {width}x{height} frame (tiled, no prefix cache)", "ms", False)
    try:
        vlm = load_vlm(text, mmproj, threads=cfg.threads, image_mode="tiled", prefix_cache=False,
                       vision_int8=cfg.vision_int8)
    except (ValueError, OSError) as exc:
        row.note = f"skipped: {exc}"
        return row
    rgb = np.random.default_rng(1).integers(0, 256, (height, width, 3), dtype=np.uint8)
    image_path: Path | None = None
    if cli is not None:
        import cv2

        image_path = Path(tempfile.mkdtemp(prefix="edgevlm-bench-")) / f"frame-{width}x{height}.png"
        cv2.imwrite(str(image_path), rgb[:, :, ::-1])  # the same pixels (OpenCV writes BGR)
    ours_stages: list[dict[str, float]] = []
    peer_runs: list[dict[str, Any]] = []
    peer_err = ""

    def ours_once() -> float:
        r = vlm.describe(rgb, DEFAULT_PROMPT, max_new_tokens=1)
        ours_stages.append(dict(r.timings_ms, n_prompt=len(r.prompt_token_ids), n_image=r.extra["n_image_tokens"],
                                views=r.extra["tiles"]))
        return float(r.timings_ms["total"])

    def peer_once() -> float:
        nonlocal peer_err
        assert cli is not None and image_path is not None
        cmd = [cli, "-m", str(text), "--mmproj", str(mmproj), "--image", str(image_path), "-p", DEFAULT_PROMPT,
               "-n", "0", "-t", str(cfg.threads), "--temp", "0", "-c", "4096", "-lv", "4"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
        parsed = parse_mtmd_log(proc.stdout + proc.stderr)
        if proc.returncode != 0 or parsed is None:
            tail = " | ".join((proc.stdout + proc.stderr).strip().splitlines()[-3:])
            peer_err = f"llama-mtmd-cli exited {proc.returncode} without its timings ({tail})"
            return float("nan")
        peer_runs.append(parsed)
        return float(parsed["ttft_ms"])

    cfg.log(f"[bench] first token of a {width}x{height} frame (tiled) x{cfg.repeats}"
            + (f", llama.cpp via {cli}" if cli else ""))
    a, b = _alternate(cfg.repeats, ours_once, peer_once if cli else None)
    good = [x for x in b if x == x]
    row.ours, row.peer = _median(a), _median(good) if good else None
    row.samples = {"ours_ms": a, "peer_ms": b}
    last = ours_stages[-1]
    notes = [f"ours: {last['views']} views, {last['n_image']} image tokens of {last['n_prompt']}; median preprocess "
             f"{_median([st['preprocess'] for st in ours_stages]):.0f} ms, vision "
             f"{_median([st['vision'] for st in ours_stages]):.0f} ms, prefill "
             f"{_median([st['prefill'] for st in ours_stages]):.0f} ms"]
    if peer_runs:
        notes.append(f"llama.cpp: {len(peer_runs[-1]['encode_ms'])} views, {peer_runs[-1]['image_tokens']} image "
                     f"tokens; median vision {_median([sum(r['encode_ms']) for r in peer_runs]):.0f} ms, image-token "
                     f"prefill {_median([sum(r['image_decode_ms']) for r in peer_runs]):.0f} ms (the rest: PNG "
                     "decode, its preprocessing, the text chunks)")
    if peer_err:
        notes.append(peer_err)
    row.note = "; ".join(notes)
    result["frame_ttft"] = {"size": list(FRAME), "ours_stages_ms": ours_stages, "peer": peer_runs}
    if image_path is not None:
        shutil.rmtree(image_path.parent, ignore_errors=True)
    return row


# llama.cpp's log lines at -lv 4: "M.SS.mmm.uuu L text" (minutes, seconds, milliseconds, microseconds since start).
_STAMP_RE = re.compile(r"^(\d+)\.(\d{2})\.(\d{3})\.(\d{3}) [A-Z] (.*)$")
_ENCODE_RE = re.compile(r"mtmd batch encoding done in (\d+) ms")
_IMAGE_DECODE_RE = re.compile(r"image decoded \(batch \d+/\d+\) in (\d+) ms")
_IMAGE_BATCH_RE = re.compile(r"decoding image batch \d+/\d+, n_tokens_batch = (\d+)")


def parse_mtmd_log(log: str) -> dict[str, Any] | None:
    """llama-mtmd-cli's timings from its -lv 4 log (None if they are not all there): ttft_ms from its
    last line before the single turn (the experimental-CLI warning, printed before the image is
    loaded) to its perf report (printed once the prompt's last logits are there, with -n 0); the
    encode time of each image batch; the prefill time of each image-token batch; the image tokens."""
    start = end = None
    encode: list[float] = []
    decode: list[float] = []
    image_tokens = 0
    for line in log.splitlines():
        m = _STAMP_RE.match(line)
        if not m:
            continue
        t = int(m[1]) * 60e3 + int(m[2]) * 1e3 + int(m[3]) + int(m[4]) / 1e3
        msg = m[5]
        if "please use the standard llama-cli" in msg:
            start = t
        elif "llama_perf_context_print:" in msg and "load time" in msg and end is None:
            end = t
        elif e := _ENCODE_RE.search(msg):
            encode.append(float(e[1]))
        elif d := _IMAGE_DECODE_RE.search(msg):
            decode.append(float(d[1]))
        elif n := _IMAGE_BATCH_RE.search(msg):
            image_tokens += int(n[1])
    if start is None or end is None or not encode or end < start:
        return None
    return {"ttft_ms": end - start, "encode_ms": encode, "image_decode_ms": decode, "image_tokens": image_tokens}


# -- output -------------------------------------------------------------------------------------


def _fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "%":
        return f"{v:.0f}%"
    if v >= 100:
        return f"{v:.0f}"
    if v >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}"


_FLOOR_NAMES = {"model_sized": "model-sized buffer", "dram": "DRAM buffer"}


def _floor_lines(rf: dict[str, Any]) -> list[str]:
    """Both bandwidth floors, each against both decode times, and which one binds."""
    fl = rf["floors"]
    lines = []
    for key in ("model_sized", "dram"):
        f = fl[key]
        shares = [f"{who} {f['floor_ms'] / rf[k] * 100:.0f}%"
                  for who, k in (("ours", "ours_ms"), ("llama.cpp", "peer_ms")) if rf.get(k)]
        lines.append(f"floor ({_FLOOR_NAMES[key]}, {f['mib']:.0f} MiB): {f['gbs']:.1f} GB/s -> "
                     f"{f['floor_ms']:.2f} ms/token" + (f"; decode at {', '.join(shares)} of it" if shares else ""))
    other = "dram" if fl["binds"] == "model_sized" else "model_sized"
    lines.append(f"the {_FLOOR_NAMES[fl['binds']]} floor binds (higher bandwidth, lower floor: "
                 f"{fl[fl['binds']]['floor_ms']:.2f} vs {fl[other]['floor_ms']:.2f} ms/token)")
    return lines


def format_table(result: dict[str, Any]) -> str:
    """The human-readable report: a markdown table plus the roofline and notes."""
    m = result["machine"]
    lines = [
        f"edgevlm bench - {result['date']} - {m['cpu']} ({m['cores']} cores, {m['arch']}) - "
        f"{result['threads']} threads, median of {result['repeats']}"
        + (f", profile {result['profile']['name']}" if result.get("profile") else ""),
        f"model: {Path(result['model']).name}; peer: {result['peer_status']}",
        "",
        "| measure | unit | ours | llama.cpp | ours/llama.cpp | better |",
        "|---|---|---:|---:|---:|---|",
    ]
    for r in result["rows"]:
        ratio = r["ratio_ours_over_peer"]
        lines.append(f"| {r['label']} | {r['unit']} | {_fmt(r['ours'], r['unit'])} | {_fmt(r['peer'], r['unit'])} | "
                     f"{'-' if ratio is None else f'{ratio:.2f}'} | {r['better']} |")
    rf = result["roofline"]
    wb, bw = rf["weight_bytes_per_token"], rf["bandwidth"]
    dram_floor = rf["floors"]["dram"]["floor_ms"] if rf.get("floors") else rf["floor_ms"]
    rec = wb.get("recurrent_state", 0)
    state = f", recurrent state read + written {rec / 1e6:.1f} MB" if rec else ""
    lines += [
        "",
        f"decode roofline: {wb['total'] / 1e6:.1f} MB read per token "
        f"(layers {'/'.join(wb['layer_types'])} {wb['layers'] / 1e6:.1f} MB, head {wb['head_type']} "
        f"{wb['head'] / 1e6:.1f} MB{state}); read bandwidth {bw['single_gbs']:.1f} GB/s on 1 thread, "
        f"{bw['all_gbs']:.1f} GB/s on {int(bw['threads'])} (numpy sum over {int(bw['mib'])} MiB; the highest of "
        f"{'/'.join(f'{g:.1f}' for g in bw.get('all_runs_gbs', [bw['all_gbs']]))} measured before and after the "
        f"decode runs and at the end) -> floor {dram_floor:.2f} ms/token",
    ]
    if rf.get("floors"):
        lines += _floor_lines(rf)
    vs = []
    for who, key in (("ours", "ours_ms"), ("llama.cpp", "peer_ms")):
        if rf[key]:
            share = rf["floor_ms"] / rf[key] * 100
            vs.append(f"{who} {rf[key]:.2f} ms vs {rf['floor_ms']:.2f} ms ({share:.0f}% of the bound)")
    if vs:
        lines.append("decode time vs floor: " + "; ".join(vs))
    notes = [f"{r['label']}: {r['note']}" for r in result["rows"] if r["note"]]
    if notes:
        lines += ["", "notes:"] + [f"  - {n}" for n in notes]
    lines.append(f"  - our kernels: {result.get('ours_variants')} (operator table: {result.get('optable')})")
    if result.get("peer_omp_wait_policy"):
        lines.append(f"  - llama.cpp threads: {result['peer_omp_wait_policy']}")
    if result.get("peer_extra_bufts"):
        eb = result["peer_extra_bufts"]
        lines.append(f"  - llama.cpp extra buffer types (repack/AMX): {'on' if eb['on'] else 'off'} ({eb['why']})")
    if result.get("peer_system_info"):
        lines.append(f"  - llama.cpp: {result['peer_system_info']}")
    if result.get("peer_libraries"):
        lines.append(f"  - llama.cpp libraries: {' '.join(result['peer_libraries'])}")
    lines.append(f"  - bench wall time {result['wall_s']:.0f} s; load average (1/5/15 min) at start "
                 f"{result.get('load_average_start')}, at end {result.get('load_average_end')} on {m['cores']} cores")
    return "\n".join(lines)


def write_png(result: dict[str, Any], path: Path) -> None:
    """A bar chart of speed ours / llama.cpp per measure (>1: ours faster), drawn with OpenCV."""
    import cv2

    bars = []
    for r in result["rows"]:
        ratio = r["ratio_ours_over_peer"]
        if ratio is None or r["key"] in ("decode_ms", "decode_bound", "vision_encode_peak"):
            continue
        speed = ratio if r["higher_is_better"] else 1.0 / ratio if ratio else 0.0
        bars.append((r["label"], speed))
    w, row_h, left = 900, 34, 340
    h = 70 + row_h * max(1, len(bars)) + 30
    img = np.full((h, w, 3), 255, np.uint8)
    font = cv2.FONT_HERSHEY_SIMPLEX
    m = result["machine"]
    cv2.putText(img, f"ours vs llama.cpp (>1: ours better) - {result['date']}", (10, 22), font, 0.55, (0, 0, 0), 1)
    cv2.putText(img, f"{m['cpu']}, {result['threads']} threads, {Path(result['model']).name}", (10, 44), font, 0.45,
                (60, 60, 60), 1)
    top = max((s for _, s in bars), default=1.0)
    scale = (w - left - 80) / max(top, 1.0)
    x1 = left + int(scale)
    for i, (label, s) in enumerate(bars):
        y = 60 + i * row_h
        cv2.putText(img, label[:42], (10, y + 20), font, 0.45, (0, 0, 0), 1)
        color = (80, 160, 60) if s >= 1.0 else (60, 60, 200)
        cv2.rectangle(img, (left, y + 6), (left + int(s * scale), y + row_h - 6), color, -1)
        cv2.putText(img, f"{s:.2f}x", (left + int(s * scale) + 6, y + 21), font, 0.45, (0, 0, 0), 1)
    if bars:
        cv2.line(img, (x1, 55), (x1, 60 + row_h * len(bars)), (0, 0, 0), 1)
    else:
        cv2.putText(img, "no llama.cpp numbers (peer missing)", (10, 80), font, 0.5, (0, 0, 0), 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not cv2.imwrite(str(path), img):
        raise OSError(f"cannot write {path}")


# -- command line -------------------------------------------------------------------------------


def _int_list(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a comma-separated list of integers") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"'{text}': token counts must be >= 1")
    return vals


def add_bench_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the `bench` arguments to a (sub)parser."""
    parser.add_argument("--model", help="GGUF text model (default: SmolLM2-135M-Instruct Q4_1 from models/)")
    parser.add_argument("--threads", type=positive_int, default=2, help="threads for both engines (2)")
    parser.add_argument("--repeats", type=positive_int, default=None, help="runs per measure, median reported (3)")
    parser.add_argument("--prefill-tokens", type=_int_list, default=None, help="prefill lengths (64,512)")
    parser.add_argument("--decode-tokens", type=positive_int, default=None, help="tokens decoded (128)")
    parser.add_argument("--no-peer", action="store_true", help="do not run llama.cpp")
    parser.add_argument("--peer-flash-attn", action="store_true", help="llama.cpp with flash attention on")
    parser.add_argument("--peer-omp-wait", choices=["auto", "default", "passive"], default="auto",
                        help="OMP_WAIT_POLICY for llama.cpp's OpenMP threads: auto = PASSIVE when the machine is "
                        "busy (load >= cores), else OpenMP's default")
    parser.add_argument("--peer-extra-bufts", choices=["auto", "on", "off"], default="auto",
                        help="llama.cpp's extra buffer types (repack/AMX): auto = on unless a probe crashes")
    parser.add_argument("--no-vision", action="store_true", help="skip the vision encoder")
    parser.add_argument("--vision-layers", type=positive_int, default=None,
                        help="layers of the random vision tower (12, as SmolVLM-256M)")
    parser.add_argument("--vision-int8", action="store_true",
                        help="our vision encode (and the frame's first token) on int8 products where this CPU has "
                        "an int8 kernel (the vision_int8 parameter); llama.cpp as it is")
    parser.add_argument("--mmproj", default=None,
                        help="time this mmproj instead of a random one (llama.cpp runs it with --model as its "
                        "text half)")
    parser.add_argument("--mtmd-cli", default=None, help="llama.cpp's llama-mtmd-cli (default: venv, then PATH)")
    parser.add_argument("--cache-dir", default=None, help="where the random vision model is kept "
                        "(~/.cache/edgevlm_ros/bench)")
    parser.add_argument("--bandwidth-mib", type=positive_int, default=None,
                        help="array size for the bandwidth measure (1024 MiB)")
    parser.add_argument("--no-rss", action="store_true", help="skip the peak-RSS child processes")
    parser.add_argument("--profile", choices=PROFILES, default="native",
                        help="native: every kernel this CPU runs; robot: as an x86 robot computer (AVX2 + AVX-VNNI, "
                        "no AVX-512 / AMX): our robot operator table, llama.cpp built for it "
                        "(scripts/install_bench_extra.sh --robot)")
    parser.add_argument("--optable", default=None, metavar="FILE",
                        help="our engine's operator table (e.g. config/optable-robot-avx2-vnni.tsv); overrides the "
                        "profile's")
    parser.add_argument("--peer-lib", default=None, metavar="DIR",
                        help="folder of the libllama.so llama.cpp loads (LLAMA_CPP_LIB_PATH; robot profile default: "
                        "$EDGEVLM_ROBOT_LLAMA_LIB or ~/.cache/edgevlm/llama-robot)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes for a smoke test: prefill 8,16, decode 8, 1 repeat, 1 vision layer, a "
                        "1152x1152x256 GEMM for the FP32 peak")
    parser.add_argument("--speculation", action="store_true",
                        help="instead: speculative decoding with the embedded demo VLM on a slowly changing view and "
                        "on independent frames (acceptance, decode tokens/s without and with, time per token against "
                        "the bandwidth floor)")
    parser.add_argument("--frames", type=positive_int, default=None,
                        help="--speculation: frames per stream (60; --quick: 6)")
    parser.add_argument("--question", default=None,
                        help="--speculation: the request sent with each frame (default: the node's, the one the "
                        "demo model was trained on)")
    parser.add_argument("--kv-cache", action="store_true",
                        help="instead: decode after 1k and 4k tokens of context with each KV cache type (f32, f16, "
                        "q8_0) on --model: KV bytes per position, decode ms/token, ratio to f32, time against a "
                        "floor of the weights plus the KV read")
    parser.add_argument("--kv-contexts", type=_int_list, default=None, metavar="N,N",
                        help="--kv-cache: context lengths (1024,4096; --quick: 64,128)")
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                        help="write the raw numbers as JSON to FILE (alone: JSON on stdout, the table on stderr)")
    parser.add_argument("--png", default=None, metavar="FILE", help="also draw the ratios as a PNG chart")
    return parser


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    from ..engine.paths import resolve_model

    quick = bool(getattr(args, "quick", False))

    def pick(name: str, normal: Any, fast: Any) -> Any:
        v = getattr(args, name, None)
        return v if v is not None else (fast if quick else normal)

    return BenchConfig(
        model=resolve_model(args.model),
        threads=args.threads,
        repeats=pick("repeats", 3, 1),
        prefill_tokens=tuple(pick("prefill_tokens", (64, 512), (8, 16))),
        decode_tokens=pick("decode_tokens", 128, 8),
        peer=not args.no_peer,
        peer_flash_attn=bool(args.peer_flash_attn),
        peer_extra_bufts=args.peer_extra_bufts,
        peer_omp_wait=args.peer_omp_wait,
        vision=not args.no_vision,
        vision_layers=pick("vision_layers", 12, 1),
        vision_int8=bool(getattr(args, "vision_int8", False)),
        mmproj=Path(args.mmproj) if args.mmproj else None,
        cache_dir=Path(args.cache_dir) if args.cache_dir else default_cache_dir(),
        bandwidth_mib=pick("bandwidth_mib", 1024, 32),
        profile=args.profile,
        optable=Path(args.optable) if args.optable else None,
        peer_lib=Path(args.peer_lib) if args.peer_lib else None,
        rss=not args.no_rss,
        mtmd_cli=args.mtmd_cli,
        peak_shape=vision_cost.QUICK_PEAK_SHAPE if quick else vision_cost.PEAK_SHAPE,
    )


def run_bench(args: argparse.Namespace) -> int:
    """Runs a parsed `bench` command: prints the table (and JSON / PNG when asked). Returns 0."""
    if getattr(args, "speculation", False):
        from .bench_speculation import format_speculation, run_speculation

        frames = args.frames or (6 if args.quick else 60)
        result = run_speculation(frames, args.threads, log=lambda s: print(s, file=sys.stderr, flush=True),
                                 prompt=args.question)
        table = format_speculation(result)
    elif getattr(args, "kv_cache", False):
        from ..engine.paths import resolve_model
        from .bench_kv import format_kv, run_kv

        contexts = args.kv_contexts or ((64, 128) if args.quick else (1024, 4096))
        result = run_kv(resolve_model(args.model), contexts, args.threads, n_decode=args.decode_tokens or
                        (8 if args.quick else 64), repeats=args.repeats or (1 if args.quick else 2),
                        log=lambda s: print(s, file=sys.stderr, flush=True), peer=not args.no_peer)
        table = format_kv(result)
    else:
        result = run(config_from_args(args))
        table = format_table(result)
    if args.json == "-":
        print(table, file=sys.stderr)
        print(json.dumps(result, indent=1))
    else:
        print(table)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
            print(f"raw numbers: {args.json}")
    if args.png and not getattr(args, "speculation", False) and not getattr(args, "kv_cache", False):
        write_png(result, Path(args.png))
        print(f"chart: {args.png}", file=sys.stderr if args.json == "-" else sys.stdout)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m edgevlm_ros.tools.bench`: the same as `edgevlm bench`."""
    return command_main("edgevlm bench", add_bench_arguments, run_bench, argv)


if __name__ == "__main__":
    sys.exit(main())
