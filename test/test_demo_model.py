"""The embedded demo VLM and its synthetic world.

- the scene generator: seeded, reproducible, frame i independent of the frames before it, and its
  own captions score perfectly;
- the scorer on hand-written captions (wrong colour, wrong place, missing or extra objects, other
  spellings);
- the demo text GGUF: SmolLM2's tensors byte for byte, SmolVLM's added tokens at SmolVLM's ids with
  zero rows, the same text as SmolLM2 on a text prompt;
- the independent evaluation world (eval_world.py: Pillow, its own colour values and backgrounds):
  reproducible, its sets keep their rules, its colour values lie inside the names' ranges;
- the committed mmproj, described by OUR engine on held-out samples of both worlds (seeds never used
  in training) against the committed thresholds below: 30 frames of the training world, 24 single
  objects, 16 scenes of two or three and 12 frames without objects of the independent one. The full
  figures (300 + 3 x 150 frames) are in edgevlm_ros/data/edgevlm-demo-mmproj.json
  (tools/train_demo_vlm.py writes it).
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edgevlm_ros.demo.scenes import (
    COLOURS,
    POSITIONS,
    SHAPES,
    SceneObject,
    caption_for,
    generate_scene,
    parse_caption,
    score,
)

ROOT = Path(__file__).resolve().parents[1]
HELD_OUT_SEED = 999  # tools/train_demo_vlm.py trains on streams 1, 2 (and monitors 3)
HELD_OUT_FRAMES = 30
# Committed thresholds for the 30-frame sample. The record's 300-frame figures are the model's
# measured quality; these leave room for a 30-frame sample's spread and for another CPU's rounding.
# Record (2026-12-07 evening, the mean of five caption runs of the 192 px tower, 300 frames): objects
# 95.5%, counts 96.3% (issue 18 asks 95% / 97%: counts not yet; the caption run before: 94.6% / 96.7%).
# One frame is 3.3 points: the counts bound leaves room for one near-tie flip below the torch
# model's own 26 of 30 (2026-12-05: grouped attention's new summation order flipped frame 24 at a
# torch top1-top2 gap of 0.109, 25 of 30; test_engine_text_equals_torch_on_the_sample checks every
# such difference is a near tie).
OBJECTS_RIGHT_MIN = 0.75
COUNT_RIGHT_MIN = 0.80
MAX_NEW_TOKENS = 48
# The independent renderer (eval_world), samples of 24 single-object, 16 multi-object and 12
# no-object frames: the record's 150-frame-per-set figures less a sample's spread.
# Record (2026-12-07 evening, 150 frames a set): single colour+shape 98.7%, objects 98.7%; multi objects
# 98.3% (overall 98.4%); frames without objects said so 99.3% (issue 18 asks 90%, 85% overall, 90%: met).
INDEPENDENT_SINGLE_MIN = 0.80  # colour and shape named right, single objects
INDEPENDENT_OBJECTS_MIN = 0.75  # objects fully right (colour, shape, place)
INDEPENDENT_EMPTY_MIN = 0.80  # no-object frames described as such
ENGINE_EQUALS_TORCH_MIN = 0.9  # of the sample (the record: 0.997 of 300 frames; each difference is checked below)
# Of the held-out sample: the float text with int8 tower products (2026-12-06: 28 / 30; the model
# retrained that evening: 30 / 30; after the caption stage that night: 29 / 30).
VISION_INT8_SAME_MIN = 0.8
TIE_MARGIN = 0.75  # torch top-1 minus top-2 logit below which int8 rounding may flip a token (test_parity.py)
PROMPT = "Describe the image in one sentence."  # the node's default request, the one the model was trained on


# -- scene generator --------------------------------------------------------------------------------


def test_scene_is_reproducible() -> None:
    a = generate_scene(5, 17, 320, 240)
    b = generate_scene(5, 17, 320, 240)
    assert a == b
    assert np.array_equal(a.image(), b.image())
    assert a.image().shape == (240, 320, 3) and a.image().dtype == np.uint8


def test_scene_depends_only_on_seed_and_index() -> None:
    later_first = [generate_scene(3, i) for i in (9, 4, 7)]
    in_order = {i: generate_scene(3, i) for i in range(10)}
    assert [in_order[i] for i in (9, 4, 7)] == later_first
    assert generate_scene(3, 4) != generate_scene(4, 4)
    assert len({generate_scene(3, i).caption for i in range(10)}) > 5


@pytest.mark.parametrize("size,frames", [((160, 120), 90), ((320, 240), 90), ((424, 240), 40), ((640, 360), 30),
                                         ((1280, 720), 12)])
def test_scenes_keep_their_rules(size: tuple[int, int], frames: int) -> None:
    from edgevlm_ros.demo.scenes import NO_OBJECTS, THIRD_MARGIN

    w, h = size
    for i in range(frames):
        s = generate_scene(11, i, w, h)
        assert 0 <= s.n_objects <= 3
        assert s.image().shape == (h, w, 3)
        if not s.objects:
            assert s.caption == NO_OBJECTS
        per_third: dict[str, set[tuple[str, str, str]]] = {}
        for o in s.objects:
            assert o.shape in SHAPES and o.colour in COLOURS and o.position in POSITIONS
            k = POSITIONS.index(o.position)
            assert (k / 3 + THIRD_MARGIN) * w - 1e-6 <= o.cx <= ((k + 1) / 3 - THIRD_MARGIN) * w + 1e-6, (i, o)
            assert 0 <= o.cy <= h, (i, o)  # the centre in view; the shape may cross the border
            per_third.setdefault(o.position, set()).add((o.shape, o.colour, o.size))
        assert all(len(k) == 1 for k in per_third.values()), "a third holds one kind of object"
        sc = score(s.caption, s)
        assert sc.all_right and sc.exact


def test_world_covers_its_variation() -> None:
    """Over 300 frames every background kind, texture, object count, size, edge and outline style,
    and every camera effect occurs; objects cross the border and fill up to a large part of the frame."""
    from edgevlm_ros.demo.scenes import BACKGROUNDS, SIZE_RADIUS, TEXTURES, frame_scale

    scenes = [generate_scene(12, i, 160, 120) for i in range(300)]
    assert {s.background.kind for s in scenes} == set(BACKGROUNDS)
    assert {s.background.texture for s in scenes if s.background.kind == "texture"} == set(TEXTURES)
    assert {s.n_objects for s in scenes} == {0, 1, 2, 3}
    objects = [(s, o) for s in scenes for o in s.objects]
    assert {o.size for _, o in objects} == {"small", "large"}
    assert {o.hard_edge for _, o in objects} == {True, False}
    assert {o.outline is None for _, o in objects} == {True, False}
    assert any(o.cx - o.radius < 0 or o.cy - o.radius < 0 or o.cx + o.radius > s.width or o.cy + o.radius > s.height
               for s, o in objects), "no object crosses the border"
    big = max(o.radius / frame_scale(s.width, s.height) for s, o in objects)
    assert SIZE_RADIUS["large"][1] * 0.8 < big <= SIZE_RADIUS["large"][1]
    fx = [s.effects for s in scenes]
    assert all(any(getattr(f, k) for f in fx) for k in ("light_gain", "blur_sigma", "noise_sigma", "jpeg_quality"))
    brightness = [float(s.image().mean()) for s in scenes[:100]]
    assert min(brightness) < 40 and max(brightness) > 215, "backgrounds from black to white"


def test_some_textures_vary_in_hue() -> None:
    """Half of the blotches, 1/f and checks textures vary in hue (three independent channels: the pixels
    of the background span RGB space; the checks become mosaics of cells of many colours); every other
    texture lies between its two colours (one axis)."""
    from edgevlm_ros.demo.scenes import _background_f32, hue_varies

    textured = [s for s in (generate_scene(12, i, 160, 120) for i in range(400)) if s.background.kind == "texture"]
    varying = [s for s in textured if hue_varies(s.background)]
    assert 5 <= len(varying) <= len(textured) // 2, (len(varying), len(textured))
    for s in textured[:40]:
        img = _background_f32(replace(s.background, noise_sigma=0.0), s.width, s.height).reshape(-1, 3)
        sv = np.linalg.svd(img - img.mean(0), compute_uv=False)
        third = sv[2] / max(sv[0], 1e-6)
        assert (third > 0.05) == hue_varies(s.background), (s.index, s.background.texture, sv)


def test_colour_ranges_do_not_overlap() -> None:
    """A colour drawn from one name's range is never inside another's: the name is never a judgement call."""
    from edgevlm_ros.demo.eval_world import in_range
    from edgevlm_ros.demo.scenes import COLOUR_RANGES, _object_colour

    rng = np.random.default_rng(0)
    for name in COLOUR_RANGES:
        assert in_range(name, COLOURS[name])
        for _ in range(200):
            rgb = _object_colour(rng, name)
            inside = [other for other in COLOUR_RANGES if in_range(other, rgb)]
            assert inside in ([name], []), (name, rgb, inside)  # [] only from rounding at a range's edge


def test_objects_stay_visible_and_distinct_from_background() -> None:
    from edgevlm_ros.demo.scenes import MIN_CONTRAST, MIN_VISIBLE, _object_mask, _paint_background, visible_fractions

    for i in range(40):
        s = generate_scene(21, i)
        if not s.objects:
            continue
        masks = [_object_mask(o, s.width, s.height) for o in s.objects]
        assert min(visible_fractions(s.objects, masks)) >= MIN_VISIBLE
        bg = _paint_background(s.background, s.width, s.height)
        for o, m in zip(s.objects, masks, strict=True):
            under = bg[m].astype(float).mean(axis=0)
            assert np.linalg.norm(under - np.asarray(o.rgb, float)) >= MIN_CONTRAST


# -- the independent evaluation world ------------------------------------------------------------------


def test_eval_world_is_reproducible_and_keeps_its_sets() -> None:
    from edgevlm_ros.demo.eval_world import EVAL_COLOURS, EVAL_SETS, eval_scene, in_range

    for name, values in EVAL_COLOURS.items():
        for rgb in values:
            assert in_range(name, rgb), (name, rgb)
    a, b = eval_scene("multi", 7), eval_scene("multi", 7)
    assert a.caption == b.caption and np.array_equal(a.pixels, b.pixels)
    with pytest.raises(ValueError, match="unknown evaluation set"):
        eval_scene("nope", 0)
    for name in EVAL_SETS:
        for i in range(12):
            s = eval_scene(name, i)
            n = s.n_objects
            assert {"single": n == 1, "multi": 2 <= n <= 3, "empty": n == 0}[name], (name, i, s.caption)
            assert s.pixels.shape == (s.height, s.width, 3) and s.pixels.dtype == np.uint8
            for o in s.objects:
                assert o.rgb in EVAL_COLOURS[o.colour]
                assert POSITIONS[min(int(3 * o.cx / s.width), 2)] == o.position
            assert score(s.caption, s).all_right


# -- captions and the scorer ------------------------------------------------------------------------


def _obj(shape: str, colour: str, position: str, size: str = "small", cy: float = 50.0) -> SceneObject:
    cx = {"left": 50.0, "centre": 160.0, "right": 270.0}[position]
    return SceneObject(shape, colour, size, position, cx, cy, 20.0, 0.0, COLOURS[colour])


def test_caption_grammar() -> None:
    one = [_obj("circle", "red", "left")]
    assert caption_for(one) == "A small red circle on the left."
    two = [_obj("square", "blue", "right", "large"), _obj("circle", "red", "left"), _obj("circle", "red", "left")]
    assert caption_for(two) == "Two small red circles on the left and a large blue square on the right."
    three = [_obj("star", "green", "right"), _obj("triangle", "white", "centre", "large"),
             _obj("circle", "pink", "left")]
    assert caption_for(three) == ("A small pink circle on the left, a large white triangle in the centre "
                                  "and a small green star on the right.")


def _scene(objects: list[SceneObject]) -> Any:
    from edgevlm_ros.demo.scenes import Background, Scene

    bg = Background("plain", (90, 90, 90), (90, 90, 90), 0.0, 0.0, 0)
    return Scene(0, 0, 320, 240, bg, tuple(objects), caption_for(objects))


def test_score_of_right_wrong_and_partial_captions() -> None:
    scene = _scene([_obj("circle", "red", "left"), _obj("circle", "red", "left", cy=120.0),
                    _obj("square", "blue", "right", "large")])
    truth = score(scene.caption, scene)
    assert truth.objects_right == (True, True, True) and truth.count_right and truth.exact and truth.all_right

    # Sizes are not scored; other spellings and word orders of the same facts are fine.
    s = score("There are two big red circles to the left and one blue square on the right", scene)
    assert s.objects_right == (True, True, True) and s.count_right and not s.exact

    s = score("Two red circles on the left and a green square on the right.", scene)  # wrong colour
    assert s.objects_right == (True, True, False) and s.count_right and not s.all_right

    s = score("A red circle on the left and a blue square on the right.", scene)  # one circle missing
    assert s.n_right == 2 and s.count_named == 2 and not s.count_right

    s = score("Three red circles on the left and a blue square on the right.", scene)  # one too many
    assert s.n_right == 3 and s.count_named == 4 and not s.count_right

    s = score("Two red circles in the middle and a blue square on the right.", scene)  # wrong place
    assert s.objects_right == (False, False, True) and s.count_right

    s = score("Two red circles and a blue square.", scene)  # no places: nothing fully right
    assert s.n_right == 0 and s.count_right

    assert score("", scene).count_named == 0 and score("", scene).n_right == 0
    assert not score("No known objects.", scene).all_right


def test_score_of_a_frame_without_objects() -> None:
    from edgevlm_ros.demo.scenes import NO_OBJECTS

    empty = _scene([])
    assert empty.caption == NO_OBJECTS
    assert score(NO_OBJECTS, empty).all_right and score(NO_OBJECTS, empty).exact
    assert score("There is nothing here.", empty).all_right
    assert score("I see no objects", empty).all_right
    assert not score("A large white circle on the left.", empty).all_right
    assert not score("A woman with a large face and long, dark hair.", empty).all_right  # says nothing of "none"


def test_parse_caption_spellings() -> None:
    ms = parse_caption("A tiny white star in the center, two yellow triangles at the middle and a GRAY square.")
    assert [(m.count, m.size, m.colour, m.shape, m.position) for m in ms] == [
        (1, "small", "white", "star", "centre"), (2, None, "yellow", "triangle", "centre"),
        (1, None, "grey", "square", None)]


# -- the demo text model ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_text(text_model_path: Path) -> Path:
    from edgevlm_ros.demo.demo_model import ensure_demo_text_model

    return ensure_demo_text_model(source=text_model_path)


def test_demo_text_model_is_smollm2_plus_smolvlm_tokens(demo_text: Path, text_model_path: Path) -> None:
    from edgevlm_ros import _engine
    from edgevlm_ros.demo.demo_model import BASE_VOCAB, VOCAB_SIZE, smolvlm_added_tokens
    from edgevlm_ros.engine.tokenizer import Tokenizer

    src, dst = _engine.GGUFFile(str(text_model_path)), _engine.GGUFFile(str(demo_text))
    src_t = {t["name"]: t for t in src.tensors()}
    dst_t = {t["name"]: t for t in dst.tensors()}
    assert list(src_t) == list(dst_t)
    with open(text_model_path, "rb") as fa, open(demo_text, "rb") as fb:
        for name, a in src_t.items():
            b = dst_t[name]
            assert b["type"] == a["type"]
            fa.seek(a["offset"])
            fb.seek(b["offset"])
            data_a, data_b = fa.read(a["nbytes"]), fb.read(b["nbytes"])
            if name == "token_embd.weight":
                assert b["shape"] == [576, VOCAB_SIZE]
                assert data_b[: len(data_a)] == data_a and not any(data_b[len(data_a):])
            else:
                assert data_b == data_a, name
    assert not np.any(dst.dequantize("token_embd.weight")[BASE_VOCAB:])

    meta = dst.metadata()
    tok = Tokenizer.from_gguf_metadata(meta)
    for i, text in enumerate(smolvlm_added_tokens()):
        assert tok.token_to_id(text) == BASE_VOCAB + i
    assert tok.token_to_id("<image>") == 49190 and tok.token_to_id("<fake_token_around_image>") == 49189
    assert tok.token_to_id("<global-img>") == 49152 and tok.token_to_id("<end_of_utterance>") == 49279
    assert tok.encode("<fake_token_around_image><global-img><image><image>", add_bos=False) == [49189, 49152,
                                                                                                   49190, 49190]
    src_meta = src.metadata()
    for key, value in src_meta.items():
        if key not in ("general.name", "llama.vocab_size", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                       "tokenizer.chat_template"):
            assert meta[key] == value, key


def test_demo_text_model_is_rewritten_only_when_stale(demo_text: Path, text_model_path: Path) -> None:
    from edgevlm_ros.demo.demo_model import ensure_demo_text_model

    before = demo_text.stat().st_mtime_ns
    assert ensure_demo_text_model(demo_text, text_model_path) == demo_text
    assert demo_text.stat().st_mtime_ns == before


def test_demo_text_model_writes_what_smollm2_writes(demo_text: Path, engine: Any) -> None:
    import edgevlm_ros

    demo = edgevlm_ros.load(demo_text, threads=2)
    for prompt in ("What is a robot?", "Name two colours."):
        a = engine.generate(prompt, max_new_tokens=24)
        b = demo.generate(prompt, max_new_tokens=24)
        assert b.prompt_token_ids == a.prompt_token_ids
        assert b.token_ids == a.token_ids


def test_demo_chat_template_places_the_image_first() -> None:
    from edgevlm_ros.demo.demo_model import demo_chat_template
    from edgevlm_ros.engine.chat_template import render_chat

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi?"}]}]
    text = render_chat(demo_chat_template(), messages, add_generation_prompt=True, bos_token="", eos_token="")
    assert text.endswith("<|im_start|>user\n<image>Hi?<|im_end|>\n<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    plain = render_chat(demo_chat_template(), [{"role": "user", "content": "Hi?"}], add_generation_prompt=True,
                        bos_token="", eos_token="")
    assert plain == text.replace("<image>", "")


def test_training_targets_give_frames_without_objects_their_own_end_word(demo_text: Path) -> None:
    """The training tool's keyword slots: a frame without known objects says so with one word of its
    own in the end slot (the caption's first word); a frame with objects ends with "."; a soft prompt
    saved before that word existed loads with the saved deltas kept and the new word's at zero."""
    import torch

    from edgevlm_ros import _engine
    from edgevlm_ros.demo.demo_model import VOCAB_SIZE
    from edgevlm_ros.demo.scenes import NO_OBJECTS
    from edgevlm_ros.engine.tokenizer import Tokenizer

    tool = _training_tool()
    tok = Tokenizer.from_gguf_metadata(_engine.GGUFFile(str(demo_text)).metadata())
    kw = tool.Keywords(tok)
    assert tok.decode([kw.none]) == NO_OBJECTS.split()[0] and kw.none in kw.vocab and kw.none != kw.pad
    empty = next(s for s in (generate_scene(7, i) for i in range(400)) if not s.objects)
    full = next(s for s in (generate_scene(7, i) for i in range(400)) if len(s.objects) >= 2)
    assert kw.slots(empty) == [kw.pad] * 15 + [kw.none]
    slots = kw.slots(full)
    assert slots[-1] == kw.pad and kw.none not in slots and len(set(slots)) > 3
    soft = tool.SoftPrompt(torch.randn(VOCAB_SIZE, tool.TEXT_WIDTH), kw)
    older = [t for t in kw.vocab if t != kw.none]
    saved = {"offsets": torch.randn(tool.N_IMAGE_TOKENS, tool.TEXT_WIDTH),
             "deltas": torch.randn(len(older), tool.TEXT_WIDTH), "vocab": older}
    assert soft.load(saved) == [kw.none]
    assert torch.equal(soft.offsets, saved["offsets"])
    assert torch.equal(soft.deltas[soft.index[torch.tensor(older)]], saved["deltas"])
    assert not soft.deltas[soft.index[kw.none]].any()
    assert soft.load(soft.state()) == []
    with pytest.raises(ValueError, match="lacks"):
        soft.load({**saved, "vocab": [*older[:-1], VOCAB_SIZE - 1]})


def test_caption_stage_count_slot_loss(demo_text: Path) -> None:
    """--caption-count-slot-weight's loss: ~0 where each count slot holds its own count word's target,
    large where a third holding one object gets the target of a count word it does not have, and the
    count slots of thirds without objects do not count."""
    import torch

    from edgevlm_ros import _engine
    from edgevlm_ros.demo.demo_model import VOCAB_SIZE
    from edgevlm_ros.engine.tokenizer import Tokenizer

    tool = _training_tool()
    kw = tool.Keywords(Tokenizer.from_gguf_metadata(_engine.GGUFFile(str(demo_text)).metadata()))
    soft = tool.SoftPrompt(torch.randn(VOCAB_SIZE, tool.TEXT_WIDTH), kw)
    scene = next(s for s in (generate_scene(7, i) for i in range(400)) if len(s.objects) == 1)
    slots = torch.tensor([kw.slots(scene)])
    image = soft(slots)
    assert float(tool.count_slot_loss(image, [scene], soft, kw)) < 1e-3
    used = next(5 * g for g in range(3) if int(slots[0, 5 * g]) != kw.pad)
    unused = next(5 * g for g in range(3) if int(slots[0, 5 * g]) == kw.pad)
    other = next(t for t in kw.count.values() if t != int(slots[0, used]))
    wrong = slots.clone()
    wrong[0, used] = other
    assert float(tool.count_slot_loss(soft(wrong), [scene], soft, kw)) > 1.0
    wrong = slots.clone()
    wrong[0, unused] = other
    assert float(tool.count_slot_loss(soft(wrong), [scene], soft, kw)) < 1e-3


def test_average_stage_means_caption_runs_from_one_start(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--stages average: the mean of caption runs' weights, refused unless they share their regress
    start; its record lists every run once (a continued run's first run shared by two folders is one
    run), sums the distinct runs and starts the next caption run after the frames any of them used."""
    import torch

    tool = _training_tool()
    regress = {"command": "regress", "frames": 100}

    def run(name: str, k: float, rec: dict[str, Any]) -> Path:
        w = tmp_path / name
        w.mkdir()
        torch.save({"w": torch.full((2, 3), k), "steps_seen": torch.tensor(7)}, w / "caption.pt")
        (w / "caption.json").write_text(json.dumps(rec))
        (w / "regress.json").write_text(json.dumps(regress))
        return w

    first = {"command": "caption a", "steps": 10, "frames": 160, "wall_seconds": 50.0, "next_frame": 120,
             "next_empty_frame": 5, "next_count_frame": 9}
    later = {"command": "caption a then b", "steps": 20, "frames": 480, "wall_seconds": 150.0,
             "wall_seconds_earlier_runs": 50.0, "continued_from": first, "next_frame": 360,
             "next_empty_frame": 8, "next_count_frame": 11}
    other = {**first, "command": "caption c", "wall_seconds": 60.0, "next_count_frame": 30,
             "hard_frames_added": 40, "next_hard_frame": 7000}  # a run with hard frames (--caption-hard-every)
    works = [run("a", 1.0, first), run("ab", 2.0, later), run("c", 6.0, other)]
    mean, rec = tool.average_caption_runs(works)
    assert torch.allclose(mean["w"], torch.full((2, 3), 3.0)) and int(mean["steps_seen"]) == 7
    assert rec["distinct_runs"] == 3 and rec["steps"] == 40 and rec["frames"] == 640
    assert rec["wall_seconds_earlier_runs"] == 210.0
    assert (rec["next_frame"], rec["next_empty_frame"], rec["next_count_frame"]) == (360, 8, 30)
    assert rec["hard_frames_added"] == 40 and rec["next_hard_frame"] == 7000
    assert "next_hard_frame" not in tool.average_caption_runs(works[:2])[1]
    rec["command"] = "average"
    assert tool._commands(rec) == ["caption a", "caption a then b", "caption c", "average"]
    (works[2] / "regress.json").write_text(json.dumps({**regress, "frames": 101}))
    with pytest.raises(SystemExit, match="same regress weights"):
        tool.average_caption_runs(works)
    with pytest.raises(SystemExit):
        tool.parse_args(["--stages", "average,eval", "--average-of", str(works[0])])
    assert "two or more work folders in --average-of" in capsys.readouterr().err


# -- the committed model on held-out frames ----------------------------------------------------------


@pytest.fixture(scope="module")
def demo_vlm(demo_text: Path) -> Any:
    from edgevlm_ros.demo.demo_model import DEMO_MMPROJ_PATH
    from edgevlm_ros.engine.vlm import load_vlm

    assert DEMO_MMPROJ_PATH.exists(), f"{DEMO_MMPROJ_PATH} is missing (tools/train_demo_vlm.py writes it)"
    return load_vlm(demo_text, DEMO_MMPROJ_PATH, threads=2, image_mode="single")


def test_caption_stage_finds_frames_without_objects() -> None:
    """The caption stage's frames without objects are found by a 64x48 scan of the stream: drawn
    at their training size they hold no object either, and they lie after the stage's other frames."""
    tool = _training_tool()
    ids = tool.empty_frames(2, tool.EMPTY_FRAMES_FIRST, 12)
    assert len(ids) == 12 and ids == sorted(set(ids)) and ids[0] >= tool.EMPTY_FRAMES_FIRST
    for i in ids:
        assert not generate_scene(2, i, *tool.frame_size(2, i)).objects, i


@pytest.mark.parametrize("kind", ["count", "large", "small"])
def test_training_stages_find_frames_with_a_count(kind: str) -> None:
    """--caption-count-every's frames (two or more alike objects in one third) and
    --regress-pair-every's (two or more alike ones of --pair-size), also drawn at their training size:
    the caption then says the count (of objects of that size), after the frames without objects; a
    frame without such a group is passed over."""
    tool = _training_tool()
    find, keep = ((tool.count_frames, tool.has_count) if kind == "count" else
                  (lambda *a: tool.pair_frames(*a, kind), lambda s: tool.has_pair(s, kind)))
    ids = find(2, tool.COUNT_FRAMES_FIRST, 12)
    assert len(ids) == 12 and ids == sorted(set(ids)) and ids[0] >= tool.COUNT_FRAMES_FIRST > tool.EMPTY_FRAMES_FIRST
    for i in ids:
        scene = generate_scene(2, i, *tool.frame_size(2, i))
        words = scene.caption.lower().replace(",", "").split()
        said = [words[k + 1] for k, w in enumerate(words[:-1]) if w in ("two", "three")]
        assert keep(scene) and said, (i, scene.caption)
        assert kind == "count" or kind in said, (i, scene.caption)
    skipped = set(range(ids[0], ids[-1])) - set(ids)
    assert skipped and not any(keep(generate_scene(2, i, 64, 48)) for i in skipped)


def test_a_tower_carries_over_to_another_tile() -> None:
    """The training tool's `retiled`: a 128/16/2 tower loaded into a 192/16/3 one (16 image tokens
    either way). Patch states that are constant over each image token give the old connector's
    output, and every image token's patches keep its group's routing code."""
    import torch

    T = _training_tool()
    old = (T.IMAGE_SIZE, T.PATCH_SIZE, T.SCALE)
    assert old == (128, 16, 2)
    small = T.VisionSide(T.idefics3_config(), 0, "routing")
    torch.nn.init.normal_(small.connector.modality_projection.proj.weight, std=0.05)
    per_token = torch.randn(1, 4, 4, T.WIDTH)

    def patches(scale: int) -> Any:  # each token's state on its scale x scale patches
        return per_token.repeat_interleave(scale, 1).repeat_interleave(scale, 2).reshape(1, -1, T.WIDTH)

    old_patches = T.TOKEN_PATCHES
    try:
        T.set_tile(192, 16, 3)
        big = T.VisionSide(T.idefics3_config(), 1)
        big.load_state_dict(small.state_dict())
        assert big.retiled_from == "128/16/2"
        with torch.no_grad():
            want, got = small.connector(patches(2)), big.connector(patches(3))
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), float((got - want).abs().max())
        pos = big.vision.embeddings.position_embedding.weight
        small_pos = small.vision.embeddings.position_embedding.weight
        # A token's corner patches keep the old corners' embeddings (row-major 3 x 3 from 2 x 2).
        for new_p, old_p in zip(T.TOKEN_PATCHES, old_patches, strict=True):
            for a, b in ((0, 0), (2, 1), (6, 2), (8, 3)):
                assert torch.equal(pos[new_p[a]], small_pos[old_p[b]])
        group_ch = range(T.WIDTH - len(POSITIONS), T.WIDTH)
        for g, tokens in enumerate(T.SLOT_GROUPS):
            for k in tokens:
                for p in T.TOKEN_PATCHES[k]:
                    assert [float(pos[p, c]) for c in group_ch] == [4.0 if c == g else 0.0 for c in range(3)]
        for name, w in small.state_dict().items():
            if name not in (T.POS_NAME, T.PROJ_NAME):
                assert torch.equal(big.state_dict()[name], w), name
    finally:
        T.set_tile(*old)


def test_a_later_stage_keeps_the_tile_of_the_saved_weights(tmp_path: Path) -> None:
    """Without --tile, a stage that goes on from weights saved in --work works at their tile (a
    192 px run's caption or eval stage must not carry them over to the default 128 px); a stage that
    starts from a fresh tower or an mmproj file keeps the default."""
    import torch

    T = _training_tool()

    def tile(*argv: str) -> Any:
        return T.work_tile(T.parse_args([*argv, "--work", str(tmp_path)]))

    assert tile("--stages", "caption") is None
    default = (T.IMAGE_SIZE, T.PATCH_SIZE, T.SCALE)
    try:
        T.set_tile(192, 16, 3)
        torch.save(T.VisionSide(T.idefics3_config(), 0).state_dict(), tmp_path / "regress.pt")
    finally:
        T.set_tile(*default)
    assert tile("--stages", "caption") == tile("--stages", "prompt,eval") == (192, 16, 3)
    assert tile("--stages", "regress", "--continue-regress") == (192, 16, 3)
    assert tile("--stages", "regress", "--regress-from-mmproj", "x.gguf") is None
    assert tile("--stages", "regress", "--regress-from-scratch") is None
    assert tile("--stages", "keywords,regress,caption") is None


def test_the_committed_mmproj_loads_into_another_tile() -> None:
    """`load_mmproj` of the committed file into a tower of the other tile (128/16/2 or 192/16/3)
    gives what `retiled` makes of the same file loaded at its own tile (a regress stage may start
    another tile from the shipped model)."""
    import torch

    from edgevlm_ros.demo.demo_model import DEMO_MMPROJ_PATH, DEMO_RECORD_PATH

    T = _training_tool()
    vision = json.loads(DEMO_RECORD_PATH.read_text())["vision"]
    own = (vision["image_size"], vision["patch_size"], vision["scale_factor"])
    other = (192, 16, 3) if own == (128, 16, 2) else (128, 16, 2)
    default = (T.IMAGE_SIZE, T.PATCH_SIZE, T.SCALE)
    try:
        T.set_tile(*own)
        at_own = T.VisionSide(T.idefics3_config(), 0)
        T.load_mmproj(at_own, DEMO_MMPROJ_PATH)
        T.set_tile(*other)
        moved = T.VisionSide(T.idefics3_config(), 1)
        T.load_mmproj(moved, DEMO_MMPROJ_PATH)
        assert moved.retiled_from == "/".join(map(str, own))
        want = T.retiled(at_own.state_dict())
        got = moved.state_dict()
        assert sorted(got) == sorted(want)
        for name, w in want.items():
            assert torch.equal(got[name], w), name
    finally:
        T.set_tile(*default)


def test_record_matches_the_committed_mmproj(demo_vlm: Any) -> None:
    from edgevlm_ros.demo.demo_model import BASE_VOCAB, DEMO_MMPROJ_PATH, DEMO_RECORD_PATH

    record = json.loads(DEMO_RECORD_PATH.read_text())
    assert record["mmproj"] == DEMO_MMPROJ_PATH.name
    assert record["mmproj_bytes"] == DEMO_MMPROJ_PATH.stat().st_size
    assert DEMO_MMPROJ_PATH.stat().st_size < 16 * 1024 * 1024
    main = record["evaluation"][0]
    assert main["frames"] >= 300 and main["seed"] == HELD_OUT_SEED and main["prompt"] == PROMPT
    assert HELD_OUT_SEED not in record["training_streams"].values()
    meta = demo_vlm.mmproj_metadata
    assert meta["clip.projector_type"] == "idefics3"
    assert meta["clip.vision.image_size"] == record["vision"]["image_size"]
    assert meta["clip.vision.block_count"] == record["vision"]["layers"]
    assert demo_vlm.images.config.image_seq_len == record["vision"]["image_tokens"]
    assert demo_vlm.image_token_id == 49190 and demo_vlm.text.config["n_vocab"] > BASE_VOCAB


def _training_tool() -> Any:
    sys.path.insert(0, str(ROOT / "tools"))
    import train_demo_vlm

    return train_demo_vlm


@pytest.fixture(scope="module")
def held_out_sample(demo_vlm: Any) -> list[tuple[Any, Any]]:
    """(scene, our engine's greedy description) for the first HELD_OUT_FRAMES held-out frames of the
    training world, at the training tool's frame sizes (160x120 up to 1280x720)."""
    frame_size = _training_tool().frame_size
    out = []
    for i in range(HELD_OUT_FRAMES):
        scene = generate_scene(HELD_OUT_SEED, i, *frame_size(HELD_OUT_SEED, i))
        out.append((scene, demo_vlm.describe(scene.image(), prompt=PROMPT, max_new_tokens=MAX_NEW_TOKENS)))
    return out


def _tally(sample: list[tuple[Any, Any]]) -> tuple[dict[str, float], str]:
    """Objects fully right, colour and shape right, counts right, no-object frames said so; a report."""
    from edgevlm_ros.demo.demo_model import BASE_VOCAB

    colour_shape = _training_tool().colour_and_shape_right
    objects = right = cs = count_right = empty = empty_said = 0
    lines = []
    for i, (scene, r) in enumerate(sample):
        assert not any(t >= BASE_VOCAB for t in r.token_ids), "an added (zero-row) token was generated"
        sc = score(r.text, scene)
        objects += sc.count_true
        right += sc.n_right
        cs += colour_shape(r.text, scene)
        count_right += sc.count_right
        if not scene.objects:
            empty += 1
            empty_said += sc.all_right
        lines.append(f"{i:2d} {'ok ' if sc.all_right else 'BAD'} {scene.caption!r} -> {r.text!r}")
    rates = {"objects": right / objects if objects else 1.0, "colour_shape": cs / objects if objects else 1.0,
             "count": count_right / len(sample), "empty": empty_said / empty if empty else 1.0}
    return rates, "\n".join(lines)


def test_held_out_sample_against_committed_threshold(held_out_sample: list[tuple[Any, Any]]) -> None:
    rates, report = _tally(held_out_sample)
    assert rates["objects"] >= OBJECTS_RIGHT_MIN, f"objects fully right {rates}\n{report}"
    assert rates["count"] >= COUNT_RIGHT_MIN, f"count right {rates}\n{report}"


def test_vision_int8_keeps_the_held_out_sample(held_out_sample: list[tuple[Any, Any]], demo_text: Path,
                                               int8_vision_table: Any) -> None:
    """vision_int8 (the tower on int8 products where this CPU has an int8 kernel; on an AMX CPU,
    whose built-in table keeps AMX's float GEMM, through a test table): the same committed
    thresholds on the same frames, and mostly the float text itself."""
    from edgevlm_ros.demo.demo_model import DEMO_MMPROJ_PATH
    from edgevlm_ros.engine.vlm import load_vlm

    kernel = int8_vision_table()
    if kernel is None:
        pytest.skip("no int8 kernel on this CPU (test_minicpmv checks that vision_int8 then changes nothing)")
    vlm = load_vlm(demo_text, DEMO_MMPROJ_PATH, threads=2, image_mode="single", vision_int8=True)
    sample = [(scene, vlm.describe(scene.image(), prompt=PROMPT, max_new_tokens=MAX_NEW_TOKENS))
              for scene, _ in held_out_sample]
    rates, report = _tally(sample)
    same = sum(a.text == b.text for (_, a), (_, b) in zip(sample, held_out_sample, strict=True))
    print(f"vision_int8 ({kernel}): {same} / {len(sample)} descriptions equal the float ones; {rates}")
    assert rates["objects"] >= OBJECTS_RIGHT_MIN, f"objects fully right {rates}\n{report}"
    assert rates["count"] >= COUNT_RIGHT_MIN, f"count right {rates}\n{report}"
    assert same >= VISION_INT8_SAME_MIN * len(sample), report


@pytest.mark.parametrize("set_name,frames,minimum", [
    ("single", 24, {"colour_shape": INDEPENDENT_SINGLE_MIN, "objects": INDEPENDENT_OBJECTS_MIN}),
    ("multi", 16, {"objects": INDEPENDENT_OBJECTS_MIN}),
    ("empty", 12, {"empty": INDEPENDENT_EMPTY_MIN}),
])
def test_independent_renderer_against_committed_thresholds(demo_vlm: Any, set_name: str, frames: int,
                                                          minimum: dict[str, float]) -> None:
    """Frames the model never saw the like of in training: drawn with Pillow by eval_world (its own
    shapes, colour values, backgrounds, camera faults and frame sizes), described by OUR engine."""
    from edgevlm_ros.demo.eval_world import eval_scenes

    sample = [(s, demo_vlm.describe(s.image(), prompt=PROMPT, max_new_tokens=MAX_NEW_TOKENS))
              for s in eval_scenes(set_name, frames)]
    rates, report = _tally(sample)
    print(set_name, rates)
    for key, low in minimum.items():
        assert rates[key] >= low, f"{set_name}: {key} {rates[key]:.3f} < {low}\n{report}"


@pytest.fixture(scope="module")
def torch_demo(demo_text: Path, text_model_path: Path, hf_model: Any) -> tuple[Any, ...]:
    """The committed model in the training tool's torch classes: (tool, tower, decoder, tokenizer,
    prompt, preprocess config) — transformers' Idefics3 vision classes with the weights read back from
    the committed mmproj, SmolLM2 dequantized to float32."""
    import torch

    T = _training_tool()

    from edgevlm_ros import _engine
    from edgevlm_ros.demo.demo_model import DEMO_MMPROJ_PATH, DEMO_RECORD_PATH
    from edgevlm_ros.engine.tokenizer import Tokenizer

    vision = json.loads(DEMO_RECORD_PATH.read_text())["vision"]
    assert (vision["width"], vision["layers"]) == (T.WIDTH, T.LAYERS), "the tool's tower differs from the record's"
    torch.set_num_threads(2)
    tile = (T.IMAGE_SIZE, T.PATCH_SIZE, T.SCALE)
    try:  # the committed model's tile geometry (the tool's --tile)
        T.set_tile(vision["image_size"], vision["patch_size"], vision["scale_factor"])
        vs = T.VisionSide(T.idefics3_config(), 0)
        cfg = T.preprocess_config()
    finally:
        T.set_tile(*tile)
    T.load_mmproj(vs, DEMO_MMPROJ_PATH)
    vs.train(False)
    dec = T.Decoder(text_model_path, hf_model)  # the session's SmolLM2 (test_parity's too)
    meta = _engine.GGUFFile(str(demo_text)).metadata()
    tok = Tokenizer.from_gguf_metadata(meta)
    prompt = T.make_prompt(tok, meta["tokenizer.chat_template"], PROMPT)
    return T, vs, dec, tok, prompt, cfg


def test_engine_text_equals_torch_on_the_sample(held_out_sample: list[tuple[Any, Any]], torch_demo: tuple[Any, ...]
                                                ) -> None:
    """The same frames through the torch model (torch_demo): the greedy texts must be
    equal, except where the torch model's top-2 logits are within TIE_MARGIN at the first differing
    token (our default decode kernels quantize activations to int8: test_parity.py measures their
    logit error, <= 0.37, and uses the same margin). Every difference is reported."""
    import torch

    from edgevlm_ros.engine.preprocess import preprocess

    T, vs, dec, tok, prompt, cfg = torch_demo
    pixels = torch.from_numpy(np.stack([preprocess(s.image(), cfg).pixel_values[0] for s, _ in held_out_sample]))
    stop = {tok.token_to_id("<|im_end|>"), tok.eos_id}
    tokens, margins = T.torch_greedy(vs, dec, prompt, pixels, stop, MAX_NEW_TOKENS)
    same, report, too_far = 0, [], []
    for i, ((_, r), t, m) in enumerate(zip(held_out_sample, tokens, margins, strict=True)):
        if list(r.token_ids) == t:
            same += 1
            continue
        j = next((k for k, (a, b) in enumerate(zip(r.token_ids, t, strict=False)) if a != b),
                 min(len(r.token_ids), len(t)))
        gap = m[j][1] if j < len(m) else float("nan")
        report.append(f"frame {i}: token {j}, torch top1-top2 {gap:.3f}: ours {r.text!r} / torch {tok.decode(t)!r}")
        if not gap < TIE_MARGIN:
            too_far.append(report[-1])
    print("\n".join(report) or "engine == torch on every frame")
    assert not too_far, "differences away from a near tie:\n" + "\n".join(too_far)
    assert same >= ENGINE_EQUALS_TORCH_MIN * HELD_OUT_FRAMES, "\n".join(report)


def test_caption_stage_hard_frames_are_the_ones_in_doubt(torch_demo: tuple[Any, ...]) -> None:
    """--caption-hard-every's scan: a caption whose count word is wrong costs more than the right one
    (the worst-token loss sees one wrong word in a long caption), and the frames kept are the scan's
    largest worst-token losses, in stream order."""
    import torch

    T, vs, dec, tok, prompt, cfg = torch_demo
    seed, first, scan, keep = 2, 5000, 48, 6
    scenes, px = T.FramePool(seed, scan, cfg, first=first).batch(0, scan)
    with torch.no_grad():
        worst = T.worst_token_losses(dec, tok, prompt, vs(px), scenes)
        one = next(i for i, s in enumerate(scenes) if len(s.objects) == 1)
        wrong = replace(scenes[one], caption=caption_for(scenes[one].objects * 2))  # "Two ..." of one object
        assert wrong.caption.startswith("Two") and scenes[one].caption != wrong.caption
        doubt = T.worst_token_losses(dec, tok, prompt, vs(px[one : one + 1]), [wrong])
    assert float(doubt[0]) > float(worst[one]) + 1.0, (scenes[one].caption, float(worst[one]), float(doubt[0]))
    found = T.hard_frames(vs, dec, tok, prompt, seed, cfg, first, scan, keep, workers=1, chunk=20)
    assert found["frames"] == sorted(found["frames"]) and len(found["frames"]) == keep
    kept = [k - first for k in found["frames"]]
    dropped = [k for k in range(scan) if k not in kept]
    assert min(worst[kept]) >= max(worst[dropped]) - 1e-4
    assert abs(found["worst_token_loss_kept_from"] - float(min(worst[kept]))) < 1e-3
    with pytest.raises(SystemExit, match="hard frames wanted"):
        T.hard_frames(vs, dec, tok, prompt, seed, cfg, first, 4, 5, workers=1)


# -- the converter's vision-only entry point (what the training tool exports with) --------------------


def test_convert_mmproj_equals_the_mmproj_of_convert(tmp_path: Path) -> None:
    from hf_fixtures import cached_random_smolvlm

    from edgevlm_ros.tools.convert import convert, convert_mmproj

    hf = cached_random_smolvlm(text_layers=2, vision_layers=2)
    _, mmproj = convert(hf, tmp_path / "both", "f16", name="m")
    alone = convert_mmproj(hf, tmp_path / "alone" / "mmproj.gguf", "f16", name="m")
    assert alone.read_bytes() == mmproj.read_bytes()


# -- the demo command ---------------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["scenes", "drift"])
def test_demo_command_describes_frames_and_summarises(demo_text: Path, tmp_path: Path, source: str) -> None:
    """`edgevlm demo --frames N` end to end: camera publisher, node and monitor as ROS 2 processes
    over DDS (localhost discovery, a domain of this run), then the summary as JSON; with the default
    camera and with the slowly changing view (--source drift), scored against its own ground truth."""
    import subprocess

    from ros_helpers import random_domain_id, ros_env

    from edgevlm_ros.demo.demo_model import DEMO_MMPROJ_PATH

    assert DEMO_MMPROJ_PATH.exists()
    frames = 4
    extra = ["--source", source] if source != "scenes" else []  # the default is tested as it is
    r = subprocess.run([sys.executable, "-m", "edgevlm_ros.cli", "demo", "--frames", str(frames), "--json",
                        "--timeout", "240", *extra], env=ros_env(random_domain_id(), tmp_path / "log"), cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["frames_described"] >= frames
    # The ground truth of every described frame reached the monitor (transient local captions: even
    # of frames published before the monitor matched; a CI run under load once lost all four).
    assert summary["frames_unmatched"] == 0, summary
    # Every described frame was matched with its ground truth and scored; the model is the real one
    # (judged on the default camera's frames: a drift view's 4 frames are one scene, moved a little).
    assert 0 <= summary["objects_fully_right"] <= 1 and 0 <= summary["count_right"] <= 1, summary
    if source == "scenes":
        assert summary["objects_fully_right"] >= 0.5 and summary["count_right"] >= 0.5, summary
    assert set(summary["latency_ms"]) >= {"preprocess", "vision", "prefill", "decode", "total"}
    assert all(v["p50"] > 0 for v in summary["latency_ms"].values())
    counters = summary["node_counters"]
    assert counters["frames_received"] >= frames and counters.get("frames_failed", 0) == 0, counters
