"""edgevlm_ros.engine.preprocess against transformers' Idefics3 processor (the reference).

The reference is built offline: ``Idefics3ImageProcessorPil`` with SmolVLM-256M's settings
(mean/std 0.5, LANCZOS, tile 512, longest edge 2048, plus smaller longest edges to keep the
suite fast) and an ``Idefics3Processor`` around the SmolLM2 GGUF tokenizer with SmolVLM's
special tokens added. Pixel values are compared for exact equality: both sides run the same
Pillow filter on the same uint8 images and the same float arithmetic, and the measured maximum
absolute difference is 0.0 for every case here.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from edgevlm_ros.engine.preprocess import (
    MAX_IMAGE_SIZE,
    PreprocessConfig,
    PreprocessedImage,
    _longest_edge_size,
    expand_image_prompt,
    preprocess,
)

ROOT = Path(__file__).resolve().parents[1]
TILE = 512
SEQ = 64
SMOLVLM_MEAN = (0.5, 0.5, 0.5)
SMOLVLM_STD = (0.5, 0.5, 0.5)
# Both sides do identical uint8 resizes and float32 arithmetic: no tolerance is needed.
PIXEL_TOLERANCE = 0.0

SMOLVLM_SPECIAL_TOKENS = (
    ["<global-img>"]
    + [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
    + ["<fake_token_around_image>", "<image>", "<end_of_utterance>"]
)

# (width, height, kind): the brief's sizes plus odd sizes and extreme aspect ratios.
IMAGES = [
    (512, 512, "noise"),
    (700, 400, "gradient"),
    (400, 700, "noise"),
    (300, 200, "gradient"),
    (1, 1, "noise"),
    (1920, 1080, "gradient"),
    (333, 517, "noise"),
    (1000, 3, "gradient"),
    (5, 900, "noise"),
]


def make_image(width: int, height: int, kind: str, seed: int = 0) -> np.ndarray:
    """Seeded (H, W, 3) uint8 RGB test image: uniform noise or a smooth, per-channel gradient."""
    rng = np.random.default_rng(seed + 7919 * width + height)
    if kind == "noise":
        return rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    y = np.linspace(0.0, 1.0, height)[:, None]
    x = np.linspace(0.0, 1.0, width)[None, :]
    channels = [255 * x * np.ones_like(y), 255 * y * np.ones_like(x), 127.5 + 127.5 * np.sin(6.0 * (x + y))]
    return np.clip(np.rint(np.stack(channels, axis=-1)), 0, 255).astype(np.uint8)


def image_id(case: tuple[int, int, str]) -> str:
    return f"{case[0]}x{case[1]}-{case[2]}"


# --- the reference ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_image_processor() -> Any:
    """Factory: transformers' PIL Idefics3 image processor, cached per (longest_edge, split, mean, std)."""
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    cache: dict[tuple[Any, ...], Any] = {}

    def get(longest_edge: int, split: bool, mean: tuple = SMOLVLM_MEAN, std: tuple = SMOLVLM_STD) -> Any:
        key = (longest_edge, split, mean, std)
        if key not in cache:
            cache[key] = Idefics3ImageProcessorPil(
                do_image_splitting=split,
                size={"longest_edge": longest_edge},
                max_image_size={"longest_edge": TILE},
                image_mean=list(mean),
                image_std=list(std),
                resample=Image.Resampling.LANCZOS,
            )
        return cache[key]

    return get


@pytest.fixture(scope="module")
def tokenizer(text_model_path: Path) -> Any:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(text_model_path.parent), gguf_file=text_model_path.name)
    tok.add_special_tokens({"additional_special_tokens": SMOLVLM_SPECIAL_TOKENS})
    # SmolVLM's ids (REFERENCE-NOTES), except <end_of_utterance> which sits at 49279 there.
    assert tok.convert_tokens_to_ids(["<global-img>", "<row_6_col_6>", "<fake_token_around_image>", "<image>"]) == [
        49152,
        49188,
        49189,
        49190,
    ]
    return tok


