"""`edgevlm bench --kv-cache`: what the KV cache's element type costs and saves (issue 19).

For each context length (1k and 4k tokens by default) and each `kv_type` (f32, f16, q8_0) the text
model prefills that many tokens, then decodes greedily one token at a time; reported per row: the
KV cache's bytes per position and at the context, decode ms per token (best of the repeats, the
kv types alternated in each repeat so that the host's load falls on all of them alike), its ratio
to f32's at the same context, and the time against a bandwidth floor that counts what a decoded
token reads: the weights plus every cached key and value (all layers over the whole context: an
upper bound for sliding-window layers, which read only their window). Where llama-cpp-python is
installed, llama.cpp decodes the same ids with the same cache type (its `type_k` / `type_v`, flash
attention on: llama.cpp reads a quantized V cache only there), alternated with ours, and each row
gives its ms per token and ours over it. Speed is a ratio from the same run, never an assertion:
these machines are shared.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..engine.kv_types import KV_TYPES
from ..engine.text_model import TextModel
from .hw_limits import highest_bandwidth, machine_info, measure_bandwidth, weight_bytes_per_token
from .llama_peer import LlamaPeer, import_peer

__all__ = ["format_kv", "run_kv"]


def _decode_ms(model: TextModel, ids: np.ndarray, n_decode: int) -> float:
    """Prefill ids, then n_decode greedy one-token steps: ms per step (the decode kernels, m = 1)."""
    native = model.native
    native.reset()
    logits = native.forward(ids)
    tok = int(np.argmax(logits))
    t0 = time.perf_counter()
    for _ in range(n_decode):
        logits = native.forward(np.asarray([tok], dtype=np.int32))
        tok = int(np.argmax(logits))
    return (time.perf_counter() - t0) * 1e3 / n_decode


def _peer_decode_ms(peer: LlamaPeer, ids: np.ndarray, n_decode: int) -> float:
    """llama.cpp: the same prefill and greedy one-token steps, ms per step."""
    return peer.decode(ids.tolist(), n_decode)[0] * 1e3 / n_decode


def run_kv(model_path: Path, contexts: Sequence[int] = (1024, 4096), threads: int = 2, n_decode: int = 64,
           repeats: int = 2, seed: int = 3, log: Callable[[str], None] = print, peer: bool = True) -> dict[str, Any]:
    weight = weight_bytes_per_token(model_path)
    bw = highest_bandwidth([measure_bandwidth(1024, threads) for _ in range(2)])  # the cache grows past L3
    n_ctx = max(contexts) + n_decode + 1
    models = {kv: TextModel(model_path, threads=threads, n_ctx=n_ctx, kv_type=kv) for kv in KV_TYPES}
    llama_cpp, peer_note = import_peer() if peer else (None, "not asked (--no-peer)")
    peers = {kv: LlamaPeer(llama_cpp, model_path, threads, n_ctx, True, True, kv_type=kv) for kv in KV_TYPES} \
        if llama_cpp is not None else {}
    n_vocab = int(models["f32"].config["n_vocab"])
    rng = np.random.default_rng(seed)
    out: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine_info(),
                           "model": model_path.name, "threads": threads, "decode_tokens": n_decode,
                           "repeats": repeats, "weight_bytes_per_token": weight["total"],
                           "dram_gbs": bw["all_gbs"], "peer": peer_note, "rows": []}
    for ctx in contexts:
        ids = rng.integers(3, min(n_vocab, 32000), ctx).astype(np.int32)  # ordinary ids, no control tokens
        best: dict[str, float] = {}
        best_peer: dict[str, float] = {}
        for r in range(repeats):  # the types, and ours and llama.cpp, in turn first
            for kv in (KV_TYPES if r % 2 == 0 else KV_TYPES[::-1]):
                runs: list[tuple[dict[str, float], Callable[[], float]]] = [
                    (best, lambda kv=kv, ids=ids: _decode_ms(models[kv], ids, n_decode))]
                if kv in peers:
                    runs.append((best_peer, lambda kv=kv, ids=ids: _peer_decode_ms(peers[kv], ids, n_decode)))
                for into, fn in (runs if r % 2 == 0 else runs[::-1]):
                    ms = fn()
                    into[kv] = min(into.get(kv, ms), ms)
        for kv in KV_TYPES:
            per_pos = int(models[kv].native.kv_bytes_per_token)
            read = weight["total"] + per_pos * ctx
            row = {"context": ctx, "kv_type": kv, "kv_bytes_per_token": per_pos, "kv_bytes_at_context": per_pos * ctx,
                   "ms_per_token": best[kv], "vs_f32": best["f32"] / best[kv],
                   "floor_ms": read / (bw["all_gbs"] * 1e9) * 1e3}
            row["vs_floor"] = row["ms_per_token"] / row["floor_ms"]
            row["peer_ms_per_token"] = best_peer.get(kv)
            row["ours_speed_vs_peer"] = best_peer[kv] / best[kv] if kv in best_peer else None
            out["rows"].append(row)
            log(format_row(row))
    for p in peers.values():
        p.close()
    return out


def format_row(r: dict[str, Any]) -> str:
    peer = "–" if r.get("peer_ms_per_token") is None else \
        f"{r['peer_ms_per_token']:.2f} | **{r['ours_speed_vs_peer']:.2f}x**"
    if r.get("peer_ms_per_token") is None:
        peer += " | –"
    return (f"| {r['context']} | {r['kv_type']} | {r['kv_bytes_per_token']:,} | "
            f"{r['kv_bytes_at_context'] / 2**20:.1f} | {r['ms_per_token']:.2f} | **{r['vs_f32']:.2f}x** | "
            f"{r['floor_ms']:.2f} ({r['vs_floor']:.2f}x) | {peer} |")


def format_kv(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [f"KV cache bench {result['date']}, {m.get('cpu', '?')}, {result['threads']} threads, {result['model']}, "
             f"{result['decode_tokens']} tokens decoded after the context, best of {result['repeats']}; weights "
             f"{result['weight_bytes_per_token'] / 1e6:.1f} MB a token, DRAM read {result['dram_gbs']:.1f} GB/s; "
             f"peer: {result.get('peer', '–')}", "",
             "| context | kv_type | KV bytes per position | KV MiB at the context | decode ms/token | speed vs f32 | "
             "floor ms/token: weights + KV read (time / floor) | llama.cpp ms/token, same cache type | "
             "ours vs llama.cpp (speed) |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [format_row(r) for r in result["rows"]]
    return "\n".join(lines)
