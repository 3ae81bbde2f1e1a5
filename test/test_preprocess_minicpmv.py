"""MiniCPM-V 4.6 preprocessing and prompt layout against transformers' MiniCPMV4_6Processor.

Pixel values (packed as the processor packs them), target sizes and prompt ids must be identical:
the prompt ids both through transformers' tokenizer and through the engine's own tokenizer (built
from the GGUF tokenizer keys our converter writes for the same tokenizer folder).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from minicpmv_fixtures import minicpmv_tokenizer_dir, reference_processor
from PIL import Image

from edgevlm_ros.engine import preprocess_minicpmv as mcv
from edgevlm_ros.engine.tokenizer import Tokenizer

# (height, width): the two frames, then awkward ones.
SIZES = {
    "700x400": (400, 700),
    "300x500": (500, 300),
    "tiny": (5, 7),
    "very_wide": (40, 2000),
    "very_tall": (3000, 60),
    "large": (2448, 3264),
    "one_slice_area": (448, 448),
    "square": (600, 600),  # a 2 x 1 grid: it ties with 1 x 2
}
PROMPT = "<|im_start|>user\n<|image_pad|>\nWhat is in the image?<|im_end|>\n<|im_start|>assistant\n"
N_VOCAB = 248320


def _image(height: int, width: int, seed: int = 0) -> np.ndarray:
    # Smooth structure plus noise: resampling errors show in either.
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([(x * 255 // max(width - 1, 1)), (y * 255 // max(height - 1, 1)), (x + y) % 256], axis=-1)
    noise = rng.integers(-40, 41, (height, width, 3))
    return np.clip(base + noise, 0, 255).astype(np.uint8)


@pytest.fixture(scope="module")
def engine_tokenizer() -> Tokenizer:
    from edgevlm_ros.tools.convert import _read_vocab, add_bpe_vocab
    from edgevlm_ros.tools.gguf_writer import GGUFWriter

    w = GGUFWriter()
    add_bpe_vocab(w, _read_vocab(minicpmv_tokenizer_dir(), {}, N_VOCAB))
    return Tokenizer.from_gguf_metadata(w.metadata)


def _reference(rgb: np.ndarray, mode: str, downsample: str, **kw: object) -> dict:
    proc = reference_processor(slice_mode=mode == "tiled", downsample_mode=downsample, **kw)
    return proc(images=[Image.fromarray(rgb)], text=[PROMPT], return_tensors="np")


@pytest.mark.parametrize("downsample", ["16x", "4x"])
@pytest.mark.parametrize("mode", ["tiled", "single"])
@pytest.mark.parametrize("name", list(SIZES))
def test_matches_transformers(name: str, mode: str, downsample: str, engine_tokenizer: Tokenizer) -> None:
    rgb = _image(*SIZES[name])
    ref = _reference(rgb, mode, downsample)
    got = mcv.preprocess(rgb, mcv.MiniCPMVConfig(mode=mode, downsample_mode=downsample))

    np.testing.assert_array_equal(got.target_sizes, ref["target_sizes"])
    pv = got.navit_pixel_values()
    assert pv.dtype == ref["pixel_values"].dtype == np.float32
    assert pv.shape == ref["pixel_values"].shape
    assert np.array_equal(pv, ref["pixel_values"]), f"max |diff| {np.abs(pv - ref['pixel_values']).max()}"

    text = PROMPT.replace(mcv.IMAGE_TOKEN, got.prompt_text)
    want = ref["input_ids"][0].tolist()
    assert engine_tokenizer.encode(text, add_bos=False) == want
    assert reference_processor().tokenizer(text)["input_ids"] == want
    pad = engine_tokenizer.token_to_id(mcv.IMAGE_TOKEN)
    assert want.count(pad) == got.n_image_tokens == sum(got.tokens)

    # The views the native tower takes: (3, h, w) float32, 14-px patches of target_sizes.
    for view, (rows, cols) in zip(got.views, got.target_sizes, strict=True):
        assert view.shape == (3, rows * 14, cols * 14) and view.flags.c_contiguous
    if mode == "single":
        assert got.n_tiles == 1 and (got.rows, got.cols) == (0, 0)


def test_448_slice_token_counts() -> None:
    for downsample, tokens in (("16x", 64), ("4x", 256)):
        plan = mcv.plan_slices(448, 448, mcv.MiniCPMVConfig(downsample_mode=downsample))
        assert plan.tokens == (tokens,) and plan.grid == (0, 0)
    plan = mcv.plan_slices(400, 700, mcv.MiniCPMVConfig())
    assert plan.grid == (1, 2) and plan.source == (336, 616) and plan.refine == (504, 784)
    assert plan.tokens == (66, 63, 63)


def test_options_match_transformers(engine_tokenizer: Tokenizer) -> None:
    """No image id, and a larger slice limit (a 4x4 grid) against the processor."""
    rgb = _image(1800, 1900, seed=3)
    for kw in ({"use_image_id": False}, {"max_slice_nums": 16}):
        ref = _reference(rgb, "tiled", "16x", **kw)
        got = mcv.preprocess(rgb, mcv.MiniCPMVConfig(**kw))  # type: ignore[arg-type]
        assert np.array_equal(got.navit_pixel_values(), ref["pixel_values"])
        text = PROMPT.replace(mcv.IMAGE_TOKEN, got.prompt_text)
        assert engine_tokenizer.encode(text, add_bos=False) == ref["input_ids"][0].tolist()
    assert (got.rows, got.cols) == (4, 4)


def test_grid_and_sizes_sweep() -> None:
    """The size rules on 3400 frame sizes against the image processor's own methods (no pixels),
    including sizes where Python's half-to-even rounding differs from rounding half up."""
    ip = reference_processor().image_processor
    rng = np.random.default_rng(7)
    sizes = [(int(h), int(w)) for h, w in rng.integers(1, 4000, (2500, 2))]
    sizes += [(int(h), int(w)) for h, w in rng.integers(1, 120, (500, 2))]
    sizes += [(s, s) for s in range(440, 4000, 9)]  # square: 1 x n and n x 1 tie, the rows win
    half_even_cases = 0
    for downsample in ("16x", "4x"):
        cfg = mcv.MiniCPMVConfig(downsample_mode=downsample)
        for h, w in sizes:
            grid = ip.get_sliced_grid((h, w), 9, 448)
            source = ip.find_best_resize((h, w), 448, 14, downsample, allow_upscale=grid is None)
            plan = mcv.plan_slices(h, w, cfg)
            assert plan.grid == (tuple(grid) if grid else (0, 0)), (h, w)
            assert plan.source == tuple(source), (h, w)
            if grid:
                refine = ip.get_refine_size((h, w), grid, 448, 14, downsample, allow_upscale=True)
                assert plan.refine == tuple(refine), (h, w)
            a = 448 / math.sqrt(w / h)
            x = int(a) / cfg.align
            half_even_cases += round(x) != math.floor(x + 0.5)
    assert half_even_cases > 0


