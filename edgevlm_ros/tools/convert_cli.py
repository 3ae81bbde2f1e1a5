"""`edgevlm convert` on the command line: picks the converter by the checkpoint (SmolVLM / Idefics3:
convert.py, text GGUF + mmproj; Qwen3.5 / MiniCPM-V 4.6's text half: convert_qwen35.py) and
reports a refused input in one line. The converters import nothing from here."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from . import convert as _convert_mod
from .convert import WEIGHT_TYPES, convert
from .convert_minicpmv import convert_minicpmv_mmproj, is_minicpmv_checkpoint
from .convert_qwen35 import convert_qwen35, is_qwen35_checkpoint

__all__ = ["add_convert_arguments", "main", "run_convert"]


def _convert_doc() -> str:
    return (_convert_mod.__doc__ or "").split("\n\n")[0]


# -- command line ---------------------------------------------------------------------------------


def add_convert_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the `convert` arguments (HF_DIR OUT_DIR --type --name) to a (sub)parser."""
    parser.add_argument("hf_dir", metavar="HF_DIR",
                        help="Hugging Face SmolVLM / Idefics3 or Qwen3.5 / MiniCPM-V 4.6 checkpoint folder")
    parser.add_argument("out_dir", metavar="OUT_DIR",
                        help="folder for <name>-<type>.gguf (and mmproj-<name>-<type>.gguf for SmolVLM, MiniCPM-V 4.6)")
    parser.add_argument("--type", dest="wtype", choices=list(WEIGHT_TYPES), default="f16",
                        help="weight format of the matrices (default f16; norms and biases stay f32)")
    parser.add_argument("--name", default=None, help="model name (general.name and file stem; default: HF_DIR's name)")
    parser.add_argument("--no-mtp", dest="mtp", action="store_false",
                        help="Qwen3.5: leave the multi-token-prediction block out (kept by default, as llama.cpp does)")
    return parser


def run_convert(args: argparse.Namespace) -> int:
    """Runs a parsed `convert` command; prints the paths written (text GGUF, then the mmproj for a
    SmolVLM or MiniCPM-V 4.6 checkpoint; a Qwen3.5 one gives its text GGUF only: tools/convert_qwen35.py).
    Returns 0, or 2 for a refused input."""
    try:
        if is_qwen35_checkpoint(args.hf_dir):
            paths: tuple[Path, ...] = (convert_qwen35(args.hf_dir, args.out_dir, args.wtype, name=args.name,
                                                      mtp=args.mtp),)
            if is_minicpmv_checkpoint(args.hf_dir):  # and its mmproj: tools/convert_minicpmv.py
                paths += (convert_minicpmv_mmproj(args.hf_dir, args.out_dir, args.wtype, name=args.name),)
        else:
            paths = convert(args.hf_dir, args.out_dir, args.wtype, name=args.name)
    except ValueError as exc:
        print(f"edgevlm convert: error: {exc}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="edgevlm convert", description=_convert_doc())
    add_convert_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return run_convert(args)


if __name__ == "__main__":
    sys.exit(main())
