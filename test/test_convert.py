"""The SmolVLM converter and our GGUF writer, checked against Hugging Face on a random SmolVLM.

A randomly initialised SmolVLM-256M-shaped checkpoint (2 text and 2 vision layers; see
test/hf_fixtures.py) is converted at f32, f16, q8_0, q4_0 and q4_1, then every tensor is read back
through the engine's GGUF reader and compared with the Hugging Face tensor, and the text GGUF is run by
the engine against transformers.

Tolerances (per tensor, x = HF value after the q/k permutation, x̂ = value read back):
* F32: bit-exact.
* F16: exactly numpy's round-to-nearest-even float16 of x.
* Q8_0: per block of 32, |x - x̂| ≤ amax·(0.5/127 + 2⁻¹¹) — half a quantization step plus the
  float16 rounding of the block scale (127 steps of it).
* Q4_0: per block, |x - x̂| ≤ amax·(1/8)·(1 + 8·2⁻¹¹) — one step (the value opposite the block's
  extreme is clamped to level 15) plus the scale's float16 rounding.
* Q4_1: per block, |x - x̂| ≤ (max - min)/15·(0.5 + 15·2⁻¹¹) + |min|·2⁻¹¹.
Logits: f32 file vs transformers, relative L2 per position ≤ 1e-4 and the same top-1 token; quantized
files vs transformers running the same (dequantized) weights, the same bounds.
"""

from __future__ import annotations

import contextlib
import copy
import json
import shutil
import struct
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edgevlm_ros import _engine
from edgevlm_ros.engine.tokenizer import Tokenizer
from edgevlm_ros.tools.convert import convert
from edgevlm_ros.tools.convert_cli import main
from edgevlm_ros.tools.gguf_writer import GGMLType, GGUFValueType, GGUFWriter, resolve_tensor_type
from edgevlm_ros.tools.quant_mix import TensorSpec, plan_types

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_fixtures as fx  # noqa: E402

TYPES = ["f32", "f16", "q8_0", "q4_0", "q4_1"]
NAME = "smolvlm-random"
N_TEXT, N_VISION = 2, 2
TEXT_HIDDEN, N_HEAD, N_HEAD_KV, HEAD_DIM = 576, 9, 3, 64
V_WIDTH, V_FF, PATCH, IMAGE, SCALE = 768, 3072, 16, 512, 4

PROMPTS = [
    "Hello, robot! 2 + 2 = 4.",
    "<|im_start|>User:<image>Describe the scene in one sentence.<end_of_utterance>\nAssistant:",
    "<fake_token_around_image><row_1_col_1><image><image><fake_token_around_image> The 3 boxes are red",
]

TOKENIZER_CASES = [
    "",
    "Hello world",
    "  leading and trailing spaces  ",
    "0x1F  99 bottles, 3.14159 and 1,000,000",
    "<image>",
    "<row_1_col_2>",
    "<end_of_utterance>",
    "User:<image><row_1_col_2><row_6_col_6><global-img>What is this?<end_of_utterance>\nAssistant:",
    "<|im_start|>system\nYou are a robot.<|im_end|>\n",
    "Ünïcödé façade — 東京 🤖 émoji\t\ttabs\nnew lines\r\n",
    "<fake_token_around_image><image><image><fake_token_around_image>",
    "<imag e> <row_7_col_1> not tokens",
]


# -- the layout, written out independently of the converter -----------------------------------------


def text_layout(tied: bool = True) -> dict[str, tuple[str, tuple[int, ...]]]:
    """GGUF name -> (HF name, numpy shape) of the text decoder."""
    t = "model.text_model."
    q, kv = N_HEAD * HEAD_DIM, N_HEAD_KV * HEAD_DIM
    out = {
        "token_embd.weight": (t + "embed_tokens.weight", (fx.VOCAB_SIZE, TEXT_HIDDEN)),
        "output_norm.weight": (t + "norm.weight", (TEXT_HIDDEN,)),
    }
    for i in range(N_TEXT):
        lp = f"{t}layers.{i}."
        out.update({
            f"blk.{i}.attn_norm.weight": (lp + "input_layernorm.weight", (TEXT_HIDDEN,)),
            f"blk.{i}.attn_q.weight": (lp + "self_attn.q_proj.weight", (q, TEXT_HIDDEN)),
            f"blk.{i}.attn_k.weight": (lp + "self_attn.k_proj.weight", (kv, TEXT_HIDDEN)),
            f"blk.{i}.attn_v.weight": (lp + "self_attn.v_proj.weight", (kv, TEXT_HIDDEN)),
            f"blk.{i}.attn_output.weight": (lp + "self_attn.o_proj.weight", (TEXT_HIDDEN, q)),
            f"blk.{i}.ffn_norm.weight": (lp + "post_attention_layernorm.weight", (TEXT_HIDDEN,)),
            f"blk.{i}.ffn_gate.weight": (lp + "mlp.gate_proj.weight", (1536, TEXT_HIDDEN)),
            f"blk.{i}.ffn_up.weight": (lp + "mlp.up_proj.weight", (1536, TEXT_HIDDEN)),
            f"blk.{i}.ffn_down.weight": (lp + "mlp.down_proj.weight", (TEXT_HIDDEN, 1536)),
        })
    if not tied:
        out["output.weight"] = ("lm_head.weight", (fx.VOCAB_SIZE, TEXT_HIDDEN))
    return out