def hf_processor(image_processor: Any, tokenizer: Any, image_seq_len: int = SEQ) -> Any:
    from transformers import Idefics3Processor

    return Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=image_seq_len)


def run_hf(processor: Any, rgb: np.ndarray) -> tuple[np.ndarray, int, int]:
    # A PIL image, not an array: transformers guesses the channel axis of arrays (1x1x3 is ambiguous).
    out = processor(Image.fromarray(rgb), return_row_col_info=True, return_tensors="np")
    return out["pixel_values"][0], int(out["rows"][0][0]), int(out["cols"][0][0])


def config(longest_edge: int, mode: str, mean: tuple = SMOLVLM_MEAN, std: tuple = SMOLVLM_STD) -> PreprocessConfig:
    return PreprocessConfig(
        tile_size=TILE, longest_edge=longest_edge, image_mean=mean, image_std=std, image_seq_len=SEQ, mode=mode
    )


def assert_same(ours: PreprocessedImage, ref_pixels: np.ndarray, ref_rows: int, ref_cols: int) -> None:
    assert (ours.rows, ours.cols) == (ref_rows, ref_cols)
    assert ours.pixel_values.dtype == np.float32
    assert ours.pixel_values.shape == ref_pixels.shape
    assert ours.n_tiles == ref_pixels.shape[0]
    assert ours.n_image_tokens == ours.n_tiles * SEQ
    max_diff = float(np.abs(ours.pixel_values - ref_pixels).max())
    assert max_diff <= PIXEL_TOLERANCE, f"max abs pixel difference {max_diff}"


# --- pixel parity ----------------------------------------------------------------------------


# SmolVLM-256M's real longest edge (2048) on the brief's sizes; every image at smaller edges (faster).
TILED_CASES = [(case, 2048) for case in IMAGES if case[:2] not in ((333, 517), (5, 900))]
TILED_CASES += [(case, edge) for edge in (1024, 512) for case in IMAGES]


@pytest.mark.parametrize("case,longest_edge", TILED_CASES, ids=[f"{image_id(c)}-{e}" for c, e in TILED_CASES])
def test_tiled_matches_transformers(hf_image_processor: Any, case: tuple[int, int, str], longest_edge: int) -> None:
    rgb = make_image(*case)
    ref = run_hf(hf_image_processor(longest_edge, split=True), rgb)
    assert_same(preprocess(rgb, config(longest_edge, "tiled")), *ref)


@pytest.mark.parametrize("case", IMAGES, ids=image_id)
def test_single_matches_transformers_without_splitting(hf_image_processor: Any, case: tuple[int, int, str]) -> None:
    """Single mode = do_image_splitting=False with size longest_edge = tile: one tile, no global view."""
    rgb = make_image(*case)
    ref = run_hf(hf_image_processor(TILE, split=False), rgb)
    ours = preprocess(rgb, config(2048, "single"))  # longest_edge does not matter in single mode
    assert_same(ours, *ref)
    assert (ours.n_tiles, ours.rows, ours.cols, ours.n_image_tokens) == (1, 0, 0, SEQ)


def test_per_channel_mean_and_std_match(hf_image_processor: Any) -> None:
    mean, std = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)  # CLIP's
    rgb = make_image(640, 480, "noise", seed=3)
    for mode, split in (("tiled", True), ("single", False)):
        ref = run_hf(hf_image_processor(1024 if split else TILE, split, mean, std), rgb)
        assert_same(preprocess(rgb, config(1024, mode, mean, std)), *ref)


