"""`edgevlm` command line: a dispatcher over the layers (generate, describe, convert, quantize, bench,
tune, camera, demo). Nothing in the package imports it back; each subcommand's module is imported only
when that subcommand runs, so `edgevlm generate` loads no ROS.

Errors are one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .engine.argtypes import OneLineParser, non_negative_int, positive_int, run_command
from .engine.kv_types import KV_TYPES


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="edgevlm", description="edgevlm native VLM engine")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    gen = sub.add_parser("generate", help="generate text from a prompt with a GGUF text model")
    gen.add_argument("--model", help="GGUF file (default: SmolLM2-135M-Instruct Q4_1 from models/)")
    gen.add_argument("--prompt", required=True, help="the user turn (or the raw text with --raw)")
    gen.add_argument("--system", help="system prompt (default: the chat template's own)")
    gen.add_argument("--max-tokens", type=non_negative_int, default=128, help="most tokens to generate (128)")
    gen.add_argument("--threads", type=positive_int, default=None, help="threads (default: cores, at most 8)")
    gen.add_argument("--raw", action="store_true", help="feed the prompt as it is: no chat template")
    gen.add_argument("--kv-type", choices=KV_TYPES, default="f32",
                     help="how the KV cache stores keys and values (f32)")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of the text")

    desc = sub.add_parser("describe", help="describe an image (JPEG, PNG, ...) with a text GGUF + mmproj pair")
    desc.add_argument("image", help="image file")
    desc.add_argument("--model", help="text GGUF of the VLM (neither this nor --mmproj: the embedded demo model)")
    desc.add_argument("--mmproj", help="vision GGUF (mmproj) of the VLM (default: the embedded demo mmproj)")
    desc.add_argument("--prompt", default=None, help="the question about the image (default: 'Describe what you "
                      "see.'; with the embedded demo model the request it was trained on)")
    desc.add_argument("--system", help="system prompt (its KV cache is reused, see --prefix-cache-dir)")
    desc.add_argument("--max-tokens", type=non_negative_int, default=64, help="most tokens to generate (64)")
    desc.add_argument("--threads", type=positive_int, default=None, help="threads (default: cores, at most 8)")
    desc.add_argument("--image-mode", choices=["tiled", "single"], default="single",
                      help="single: one encoder tile, constant latency (default); tiled: SmolVLM's tiles + global view")
    desc.add_argument("--longest-edge", type=positive_int, default=None,
                      help="tiled mode: resize the longest edge to this first (default: the mmproj's)")
    desc.add_argument("--prefix-cache-dir", default=None, help="directory for the system prompt's KV cache file")
    desc.add_argument("--kv-type", choices=KV_TYPES, default="f32",
                      help="how the KV cache stores keys and values (f32)")
    desc.add_argument("--vision-int8", action="store_true",
                      help="int8 products for the vision tower where this CPU has them (AVX-VNNI, AVX512-VNNI, Arm "
                           "dotprod): faster, features "
                           "move by int8's rounding")
    desc.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    desc.add_argument("--choice", action="append", default=None, metavar="TEXT",
                      help="the answer is exactly one of these (repeat it: --choice yes --choice no)")
    desc.add_argument("--schema", default=None, metavar="JSON|@FILE",
                      help="the answer is JSON valid against this JSON schema (its text, or @ and a file)")

    conv = sub.add_parser("convert", help="convert a Hugging Face SmolVLM / Idefics3 or Qwen3.5 checkpoint to GGUF")
    from .tools.convert_cli import add_convert_arguments

    add_convert_arguments(conv)

    from .ros.camera import add_camera_arguments
    from .ros.demo import add_demo_arguments
    from .tools.bench import add_bench_arguments
    from .tools.quantize import add_quantize_arguments
    from .tools.tune import add_tune_arguments

    add_bench_arguments(sub.add_parser("bench", help="our engine and llama.cpp side by side on the same GGUF"))
    add_quantize_arguments(sub.add_parser("quantize", help="requantize a GGUF: q4_k_m, q5_k_m (K-quant mixes) or q8_0"))
    add_tune_arguments(sub.add_parser("tune", help="measure the kernel variants here and write an operator table"))
    add_camera_arguments(sub.add_parser("camera", help="publish sensor_msgs/Image from scenes, a folder, a video "
                                                       "or a V4L2 device"))
    add_demo_arguments(sub.add_parser("demo", help="camera -> node -> live descriptions with the embedded demo model"))
    return parser


def _generate(args: argparse.Namespace) -> int:
    from .engine.text_model import load

    model = load(args.model, threads=args.threads, kv_type=args.kv_type)
    if not args.raw and model.raw_note:
        print(model.raw_note, file=sys.stderr)
    result = model.generate(args.prompt, max_new_tokens=args.max_tokens, raw=args.raw, system=args.system)
    if args.json:
        print(json.dumps(result.as_dict(), ensure_ascii=False))
    else:
        print(result.text)
        t = result.timings_ms
        print(
            f"[{len(result.prompt_token_ids)} prompt tokens, {len(result.token_ids)} generated, "
            f"prefill {t['prefill']:.0f} ms, decode {t['decode']:.0f} ms, {result.tokens_per_s:.1f} tokens/s, "
            f"stop: {result.stop_reason}]",
            file=sys.stderr,
        )
    return 0


def _read_rgb(path: str) -> Any:
    import cv2

    bgr = cv2.imread(path, cv2.IMREAD_COLOR)
    if bgr is None:
        raise ValueError(f"cannot read image '{path}' (missing, unreadable or not an image)")
    return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)


def _describe(args: argparse.Namespace) -> int:
    from .demo.demo_model import DEMO_PROMPT, resolve_pair
    from .engine.vlm import DEFAULT_PROMPT, load_vlm

    rgb = _read_rgb(args.image)
    vlm = load_vlm(*resolve_pair(args.model, args.mmproj), threads=args.threads, image_mode=args.image_mode,
                   system_prompt=args.system, prefix_cache_dir=args.prefix_cache_dir, longest_edge=args.longest_edge,
                   kv_type=args.kv_type, vision_int8=args.vision_int8)
    default_prompt = DEFAULT_PROMPT if args.model or args.mmproj else DEMO_PROMPT
    schema = args.schema
    if schema is not None and schema.startswith("@"):
        schema = Path(schema[1:]).read_text(encoding="utf-8")
    result = vlm.describe(rgb, prompt=args.prompt or default_prompt, max_new_tokens=args.max_tokens,
                          choices=args.choice, schema=schema)
    if args.json:
        print(json.dumps(dict(result.as_dict(), vision_kernels=vlm.vision.variants()), ensure_ascii=False))
    else:
        print(result.text)
        stages = ", ".join(f"{k} {v:.0f} ms" for k, v in result.timings_ms.items())
        print(f"[{result.extra['tiles']} tile(s), {len(result.token_ids)} tokens, {stages}]", file=sys.stderr)
    return 0


def _convert(args: argparse.Namespace) -> int:
    from .tools.convert_cli import run_convert

    return run_convert(args)


def _lazy(module: str, func: str) -> Any:
    def run(args: argparse.Namespace) -> int:
        import importlib

        return int(getattr(importlib.import_module(f"edgevlm_ros.{module}"), func)(args))

    return run


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handlers = {"generate": _generate, "describe": _describe, "convert": _convert,
                "bench": _lazy("tools.bench", "run_bench"), "quantize": _lazy("tools.quantize", "run_quantize"),
                "tune": _lazy("tools.tune", "run_tune"),
                "camera": _lazy("ros.camera", "run_camera"), "demo": _lazy("ros.demo", "run_demo")}
    return run_command(handlers[args.command], args)


if __name__ == "__main__":
    sys.exit(main())
