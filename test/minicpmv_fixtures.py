"""A random MiniCPM-V 4.6 checkpoint (`MiniCPMV4_6ForConditionalGeneration`) at the real vision widths
(SigLIP so400m: 1152 wide, 4304 feed-forward, 16 heads, patch 14, the 70 x 70 position bucket grid)
with a few vision layers and Qwen3.5-0.8B's text widths (qwen35_fixtures), for the minicpmv4_6
vision tests; and its mmproj written by llama.cpp's own converter (`--mmproj`).

* vision layers and `insert_layer_id` are parameters: the fast test uses 2 layers with the window
  merger after layer 0 (layers before and after it); the full form 27 and 6, as published;
* weights: Linear weights ~ N(0, 0.02²) (the patch embedding and positions too), biases ~
  N(0, 0.02²), LayerNorm weights 1 + N(0, 0.1²) and biases N(0, 0.05²), so every norm's affine part
  matters; the text half as qwen35_fixtures draws it. transformers' own init (N(0, 1) merger
  projections) would saturate the softmaxes of the window attention;
* the image processor is transformers' `MiniCPMV4_6ImageProcessorPil` with its defaults
  (scale_resolution 448, max_slice_nums 9), saved as preprocessor_config.json;
* built once per parameters into the fixture cache (hf_fixtures.build_once).
Sizes: 2 vision + 4 text layers ~2.1 GB (F32; the text embedding is 1.0 GB, the merger's 4608 x
17216 MLP 0.3 GB). Build on 2 cores ~1-2 min; llama.cpp's mmproj conversion ~1 min.

Also MiniCPM-V 4.6's tokenizer — Qwen3.5's (qwen35_fixtures.tokenizer_dir) plus the added special
tokens MiniCPM-V 4.6 publishes (`<image>`, `</image>`, `<video>`, `</video>`, `<slice>`, `</slice>`,
`<image_id>`, `</image_id>`, from id 248077) and the named `extra_special_tokens` the processor reads
(`image_token` `<|image_pad|>`, ...) — and `reference_processor()`: transformers' MiniCPMV4_6Processor
over MiniCPMV4_6ImageProcessorPil, its class check skipped because the video-processor registry it
consults is gated on torchvision, which must not be installed (REFERENCE-NOTES).
"""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from hf_fixtures import _MARKER, build_once
from qwen35_fixtures import (
    LLAMA_CPP_VERSION,
    _init_weights,
    cache_root,
    qwen35_config_dict,
    run_llama_cpp_converter,
    tokenizer_dir,
)

VISION_WIDTH, VISION_FFN, VISION_HEADS, PATCH, BUCKET_IMAGE = 1152, 4304, 16, 14, 980
STD, LN_STD, LN_BIAS_STD = 0.02, 0.1, 0.05
IMAGE_PAD_ID = 248056
_VERSION = 1


def minicpmv_config_dict(vision_layers: int, insert_layer_id: int, text_layers: int) -> dict[str, Any]:
    text = {k: v for k, v in qwen35_config_dict(text_layers).items() if k not in ("architectures", "dtype")}
    return {
        "architectures": ["MiniCPMV4_6ForConditionalGeneration"],
        "model_type": "minicpmv4_6",
        "insert_layer_id": insert_layer_id,
        "downsample_mode": "16x",
        "merge_kernel_size": [2, 2],
        "merger_times": 1,
        "tie_word_embeddings": False,
        "image_token_id": IMAGE_PAD_ID, "video_token_id": IMAGE_PAD_ID + 1,  # <|image_pad|>, <|video_pad|>
        "vision_config": {"model_type": "minicpmv4_6_vision", "hidden_size": VISION_WIDTH,
                          "intermediate_size": VISION_FFN, "num_hidden_layers": vision_layers,
                          "num_attention_heads": VISION_HEADS, "patch_size": PATCH, "image_size": BUCKET_IMAGE,
                          "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6,
                          "insert_layer_id": insert_layer_id, "window_kernel_size": [2, 2]},
        "text_config": text,
    }


def _init_vision(model: Any) -> None:
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".language_model." in name or name.startswith("lm_head"):
                continue
            is_norm = "norm" in name.rsplit(".", 2)[-2]
            if is_norm and name.endswith(".weight"):
                p.normal_(1.0, LN_STD)
            elif is_norm:
                p.normal_(0.0, LN_BIAS_STD)
            else:
                p.normal_(0.0, STD)


def _write_checkpoint(out: Path, vision_layers: int, insert_layer_id: int, text_layers: int, seed: int) -> None:
    import torch
    from transformers import MiniCPMV4_6Config, MiniCPMV4_6ForConditionalGeneration
    from transformers.models.minicpmv4_6.image_processing_pil_minicpmv4_6 import MiniCPMV4_6ImageProcessorPil

    cfg = minicpmv_config_dict(vision_layers, insert_layer_id, text_layers)
    config = MiniCPMV4_6Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    torch.manual_seed(seed)
    model = MiniCPMV4_6ForConditionalGeneration(config)
    _init_weights(model.model.language_model)
    _init_weights(model.lm_head)
    _init_vision(model)
    model.to(torch.float32)
    model.save_pretrained(str(out))
    del model
    saved = json.loads((out / "config.json").read_text())
    saved["architectures"] = cfg["architectures"]
    (out / "config.json").write_text(json.dumps(saved, indent=2))
    MiniCPMV4_6ImageProcessorPil().save_pretrained(str(out))
    for f in minicpmv_tokenizer_dir().iterdir():  # Qwen3.5's and MiniCPM-V's image tokens
        if f.is_file() and f.name != _MARKER:
            shutil.copy2(f, out / f.name)