def test_known_grids_from_reference_notes() -> None:
    # SmolVLM-256M: 700x400 -> 3 x 4 tiles + global = 13 x 64 = 832 image tokens.
    out = preprocess(make_image(700, 400, "noise"), config(2048, "tiled"))
    assert (out.rows, out.cols, out.n_tiles, out.n_image_tokens) == (3, 4, 13, 832)
    # A 512^2 image with longest edge 512 is one tile (no global duplicate): 64 tokens.
    out = preprocess(make_image(512, 512, "noise"), config(512, "tiled"))
    assert (out.rows, out.cols, out.n_tiles, out.n_image_tokens) == (0, 0, 1, 64)
    # transformers upscales small images to the longest edge first: 300x200 is 3 x 4 tiles at 2048.
    out = preprocess(make_image(300, 200, "noise"), config(2048, "tiled"))
    assert (out.rows, out.cols, out.n_tiles) == (3, 4, 13)


def test_tiles_are_row_major_then_global() -> None:
    """Tile k of the output is the k-th crop (row-major) of the step-2 image; the global view is last."""
    rgb = make_image(1024, 512, "gradient")  # 1024 x 512 at longest edge 1024: exactly 1 x 2 tiles, no resize
    out = preprocess(rgb, config(1024, "tiled"))
    assert (out.rows, out.cols, out.n_tiles) == (1, 2, 3)
    expected_left = (rgb[:, :512].astype(np.float64) / 255 - 0.5) / 0.5
    expected_right = (rgb[:, 512:].astype(np.float64) / 255 - 0.5) / 0.5
    np.testing.assert_allclose(out.pixel_values[0].transpose(1, 2, 0), expected_left, atol=1e-6)
    np.testing.assert_allclose(out.pixel_values[1].transpose(1, 2, 0), expected_right, atol=1e-6)


def test_longest_edge_sizes_match_transformers() -> None:
    """The resize arithmetic (even short edge, 4096 cap) equals transformers' on many sizes."""
    from transformers.models.idefics3.image_processing_pil_idefics3 import get_resize_output_image_size

    rng = np.random.default_rng(11)
    sizes = [(1, 1), (1, 5000), (5000, 1), (3, 1000), (999, 1001), (4096, 4097)]
    sizes += [tuple(int(v) for v in rng.integers(1, 5000, 2)) for _ in range(300)]
    for longest in (364, 512, 1024, 1536, 2048, 4096, 5000, 8192):
        for h, w in sizes:
            dummy = np.broadcast_to(np.uint8(0), (3, h, w))  # no memory: only the shape is read
            assert _longest_edge_size(h, w, longest) == get_resize_output_image_size(dummy, longest), (h, w, longest)
    assert max(_longest_edge_size(10, 20, 8192)) == MAX_IMAGE_SIZE


# --- prompt parity ---------------------------------------------------------------------------


@pytest.mark.parametrize("rows,cols", [(0, 0), (1, 1), (1, 4), (3, 4), (4, 3), (2, 5), (6, 6)])
def test_expand_image_prompt_matches_processor(hf_image_processor: Any, tokenizer: Any, rows: int, cols: int) -> None:
    for seq in (SEQ, 1, 81):
        processor = hf_processor(hf_image_processor(2048, True), tokenizer, image_seq_len=seq)
        expected = processor.replace_image_token({"rows": [[rows]], "cols": [[cols]]}, 0)
        assert expand_image_prompt(rows, cols, seq) == expected


def test_expand_image_prompt_layout() -> None:
    assert expand_image_prompt(0, 0, 2) == (
        "<fake_token_around_image><global-img><image><image><fake_token_around_image>"
    )
    assert expand_image_prompt(1, 2, 1) == (
        "<fake_token_around_image><row_1_col_1><image><fake_token_around_image><row_1_col_2><image>\n"
        "\n<fake_token_around_image><global-img><image><fake_token_around_image>"
    )


PROMPT = "<|im_start|>User:<image>Describe what the robot sees.<end_of_utterance>\nAssistant:"


