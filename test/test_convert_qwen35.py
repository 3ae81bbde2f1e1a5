"""`edgevlm convert` on Qwen3.5 checkpoints (and MiniCPM-V 4.6's text half), checked tensor by tensor
against llama.cpp's own converter.

The checkpoint is the random Qwen3.5 fixture at the 0.8B widths (4 layers: three linear, one full;
test/qwen35_fixtures.py); llama.cpp's convert_hf_to_gguf.py (0.3.36) converts the same folder. Our
file and theirs must hold the same tensor names, types, shapes and bytes, and the same metadata
except the naming keys (general.name, .basename, .version, .finetune, .size_label: llama.cpp derives
those from the folder name and a parameter count) and general.alignment (we state the default, 32).
One tolerance: ssm_a = -exp(A_log) within 2 ulp (torch's float32 exp against numpy's, each within one;
measured 2026-12-01: at most 1 ulp on the 0.8B shapes, 2 on the 32-value-head checkpoint).
EDGEVLM_TEST_QWEN35_CONVERT_ALL=1 adds the F16, BF16 and Q8_0 comparisons and a checkpoint with 32 value heads
on 16 key heads (the tiled value-head order).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edgevlm_ros import _engine
from edgevlm_ros.tools.convert_cli import main
from edgevlm_ros.tools.convert_qwen35 import convert_qwen35, tile_value_heads

sys.path.insert(0, str(Path(__file__).resolve().parent))
import qwen35_fixtures as qf  # noqa: E402

LAYERS = 4
# llama.cpp derives these from the folder name and a parameter count; alignment we state (the default).
NAMING_KEYS = {"general.name", "general.basename", "general.version", "general.finetune", "general.size_label",
               "general.alignment"}


@pytest.fixture(scope="module")
def hf_dir() -> Path:
    return qf.cached_qwen35(LAYERS)


@pytest.fixture(scope="module")
def ours(hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], Path]]:
    """Our file of each type, made once per module through the command line (`edgevlm convert`)."""
    out = tmp_path_factory.mktemp("qwen35-ours")
    made: dict[str, Path] = {}

    def get(wtype: str) -> Path:
        if wtype not in made:
            assert main([str(hf_dir), str(out), "--type", wtype, "--name", "ours"]) == 0
            made[wtype] = out / f"ours-{wtype}.gguf"
        return made[wtype]

    yield get
    shutil.rmtree(out, ignore_errors=True)  # 1.3 GB per type: not kept until the session ends


def _tensors(path: Path) -> dict[str, tuple[dict[str, Any], np.ndarray]]:
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    return {t["name"]: (t, mm[t["offset"]:t["offset"] + t["nbytes"]]) for t in _engine.GGUFFile(str(path)).tensors()}


def _differences(ours: Path, theirs: Path) -> list[str]:
    """Everything that differs between the two files, beyond the naming keys and ssm_a's last bits."""
    ma, mb = _engine.GGUFFile(str(ours)).metadata(), _engine.GGUFFile(str(theirs)).metadata()
    out = [f"metadata {k}: ours {str(ma.get(k))[:60]} vs llama.cpp {str(mb.get(k))[:60]}"
           for k in sorted((set(ma) | set(mb)) - NAMING_KEYS) if ma.get(k) != mb.get(k)]
    ta, tb = _tensors(ours), _tensors(theirs)
    out += [f"tensor {n} only in {'ours' if n in ta else 'llama.cpp'}" for n in sorted(set(ta) ^ set(tb))]
    for name in sorted(set(ta) & set(tb)):
        (ia, da), (ib, db) = ta[name], tb[name]
        if (ia["type"], ia["shape"]) != (ib["type"], ib["shape"]):
            out.append(f"{name}: ours {ia['type']} {ia['shape']} vs llama.cpp {ib['type']} {ib['shape']}")
        elif not np.array_equal(da, db):
            if name.endswith("ssm_a") and ia["type"] == "F32":
                a, b = da.view(np.float32), db.view(np.float32)
                if np.all(np.abs(a - b) <= 2 * np.spacing(np.abs(b))):
                    continue
            out.append(f"{name}: {int((da != db).sum())} of {len(da)} bytes differ")
    return out