def cached_minicpmv(vision_layers: int = 2, insert_layer_id: int = 0, text_layers: int = 4, seed: int = 0) -> Path:
    """The random checkpoint folder, built once per parameters."""
    if not 0 <= insert_layer_id < vision_layers - 1:
        raise ValueError("the merger needs layers before and after it")
    args = {"version": _VERSION, "vision_layers": vision_layers, "insert": insert_layer_id,
            "text_layers": text_layers, "seed": seed, "std": STD, "ln_std": LN_STD, "ln_bias_std": LN_BIAS_STD}
    out = cache_root() / f"minicpmv46-random-v{vision_layers}i{insert_layer_id}-l{text_layers}-s{seed}"
    return build_once(out, args,
                       lambda tmp: _write_checkpoint(tmp, vision_layers, insert_layer_id, text_layers, seed))


def cached_minicpmv_llama_cpp_mmproj(hf: Path) -> Path:
    """llama.cpp's convert_hf_to_gguf.py --mmproj (F32) on that checkpoint, built once."""
    args = {"checkpoint": json.loads((hf / _MARKER).read_text()), "llama_cpp": LLAMA_CPP_VERSION}
    out = cache_root() / f"{hf.name}-llama-cpp-mmproj"
    name = "mmproj-f32.gguf"
    build_once(out, args, lambda tmp: run_llama_cpp_converter(hf, tmp / name, "f32", "--mmproj", no_mtp=False))
    return out / name


def cached_minicpmv_llama_cpp_text(hf: Path) -> Path:
    """llama.cpp's convert_hf_to_gguf.py (F32, --no-mtp: the checkpoint has no MTP layers) text file of
    that checkpoint, built once."""
    args = {"checkpoint": json.loads((hf / _MARKER).read_text()), "llama_cpp": LLAMA_CPP_VERSION}
    out = cache_root() / f"{hf.name}-llama-cpp-text"
    name = "text-f32.gguf"
    build_once(out, args, lambda tmp: run_llama_cpp_converter(hf, tmp / name, "f32"))
    return out / name


def cached_minicpmv_pair(hf: Path) -> dict[str, Path]:
    """Our converter's files of that checkpoint, F32, built once: "text" (arch qwen35) and the mmproj
    per downsample mode ("16x", "4x"). The key hashes the converter's sources, so a changed
    converter never serves stale files."""
    from edgevlm_ros.tools import convert, convert_minicpmv, convert_qwen35, gguf_writer

    sources = hashlib.sha256(b"".join(Path(m.__file__).read_bytes()
                                      for m in (convert, convert_minicpmv, convert_qwen35, gguf_writer)))
    args = {"checkpoint": json.loads((hf / _MARKER).read_text()), "converter": sources.hexdigest()}
    out = cache_root() / f"{hf.name}-ours-f32"

    def write(tmp: Path) -> None:
        convert_qwen35.convert_qwen35(hf, tmp / "text", "f32")
        for mode in ("16x", "4x"):
            convert_minicpmv.convert_minicpmv_mmproj(hf, tmp / mode, "f32", downsample_mode=mode)

    build_once(out, args, write)
    return {"text": next((out / "text").glob("*.gguf")),
            **{mode: next((out / mode).glob("*.gguf")) for mode in ("16x", "4x")}}


ADDED = ("<image>", "</image>", "<video>", "</video>", "<slice>", "</slice>", "<image_id>", "</image_id>")
FIRST_ADDED_ID = 248077
NAMED = {
    "image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
    "image_start_token": "<image>", "image_end_token": "</image>",
    "slice_start_token": "<slice>", "slice_end_token": "</slice>",
    "image_id_start_token": "<image_id>", "image_id_end_token": "</image_id>",
}
_TOKENIZER_VERSION = 1


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
    out = cache_root() / f"minicpmv46-tokenizer-v{_TOKENIZER_VERSION}"
    return build_once(out, {"version": _TOKENIZER_VERSION, "added": list(ADDED), "named": NAMED}, _write)


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


def cached_text_with_mtp_block(text: Path, donor: Path) -> Path:
    """`text` (a qwen35 GGUF without a multi-token-prediction block) with the block of `donor` (a qwen35
    file of the same widths whose block n_layer is one, e.g. qwen35_fixtures.cached_qwen35_mtp_llama_cpp_gguf)
    appended as llama.cpp's converter lays it out: block_count + 1, nextn_predict_layers 1, the layer
    list one longer. Rewritten by llama.cpp's own gguf-py (its reader and writer), built once."""
    from qwen35_fixtures import llama_cpp_files

    args = {"text": str(text), "text_size": text.stat().st_size, "donor": str(donor),
            "donor_size": donor.stat().st_size, "version": 1}
    out = cache_root() / f"{text.stem}-with-mtp"

    def write(tmp: Path) -> None:
        sys.path.insert(0, str(llama_cpp_files() / "gguf-py"))
        import gguf

        src, extra = gguf.GGUFReader(text), gguf.GGUFReader(donor)
        n_layer = int(src.fields["qwen35.block_count"].contents())
        w = gguf.GGUFWriter(tmp / f"{text.stem}-with-mtp.gguf", "qwen35")
        for field in src.fields.values():
            if field.name.startswith("GGUF.") or field.name == "general.architecture":
                continue
            value = field.contents()
            if field.name == "qwen35.block_count":
                value = n_layer + 1
            elif field.name == "qwen35.attention.recurrent_layers":
                value = [*value, False]
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(field.name, value, field.types[0], sub_type=sub)
        w.add_uint32("qwen35.nextn_predict_layers", 1)
        block = f"blk.{n_layer}."
        for t in [*src.tensors, *(t for t in extra.tensors if t.name.startswith(block))]:
            w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    build_once(out, args, write)
    return next(out.glob("*.gguf"))
