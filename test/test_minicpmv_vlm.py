"""MiniCPM-V 4.6 end to end through the Python API (load_vlm / describe), against transformers: a
random MiniCPMV4_6ForConditionalGeneration (minicpmv_fixtures) converted by our converter (text GGUF
of arch qwen35 + minicpmv4_6 mmproj, F32), on a 700x400 and a 300x500 image, image_mode tiled and
single, downsample 16x and 4x: the prompt ids equal transformers' MiniCPMV4_6Processor's and the 24
greedy tokens equal MiniCPMV4_6ForConditionalGeneration.generate's. The same checkpoint converted by
llama.cpp's own converter (text --no-mtp, and --mmproj) gives the same tokens; the prefix cache
(which restores the hybrid decoder's recurrent state) gives the same tokens as no cache; a frame
whose image tokens do not fit the context is refused in one line before any encoding.

Default (~2 min on 2 cores): 2 vision layers (the merger after layer 0), 4 text layers, two
(mode, downsample, size) cases that take each value of each (tiled 16x 700x400, single 4x 300x500).
EDGEVLM_MINICPMV_FULL=1: the published 27 vision layers (merger after layer 6) and all eight cases.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from minicpmv_fixtures import (
    cached_minicpmv,
    cached_minicpmv_llama_cpp_mmproj,
    cached_minicpmv_llama_cpp_text,
    cached_minicpmv_pair,
    reference_processor,
)

FULL = os.environ.get("EDGEVLM_MINICPMV_FULL") == "1"
VISION_LAYERS, INSERT = (27, 6) if FULL else (2, 0)
SIZES = ((700, 400), (300, 500))  # width x height: a source view + a 1x2 grid, and a single view
N_NEW = 24
THREADS = 2
PROMPT = "What is in the picture?"
ALL = [(m, d, s) for m in ("tiled", "single") for d in ("16x", "4x") for s in SIZES]
# Default: two cases that between them take each mode, each downsample and each size.
CASES = ALL if FULL else [("tiled", "16x", SIZES[0]), ("single", "4x", SIZES[1])]


@pytest.fixture(scope="module")
def hf_dir() -> Path:
    return cached_minicpmv(VISION_LAYERS, INSERT)


@pytest.fixture(scope="module")
def hf_model(hf_dir: Path) -> Any:
    import torch
    from transformers import MiniCPMV4_6ForConditionalGeneration

    torch.set_num_threads(THREADS)
    return MiniCPMV4_6ForConditionalGeneration.from_pretrained(str(hf_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def pair(hf_dir: Path) -> dict[str, Path]:
    """Our text GGUF ("text") and our mmproj per downsample mode, F32."""
    return cached_minicpmv_pair(hf_dir)


def _image(width: int, height: int) -> np.ndarray:
    rng = np.random.default_rng(width + 7 * height)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // width, y * 255 // height, (x + y) * 255 // (width + height)], axis=-1)
    return np.clip(base + rng.integers(-40, 40, base.shape), 0, 255).astype(np.uint8)


def _vlm(text: Path, mmproj: Path, mode: str = "tiled", **kw: Any) -> Any:
    import edgevlm_ros  # the public name, as the README shows it

    return edgevlm_ros.load_vlm(text, mmproj, threads=THREADS, image_mode=mode, **kw)


def _reference(hf_model: Any, vlm: Any, rgb: np.ndarray, mode: str, downsample: str) -> tuple[list[int], list[int]]:
    """transformers' prompt ids and greedy tokens (cut at the first stop token) for the prompt
    our chat template renders."""
    import torch
    from PIL import Image

    proc = reference_processor(slice_mode=mode == "tiled", downsample_mode=downsample)
    enc = proc(text=[vlm._render(PROMPT)], images=[[Image.fromarray(rgb)]], return_tensors="pt")
    with torch.no_grad():
        gen = hf_model.generate(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                                pixel_values=enc["pixel_values"], target_sizes=enc["target_sizes"],
                                downsample_mode=downsample, max_new_tokens=N_NEW, do_sample=False,
                                eos_token_id=list(vlm.text.stop_ids), pad_token_id=vlm.text.stop_ids[0])
    ids = enc["input_ids"][0].tolist()
    new = [int(t) for t in gen[0, len(ids):]]
    return ids, new[: next((i for i, t in enumerate(new) if t in vlm.text.stop_ids), len(new))]


@pytest.fixture(scope="module")
def ours_tokens() -> dict[str, list[int]]:
    """Our tiled 16x 700x400 tokens, as the parity test produced them (for the later tests)."""
    return {}


def _tokens_of(ours_tokens: dict[str, list[int]], pair: dict[str, Path]) -> list[int]:
    if "tiled" not in ours_tokens:
        vlm = _vlm(pair["text"], pair["16x"])
        ours_tokens["tiled"] = vlm.describe(_image(*SIZES[0]), PROMPT, max_new_tokens=N_NEW).token_ids
    return ours_tokens["tiled"]


@pytest.mark.parametrize(("mode", "downsample", "size"), CASES)
def test_prompt_and_greedy_match_transformers(hf_model: Any, pair: dict[str, Path], mode: str, downsample: str,
                                              size: tuple[int, int], ours_tokens: dict[str, list[int]]) -> None:
    vlm = _vlm(pair["text"], pair[downsample], mode)
    assert vlm.vision.config["projector"] == "minicpmv4_6" and vlm.image_token_id == 248056
    rgb = _image(*size)
    ref_ids, ref_new = _reference(hf_model, vlm, rgb, mode, downsample)
    plan = vlm.images.plan(*rgb.shape[:2])
    prefix_ids, rest_ids = vlm.prompt_ids(PROMPT, plan)
    assert prefix_ids + rest_ids == ref_ids
    result = vlm.describe(rgb, PROMPT, max_new_tokens=N_NEW)
    print(f"minicpmv4_6 {mode} {downsample} {size[0]}x{size[1]}: {plan.n_views} view(s), {plan.n_image_tokens} "
          f"image tokens, {len(result.token_ids)} tokens, first {result.token_ids[:6]}")
    assert result.extra["tiles"] == plan.n_views == (3 if mode == "tiled" and size == SIZES[0] else 1)
    assert result.extra["n_image_tokens"] == ref_ids.count(vlm.image_token_id)
    assert result.token_ids == ref_new
    assert len(set(ref_new)) > 3  # a sequence, not one token repeated: the check can tell engines apart
    if (mode, downsample, size) == ("tiled", "16x", SIZES[0]):
        ours_tokens["tiled"] = result.token_ids


def test_llama_cpp_converted_pair_gives_the_same_tokens(hf_dir: Path, pair: dict[str, Path],
                                                        ours_tokens: dict[str, list[int]]) -> None:
    vlm = _vlm(cached_minicpmv_llama_cpp_text(hf_dir), cached_minicpmv_llama_cpp_mmproj(hf_dir))
    assert vlm.describe(_image(*SIZES[0]), PROMPT, max_new_tokens=N_NEW).token_ids == _tokens_of(ours_tokens, pair)


def test_prefix_cache_restores_the_recurrent_state(pair: dict[str, Path], tmp_path: Path) -> None:
    rgb = _image(*SIZES[1])
    system = "You are a robot's eyes."
    built = _vlm(pair["text"], pair["4x"], system_prompt=system, prefix_cache_dir=tmp_path)
    assert built.prefix_cache_status == "built"
    assert built.text.native.state_shape["recurrent"] > 0  # Gated DeltaNet layers carry state
    a = built.describe(rgb, PROMPT, max_new_tokens=12)
    assert a.cached_prefix_tokens == len(built.prefix.token_ids) > 0
    loaded = _vlm(pair["text"], pair["4x"], system_prompt=system, prefix_cache_dir=tmp_path)
    assert loaded.prefix_cache_status.startswith("loaded from")
    b = loaded.describe(rgb, PROMPT, max_new_tokens=12)
    none = _vlm(pair["text"], pair["4x"], system_prompt=system, prefix_cache=False)
    c = none.describe(rgb, PROMPT, max_new_tokens=12)
    assert c.cached_prefix_tokens == 0
    assert a.token_ids == b.token_ids == c.token_ids
    # Frames in a row (the state restored is the prefix's, not the last frame's): test_node.py.


def test_frame_beyond_the_context_refused_before_encoding(pair: dict[str, Path]) -> None:
    from edgevlm_ros.engine.preprocess import ImageRefused

    vlm = _vlm(pair["text"], pair["4x"])
    rgb = _image(1600, 1200)  # 4x: a source view and a 3x3 grid of ~256 tokens each, beyond 2048
    plan = vlm.images.plan(*rgb.shape[:2])
    n_ctx = int(vlm.text.native.n_ctx)
    assert plan.n_image_tokens > n_ctx // 2
    calls: list[int] = []
    encode = vlm.images.encode
    vlm.images.encode = lambda vision, image: calls.append(1) or encode(vision, image)  # type: ignore[method-assign]
    with pytest.raises(ImageRefused) as err:
        vlm.describe(rgb, PROMPT, max_new_tokens=n_ctx - plan.n_image_tokens)
    msg = str(err.value)
    assert "1600x1200" in msg and "image tokens" in msg and str(n_ctx) in msg and "\n" not in msg
    with pytest.raises(ImageRefused, match="max_image_pixels"):
        vlm.describe(rgb, PROMPT, max_new_tokens=4, max_image_pixels=1 << 20)
    assert not calls
    assert vlm.describe(_image(*SIZES[1]), PROMPT, max_new_tokens=4).token_ids  # and it keeps serving


def test_edgevlm_describe_takes_the_pair(pair: dict[str, Path], tmp_path: Path) -> None:
    """`edgevlm describe IMAGE --model TEXT --mmproj MMPROJ` from its own process, as the README shows it."""
    import json
    import subprocess
    import sys

    from PIL import Image

    rgb = _image(*SIZES[1])
    Image.fromarray(rgb).save(tmp_path / "frame.png")
    edgevlm = Path(sys.executable).parent / "edgevlm"  # the console script scripts/setup.sh installs
    cmd = [str(edgevlm), "describe", str(tmp_path / "frame.png"), "--model", str(pair["text"]), "--mmproj",
           str(pair["4x"]), "--prompt", PROMPT, "--max-tokens", "8", "--threads", str(THREADS), "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    expected = _vlm(pair["text"], pair["4x"], "single").describe(rgb, PROMPT, max_new_tokens=8)
    assert out["token_ids"] == expected.token_ids and out["text"] == expected.text
    assert out["tiles"] == 1 and out["n_image_tokens"] == expected.extra["n_image_tokens"]