def test_single_mode_is_tiled_source_view() -> None:
    rgb = _image(400, 700)
    tiled = mcv.preprocess(rgb, mcv.MiniCPMVConfig(mode="tiled"))
    single = mcv.preprocess(rgb, mcv.MiniCPMVConfig(mode="single"))
    assert single.n_tiles == 1 and tiled.n_tiles == 3
    assert np.array_equal(single.views[0], tiled.views[0])
    assert single.prompt_text == tiled.prompt_text.split("<slice>")[0]


def test_broken_rule_is_caught() -> None:
    """The comparison is sensitive: bilinear instead of bicubic resampling, or a source view
    resized without the processor's rounding, does not pass."""
    rgb = _image(400, 700)
    ref = _reference(rgb, "tiled", "16x")
    bilinear = mcv.preprocess(rgb, mcv.MiniCPMVConfig(resample=Image.Resampling.BILINEAR))
    assert not np.array_equal(bilinear.navit_pixel_values(), ref["pixel_values"])
    wrong_mode = mcv.preprocess(rgb, mcv.MiniCPMVConfig(downsample_mode="4x"))
    assert wrong_mode.target_sizes.tolist() != ref["target_sizes"].tolist()


def test_budget_refusals() -> None:
    cfg = mcv.MiniCPMVConfig()
    plan = mcv.plan_slices(2448, 3264, cfg)
    assert plan.grid == (3, 3) and plan.n_image_tokens > 500
    mcv.check_budget(plan, max_image_tokens=plan.n_image_tokens, max_image_pixels=1 << 24)
    cases = [
        (dict(max_image_tokens=plan.n_image_tokens - 1), "image tokens"),
        (dict(max_image_pixels=2448 * 3264 - 1), "more than max_image_pixels"),
    ]
    small = mcv.plan_slices(500, 300, cfg)  # upscaled: its source view has more pixels than the frame
    assert small.resized_pixels > 500 * 300
    for p, kw, words in [(plan, *c) for c in cases] + [(small, dict(max_image_pixels=500 * 300), "resizes to")]:
        with pytest.raises(mcv.ImageRefused, match=words) as err:
            mcv.check_budget(p, **kw)  # type: ignore[arg-type]
        assert "\n" not in str(err.value)
    # A 1 x 100000 strip passes the frame's own pixel limit but its source view is 56 x 100016.
    strip = np.zeros((1, 100_000, 3), dtype=np.uint8)
    with pytest.raises(mcv.ImageRefused, match="resizes to 5600896 pixels"):
        mcv.preprocess(strip, mcv.MiniCPMVConfig(mode="single"), max_image_pixels=1 << 20)


def test_from_mmproj_metadata() -> None:
    meta = {"clip.projector_type": "minicpmv4_6", "clip.vision.image_size": 448, "clip.vision.patch_size": 14,
            "clip.vision.image_mean": [0.5, 0.5, 0.5], "clip.vision.image_std": [0.5, 0.5, 0.5],
            "clip.vision.projector.scale_factor": 4}
    cfg = mcv.MiniCPMVConfig.from_mmproj_metadata(meta, "single")
    assert cfg == mcv.MiniCPMVConfig(mode="single")
    assert mcv.MiniCPMVConfig.from_mmproj_metadata({**meta, "clip.vision.projector.scale_factor": 2},
                                                   "tiled").downsample_mode == "4x"
    for bad, words in (({"clip.projector_type": "idefics3"}, "for 'minicpmv4_6'"),
                       ({"clip.vision.projector.scale_factor": 3}, "4 \\(16x\\) or 2 \\(4x\\)")):
        with pytest.raises(ValueError, match=words):
            mcv.MiniCPMVConfig.from_mmproj_metadata({**meta, **bad}, "tiled")
    with pytest.raises(ValueError, match="mode must be one of"):
        mcv.MiniCPMVConfig.from_mmproj_metadata(meta, "tiles")
