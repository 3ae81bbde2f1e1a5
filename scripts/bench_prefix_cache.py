#!/usr/bin/env python3
"""Time to first token with and without the fixed-prefix KV cache, and the text both give.

    python scripts/bench_prefix_cache.py [--model M.gguf] [--mmproj P.gguf] [--image photo.jpg]
        [--runs 5] [--threads N] [--system-prompt TEXT] [--json]

The system prompt is the same for every frame, so the engine computes its KV cache once (at
load, or from a file in the prefix cache directory) and restores it per frame: only the image
and the prompt suffix are prefilled. This script loads the model three ways - building the cache,
loading the file that build wrote, and with the cache off - describes the same frame with each
(runs interleaved, so drift on a shared machine hits both alike), and prints the medians of time
to first token (preprocess + vision + prefill: the first token comes from the prefill's logits)
and of the prefill alone, their ratios, and whether every run produced the same tokens.
Exit status 0 when all texts are identical, 1 when not, 2 on a usage or load error.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

# A realistic robot system prompt: long enough (~300 tokens) that its prefill is worth caching.
DEFAULT_SYSTEM_PROMPT = (
    "You are the eyes of a mobile service robot that works in offices, warehouses and homes. "
    "You receive one camera frame at a time from a camera mounted 1.2 metres above the floor, "
    "looking forward. Describe what the robot sees so that its planner can act on it. Mention "
    "people first, with where they are (left, centre or right, near or far) and what they are "
    "doing. Then mention obstacles on the floor, open and closed doors, stairs, cables, spills, "
    "shelves, boxes, pallets, chairs, tables, screens and anything that could block a path of "
    "one metre width. Name colours and rough sizes when they help to tell objects apart. Use "
    "short plain sentences, no lists, no speculation about things you cannot see, and never "
    "invent text that is not readable in the frame. If the frame is dark, blurred, covered or "
    "empty, say so in one sentence. If a person is very close to the camera, say that first. "
    "If you see a sign, read it exactly. Numbers matter: count objects up to ten, and say "
    "'many' above that. Distances are rough: near means within two metres, far means beyond "
    "five metres, and anything between is in the middle distance. Keep the answer under forty "
    "words, because it is read aloud to the operator and logged with every frame."
)


def synthetic_frame(width: int = 640, height: int = 480) -> np.ndarray:
    """A gradient background with a few coloured shapes (deterministic)."""
    import cv2

    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    frame = np.stack([x / width * 200, y / height * 200, np.full_like(x, 90)], axis=-1).astype(np.uint8)
    cv2.circle(frame, (width // 4, height // 2), height // 6, (220, 30, 30), -1)
    cv2.rectangle(frame, (width // 2, height // 4), (width // 2 + width // 6, height // 4 + height // 5),
                  (30, 40, 220), -1)
    cv2.fillPoly(frame, [np.array([[3 * width // 4, height // 3], [7 * width // 8, 2 * height // 3],
                                   [5 * width // 8, 2 * height // 3]], np.int32)], (240, 220, 40))
    return np.ascontiguousarray(frame)


def load_frame(path: str | None) -> np.ndarray:
    if path is None:
        return synthetic_frame()
    import cv2

    bgr = cv2.imread(path, cv2.IMREAD_COLOR)
    if bgr is None:
        raise ValueError(f"cannot read image '{path}'")
    return np.ascontiguousarray(bgr[..., ::-1])


def ttft_ms(result: Any) -> float:
    from edgevlm_ros.engine.latency import first_token_ms

    return first_token_ms(result.timings_ms)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from edgevlm_ros.demo.demo_model import resolve_pair
    from edgevlm_ros.engine.vlm import load_vlm

    if "prefix_cache" not in inspect.signature(load_vlm).parameters:
        raise ValueError("load_vlm() has no prefix_cache switch, so the engine cannot run without the cache")
    frame = load_frame(args.image)
    common = {"threads": args.threads, "image_mode": args.image_mode, "system_prompt": args.system_prompt}

    def load(**kwargs: Any) -> tuple[Any, float]:
        t0 = time.perf_counter()
        vlm = load_vlm(*resolve_pair(args.model, args.mmproj), **common, **kwargs)
        return vlm, (time.perf_counter() - t0) * 1e3

    with tempfile.TemporaryDirectory(prefix="edgevlm_prefix_") as cache_dir:
        built, build_ms = load(prefix_cache_dir=cache_dir)
        built_result = built.describe(frame, args.prompt, args.max_new_tokens)
        built_status = built.prefix_cache_status
        del built
        cached, load_ms = load(prefix_cache_dir=cache_dir)
        cached_status = cached.prefix_cache_status
        uncached, off_ms = load(prefix_cache=False)
        uncached_status = uncached.prefix_cache_status

        results: dict[str, list[Any]] = {"cached": [], "uncached": []}
        cached.describe(frame, args.prompt, args.max_new_tokens)  # warm caches and pages alike
        uncached.describe(frame, args.prompt, args.max_new_tokens)
        for _ in range(args.runs):
            results["cached"].append(cached.describe(frame, args.prompt, args.max_new_tokens))
            results["uncached"].append(uncached.describe(frame, args.prompt, args.max_new_tokens))

    every = [built_result, *results["cached"], *results["uncached"]]
    identical = all(r.token_ids == built_result.token_ids and r.text == built_result.text for r in every)

    def median(name: str, key: Any) -> float:
        return statistics.median(key(r) for r in results[name])

    ttft_on, ttft_off = median("cached", ttft_ms), median("uncached", ttft_ms)
    prefill_on = median("cached", lambda r: r.timings_ms["prefill"])
    prefill_off = median("uncached", lambda r: r.timings_ms["prefill"])
    return {
        "runs": args.runs,
        "frame": f"{frame.shape[1]}x{frame.shape[0]}",
        "prefix_cache_status": {"first_load": built_status, "second_load": cached_status, "off": uncached_status},
        "load_ms": {"building_the_cache": build_ms, "cache_from_file": load_ms, "no_cache": off_ms},
        "ttft_ms": {"cached": ttft_on, "uncached": ttft_off},
        "prefill_ms": {"cached": prefill_on, "uncached": prefill_off},
        "ttft_ratio": ttft_off / ttft_on if ttft_on > 0 else float("inf"),
        "prefill_ratio": prefill_off / prefill_on if prefill_on > 0 else float("inf"),
        "text_identical": identical,
        "text": built_result.text,
        "tokens": len(built_result.token_ids),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_prefix_cache.py", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="text GGUF (neither this nor --mmproj: the embedded demo pair)")
    parser.add_argument("--mmproj", default=None, help="mmproj GGUF (default: the embedded demo mmproj)")
    parser.add_argument("--image", default=None, help="image file (default: a synthetic 640x480 frame)")
    parser.add_argument("--prompt", default="Describe the image in one sentence.")
    parser.add_argument("--system-prompt", default=DEFAULT_SYSTEM_PROMPT)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--image-mode", default="single", choices=["single", "tiled"])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    try:
        report = run(args)
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"bench_prefix_cache: error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
              file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report))
    else:
        t, p = report["ttft_ms"], report["prefill_ms"]
        print(f"frame {report['frame']}, {report['runs']} runs each, medians; prefix cache: "
              f"{report['prefix_cache_status']}")
        print(f"time to first token: {t['uncached']:.1f} ms without the prefix cache, {t['cached']:.1f} ms with it "
              f"-> {report['ttft_ratio']:.2f}x")
        print(f"prefill:             {p['uncached']:.1f} ms without, {p['cached']:.1f} ms with "
              f"-> {report['prefill_ratio']:.2f}x")
        lm = report["load_ms"]
        print(f"load: {lm['no_cache']:.0f} ms without a cache, {lm['building_the_cache']:.0f} ms building it, "
              f"{lm['cache_from_file']:.0f} ms reading it from its file")
        print(f"text identical with and without the cache: {report['text_identical']} ({report['text']!r})")
    return 0 if report["text_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