# F16, BF16 and Q8_0 (llama.cpp's conversions, ~1 min each to build once; ours ~20 / 40 s) only when asked.
WTYPES = ["f32", "f16", "bf16", "q8_0"] if os.environ.get("EDGEVLM_TEST_QWEN35_CONVERT_ALL") else ["f32"]


@pytest.mark.parametrize("wtype", WTYPES)
def test_same_file_as_llama_cpp(ours: Callable[[str], Path], wtype: str) -> None:
    theirs = qf.cached_qwen35_llama_cpp_gguf(LAYERS, outtype=wtype)
    assert _differences(ours(wtype), theirs) == []
    types = {t["name"]: t["type"] for t in _engine.GGUFFile(str(ours(wtype))).tensors()}
    want = wtype.upper()
    assert types["token_embd.weight"] == types["blk.0.attn_qkv.weight"] == types["blk.3.attn_q.weight"] == want
    assert types["blk.0.ssm_conv1d.weight"] == types["blk.0.ssm_a"] == types["blk.0.ssm_norm.weight"] == "F32"


def test_the_comparison_catches_a_wrong_layout(tmp_path: Path) -> None:
    """llama.cpp's file with one norm left unshifted and one metadata value changed: both reported."""
    theirs = qf.cached_qwen35_llama_cpp_gguf(LAYERS, outtype="f32")
    flipped = tmp_path / "flipped.gguf"
    shutil.copyfile(theirs, flipped)
    info = next(t for t in _engine.GGUFFile(str(flipped)).tensors() if t["name"] == "blk.3.attn_q_norm.weight")
    with open(flipped, "r+b") as f:
        head = f.read(1 << 16)
        key = b"qwen35.full_attention_interval"
        at = head.index(key) + len(key)
        assert struct.unpack_from("<II", head, at) == (4, 4)  # type uint32, value 4
        f.seek(at + 4)
        f.write(struct.pack("<I", 3))
    mm = np.memmap(flipped, dtype=np.float32, mode="r+", offset=info["offset"], shape=(info["nbytes"] // 4,))
    mm -= 1.0
    mm.flush()
    del mm
    diffs = _differences(flipped, theirs)
    assert len(diffs) == 2, diffs
    assert diffs[0] == "metadata qwen35.full_attention_interval: ours 3 vs llama.cpp 4"
    assert diffs[1].startswith("blk.3.attn_q_norm.weight")


def test_minicpm_v46_text_half_is_the_same_file_as_llama_cpps(tmp_path: Path) -> None:
    """The text half of a MiniCPM-V 4.6 checkpoint (text under model.language_model., with vision tower,
    merger and MTP tensors beside it): llama.cpp's text file, and the same tensors as the plain
    Qwen3.5 checkpoint's."""
    src = qf.cached_minicpmv46_text(LAYERS)
    path = convert_qwen35(src, tmp_path, "f32", name="minicpm")
    assert _differences(path, qf.cached_minicpmv46_llama_cpp_gguf(LAYERS)) == []
    assert _differences(path, qf.cached_qwen35_llama_cpp_gguf(LAYERS)) == []


@pytest.mark.skipif(not os.environ.get("EDGEVLM_TEST_QWEN35_CONVERT_ALL"), reason="EDGEVLM_TEST_QWEN35_CONVERT_ALL=1")
def test_more_value_heads_than_key_heads_as_llama_cpp(tmp_path: Path) -> None:
    """32 value heads on 16 key heads (the larger Qwen3.5s): the tiled value-head order is llama.cpp's
    (2 layers, both linear; a checkpoint of its own, ~2 min to build once)."""
    src = qf.cached_qwen35(2, value_heads=32)
    path = convert_qwen35(src, tmp_path, "f32", name="v32")
    assert _differences(path, qf.cached_qwen35_llama_cpp_gguf(2, value_heads=32)) == []


def test_value_heads_go_from_grouped_to_tiled_order() -> None:
    """transformers pairs value head j with key head j // (v/k) (grouped); llama.cpp's qwen35 layout
    pairs position j with key head j % k (tiled): position r*k + h must hold grouped head h*(v/k) + r."""
    k_heads, per_k, head_dim = 3, 4, 2
    grouped = np.arange(k_heads * per_k * head_dim, dtype=np.float32)
    tiled = tile_value_heads(grouped, 0, k_heads, head_dim).reshape(per_k, k_heads, head_dim)
    for r in range(per_k):
        for h in range(k_heads):
            head = h * per_k + r
            assert list(tiled[r, h]) == list(grouped[head * head_dim:(head + 1) * head_dim])
    cols = np.tile(grouped, (5, 1))  # along the last axis, as ssm_out's columns
    assert np.array_equal(tile_value_heads(cols, 1, k_heads, head_dim)[0], tiled.reshape(-1))
    assert np.array_equal(tile_value_heads(grouped, 0, 1, head_dim), grouped)  # one key head: no change


def _variant(hf_dir: Path, dest: Path, config_edit: Callable[[dict[str, Any]], None] | None = None,
             tokenizer_edit: Callable[[dict[str, Any]], None] | None = None) -> Path:
    """A copy of the checkpoint folder with config.json / tokenizer.json edited (weights linked)."""
    dest.mkdir()
    for f in hf_dir.iterdir():
        if f.name == "model.safetensors":
            (dest / f.name).symlink_to(f)
        elif f.is_file():
            shutil.copy2(f, dest / f.name)
    for name, edit in (("config.json", config_edit), ("tokenizer.json", tokenizer_edit)):
        if edit is not None:
            data = json.loads((dest / name).read_text())
            edit(data)
            (dest / name).write_text(json.dumps(data))
    return dest


def _layers(n: int) -> Callable[[dict[str, Any]], None]:
    def edit(c: dict[str, Any]) -> None:
        c["num_hidden_layers"] = n
        c["layer_types"] = qf.layer_types(n)

    return edit


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(c: dict[str, Any]) -> None:
        c[key] = value

    return edit


def _rope(**kw: Any) -> Callable[[dict[str, Any]], None]:
    def edit(c: dict[str, Any]) -> None:
        c["rope_parameters"] = {**c["rope_parameters"], **kw}

    return edit


@pytest.mark.parametrize(("config_edit", "tokenizer_edit", "message"), [
    (_layers(5), None, "missing tensor 'model.layers.4"),
    (_layers(3), None, "does not know: model.layers.3"),
    (_set("layer_types", ["linear_attention"] * 3), None, "layer_types must list 4 layers"),
    (_set("layer_types", ["linear_attention", "sliding", "linear_attention", "full_attention"]), None,
     "unknown kinds"),
    (_set("linear_num_value_heads", 24), None, "do not divide 24 value heads"),
    (_set("linear_num_value_heads", 32), None, "A_log' has shape \\[16\\], config.json implies \\[32\\]"),
    (_rope(rope_type="yarn"), None, "RoPE type 'yarn'"),
    (_rope(mrope_section=[40, 11, 10]), None, "does not fit 64 rotary dimensions"),
    (_set("attn_output_gate", False), None, "attn_output_gate false"),
    (_set("model_type", "qwen3"), None, "not a Qwen3.5 text model"),
    (None, _set("normalizer", None), "normalizer (None) is not supported with pre-tokenizer 'qwen35'"),
    (None, lambda t: t["pre_tokenizer"]["pretokenizers"][0].update(pattern={"Regex": r"\s+"}),
     "unsupported pre-tokenizer"),
])
def test_bad_checkpoints_are_refused(hf_dir: Path, tmp_path: Path, config_edit: Any, tokenizer_edit: Any,
                                     message: str) -> None:
    bad = _variant(hf_dir, tmp_path / "bad", config_edit, tokenizer_edit)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        convert_qwen35(bad, tmp_path / "out", "f32")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())  # nothing written


def test_cli_refuses_other_types_for_qwen35(hf_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(hf_dir), str(tmp_path), "--type", "q4_k_m"]) == 2
    assert "not offered for qwen35" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