def vision_layout() -> dict[str, tuple[str, tuple[int, ...]]]:
    """GGUF name -> (HF name, numpy shape) of the mmproj file."""
    v = "model.vision_model."
    out = {
        "v.patch_embd.weight": (v + "embeddings.patch_embedding.weight", (V_WIDTH, 3, PATCH, PATCH)),
        "v.patch_embd.bias": (v + "embeddings.patch_embedding.bias", (V_WIDTH,)),
        "v.position_embd.weight": (v + "embeddings.position_embedding.weight", ((IMAGE // PATCH) ** 2, V_WIDTH)),
        "v.post_ln.weight": (v + "post_layernorm.weight", (V_WIDTH,)),
        "v.post_ln.bias": (v + "post_layernorm.bias", (V_WIDTH,)),
        "mm.model.fc.weight": ("model.connector.modality_projection.proj.weight",
                               (TEXT_HIDDEN, V_WIDTH * SCALE * SCALE)),
    }
    parts = {
        "attn_q": ("self_attn.q_proj", (V_WIDTH, V_WIDTH)),
        "attn_k": ("self_attn.k_proj", (V_WIDTH, V_WIDTH)),
        "attn_v": ("self_attn.v_proj", (V_WIDTH, V_WIDTH)),
        "attn_out": ("self_attn.out_proj", (V_WIDTH, V_WIDTH)),
        "ln1": ("layer_norm1", (V_WIDTH,)),
        "ln2": ("layer_norm2", (V_WIDTH,)),
        "ffn_up": ("mlp.fc1", (V_FF, V_WIDTH)),
        "ffn_down": ("mlp.fc2", (V_WIDTH, V_FF)),
    }
    for i in range(N_VISION):
        for g, (h, shape) in parts.items():
            out[f"v.blk.{i}.{g}.weight"] = (f"{v}encoder.layers.{i}.{h}.weight", shape)
            out[f"v.blk.{i}.{g}.bias"] = (f"{v}encoder.layers.{i}.{h}.bias", (shape[0],))
    return out


def expected_type(gguf_name: str, shape: tuple[int, ...], wtype: str) -> str:
    if len(shape) == 1 or gguf_name in ("v.patch_embd.weight", "v.position_embd.weight"):
        return "F32"
    if gguf_name == "token_embd.weight" and wtype in ("q4_0", "q4_1"):
        return "Q8_0"  # tied output head stays at 8 bits
    return wtype.upper()


def permute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    hd = w.shape[0] // n_head
    return w.reshape(n_head, 2, hd // 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    hd = w.shape[0] // n_head
    return w.reshape(n_head, hd // 2, 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)


def reference(gguf_name: str, x: np.ndarray) -> np.ndarray:
    """The HF tensor as the GGUF should hold it: text q/k rows permuted, everything else as is."""
    if gguf_name.startswith("blk.") and ".attn_q." in gguf_name:
        return permute_rope(x, N_HEAD)
    if gguf_name.startswith("blk.") and ".attn_k." in gguf_name:
        return permute_rope(x, N_HEAD_KV)
    return x


def block_error_ok(kind: str, x: np.ndarray, got: np.ndarray) -> tuple[bool, float]:
    """(within the format's bound, largest error as a fraction of the block's amax)."""
    if kind == "F32":
        return bool(np.array_equal(x, got)), float(np.abs(x - got).max())
    if kind == "F16":
        return bool(np.array_equal(x.astype(np.float16).astype(np.float32), got)), 0.0
    xb = x.reshape(-1, 32).astype(np.float64)
    gb = got.reshape(-1, 32).astype(np.float64)
    err = np.abs(xb - gb).max(axis=1)
    amax = np.abs(xb).max(axis=1)
    eps = 1e-7 * amax + 1e-12
    if kind == "Q8_0":
        bound = amax * (0.5 / 127 + 2.0**-11)
    elif kind == "Q4_0":
        bound = amax / 8 * (1 + 8 * 2.0**-11)
    elif kind == "Q4_1":
        lo, hi = xb.min(axis=1), xb.max(axis=1)
        bound = (hi - lo) / 15 * (0.5 + 15 * 2.0**-11) + np.abs(lo) * 2.0**-11
    else:
        raise AssertionError(kind)
    frac = float((err / np.maximum(amax, 1e-30)).max())
    return bool(np.all(err <= bound + eps)), frac


# -- fixtures -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_dir() -> Path:
    assert (fx.GGUF_DIR / fx.GGUF_NAME).exists(), "models/SmolLM2-135M-Instruct.Q4_1.gguf is missing: run make setup"
    return fx.cached_random_smolvlm(text_layers=N_TEXT, vision_layers=N_VISION)


@pytest.fixture(scope="module")
def converted(hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[Path, Path]]]:
    out = tmp_path_factory.mktemp("gguf")
    yield {t: convert(hf_dir, out, t, name=NAME) for t in TYPES}
    shutil.rmtree(out, ignore_errors=True)  # ~0.5 GB: not kept until the session ends


@pytest.fixture(scope="module")
def hf_tensors(hf_dir: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(hf_dir / "model.safetensors"))


@pytest.fixture(scope="module")
def hf_model(hf_dir: Path) -> Any:
    import torch

    torch.set_num_threads(2)
    return fx.load_hf_model(hf_dir)


@pytest.fixture(scope="module")
def hf_tokenizer(hf_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(hf_dir))


def hf_logits(model: Any, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float().numpy()


def assert_logits_close(ours: np.ndarray, ref: np.ndarray, rel_tol: float = 1e-4) -> float:
    assert ours.shape == ref.shape
    rel = np.linalg.norm(ours - ref, axis=-1) / np.linalg.norm(ref, axis=-1)
    assert rel.max() <= rel_tol, f"relative L2 per position {rel}"
    np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))
    return float(rel.max())


@contextlib.contextmanager
def reference_kernels() -> Iterator[None]:
    """Models loaded inside use the scalar reference kernels, which compute with float activations.

    Optimized kernels for quantized weights may round activations to 8 bits (as llama.cpp does); that
    is the engine's business, not the file's, and would blur a check of what the file holds.
    """
    if not hasattr(_engine, "load_optable"):  # an engine without an operator table computes in float
        yield
        return
    from edgevlm_ros.engine import optable

    optable.activate_text("matmul * * any - ref\nattention * * any - ref\n", "test_convert: reference kernels")
    try:
        yield
    finally:
        optable.activate()


def variant_dir(hf_dir: Path, dest: Path, drop: tuple[str, ...] = (),
                edit: dict[str, Callable[[dict[str, Any]], None]] | None = None) -> Path:
    """A copy of the checkpoint made of symlinks, minus `drop`, with JSON files edited in place."""
    dest.mkdir()
    for f in hf_dir.iterdir():
        if f.name not in drop and not f.name.startswith("."):
            (dest / f.name).symlink_to(f)
    for name, fn in (edit or {}).items():
        data = json.loads((hf_dir / name).read_text())
        fn(data)
        (dest / name).unlink()
        (dest / name).write_text(json.dumps(data))
    return dest


def write_shards(src: dict[str, np.ndarray], dest: Path, *, bf16: bool = False, skip: str | None = None) -> None:
    """model-0000N-of-00002.safetensors + model.safetensors.index.json, like a published sharded checkpoint."""
    import torch
    from safetensors.torch import save_file

    names = sorted(n for n in src if n != skip)
    halves = [names[: len(names) // 2], names[len(names) // 2 :]]
    weight_map = {}
    for k, part in enumerate(halves, 1):
        fname = f"model-{k:05d}-of-00002.safetensors"
        tensors = {n: torch.from_numpy(src[n]) for n in part}
        if bf16:
            tensors = {n: t.to(torch.bfloat16) for n, t in tensors.items()}
        save_file(tensors, str(dest / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    (dest / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


# -- (a) every tensor read back equals the HF tensor -----------------------------------------------------


@pytest.mark.parametrize("wtype", TYPES)
def test_tensors_read_back_equal_hf(converted: dict[str, tuple[Path, Path]], hf_tensors: dict[str, np.ndarray],
                                    wtype: str) -> None:
    text_path, mmproj_path = converted[wtype]
    assert text_path.name == f"{NAME}-{wtype}.gguf"
    assert mmproj_path.name == f"mmproj-{NAME}-{wtype}.gguf"
    worst: dict[str, float] = {}
    for path, layout in ((text_path, text_layout()), (mmproj_path, vision_layout())):
        g = _engine.GGUFFile(str(path))
        infos = {t["name"]: t for t in g.tensors()}
        assert set(infos) == set(layout)
        for gname, (hname, shape) in layout.items():
            info = infos[gname]
            assert tuple(info["shape"]) == shape[::-1], gname  # ggml order
            kind = expected_type(gname, shape, wtype)
            assert info["type"] == kind, gname
            assert info["offset"] % 32 == 0
            x = reference(gname, hf_tensors[hname])
            got = g.dequantize(gname)
            assert got.shape == shape
            ok, frac = block_error_ok(kind, x, got)
            assert ok, f"{gname} ({kind}): error beyond the format's bound (max {frac:.3g} of block amax)"
            worst[kind] = max(worst.get(kind, 0.0), frac)
    print(f"{wtype}: worst error / block amax per format: {worst}")


def test_quantized_blocks_are_the_engines_reference_encoding(converted: dict[str, tuple[Path, Path]],
                                                             hf_tensors: dict[str, np.ndarray]) -> None:
    # Byte-level: the writer stores exactly what _engine.quantize produces, row by row.
    for wtype in ("q8_0", "q4_0", "q4_1", "f16"):
        path = converted[wtype][0]
        raw = path.read_bytes()
        g = _engine.GGUFFile(str(path))
        info = next(t for t in g.tensors() if t["name"] == "blk.1.ffn_down.weight")
        x = hf_tensors["model.text_model.layers.1.mlp.down_proj.weight"]
        start = info["offset"]  # the reader reports absolute file offsets
        row_bytes = info["nbytes"] // x.shape[0]
        for r in (0, 17, x.shape[0] - 1):
            want = _engine.quantize(wtype.upper(), np.ascontiguousarray(x[r])).tobytes()
            assert raw[start + r * row_bytes : start + (r + 1) * row_bytes] == want


# -- (b) the text GGUF runs like the HF text model ------------------------------------------------------


def test_f32_text_logits_match_hf(converted: dict[str, tuple[Path, Path]], hf_model: Any, hf_tokenizer: Any) -> None:
    import edgevlm_ros

    model = edgevlm_ros.load(converted["f32"][0], threads=2)
    assert model.config["n_vocab"] == fx.VOCAB_SIZE
    worst = 0.0
    for prompt in PROMPTS:
        ids = hf_tokenizer.encode(prompt, add_special_tokens=False)
        assert len(ids) >= 8
        worst = max(worst, assert_logits_close(model.logits(ids), hf_logits(hf_model, ids)))
    print(f"f32 text logits: worst relative L2 {worst:.3g}")


def test_f32_greedy_generation_matches_hf(converted: dict[str, tuple[Path, Path]], hf_model: Any,
                                          hf_tokenizer: Any) -> None:
    import torch

    import edgevlm_ros

    model = edgevlm_ros.load(converted["f32"][0], threads=2)
    ids = hf_tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    ours = model.generate_ids(ids, max_new_tokens=12).token_ids
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(ids):].tolist()
    assert len(set(ref)) > 3, f"degenerate fixture: greedy output {ref}"
    assert ours == ref[: len(ours)]
    assert len(ours) == 12 or ref[len(ours)] in model.stop_ids


@pytest.mark.parametrize("wtype", ["f16", "q8_0", "q4_0", "q4_1"])
def test_quantized_text_logits_match_hf_on_the_same_weights(converted: dict[str, tuple[Path, Path]], hf_model: Any,
                                                            hf_tokenizer: Any, wtype: str) -> None:
    """The quantized file, run by the engine, equals transformers running the dequantized weights:
    so the file holds the right tensors in the right places for every format."""
    worst = logits_match_dequantized(converted[wtype][0], hf_model, hf_tokenizer)
    print(f"{wtype} text logits vs transformers on the dequantized weights: worst relative L2 {worst:.3g}")


def logits_match_dequantized(path: Path, hf_model: Any, hf_tokenizer: Any) -> float:
    """Asserts the engine running the text GGUF `path` gives the logits of transformers running that
    file's weights, dequantized; returns the worst relative L2 error."""
    import torch

    import edgevlm_ros

    g = _engine.GGUFFile(str(path))
    state = {}
    for gname, (hname, _) in text_layout().items():
        w = g.dequantize(gname)
        if ".attn_q." in gname:
            w = unpermute_rope(w, N_HEAD)
        elif ".attn_k." in gname:
            w = unpermute_rope(w, N_HEAD_KV)
        state[hname] = torch.from_numpy(np.ascontiguousarray(w))
    state["lm_head.weight"] = state["model.text_model.embed_tokens.weight"]
    ref_model = copy.deepcopy(hf_model)
    ref_model.load_state_dict(state, strict=False)
    with reference_kernels():
        model = edgevlm_ros.load(path, threads=2)
    worst = 0.0
    for prompt in PROMPTS[:2]:
        ids = hf_tokenizer.encode(prompt, add_special_tokens=False)
        worst = max(worst, assert_logits_close(model.logits(ids), hf_logits(ref_model, ids)))
    return worst


def test_k_quant_mix_conversion(hf_dir: Path, hf_tensors: dict[str, np.ndarray], hf_model: Any, hf_tokenizer: Any,
                                tmp_path: Path) -> None:
    """--type q4_k_m: the text decoder as edgevlm quantize's mix (576-wide rows fall back to Q5_0, the
    1536-wide ffn_down rows stay K-quants), the mmproj as Q8_0; the engine runs it like transformers
    runs its dequantized weights."""
    text_path, mmproj_path = convert(hf_dir, tmp_path, "q4_k_m", name=NAME)
    g = _engine.GGUFFile(str(text_path))
    types = {t["name"]: t["type"] for t in g.tensors()}
    specs = [TensorSpec(n, shape, GGMLType.F32) for n, (_, shape) in text_layout().items()]
    assert types == {n: t.name for n, t in plan_types(specs, "q4_k_m", N_TEXT).items()}
    # of 2 layers the last gets more bits: its attn_v Q6_K -> Q8_0 (fallback), its ffn_down Q6_K
    assert (types["token_embd.weight"], types["blk.0.attn_v.weight"], types["blk.1.attn_v.weight"]) == \
        ("Q8_0", "Q5_0", "Q8_0")
    assert (types["blk.0.ffn_down.weight"], types["blk.1.ffn_down.weight"]) == ("Q4_K", "Q6_K")
    assert g.metadata()["general.file_type"] == 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    raw = text_path.read_bytes()
    for gname, hname in (("blk.1.ffn_down.weight", "model.text_model.layers.1.mlp.down_proj.weight"),
                         ("blk.1.attn_q.weight", "model.text_model.layers.1.self_attn.q_proj.weight")):
        info = next(t for t in g.tensors() if t["name"] == gname)
        x = reference(gname, hf_tensors[hname])
        row_bytes = info["nbytes"] // x.shape[0]
        want = _engine.quantize(info["type"], np.ascontiguousarray(x[3])).tobytes()
        assert raw[info["offset"] + 3 * row_bytes : info["offset"] + 4 * row_bytes] == want, gname
    for t in _engine.GGUFFile(str(mmproj_path)).tensors():
        shape = tuple(t["shape"][::-1])
        assert t["type"] == expected_type(t["name"], shape, "q8_0"), t["name"]
    worst = logits_match_dequantized(text_path, hf_model, hf_tokenizer)
    print(f"q4_k_m text logits vs transformers on the dequantized weights: worst relative L2 {worst:.3g}")


# -- (c) the tokenizer built from the GGUF equals the HF tokenizer -----------------------------------------


@pytest.fixture(scope="module")
def gguf_tokenizer(converted: dict[str, tuple[Path, Path]]) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(_engine.GGUFFile(str(converted["q8_0"][0])).metadata())


@pytest.mark.parametrize("text", TOKENIZER_CASES)
def test_tokenizer_matches_hf(gguf_tokenizer: Tokenizer, hf_tokenizer: Any, text: str) -> None:
    want = hf_tokenizer.encode(text, add_special_tokens=False)
    assert gguf_tokenizer.encode(text, add_bos=False) == want
    assert gguf_tokenizer.encode(text) == hf_tokenizer.encode(text)  # the files' own BOS/EOS rules
    assert gguf_tokenizer.decode(want) == hf_tokenizer.decode(want)


def test_tokenizer_special_ids(gguf_tokenizer: Tokenizer) -> None:
    assert gguf_tokenizer.encode("<image>") == [fx.IMAGE_TOKEN_ID]
    assert gguf_tokenizer.encode("<row_1_col_2>") == [49154]
    assert gguf_tokenizer.encode("<global-img><fake_token_around_image>") == [fx.GLOBAL_IMG_ID, fx.FAKE_TOKEN_ID]
    assert gguf_tokenizer.encode("<end_of_utterance>") == [fx.END_OF_UTTERANCE_ID]
    assert gguf_tokenizer.encode("2025") == [gguf_tokenizer.encode(d)[0] for d in "2025"]  # digits split
    assert gguf_tokenizer.eos_id == fx.END_OF_UTTERANCE_ID
    assert fx.END_OF_UTTERANCE_ID in gguf_tokenizer.eot_ids


def test_vocabulary_carries_smollm2s_exactly(converted: dict[str, tuple[Path, Path]]) -> None:
    meta = _engine.GGUFFile(str(converted["f16"][0])).metadata()
    base = _engine.GGUFFile(str(fx.GGUF_DIR / fx.GGUF_NAME)).metadata()
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == fx.VOCAB_SIZE
    assert tokens[: fx.BASE_VOCAB] == base["tokenizer.ggml.tokens"]
    assert types[: fx.BASE_VOCAB] == base["tokenizer.ggml.token_type"]
    assert meta["tokenizer.ggml.merges"] == base["tokenizer.ggml.merges"]
    assert tokens[fx.BASE_VOCAB :] == fx.smolvlm_added_tokens()
    assert set(types[fx.BASE_VOCAB :]) == {3}  # added as special -> control
    assert meta["tokenizer.ggml.pre"] == base["tokenizer.ggml.pre"] == "smollm"


# -- (d) metadata and names are llama.cpp's layouts ---------------------------------------------------


def test_text_metadata(converted: dict[str, tuple[Path, Path]]) -> None:
    meta = _engine.GGUFFile(str(converted["q4_0"][0])).metadata()
    expected = {
        "general.alignment": 32,
        "general.architecture": "llama",
        "general.type": "model",
        "general.name": NAME,
        "general.file_type": 2,
        "general.quantization_version": 2,
        "llama.vocab_size": fx.VOCAB_SIZE,
        "llama.context_length": 8192,
        "llama.embedding_length": TEXT_HIDDEN,
        "llama.feed_forward_length": 1536,
        "llama.block_count": N_TEXT,
        "llama.attention.head_count": N_HEAD,
        "llama.attention.head_count_kv": N_HEAD_KV,
        "llama.rope.freq_base": 100000.0,
        "llama.attention.layer_norm_rms_epsilon": pytest.approx(1e-5),
        "llama.rope.dimension_count": HEAD_DIM,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": fx.END_OF_UTTERANCE_ID,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.padding_token_id": 2,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.ggml.add_eos_token": False,
        "tokenizer.ggml.add_space_prefix": False,
        "tokenizer.chat_template": fx.SMOLVLM_CHAT_TEMPLATE,
    }
    arrays = {"tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"}
    assert set(meta) == set(expected) | arrays
    for key, value in expected.items():
        assert meta[key] == value, key
    # Every kind of key the published SmolLM2 GGUF carries for the model and tokenizer is here too.
    base = _engine.GGUFFile(str(fx.GGUF_DIR / fx.GGUF_NAME)).metadata()
    wanted = {k for k in base if k.startswith(("llama.", "tokenizer.")) or k in ("general.architecture",
                                                                                  "general.file_type")}
    assert wanted <= set(meta)
    assert [_engine.GGUFFile(str(converted[t][0])).metadata()["general.file_type"] for t in TYPES] == [0, 1, 7, 2, 3]


def test_mmproj_metadata(converted: dict[str, tuple[Path, Path]]) -> None:
    for wtype, ftype in (("f16", 1), ("q8_0", 7)):
        meta = _engine.GGUFFile(str(converted[wtype][1])).metadata()
        expected: dict[str, Any] = {
            "general.alignment": 32,
            "general.architecture": "clip",
            "general.type": "mmproj",
            "general.name": NAME,
            "general.file_type": ftype,
            "clip.has_vision_encoder": True,
            "clip.has_text_encoder": False,
            "clip.projector_type": "idefics3",
            "clip.use_gelu": True,
            "clip.vision.image_size": IMAGE,
            "clip.vision.patch_size": PATCH,
            "clip.vision.embedding_length": V_WIDTH,
            "clip.vision.feed_forward_length": V_FF,
            "clip.vision.block_count": N_VISION,
            "clip.vision.attention.head_count": 12,
            "clip.vision.attention.layer_norm_epsilon": pytest.approx(1e-6),
            "clip.vision.projection_dim": TEXT_HIDDEN,
            "clip.vision.image_mean": [0.5, 0.5, 0.5],
            "clip.vision.image_std": [0.5, 0.5, 0.5],
            "clip.vision.projector.scale_factor": SCALE,
            "clip.vision.preproc_image_size": 2048,
        }
        if wtype == "q8_0":
            expected["general.quantization_version"] = 2
        assert set(meta) == set(expected)
        for key, value in expected.items():
            assert meta[key] == value, key


def test_mmproj_metadata_value_types(converted: dict[str, tuple[Path, Path]]) -> None:
    # llama.cpp reads these with typed getters: counts are uint32, eps float32, mean/std float32 arrays.
    import gguf

    r = gguf.GGUFReader(str(converted["f16"][1]))
    types = {k: f.types for k, f in r.fields.items() if not k.startswith("GGUF.")}
    V = gguf.GGUFValueType
    assert types["clip.vision.image_size"] == [V.UINT32]
    assert types["clip.vision.projector.scale_factor"] == [V.UINT32]
    assert types["clip.vision.attention.layer_norm_epsilon"] == [V.FLOAT32]
    assert types["clip.vision.image_mean"] == [V.ARRAY, V.FLOAT32]
    assert types["clip.use_gelu"] == [V.BOOL]
    assert types["clip.projector_type"] == [V.STRING]


# -- other checkpoint forms ----------------------------------------------------------------------------


def test_untied_head_is_written_as_output_weight(hf_dir: Path, hf_tensors: dict[str, np.ndarray],
                                                 tmp_path: Path) -> None:
    def untie(cfg: dict[str, Any]) -> None:
        cfg["tie_word_embeddings"] = False
        cfg["text_config"]["tie_word_embeddings"] = False

    src = variant_dir(hf_dir, tmp_path / "untied", drop=("model.safetensors",), edit={"config.json": untie})
    head = np.ascontiguousarray(hf_tensors["model.text_model.embed_tokens.weight"][::-1])
    write_shards({**hf_tensors, "lm_head.weight": head}, src)
    text, _ = convert(src, tmp_path / "out", "q4_0")
    g = _engine.GGUFFile(str(text))
    infos = {t["name"]: t for t in g.tensors()}
    assert set(infos) == set(text_layout(tied=False))
    assert infos["output.weight"]["type"] == "Q8_0"
    assert infos["token_embd.weight"]["type"] == "Q4_0"
    ok, _ = block_error_ok("Q8_0", head, g.dequantize("output.weight"))
    assert ok


def test_sharded_bf16_checkpoint(hf_dir: Path, hf_tensors: dict[str, np.ndarray], tmp_path: Path) -> None:
    """A BF16 checkpoint in shards, written as F32 and as BF16 (`--type bf16`, the checkpoint's own
    format: lossless, so every matrix reads back bit for bit)."""
    import torch

    src = variant_dir(hf_dir, tmp_path / "bf16", drop=("model.safetensors",))
    write_shards(hf_tensors, src, bf16=True)
    for wtype in ("f32", "bf16"):
        text, mmproj = convert(src, tmp_path / wtype, wtype, name="x")
        assert _engine.GGUFFile(str(text)).metadata()["general.file_type"] == {"f32": 0, "bf16": 32}[wtype]
        for path, layout in ((text, text_layout()), (mmproj, vision_layout())):
            g = _engine.GGUFFile(str(path))
            types = {t["name"]: t["type"] for t in g.tensors()}
            for gname, (hname, shape) in layout.items():
                assert types[gname] == expected_type(gname, shape, wtype), gname
                want = torch.from_numpy(hf_tensors[hname]).to(torch.bfloat16).float().numpy()
                np.testing.assert_array_equal(g.dequantize(gname), reference(gname, want), err_msg=gname)


def test_vocab_shorter_than_embeddings_is_padded(hf_dir: Path, tmp_path: Path) -> None:
    cut = 49200

    def drop_tail(tj: dict[str, Any]) -> None:
        tj["added_tokens"] = [t for t in tj["added_tokens"] if t["id"] < cut]

    src = variant_dir(hf_dir, tmp_path / "short", edit={"tokenizer.json": drop_tail})
    (src / "tokenizer_config.json").unlink()  # it names <end_of_utterance> as eos; fall back to config.json
    text, _ = convert(src, tmp_path / "out", "f16")
    meta = _engine.GGUFFile(str(text)).metadata()
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    assert len(tokens) == fx.VOCAB_SIZE
    assert tokens[cut:] == [f"[PAD{i}]" for i in range(cut, fx.VOCAB_SIZE)]
    assert set(types[cut:]) == {5}
    assert meta["tokenizer.ggml.eos_token_id"] == 2  # text_config.eos_token_id
    assert "tokenizer.chat_template" in meta  # from chat_template.jinja


# -- (e) bad inputs are refused, clearly, before anything is written --------------------------------------


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(d: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        for p in parents:
            d = d[p]
        if value is _DELETE:
            del d[last]
        else:
            d[last] = value

    return edit


_DELETE = object()


@pytest.mark.parametrize(
    ("drop", "edit", "message"),
    [
        (("config.json",), {}, r"config\.json is missing"),
        ((), {"config.json": _set("model_type", "llava")}, r"model_type 'llava' is not supported"),
        ((), {"config.json": _set("text_config.hidden_size", _DELETE)}, r"text_config has no 'hidden_size'"),
        ((), {"config.json": _set("scale_factor", _DELETE)}, r"no 'scale_factor'"),
        ((), {"config.json": _set("image_token_id", _DELETE)}, r"no 'image_token_id'"),
        ((), {"config.json": _set("vision_config", _DELETE)}, r"no 'vision_config'"),
        ((), {"config.json": _set("text_config.model_type", "qwen2")}, r"text_config\.model_type 'qwen2'"),
        ((), {"config.json": _set("text_config.rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4})},
         r"RoPE scaling 'yarn'"),
        ((), {"config.json": _set("text_config.intermediate_size", 2048)},
         r"mlp\.gate_proj\.weight' has shape \[1536, 576\], config\.json implies \[2048, 576\]"),
        ((), {"config.json": _set("vision_config.hidden_act", "relu")}, r"hidden_act 'relu'"),
        ((), {"tokenizer.json": _set("pre_tokenizer", {"type": "Metaspace"})}, r"unsupported pre-tokenizer"),
        ((), {"tokenizer.json": _set("model.type", "Unigram")}, r"only byte-level BPE"),
        (("tokenizer.json",), {}, r"tokenizer\.json is missing"),
        (("preprocessor_config.json", "processor_config.json"), {}, r"no preprocessor_config\.json"),
        (("model.safetensors",), {}, r"no model\.safetensors"),
        ((), {"config.json": lambda c: (_set("tie_word_embeddings", False)(c),
                                        _set("text_config.tie_word_embeddings", False)(c))},
         r"missing tensor 'lm_head\.weight' and config\.json says the output head is not tied"),
    ],
)
def test_bad_checkpoint_is_refused(hf_dir: Path, tmp_path: Path, drop: tuple[str, ...],
                                   edit: dict[str, Callable[[dict[str, Any]], None]], message: str) -> None:
    src = variant_dir(hf_dir, tmp_path / "bad", drop=drop, edit=edit)
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=message):
        convert(src, out, "f16")
    assert not out.exists() or not list(out.iterdir())


@pytest.mark.parametrize("missing", ["model.text_model.layers.1.self_attn.k_proj.weight",
                                     "model.vision_model.encoder.layers.0.mlp.fc2.bias",
                                     "model.connector.modality_projection.proj.weight"])
def test_missing_tensor_is_refused(hf_dir: Path, hf_tensors: dict[str, np.ndarray], tmp_path: Path,
                                   missing: str) -> None:
    src = variant_dir(hf_dir, tmp_path / "bad", drop=("model.safetensors",))
    write_shards(hf_tensors, src, skip=missing)
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=rf"missing tensor '{missing}'"):
        convert(src, out, "q8_0")
    assert not out.exists() or not list(out.iterdir())


def test_unknown_tensor_and_bad_arguments_are_refused(hf_dir: Path, hf_tensors: dict[str, np.ndarray],
                                                      tmp_path: Path) -> None:
    src = variant_dir(hf_dir, tmp_path / "extra", drop=("model.safetensors",))
    extra = "model.text_model.layers.0.self_attn.q_norm.weight"
    write_shards({**hf_tensors, extra: np.ones(64, np.float32)}, src)
    with pytest.raises(ValueError, match=rf"does not know: {extra}"):
        convert(src, tmp_path / "out", "f16")
    with pytest.raises(ValueError, match=r"unknown weight type 'q5_k'"):
        convert(hf_dir, tmp_path / "out", "q5_k")
    with pytest.raises(ValueError, match=r"is not a directory"):
        convert(tmp_path / "nowhere", tmp_path / "out")


def test_main_cli(hf_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(hf_dir), str(tmp_path / "o"), "--type", "q8_0", "--name", "Smol VLM/test"]) == 0
    lines = capsys.readouterr().out.split()
    assert [Path(p).name for p in lines] == ["Smol-VLM-test-q8_0.gguf", "mmproj-Smol-VLM-test-q8_0.gguf"]
    assert _engine.GGUFFile(lines[0]).metadata()["general.name"] == "Smol VLM/test"
    bad = variant_dir(hf_dir, tmp_path / "bad", drop=("config.json",))
    assert main([str(bad), str(tmp_path / "o2")]) == 2
    assert "config.json is missing" in capsys.readouterr().err


# -- the writer on its own ----------------------------------------------------------------------------


def test_writer_metadata_of_every_type(tmp_path: Path) -> None:
    import gguf

    V = GGUFValueType
    w = GGUFWriter()
    values = [
        ("t.u8", 255, V.UINT8), ("t.i8", -128, V.INT8), ("t.u16", 65535, V.UINT16), ("t.i16", -32768, V.INT16),
        ("t.u32", 2**32 - 1, V.UINT32), ("t.i32", -(2**31), V.INT32), ("t.f32", 0.25, V.FLOAT32),
        ("t.bool", False, V.BOOL), ("t.str", "ünïcode ✓", V.STRING), ("t.u64", 2**64 - 1, V.UINT64),
        ("t.i64", -(2**63), V.INT64), ("t.f64", 1 / 3, V.FLOAT64),
    ]
    for key, value, vtype in values:
        w.add_value(key, value, vtype)
    w.add_array("t.strs", ["a b", "", "東京"], V.STRING)
    w.add_array("t.f32s", [0.5, -1.5], V.FLOAT32)
    w.add_array("t.u8s", [0, 255], V.UINT8)
    w.add_array("t.bools", [True, False], V.BOOL)
    w.add_array("t.empty", [], V.INT32)
    w.add_array("t.nested", [(V.INT32, [1, 2]), (V.STRING, ["x"])], V.ARRAY)
    w.add_tensor("x", np.arange(64, dtype=np.float32).reshape(2, 32))
    path = w.write(tmp_path / "m.gguf")
    meta = _engine.GGUFFile(str(path)).metadata()
    for key, value, _ in values:
        assert meta[key] == value, key
    assert meta["t.strs"] == ["a b", "", "東京"]
    assert meta["t.f32s"] == [0.5, -1.5]
    assert meta["t.u8s"] == [0, 255]
    assert meta["t.bools"] == [True, False]
    assert meta["t.empty"] == []
    assert meta["t.nested"] == [[1, 2], ["x"]]
    assert meta["general.alignment"] == 32
    fields = gguf.GGUFReader(str(path)).fields  # an independent reader agrees on the types
    for key, _, vtype in values:
        assert fields[key].types == [gguf.GGUFValueType(int(vtype))], key
    raw = path.read_bytes()
    assert raw[:4] == b"GGUF" and struct.unpack("<IQQ", raw[4:24]) == (3, 1, len(values) + 7)


def test_writer_tensor_types_fallback_and_alignment(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    arrays = {
        "q8": (rng.standard_normal((3, 64)).astype(np.float32), "q8_0", "Q8_0"),
        "q4_odd_rows": (rng.standard_normal((5, 40)).astype(np.float32), "q4_0", "F16"),  # 40 % 32 != 0
        "q41": (rng.standard_normal((2, 2, 96)).astype(np.float32), "q4_1", "Q4_1"),
        "f16": (rng.standard_normal((7,)).astype(np.float32), "f16", "F16"),
        "f32_from_f64": (rng.standard_normal((3, 5)), "f32", "F32"),
        "lazy": (rng.standard_normal((4, 32)).astype(np.float32), "q4_0", "Q4_0"),
    }
    w = GGUFWriter()
    for name, (x, t, want) in arrays.items():
        data = (lambda x=x: x) if name == "lazy" else x
        got = w.add_tensor(name, data, t, shape=x.shape)
        assert got == GGMLType[want] == resolve_tensor_type(t, x.shape)
    path = w.write(tmp_path / "t.gguf")
    g = _engine.GGUFFile(str(path))
    raw_len = path.stat().st_size
    for info in g.tensors():
        x, _, want = arrays[info["name"]]
        assert info["type"] == want
        assert info["offset"] % 32 == 0
        assert tuple(info["shape"]) == x.shape[::-1]
        got = g.dequantize(info["name"])
        if want == "F32":
            np.testing.assert_array_equal(got, x.astype(np.float32))
        elif want == "F16":
            np.testing.assert_array_equal(got, x.astype(np.float16).astype(np.float32))
        else:
            assert block_error_ok(want, x.astype(np.float32), got)[0]
    assert raw_len % 32 == 0


def test_writer_refuses_bad_input(tmp_path: Path) -> None:
    w = GGUFWriter()
    w.add_uint32("a", 1)
    with pytest.raises(ValueError, match="set twice"):
        w.add_uint32("a", 2)
    with pytest.raises(ValueError, match="does not fit"):
        w.add_uint8("b", 256)
    with pytest.raises(ValueError, match="must be an integer"):
        w.add_int32("c", 1.5)
    with pytest.raises(ValueError, match="must be a bool"):
        w.add_bool("d", 1)
    with pytest.raises(ValueError, match="does not fit"):
        w.add_array("e", [1, 300], GGUFValueType.UINT8)
    with pytest.raises(ValueError, match="1..63 bytes"):
        w.add_tensor("n" * 64, np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="needs its shape"):
        w.add_tensor("lazy", lambda: np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="unknown tensor type"):
        w.add_tensor("t", np.zeros(32, np.float32), "q7_k")  # q5_k became a real format (Q5_K)
    w.add_tensor("liar", lambda: np.zeros((2, 32), np.float32), "f32", shape=(3, 32))
    with pytest.raises(ValueError, match="not the declared"):
        w.write(tmp_path / "bad.gguf")
    assert not list(tmp_path.iterdir())  # no partial file left behind


def test_fixture_is_idempotent(hf_dir: Path) -> None:
    before = (hf_dir / "model.safetensors").stat().st_mtime_ns
    assert fx.cached_random_smolvlm(text_layers=N_TEXT, vision_layers=N_VISION) == hf_dir
    assert (hf_dir / "model.safetensors").stat().st_mtime_ns == before


def test_variant_dirs_leave_the_cached_checkpoint_untouched(hf_dir: Path, tmp_path: Path) -> None:
    # variant_dir must never touch the cached checkpoint it links to.
    src = variant_dir(hf_dir, tmp_path / "v", edit={"config.json": _set("model_type", "x")})
    assert json.loads((hf_dir / "config.json").read_text())["model_type"] == "idefics3"
    shutil.rmtree(src)
    assert (hf_dir / "config.json").exists()
