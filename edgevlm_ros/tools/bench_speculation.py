"""`edgevlm bench --speculation`: what drafting from a camera's last descriptions is worth (issue 19).

The embedded demo VLM describes N frames of a slowly changing view (`demo.drift`, 5 frames/s) and
N independent scenes, each frame twice in alternation: plainly, and drafting from the camera's last
three descriptions. The request is the node's default, the one the demo model was trained on
(`DEMO_PROMPT`; until 2026-12-07 the bench sent the engine's generic "Describe what you see.", which
the demo model answers in rambling second sentences no node sends it by default; `--question`).
Reported per stream: the drafts' acceptance (accepted / drafted, and the share of the decoded tokens
that came from drafts), decode tokens/s without and with speculation and their ratio (the sum of
each frame's decode time: the same tokens, checked), and the effective time per decoded token
against the bandwidth floor of the text model (its weight bytes per token over the measured read
bandwidth of a model-sized buffer, as `edgevlm bench` measures it). Speed is a ratio from the same
run, never an assertion: these machines are shared.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..demo.demo_model import DEMO_PROMPT, resolve_pair
from ..demo.drift import DriftStream
from ..demo.scenes import generate_scene
from ..engine.generation import DRAFT_HISTORY
from ..engine.vlm import load_vlm
from .hw_limits import bandwidth_floors, highest_bandwidth, machine_info, measure_bandwidth, weight_bytes_per_token

__all__ = ["format_speculation", "run_speculation"]

def run_speculation(frames: int = 60, threads: int = 2, seed: int = 42, max_new_tokens: int = 32,
                    log: Callable[[str], None] = print, prompt: str | None = None) -> dict[str, Any]:
    prompt = prompt or DEMO_PROMPT
    text, mmproj = resolve_pair(None, None)
    vlm = load_vlm(text, mmproj, threads=threads)
    weight = weight_bytes_per_token(text)
    bw = highest_bandwidth([measure_bandwidth(max(weight["total"] / 2**20, 16.0), threads) for _ in range(2)])
    dram = measure_bandwidth(1024, threads)
    floors = bandwidth_floors(weight["total"], bw, dram)
    streams = {"drift": [DriftStream(seed, fps=5.0).scene(i) for i in range(frames)],
               "independent": [generate_scene(seed, i) for i in range(frames)]}
    out: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine_info(),
                           "threads": threads, "frames": frames, "max_new_tokens": max_new_tokens, "prompt": prompt,
                           "weight_bytes_per_token": weight["total"], "floor": floors, "streams": {}}
    for name, scenes in streams.items():
        history: list[list[int]] = []
        plain_ms = spec_ms = 0.0
        decoded = passes = drafted = accepted = mismatches = 0
        for k, scene in enumerate(scenes):
            image = scene.image()
            runs = {}
            for mode in (("plain", "spec") if k % 2 == 0 else ("spec", "plain")):  # alternate the order
                drafts = history[-DRAFT_HISTORY:] if mode == "spec" else None
                runs[mode] = vlm.describe(image, prompt=prompt, max_new_tokens=max_new_tokens, drafts_from=drafts)
            plain, spec = runs["plain"], runs["spec"]
            mismatches += plain.token_ids != spec.token_ids
            plain_ms += plain.timings_ms["decode"]
            spec_ms += spec.timings_ms["decode"]
            decoded += max(len(plain.token_ids) - 1, 0)  # the first token comes from the prefill
            s = spec.extra.get("speculation", {})
            passes += s.get("passes", 0)
            drafted += s.get("drafted", 0)
            accepted += s.get("accepted", 0)
            history.append(plain.token_ids)
        row = {"decoded_tokens": decoded, "passes": passes, "drafted": drafted, "accepted": accepted,
               "acceptance": accepted / drafted if drafted else None,
               "from_drafts": accepted / decoded if decoded else None,
               "plain_tokens_per_s": decoded / (plain_ms / 1e3) if plain_ms else None,
               "spec_tokens_per_s": decoded / (spec_ms / 1e3) if spec_ms else None,
               "speedup": plain_ms / spec_ms if spec_ms else None,
               "plain_ms_per_token": plain_ms / decoded if decoded else None,
               "spec_ms_per_token": spec_ms / decoded if decoded else None,
               "text_mismatches": mismatches}
        row["spec_vs_floor"] = row["spec_ms_per_token"] / floors["floor_ms"] if row["spec_ms_per_token"] else None
        row["plain_vs_floor"] = row["plain_ms_per_token"] / floors["floor_ms"] if row["plain_ms_per_token"] else None
        out["streams"][name] = row
        log(f"{name}: {format_row(name, row)}")
    # What a verification pass of 1..8 rows cost the decoder (its running means, which size the passes).
    out["pass_ms"] = [round(float(x), 3) for x in vlm.text.native.pass_ms]
    return out


def format_row(name: str, r: dict[str, Any]) -> str:
    def f(x: float | None, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    return (f"| {name} | {r['decoded_tokens']} | {f(r['acceptance'], '.0%')} | {f(r['from_drafts'], '.0%')} | "
            f"{f(r['plain_tokens_per_s'], '.1f')} | {f(r['spec_tokens_per_s'], '.1f')} | "
            f"**{f(r['speedup'], '.2f')}x** | "
            f"{f(r['plain_ms_per_token'], '.2f')} ({f(r['plain_vs_floor'], '.2f')}x) | "
            f"{f(r['spec_ms_per_token'], '.2f')} ({f(r['spec_vs_floor'], '.2f')}x) | {r['text_mismatches']} |")


def format_speculation(result: dict[str, Any]) -> str:
    m, fl = result["machine"], result["floor"]
    lines = [f"speculation bench {result['date']}, {m.get('cpu', '?')}, {result['threads']} threads, demo VLM, "
             f"{result['frames']} frames a stream, \"{result['prompt']}\", "
             f"floor {fl['floor_ms']:.2f} ms/token "
             f"({result['weight_bytes_per_token'] / 1e6:.1f} MB at {fl[fl['binds']]['gbs']:.1f} GB/s)", "",
             "| stream | decoded tokens | drafts accepted | tokens from drafts | plain tok/s | speculative tok/s | "
             "ratio | plain ms/token (x floor) | speculative ms/token (x floor) | text mismatches |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [format_row(name, row) for name, row in result["streams"].items()]
    ms = result.get("pass_ms") or []
    if ms and ms[0] > 0:
        cost = " / ".join("-" if x <= 0 else f"{x / ms[0]:.2f}" for x in ms)
        lines += ["", f"a verification pass of 1 / 2 / ... / {len(ms)} rows, against a one-row step: {cost}"]
    return "\n".join(lines)
