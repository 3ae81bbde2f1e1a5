#!/usr/bin/env python3
"""Speculative decoding gives plain greedy's text on every frame (issue 19's exactness run).

For each model, N frames of a slowly changing view (`demo.drift`, 5 frames/s) and N independent
scenes: every frame is answered plainly, then with speculation drafting from the last 3 plain
answers of the same stream; the token ids must be equal. Every 5th frame is also answered
speculatively under a deadline of half the plain answer's decode time: its tokens must be a prefix
of plain greedy's. A VLM (text + mmproj pair) describes the frame; a text model answers a prompt
made of the frame's ground-truth caption (so its prompts change as slowly as the view does).

    scripts/speculation_exactness.py --frames 300                       # SmolLM2 + the demo VLM
    scripts/speculation_exactness.py --frames 300 --pair TEXT MMPROJ --text MODEL ...

Exit status 0 when every frame matched; prints one line per model and stream and a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from edgevlm_ros.demo.demo_model import resolve_pair  # noqa: E402
from edgevlm_ros.demo.drift import DriftStream  # noqa: E402
from edgevlm_ros.demo.scenes import generate_scene  # noqa: E402
from edgevlm_ros.engine.generation import DRAFT_HISTORY  # noqa: E402

MAX_NEW_TOKENS = 32


def _streams(frames: int, seed: int) -> dict[str, list[Any]]:
    return {"drift": [DriftStream(seed, fps=5.0).scene(i) for i in range(frames)],
            "independent": [generate_scene(seed, i) for i in range(frames)]}


def _answer_vlm(vlm: Any) -> Callable[..., Any]:
    def answer(scene: Any, drafts: list[list[int]] | None, deadline_ms: float | None = None) -> Any:
        return vlm.describe(scene.image(), max_new_tokens=MAX_NEW_TOKENS, drafts_from=drafts, deadline_ms=deadline_ms)
    return answer


def _answer_text(model: Any) -> Callable[..., Any]:
    def answer(scene: Any, drafts: list[list[int]] | None, deadline_ms: float | None = None) -> Any:
        prompt = f"Rewrite this scene description in other words: {scene.caption}"
        return model.generate(prompt, max_new_tokens=MAX_NEW_TOKENS, drafts_from=drafts, deadline_ms=deadline_ms)
    return answer


def check(name: str, answer: Callable[..., Any], frames: int, seed: int,
          log: Callable[[str], None] = print) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for stream, scenes in _streams(frames, seed).items():
        history: list[list[int]] = []
        mismatches, deadline_frames, deadline_cut, not_prefix = [], 0, 0, []
        passes = accepted = decoded = 0
        for k, scene in enumerate(scenes):
            plain = answer(scene, None)
            spec = answer(scene, history[-DRAFT_HISTORY:])
            if spec.token_ids != plain.token_ids:
                mismatches.append(k)
            s = spec.extra.get("speculation", {})
            passes += s.get("passes", 0)
            accepted += s.get("accepted", 0)
            decoded += len(plain.token_ids)
            if k % 5 == 0 and plain.timings_ms["decode"] > 0:
                cut = answer(scene, history[-DRAFT_HISTORY:], deadline_ms=plain.timings_ms["decode"] / 2
                             + plain.timings_ms["prefill"])
                deadline_frames += 1
                deadline_cut += cut.stop_reason == "deadline"
                if cut.token_ids != plain.token_ids[: len(cut.token_ids)]:
                    not_prefix.append(k)
            history.append(plain.token_ids)
        row = {"frames": frames, "mismatches": mismatches, "tokens": decoded, "passes": passes,
               "accepted": accepted, "deadline_frames": deadline_frames, "deadline_hit": deadline_cut,
               "deadline_not_prefix": not_prefix}
        out[stream] = row
        log(f"{name} {stream}: {frames} frames, {decoded} tokens, {accepted} from drafts in {passes} passes, "
            f"{len(mismatches)} text mismatches; {deadline_frames} frames under a deadline ({deadline_cut} cut), "
            f"{len(not_prefix)} not a prefix")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=300, help="frames per stream (300)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--pair", nargs=2, action="append", default=[], metavar=("TEXT", "MMPROJ"),
                        help="a VLM pair to check too (repeatable)")
    parser.add_argument("--text", action="append", default=[], metavar="MODEL", help="a text model to check too")
    parser.add_argument("--no-defaults", action="store_true", help="only the models given (not SmolLM2, demo VLM)")
    args = parser.parse_args(argv)

    import edgevlm_ros
    from edgevlm_ros.engine.vlm import load_vlm

    models: list[tuple[str, Callable[[], Callable[..., Any]]]] = []
    if not args.no_defaults:
        models.append(("SmolLM2-135M", lambda: _answer_text(edgevlm_ros.load(threads=args.threads))))
        models.append(("demo VLM", lambda: _answer_vlm(load_vlm(*resolve_pair(None, None), threads=args.threads))))
    for text, mmproj in args.pair:
        models.append((Path(text).name, lambda t=text, m=mmproj: _answer_vlm(load_vlm(t, m, threads=args.threads))))
    for text in args.text:
        models.append((Path(text).name, lambda t=text: _answer_text(edgevlm_ros.load(t, threads=args.threads))))
    t0 = time.perf_counter()
    summary = {name: check(name, make(), args.frames, args.seed) for name, make in models}
    bad = sum(len(r["mismatches"]) + len(r["deadline_not_prefix"]) for m in summary.values() for r in m.values())
    print(json.dumps({"frames": args.frames, "seconds": round(time.perf_counter() - t0, 1), "failures": bad,
                      "models": summary}))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