@pytest.mark.parametrize(
    "case,longest_edge,mode",
    [
        ((700, 400, "gradient"), 2048, "tiled"),
        ((300, 200, "noise"), 1024, "tiled"),
        ((512, 512, "noise"), 512, "tiled"),
        ((640, 480, "gradient"), 2048, "single"),
    ],
    ids=["700x400-2048", "300x200-1024", "512x512-512", "640x480-single"],
)
def test_full_processor_call(
    hf_image_processor: Any, tokenizer: Any, case: tuple[int, int, str], longest_edge: int, mode: str
) -> None:
    """The whole Idefics3Processor call: same pixel values, same text, same input_ids."""
    rgb = make_image(*case)
    split = mode == "tiled"
    processor = hf_processor(hf_image_processor(longest_edge if split else TILE, split), tokenizer)
    ref = processor(images=[Image.fromarray(rgb)], text=PROMPT, return_tensors="np")

    ours = preprocess(rgb, config(longest_edge, mode))
    ref_pixels = ref["pixel_values"][0]
    assert ours.pixel_values.shape == ref_pixels.shape
    assert float(np.abs(ours.pixel_values - ref_pixels).max()) <= PIXEL_TOLERANCE

    text = PROMPT.replace("<image>", ours.prompt_text)
    ours_ids = tokenizer(text)["input_ids"]
    assert ours_ids == ref["input_ids"][0].tolist()
    assert ours_ids.count(tokenizer.convert_tokens_to_ids("<image>")) == ours.n_image_tokens


# --- configuration ---------------------------------------------------------------------------

SMOLVLM_256M_MMPROJ = {
    "clip.projector_type": "idefics3",
    "clip.vision.image_size": 512,
    "clip.vision.patch_size": 16,
    "clip.vision.image_mean": [0.5, 0.5, 0.5],
    "clip.vision.image_std": [0.5, 0.5, 0.5],
    "clip.vision.projector.scale_factor": 4,
    "clip.vision.preproc_image_size": 2048,
}


def test_from_mmproj_metadata() -> None:
    cfg = PreprocessConfig.from_mmproj_metadata(SMOLVLM_256M_MMPROJ, "tiled")
    assert cfg == PreprocessConfig(512, 2048, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5), 64, "tiled")
    assert cfg.rescale_factor == 1 / 255 and cfg.resample == Image.Resampling.LANCZOS

    without = {k: v for k, v in SMOLVLM_256M_MMPROJ.items() if k != "clip.vision.preproc_image_size"}
    assert PreprocessConfig.from_mmproj_metadata(without, "tiled").longest_edge == 4 * 512
    assert PreprocessConfig.from_mmproj_metadata(SMOLVLM_256M_MMPROJ, "single", longest_edge=1024).longest_edge == 1024
    # SmolVLM-2.2B-like: 384 tiles, patch 14, scale 3 -> (27/3)^2 = 81 tokens; numpy arrays accepted.
    big = {
        **SMOLVLM_256M_MMPROJ,
        "clip.vision.image_size": 384,
        "clip.vision.patch_size": 14,
        "clip.vision.projector.scale_factor": 3,
        "clip.vision.preproc_image_size": 1536,
        "clip.vision.image_mean": np.array([0.5, 0.5, 0.5], dtype=np.float32),
    }
    assert PreprocessConfig.from_mmproj_metadata(big, "tiled").image_seq_len == 81


