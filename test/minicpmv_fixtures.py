"""MiniCPM-V 4.6's tokenizer and transformers' processor, built offline for the parity tests.

The tokenizer is Qwen3.5's (qwen35_fixtures.tokenizer_dir) plus the added special tokens MiniCPM-V
4.6 publishes (`<image>`, `</image>`, `<video>`, `</video>`, `<slice>`, `</slice>`, `<image_id>`,
`</image_id>`, from id 248077) and the named `extra_special_tokens` the processor reads
(`image_token` `<|image_pad|>`, `video_token` `<|video_pad|>`, `image_start_token`, ...). Built once
into the fixture cache.

`reference_processor()` is transformers' MiniCPMV4_6Processor over MiniCPMV4_6ImageProcessorPil; its
class check is skipped because the video-processor registry it consults is gated on torchvision,
which must not be installed (REFERENCE-NOTES).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from qwen35_fixtures import _build_once, cache_root, tokenizer_dir

ADDED = ("<image>", "</image>", "<video>", "</video>", "<slice>", "</slice>", "<image_id>", "</image_id>")
FIRST_ADDED_ID = 248077
NAMED = {
    "image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
    "image_start_token": "<image>", "image_end_token": "</image>",
    "slice_start_token": "<slice>", "slice_end_token": "</slice>",
    "image_id_start_token": "<image_id>", "image_id_end_token": "</image_id>",
}
_VERSION = 1


def _write(out: Path) -> None:
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir()))
    for i, text in enumerate(ADDED, FIRST_ADDED_ID):
        tok.add_tokens([AddedToken(text, special=True, normalized=False)], special_tokens=True)
        if tok.convert_tokens_to_ids(text) != i:
            raise RuntimeError(f"{text} got id {tok.convert_tokens_to_ids(text)}, expected {i}")
    tok.save_pretrained(str(out))
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["extra_special_tokens"] = dict(NAMED)
    cfg_path.write_text(json.dumps(cfg, indent=2))


def minicpmv_tokenizer_dir() -> Path:
    """A folder with MiniCPM-V 4.6's tokenizer files (Qwen3.5's + its image tokens)."""
    out = cache_root() / f"minicpmv46-tokenizer-v{_VERSION}"
    return _build_once(out, {"version": _VERSION, "added": list(ADDED), "named": NAMED}, _write)


@functools.cache
def hf_tokenizer() -> Any:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(minicpmv_tokenizer_dir()))
    for name, text in NAMED.items():
        if getattr(tok, name, None) != text:
            raise RuntimeError(f"tokenizer.{name} is {getattr(tok, name, None)!r}, expected {text!r}")
    return tok


@functools.cache
def reference_processor(slice_mode: bool = True, downsample_mode: str = "16x", max_slice_nums: int = 9,
                        use_image_id: bool = True) -> Any:
    """transformers' MiniCPMV4_6Processor with these image-processor settings."""
    # From the modules: the package's names are torchvision-gated stand-ins.
    from transformers.models.minicpmv4_6.image_processing_pil_minicpmv4_6 import MiniCPMV4_6ImageProcessorPil
    from transformers.models.minicpmv4_6.processing_minicpmv4_6 import MiniCPMV4_6Processor
    from transformers.models.minicpmv4_6.video_processing_minicpmv4_6 import MiniCPMV4_6VideoProcessor

    class Processor(MiniCPMV4_6Processor):
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            return type(argument)

    image = MiniCPMV4_6ImageProcessorPil(slice_mode=slice_mode, downsample_mode=downsample_mode,
                                         max_slice_nums=max_slice_nums, use_image_id=use_image_id)
    return Processor(image_processor=image, video_processor=MiniCPMV4_6VideoProcessor(), tokenizer=hf_tokenizer())