@pytest.mark.parametrize(
    "change,message",
    [
        ({"clip.projector_type": "mlp"}, "idefics3"),
        ({"clip.vision.image_size": None}, "clip.vision.image_size"),
        ({"clip.vision.image_size": 8}, "larger"),
        ({"clip.vision.image_size": 500}, "scale_factor"),
        ({"clip.vision.projector.scale_factor": 3}, "scale_factor"),
        ({"clip.vision.patch_size": 0}, "positive"),
        ({"clip.vision.image_mean": [0.5, 0.5]}, "3 values"),
        ({"clip.vision.image_std": [0.5, 0.0, 0.5]}, "> 0"),
        ({"clip.vision.preproc_image_size": "big"}, "preproc_image_size"),
        ({"clip.vision.preproc_image_size": 4096}, "row_R_col_C"),
    ],
)
def test_from_mmproj_metadata_rejects_bad_values(change: dict, message: str) -> None:
    meta = {k: v for k, v in {**SMOLVLM_256M_MMPROJ, **change}.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        PreprocessConfig.from_mmproj_metadata(meta, "tiled")


def test_from_mmproj_metadata_rejects_unknown_mode() -> None:
    with pytest.raises(ValueError, match="mode"):
        PreprocessConfig.from_mmproj_metadata(SMOLVLM_256M_MMPROJ, "fast")


@pytest.mark.parametrize(
    "field,value",
    [
        ("tile_size", 0),
        ("tile_size", 512.0),
        ("tile_size", True),
        ("longest_edge", -1),
        ("image_seq_len", 0),
        ("image_mean", (0.5, 0.5)),
        ("image_mean", (0.5, float("nan"), 0.5)),
        ("image_mean", "0.5"),
        ("image_std", (0.5, -0.5, 0.5)),
        ("mode", "tile"),
        ("rescale_factor", 0.0),
        ("resample", 99),
        ("longest_edge", 7 * 512),  # 7 tiles per side: no <row_7_col_1> token
    ],
)
def test_config_rejects_bad_values(field: str, value: object) -> None:
    kwargs: dict[str, Any] = {
        "tile_size": 512,
        "longest_edge": 2048,
        "image_mean": SMOLVLM_MEAN,
        "image_std": SMOLVLM_STD,
        "image_seq_len": 64,
    }
    kwargs[field] = value
    with pytest.raises(ValueError, match=field.split("_")[0]):
        PreprocessConfig(**kwargs)


def test_single_mode_ignores_grid_limit() -> None:
    assert PreprocessConfig(512, 7 * 512, SMOLVLM_MEAN, SMOLVLM_STD, 64, mode="single").mode == "single"


# --- input checks ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "image,message",
    [
        (np.zeros((8, 8, 3), dtype=np.float32), "uint8"),
        (np.zeros((8, 8), dtype=np.uint8), "shape"),
        (np.zeros((8, 8, 4), dtype=np.uint8), "shape"),
        (np.zeros((3, 8, 8), dtype=np.uint8), "shape"),
        (np.zeros((0, 8, 3), dtype=np.uint8), "empty"),
        (np.zeros((8, 0, 3), dtype=np.uint8), "empty"),
        ([[[0, 0, 0]]], "numpy"),
    ],
)
def test_preprocess_rejects_bad_images(image: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        preprocess(image, config(1024, "tiled"))


def test_non_contiguous_input() -> None:
    bgr = make_image(640, 480, "noise", seed=5)
    view = bgr[..., ::-1]  # BGR -> RGB without a copy
    for mode in ("tiled", "single"):
        a = preprocess(view, config(1024, mode))
        b = preprocess(np.ascontiguousarray(view), config(1024, mode))
        np.testing.assert_array_equal(a.pixel_values, b.pixel_values)


def test_expand_image_prompt_rejects_bad_grids() -> None:
    for rows, cols, seq in ((0, 2, 64), (2, 0, 64), (-1, -1, 64), (1, 1, 0), (1.0, 1, 64)):
        with pytest.raises(ValueError):
            expand_image_prompt(rows, cols, seq)  # type: ignore[arg-type]


def test_import_is_light() -> None:
    """Importing preprocess needs neither the native engine nor torch / transformers."""
    probe = [str(ROOT / "test" / "import_probe.py"), "edgevlm_ros.engine.preprocess", "torch", "transformers",
             "edgevlm_ros._engine"]
    subprocess.run([sys.executable, *probe], cwd=ROOT, check=True, env={"PYTHONPATH": str(ROOT)})
