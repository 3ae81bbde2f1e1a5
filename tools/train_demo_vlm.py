#!/usr/bin/env python3
"""Trains the embedded demo VLM's vision side and writes it, with its record, to edgevlm_ros/data/.

    .venv/bin/python tools/train_demo_vlm.py            # a developer tool, not CI (see "Time" below)

What is trained: a SigLIP-style vision tower and the idefics3 connector, built from transformers'
own Idefics3 classes (so the math is exactly what the converter and the engine implement), on top
of the real SmolLM2-135M-Instruct decoder, frozen (the Q4_1 GGUF dequantized to float32, plus the
128 zero rows of SmolVLM's added tokens: edgevlm_ros/demo/demo_model.py). The world is the synthetic
one of edgevlm_ros/demo/scenes.py; the target is its ground-truth caption after the chat prompt
(the node's default request, "Describe the image in one sentence.").

Shapes: 128 x 128 input, 16 x 16 patches (an 8 x 8 grid), width 128, 4 layers, 2 heads, MLP 512,
pixel shuffle scale 2 -> 16 image tokens of width 576 (about 1.2 M parameters, ~2.6 MB as F16).
Small on purpose: on this 2-core machine, shared with other jobs, a 256 px tile (256 patches,
width 192) ran ~15x slower per step and learned too little in 20 minutes (2026-11-30); what the
tower must learn is mostly routing (which third goes to which image token), which takes steps.

The image tokens are trained to hold a "soft prompt" the frozen decoder turns into the caption:
16 slots, five per third of the frame (count, size, colour, shape, position words; "." where the
third is empty) and an end slot ("." after objects; "No", the caption's first word, in a frame
without known objects: one global decision the tower makes and the decoder reads); slot k holds
E[word] + offset[k] + delta[word] (E: the decoder's own input embeddings). Stages (`--stages`,
each saves to --work, so they can run as separate commands; "prompt" needs no vision weights and
may run beside "keywords"):
1. keywords: tower + connector learn to emit E[word] per slot (offsets and deltas zero) — no
   decoder in the loop, so a step costs ~1/20 of a decoder step. A throw-away linear head on the
   tower's patch outputs also learns, per patch, the colour and the shape of the object covering it
   (or background): a dense, local signal that teaches the tower to see sooner; it is not exported.
2. prompt: the offsets and deltas (26 x 576 + 16 x 576 numbers) learn, through the frozen decoder,
   to make it write the exact caption (cross-entropy on the caption and <|im_end|>), from scene
   descriptions alone (no pixels, no tower). Starting from plain keywords the decoder already got
   62% of the caption tokens right; 50 steps of 16 scenes bring it to ~98%.
3. regress: the tower + connector learn the learned targets (same losses as stage 1). The shipped
   model runs this stage alone from a fresh tower (--regress-from-scratch --pos-init routing):
   the routing start (VisionSide._routing_prior) gives head 0 of the last layer "each mention's
   tokens look at their third" before the first step, and the dense per-patch head also learns
   size and object centres. With it the colour and position slots are right in >98% of held-out
   slots after ~4 minutes instead of ~4000 steps.
4. caption (--steps2 > 0): connector, post-layernorm and the top --train-layers layers of the tower
   (and with --train-patch-embedding its patch embedding)
   fine-tuned through the frozen decoder on teacher-forced captions of new frames (stream seed + 1,
   each seen once; every --caption-empty-every-th one without objects, every --caption-count-every-th
   one with two or more alike objects in a third, every --caption-hard-every-th one of the frames the
   starting tower leaves most in doubt: the largest teacher-forced loss of any caption token among
   --caption-hard-scan new frames). The regress targets are the
   nearest-keyword picture of what the decoder needs; this stage corrects what lies between them:
   a slot's output a quarter of the way from "No" to "." is the nearest keyword's, but the decoder
   does not read it so. A run from caption.pt continues the saved one on the frames after it.
   Scored before, every --caption-monitor-every steps and after on 64 + 16 fixed frames of
   stream seed + 2 (teacher-forced loss, token accuracy, exact captions). --caption-first-frames
   moves a run from regress weights onto other frames.
   average (not in the default --stages; --average-of WORK WORK ...): the mean of the weights of
   caption runs from the same regress weights (a "model soup": the runs' errors differ, the mean keeps
   what they share), saved as caption.pt with a record of every run averaged.
5. eval: export (transformers-layout checkpoint -> edgevlm_ros.tools.convert.convert_mmproj, F16), then
   `--eval-frames` frames of `--eval-seed` (never used in training, the training frame sizes) through
   OUR engine and through torch (the same F16-rounded vision weights, the same dequantized decoder):
   accuracy by edgevlm_ros.demo.scenes.score, greedy text agreement, near ties; and
   `--independent-frames` frames of each set of edgevlm_ros.demo.eval_world (drawn with Pillow, its
   own colours, backgrounds and seed: single objects, scenes of two or three, frames without known
   objects) through our engine. Everything lands in the JSON record.

What is slow: SHAPE. With perfect slots the frozen decoder names 99% of the objects right
(48 held-out scenes: soft prompt alone, no pixels), so the vision side is the limit, and in it the
shape slot: the tower learns colour, position, size and count in minutes, but shape only turns
after ~1500 steps (per-patch shape accuracy 0.5 -> 0.97 between steps ~1250 and 5000 of the
shipped run). docs/demo-model.md has the pilots (tile size, patch size, width, depth, object
size, grouping supervision, the dark outline that the scenes now draw) and that curve.

Seeds: the vision stages draw frames from stream `seed`, the prompt stage scenes from `seed + 1`,
the held-out monitor from `seed + 2`; the evaluation seed must differ from all three.

Time: --threads sets torch's threads (default 1, so that the machine stays usable). The record
lists the exact commands of the shipped model and their wall times: the prompt stage ran on one
thread beside other jobs (41 min; the same 53 steps take 2 min on two threads on a quiet machine),
the two regress runs on two threads on a quiet machine (17 + 20 min), the evaluation ~3 min.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import platform
import shutil
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edgevlm_ros.demo.demo_model import (  # noqa: E402
    BASE_VOCAB,
    DEMO_MMPROJ_PATH,
    DEMO_RECORD_PATH,
    IMAGE_TOKEN_ID,
    VOCAB_SIZE,
    ensure_demo_text_model,
)
from edgevlm_ros.demo.eval_world import EVAL_SEED, EVAL_SETS, eval_scenes  # noqa: E402
from edgevlm_ros.demo.scenes import NO_OBJECTS, POSITIONS, Scene, generate_scene, mentions, parse_caption, score  # noqa: E402
from edgevlm_ros.engine.chat_template import render_chat  # noqa: E402
from edgevlm_ros.engine.preprocess import IMAGE_TOKEN, PreprocessConfig, expand_image_prompt, preprocess  # noqa: E402
from edgevlm_ros.engine.tokenizer import Tokenizer  # noqa: E402

log = logging.getLogger("train_demo_vlm")

# -- model shape ------------------------------------------------------------------------------------
IMAGE_SIZE = 128
PATCH_SIZE = 16
WIDTH = 128
LAYERS = 4
HEADS = 2
MLP = 512
SCALE = 2
N_IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE**2  # 16
TEXT_WIDTH = 576
ROUTE_LAYER = LAYERS - 1  # the layer whose head 0 gathers each third's patches for its mention tokens
GROUP_LAYERS = (1, 2)  # layers whose head 0 learns to gather each object's patches (grouping_target)

# The node's default request (config/edgevlm.yaml). Stage 2 trains on it alone: decoder time is scarce.
PROMPTS = ("Describe the image in one sentence.",)
EXTRA_EVAL_PROMPTS = ("Describe what you see.",)  # edgevlm_ros.engine.vlm.DEFAULT_PROMPT: reported, not trained
# Frame sizes seen in training (width, height, probability): 160x120 up to 1280x720, 4:3, 16:9, 1:1
# and 16:10, so neither the stretch to a square tile nor the detail lost on the way is one fixed
# amount. Weighted to the small sizes: drawing a 1280x720 frame costs ~12x a 320x240 one
# (163 vs 14 ms here), and every size ends as a 128 px tile.
FRAME_SIZES = ((160, 120, 0.15), (320, 240, 0.35), (424, 240, 0.1), (256, 256, 0.1), (384, 240, 0.05),
               (640, 480, 0.1), (640, 360, 0.1), (1280, 720, 0.05))
MAX_NEW_TOKENS = 48


# -- data -------------------------------------------------------------------------------------------


def preprocess_config() -> PreprocessConfig:
    return PreprocessConfig(tile_size=IMAGE_SIZE, longest_edge=IMAGE_SIZE, image_mean=(0.5, 0.5, 0.5),
                            image_std=(0.5, 0.5, 0.5), image_seq_len=N_IMAGE_TOKENS, mode="single")


def frame_size(seed: int, index: int) -> tuple[int, int]:
    rng = np.random.default_rng([seed, index, 0x5EED])
    i = int(rng.choice(len(FRAME_SIZES), p=[p for _, _, p in FRAME_SIZES]))
    return FRAME_SIZES[i][0], FRAME_SIZES[i][1]


def sample(seed: int, index: int, cfg: PreprocessConfig, size: tuple[int, int] | None = None
           ) -> tuple[Scene, np.ndarray]:
    w, h = size or frame_size(seed, index)
    scene = generate_scene(seed, index, w, h)
    return scene, preprocess(scene.image(), cfg).pixel_values[0]


SHAPE_COVERAGE = 0.5  # a patch's shape label counts only where its object covers at least this much of it


def patch_labels(scene: Scene) -> tuple[np.ndarray, ...]:
    """Per patch of the tile (row-major): the colour, shape and size index of the object covering
    most of it (at least a fifth), else the background class (len(COLOURS), len(SHAPES), len(SIZES));
    the index of that object (-1: none); and how many object centres lie in the patch. The shape
    label is -100 (ignored) where the object covers less than SHAPE_COVERAGE of the patch: a sliver
    of an edge does not tell a circle from a square. The tile is
    the whole frame stretched, so the patch grid is the frame cut into side x side cells."""
    import cv2

    from edgevlm_ros.demo.scenes import COLOURS, SHAPES, SIZES, _object_mask

    side = IMAGE_SIZE // PATCH_SIZE
    ids = np.zeros((scene.height, scene.width), np.uint8)
    for k, o in enumerate(scene.objects):  # later objects cover earlier ones
        ids[_object_mask(o, scene.width, scene.height)] = k + 1
    fractions = np.stack([cv2.resize((ids == k + 1).astype(np.float32), (side, side), interpolation=cv2.INTER_AREA)
                          for k in range(len(scene.objects))] or [np.zeros((side, side), np.float32)])
    best = fractions.argmax(0)
    cover = fractions.max(0).reshape(-1)
    covered = fractions.max(0) >= 0.2
    colours, shapes = list(COLOURS), list(SHAPES)
    col = np.full(side * side, len(colours), np.int64)
    shp = np.full(side * side, len(shapes), np.int64)
    size = np.full(side * side, len(SIZES), np.int64)
    obj = np.full(side * side, -1, np.int64)
    for flat, (b, c) in enumerate(zip(best.reshape(-1), covered.reshape(-1), strict=True)):
        if c:
            o = scene.objects[int(b)]
            col[flat], obj[flat] = colours.index(o.colour), int(b)
            shp[flat] = shapes.index(o.shape) if cover[flat] >= SHAPE_COVERAGE else -100
            size[flat] = SIZES.index(o.size)
    centres = np.zeros(side * side, np.float32)
    for o in scene.objects:
        cx = min(int(o.cx / scene.width * side), side - 1)
        cy = min(int(o.cy / scene.height * side), side - 1)
        centres[cy * side + cx] += 1.0
    return col, shp, size, obj, centres


def _token_patches() -> list[list[int]]:
    """The patches (flat, row-major) that pixel shuffle packs into each image token."""
    side, tokens_side = IMAGE_SIZE // PATCH_SIZE, IMAGE_SIZE // PATCH_SIZE // SCALE
    out = []
    for k in range(tokens_side * tokens_side):
        r, c = divmod(k, tokens_side)
        out.append([(SCALE * r + i) * side + SCALE * c + j for i in range(SCALE) for j in range(SCALE)])
    return out


TOKEN_PATCHES = _token_patches()


def set_tile(image_size: int, patch_size: int, scale: int) -> None:
    """Another tile geometry (it must still give N_IMAGE_TOKENS image tokens)."""
    global IMAGE_SIZE, PATCH_SIZE, SCALE, TOKEN_PATCHES
    side = image_size // patch_size
    if image_size % patch_size or side % scale or (side // scale) ** 2 != N_IMAGE_TOKENS:
        raise ValueError(f"{image_size}/{patch_size}/scale {scale} does not give {N_IMAGE_TOKENS} image tokens")
    IMAGE_SIZE, PATCH_SIZE, SCALE = image_size, patch_size, scale
    TOKEN_PATCHES = _token_patches()


SLOT_GROUPS = [list(range(5 * g, 5 * g + 5)) for g in range(len(POSITIONS))]  # tokens of each third's mention
COUNT_SLOTS = [group[0] for group in SLOT_GROUPS]  # the count word of each third's mention


def nearest_target_logits(out: Any, cand: Any) -> Any:
    """Slot logits of tower outputs (..., 576) against targets (..., K, 576): nearest target wins,
    the logits are minus squared distances (consistent with the regress stage's MSE)."""
    return -(out.unsqueeze(-2) - cand).pow(2).sum(-1)


def routing_target(scene: Scene, obj: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where the patches of a mention's image tokens should look: (64, 64) rows = query patches, a
    uniform distribution over the patches of that third's objects; and which rows are supervised."""
    n = obj.shape[0]
    target = np.zeros((n, n), np.float32)
    mask = np.zeros(n, bool)
    for g, place in enumerate(POSITIONS):
        keys = [p for p in range(n) if obj[p] >= 0 and scene.objects[int(obj[p])].position == place]
        if not keys:
            continue
        for k in SLOT_GROUPS[g]:
            for q in TOKEN_PATCHES[k]:
                target[q, keys] = 1.0 / len(keys)
                mask[q] = True
    return target, mask


def grouping_target(obj: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Which patches belong together: (patches, patches) rows = query patches, for a patch of an object
    a uniform distribution over that object's patches; and which rows are supervised (object patches).
    Shape is a property of the whole silhouette, not of one patch (an inner patch is just colour), so
    the grouping heads (GROUP_LAYERS) are told to gather each object's patches."""
    n = obj.shape[0]
    target = np.zeros((n, n), np.float32)
    for o in set(obj[obj >= 0].tolist()):
        members = np.flatnonzero(obj == o)
        target[np.ix_(members, members)] = 1.0 / len(members)
    return target, obj >= 0


class Keywords:
    """Stage 1 targets: 16 decoder token ids per scene (5 per third + an end slot)."""

    def __init__(self, tok: Tokenizer) -> None:
        def one(text: str) -> int:
            ids = tok.encode(text, add_bos=False)
            if len(ids) != 1:
                raise ValueError(f"{text!r} is {len(ids)} tokens; keyword slots need single tokens")
            return ids[0]

        from edgevlm_ros.demo.scenes import COLOURS, SHAPES, SIZES

        self.count = {1: one(" a"), 2: one(" two"), 3: one(" three")}
        self.size = {s: one(" " + s) for s in SIZES}
        self.colour = {c: one(" " + c) for c in COLOURS}
        self.shape = {s: one(" " + s) for s in SHAPES} | {s + "s": one(" " + s + "s") for s in SHAPES}
        self.position = {p: one(" " + p) for p in POSITIONS}
        self.pad = one(".")
        # The end slot of a frame without known objects: the caption's own first word, so the frozen
        # decoder reads one clear token for the one global decision (all "." slots did not do it:
        # the "." delta and the slot offsets also serve every empty third of every other frame).
        self.none = one(NO_OBJECTS.split()[0])
        vocab = {self.pad, self.none, *self.count.values(), *self.size.values(), *self.colour.values(),
                 *self.shape.values(), *self.position.values()}
        self.vocab = sorted(vocab)
        self.index = {t: i for i, t in enumerate(self.vocab)}

    def slots(self, scene: Scene) -> list[int]:
        out: list[int] = []
        for p in POSITIONS:
            objs = [o for o in scene.objects if o.position == p]
            if not objs:
                out += [self.pad] * 5
                continue
            o, n = objs[0], len(objs)
            out += [self.count[n], self.size[o.size], self.colour[o.colour],
                    self.shape[o.shape + ("s" if n > 1 else "")], self.position[p]]
        out.append(self.pad if scene.objects else self.none)
        assert len(out) == N_IMAGE_TOKENS
        return out


@dataclass
class Prompt:
    """Token ids around the image for one user prompt, split as the engine splits them."""

    text: str
    prefix: list[int]  # everything before the image: the engine's cached prefix
    rest: list[int]  # image block (with <image> x N) + the rest of the prompt up to the answer

    @property
    def image_slots(self) -> np.ndarray:
        return np.flatnonzero(np.asarray(self.rest) == IMAGE_TOKEN_ID)


def make_prompt(tok: Tokenizer, template: str, text: str) -> Prompt:
    """Same rendering and split as edgevlm_ros.engine.vlm.VisionLanguageModel (no system prompt given)."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    bos = tok.id_to_token(tok.bos_id) if tok.bos_id is not None else ""
    eos = tok.id_to_token(tok.eos_id) if tok.eos_id is not None else ""
    rendered = render_chat(template, messages, add_generation_prompt=True, bos_token=bos, eos_token=eos)
    before, after = rendered.split(IMAGE_TOKEN, 1)
    rest = tok.encode(expand_image_prompt(0, 0, N_IMAGE_TOKENS) + after, add_bos=False)
    return Prompt(text, tok.encode(before, add_bos=False), rest)


# -- models -----------------------------------------------------------------------------------------


def idefics3_config() -> Any:
    from transformers import Idefics3Config

    text = {
        "model_type": "llama", "vocab_size": VOCAB_SIZE, "hidden_size": TEXT_WIDTH, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "hidden_act": "silu",
        "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
    }
    vision = {
        "hidden_size": WIDTH, "intermediate_size": MLP, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_channels": 3, "image_size": IMAGE_SIZE, "patch_size": PATCH_SIZE, "layer_norm_eps": 1e-6,
        "hidden_act": "gelu_pytorch_tanh",
    }
    return Idefics3Config(text_config=text, vision_config=vision, scale_factor=SCALE, image_token_id=IMAGE_TOKEN_ID,
                          tie_word_embeddings=True)


class VisionSide:
    """transformers' Idefics3VisionTransformer + Idefics3Connector: image -> 16 x 576 embeddings."""

    def __init__(self, config: Any, seed: int, pos_init: str = "default") -> None:
        import torch
        from transformers.models.idefics3.modeling_idefics3 import Idefics3Connector, Idefics3VisionTransformer

        torch.manual_seed(seed)
        # Eager attention (same math as SDPA) so that training can read the attention weights.
        config.vision_config._attn_implementation = "eager"
        self.config = config
        self.vision = Idefics3VisionTransformer(config.vision_config)
        self.connector = Idefics3Connector(config)
        self.retiled_from = ""  # the tile geometry of loaded weights carried over by `retiled`, if any
        # Start the image tokens near the decoder's embedding scale (|e| ~ 2.5), not ~14 as nn.Linear's
        # default gives for 3072 unit-variance inputs.
        torch.nn.init.normal_(self.connector.modality_projection.proj.weight, std=0.002)
        if pos_init == "sincos":
            # 2-D sine/cosine position embeddings (x in half the channels, y in the other half) instead
            # of N(0, 0.02^2). Tried (a 4-minute run): no clear gain; the shipped model does not use it.
            side = IMAGE_SIZE // PATCH_SIZE
            half = WIDTH // 2
            freqs = torch.exp(-math.log(100.0) * torch.arange(half // 2) / (half // 2))
            ys, xs = torch.meshgrid(torch.arange(side, dtype=torch.float32),
                                    torch.arange(side, dtype=torch.float32), indexing="ij")

            def code(v: Any) -> Any:
                a = v.reshape(-1, 1) * freqs
                return torch.cat([a.sin(), a.cos()], 1)

            with torch.no_grad():
                self.vision.embeddings.position_embedding.weight.copy_(torch.cat([code(xs), code(ys)], 1))

        elif pos_init == "routing":
            self._routing_prior()

    def _routing_prior(self) -> None:
        """Initial weights that give head 0 of the last layer a start on the routing: every patch of
        a third's mention tokens attends evenly to the patches of that third (and nothing else does).
        Six channels of the position embeddings carry two codes, "my third" (which third of the frame
        the patch lies in) and "my group" (which third the image token the patch belongs to describes);
        the head's query reads the group code, its key the third code. The patch embedding writes
        nothing into those channels at the start. Everything stays trainable: this is where training
        starts, not a fixed part of the model."""
        import torch

        side = IMAGE_SIZE // PATCH_SIZE
        n_thirds = len(POSITIONS)
        third_ch = list(range(WIDTH - 2 * n_thirds, WIDTH - n_thirds))
        group_ch = list(range(WIDTH - n_thirds, WIDTH))
        alpha, beta = 4.0, 3.0
        pos = self.vision.embeddings.position_embedding.weight
        attn = self.vision.encoder.layers[ROUTE_LAYER].self_attn
        with torch.no_grad():
            pos[:, third_ch + group_ch] = 0.0
            for p in range(side * side):
                pos[p, third_ch[min(int(3 * ((p % side) + 0.5) / side), n_thirds - 1)]] = alpha
            for g, tokens in enumerate(SLOT_GROUPS):
                for k in tokens:
                    for p in TOKEN_PATCHES[k]:
                        pos[p, group_ch[g]] = alpha
            self.vision.embeddings.patch_embedding.weight[third_ch + group_ch] = 0.0
            self.vision.embeddings.patch_embedding.bias[third_ch + group_ch] = 0.0
            # Head 0 owns the first head_dim rows of q_proj / k_proj; its first three dimensions match codes.
            for d in range(n_thirds):
                attn.q_proj.weight[d] = 0.0
                attn.k_proj.weight[d] = 0.0
                attn.q_proj.weight[d, group_ch[d]] = beta
                attn.k_proj.weight[d, third_ch[d]] = beta
            attn.q_proj.bias[:n_thirds] = 0.0
            attn.k_proj.bias[:n_thirds] = 0.0

    def modules(self) -> list[Any]:
        return [self.vision, self.connector]

    def train(self, mode: bool = True) -> None:
        """Training (True) or evaluation (False) mode for the tower and the connector."""
        for m in self.modules():
            m.train(mode)

    def __call__(self, pixel_values: Any, with_patches: bool = False) -> Any:
        """(B, 16, 576) image embeddings; with_patches: also the patch states that enter the routing
        layer (B, patches, WIDTH), and the attention maps in self.attentions."""
        if with_patches:
            o = self.vision(pixel_values=pixel_values, output_attentions=True, output_hidden_states=True)
            self.attentions = o.attentions
            return self.connector(o.last_hidden_state), o.hidden_states[ROUTE_LAYER]
        return self.connector(self.vision(pixel_values=pixel_values).last_hidden_state)

    def state_dict(self) -> dict[str, Any]:
        """Tensors under the names of an Idefics3ForConditionalGeneration checkpoint."""
        out = {f"model.vision_model.{k}": v for k, v in self.vision.state_dict().items()}
        out |= {f"model.connector.{k}": v for k, v in self.connector.state_dict().items()}
        return out

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Loads weights under an Idefics3 checkpoint's names; weights of another tile geometry (16
        image tokens either way, e.g. the shipped 128/16/2 into a 192/16/3 tower) are carried over
        by `retiled`."""
        if sd[POS_NAME].shape != self.vision.embeddings.position_embedding.weight.shape:
            self.retiled_from = "{}/{}/{}".format(*tile_of(sd))
            sd = retiled(sd)
        self.vision.load_state_dict({k[len("model.vision_model."):]: v for k, v in sd.items()
                                     if k.startswith("model.vision_model.")})
        self.connector.load_state_dict({k[len("model.connector."):]: v for k, v in sd.items()
                                        if k.startswith("model.connector.")})


POS_NAME = "model.vision_model.embeddings.position_embedding.weight"
PROJ_NAME = "model.connector.modality_projection.proj.weight"


def _sub_interpolation(old: int, new: int) -> np.ndarray:
    """(new, old): linear interpolation between the old sub-patch centres of one image token, at the
    new sub-patch centres (clamped at the token's edges). Each column sums to new / old."""
    m = np.zeros((new, old))
    for a in range(new):
        x = min(max((a + 0.5) * old / new - 0.5, 0.0), old - 1.0)
        lo = int(x)
        hi = min(lo + 1, old - 1)
        m[a, lo] += 1.0 - (x - lo)
        m[a, hi] += x - lo
    return m


def tile_of(sd: dict[str, Any]) -> tuple[int, int, int]:
    """(image size, patch size, scale) of a checkpoint, read from its tensors' shapes."""
    return (math.isqrt(sd[POS_NAME].shape[0]) * PATCH_SIZE, PATCH_SIZE,
            math.isqrt(sd[PROJ_NAME].shape[1] // WIDTH))


def retiled(sd: dict[str, Any]) -> dict[str, Any]:
    """The weights of a tower of another tile geometry, carried over to the current one (same patch
    size and image tokens; the old geometry read from the tensors' shapes). An image token covers
    the same part of the frame in both, so within each token the position embeddings are
    interpolated between the old sub-patches (the routing codes of a token's group stay its own),
    and the connector's weight for a new sub-patch is the interpolated old weights scaled by
    old_scale^2 / new_scale^2, so that a token whose patches all equal the old ones' gives the old
    output. Everything else (patch embedding, layers, norms) has the same shape and is kept."""
    import torch

    size, _, old_scale = tile_of(sd)
    old_side = size // PATCH_SIZE
    new_side, new_scale = IMAGE_SIZE // PATCH_SIZE, SCALE
    tokens_side = new_side // new_scale
    if old_side * old_side != sd[POS_NAME].shape[0] or old_side // old_scale != tokens_side:
        raise ValueError(f"cannot carry a {old_side}x{old_side}-patch tower (scale {old_scale}) over to "
                         f"{new_side}x{new_side} (scale {new_scale}): the image tokens differ")
    m = torch.from_numpy(_sub_interpolation(old_scale, new_scale)).float()
    old_pos = sd[POS_NAME].reshape(tokens_side, old_scale, tokens_side, old_scale, WIDTH)
    new_pos = torch.einsum("ai,bj,ricjw->racbw", m, m, old_pos).reshape(new_side * new_side, WIDTH)
    proj = sd[PROJ_NAME]
    old_w = proj.reshape(proj.shape[0], old_scale, old_scale, WIDTH)  # channel (a * s + b) * WIDTH + d
    new_w = torch.einsum("ai,bj,hijw->habw", m, m, old_w) * (old_scale**2 / new_scale**2)
    return {**sd, POS_NAME: new_pos, PROJ_NAME: new_w.reshape(proj.shape[0], new_scale * new_scale * WIDTH)}


class Decoder:
    """The frozen SmolLM2 decoder in torch, with the demo file's 49280-row (zero-extended) embeddings."""

    def __init__(self, gguf: Path, model: Any = None) -> None:
        """`model`: transformers' float32 model already loaded from `gguf` (the tests' session
        fixture: loading dequantizes the whole file again, tens of seconds)."""
        import torch
        from transformers import AutoModelForCausalLM

        self.model = model if model is not None else AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        self.model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        base = self.model.model.embed_tokens.weight
        if base.shape != (BASE_VOCAB, TEXT_WIDTH):
            raise ValueError(f"unexpected SmolLM2 embeddings {tuple(base.shape)}")
        self.embeddings = torch.cat([base, torch.zeros(VOCAB_SIZE - BASE_VOCAB, TEXT_WIDTH)], 0)
        self._prefix_kv: dict[tuple[int, ...], list[tuple[Any, Any]]] = {}

    def embed(self, ids: Any) -> Any:
        return self.embeddings[ids]

    def logits(self, hidden: Any) -> Any:
        return hidden @ self.embeddings.T

    def prefix_cache(self, prefix: Sequence[int], batch: int) -> Any:
        """A fresh KV cache holding `prefix` (computed once per prefix), expanded to `batch` rows."""
        import torch
        from transformers import DynamicCache

        key = tuple(prefix)
        if key not in self._prefix_kv:
            with torch.no_grad():
                out = self.model.model(inputs_embeds=self.embed(torch.tensor([key])), use_cache=True)
            self._prefix_kv[key] = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
        cache = DynamicCache(config=self.model.config)
        for i, (k, v) in enumerate(self._prefix_kv[key]):
            cache.update(k.expand(batch, -1, -1, -1), v.expand(batch, -1, -1, -1), i)
        return cache

    def hidden(self, x: Any, cache: Any) -> Any:
        return self.model.model(inputs_embeds=x, past_key_values=cache, use_cache=True).last_hidden_state


# -- training ---------------------------------------------------------------------------------------


_MIRROR = {"left": "right", "centre": "centre", "right": "left"}


def _grid_perm(flip_h: bool, flip_v: bool) -> np.ndarray:
    """Where each patch of the flipped tile comes from (flat, row-major)."""
    side = IMAGE_SIZE // PATCH_SIZE
    rows = np.arange(side)[::-1] if flip_v else np.arange(side)
    cols = np.arange(side)[::-1] if flip_h else np.arange(side)
    return (rows[:, None] * side + cols[None, :]).reshape(-1)


def flip_batch(scenes: list[Scene], px: Any, labels: tuple[Any, ...], rng: np.random.Generator
               ) -> tuple[list[Scene], Any, tuple[Any, ...]]:
    """Mirrors each frame left-right and / or upside down at random (a quarter of the frames each
    way): four distinct frames for one drawn, at no drawing cost. A left-right mirror swaps the left
    and right thirds (the scene's positions follow); per-patch labels and the patch-to-patch targets
    are permuted with the patches. The routing target is tied to the fixed patches of each third's
    tokens, so it is not supervised on a flipped frame (its weight is 0 in every shipped run)."""
    import torch

    col, shp, size, centres, route_t, route_m, group_t, group_m = (t.clone() for t in labels)
    px = px.clone()
    out = list(scenes)
    for b, (fh, fv) in enumerate(rng.integers(0, 2, size=(len(scenes), 2)).astype(bool)):
        if not (fh or fv):
            continue
        perm = torch.from_numpy(_grid_perm(bool(fh), bool(fv)))
        dims = [d for d, f in ((-1, fh), (-2, fv)) if f]
        px[b] = torch.flip(px[b], dims)
        for t in (col, shp, size, centres, group_m):
            t[b] = t[b][perm]
        group_t[b] = group_t[b][perm][:, perm]
        route_m[b] = False
        if fh:
            s = scenes[b]
            out[b] = replace(s, objects=tuple(replace(o, position=_MIRROR[o.position], cx=s.width - o.cx,
                                                      angle=-o.angle) for o in s.objects))
    return out, px, (col, shp, size, centres, route_t, route_m, group_t, group_m)


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(total - warmup, 1)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def frame_labels(scene: Scene) -> tuple[np.ndarray, ...]:
    """The per-frame targets of the vision stages besides the keyword slots (see train_vision)."""
    col, shp, size, obj, centres = patch_labels(scene)
    return (col, shp, size, centres, *routing_target(scene, obj), *grouping_target(obj))


def _worker_init() -> None:
    import cv2

    cv2.setNumThreads(1)


def _pool_frame(job: tuple[int, int, PreprocessConfig, bool, int]) -> tuple[int, tuple[Scene, np.ndarray],
                                                                      tuple[np.ndarray, ...] | None]:
    seed, k, cfg, labels, index = job
    frame = sample(seed, index, cfg)
    return k, frame, frame_labels(frame[0]) if labels else None


class FramePool:
    """Frames first .. first+size-1 of one stream, generated on first use and then kept (as the
    preprocessed float tiles): generation and Lanczos resizing cost ~20% of a stage-1 step on this machine."""

    def __init__(self, seed: int, size: int, cfg: PreprocessConfig, labels: bool = False, first: int = 0,
                 indices: Sequence[int] | None = None) -> None:
        """`indices`: the stream's frame numbers to use (frame k is indices[k]), instead of first, first+1, ..."""
        self.seed, self.size, self.cfg, self.labels, self.first = seed, size, cfg, labels, first
        self.indices = list(indices) if indices is not None else None
        if self.indices is not None:
            self.size = min(self.size, len(self.indices))
        self._frames: dict[int, tuple[Scene, np.ndarray]] = {}
        self._labels: dict[int, tuple[np.ndarray, ...]] = {}
        self.last_labels: tuple[Any, Any] | None = None

    def _index(self, k: int) -> int:
        return self.indices[k] if self.indices is not None else self.first + k

    def _make(self, k: int) -> None:
        frame = sample(self.seed, self._index(k), self.cfg)
        self._frames[k] = frame
        if self.labels:
            self._labels[k] = frame_labels(frame[0])

    def fill(self, count: int, workers: int) -> None:
        """Draws frames 0 .. count-1 ahead of training in `workers` processes (a 1280x720 frame costs
        ~160 ms to draw: in the training loop the first pass over a 40 000-frame pool cost more than
        the training steps)."""
        todo = [k for k in range(min(count, self.size)) if k not in self._frames]
        if workers <= 1 or len(todo) < 64:
            for k in todo:
                self._make(k)
            return
        import multiprocessing

        t0 = time.time()
        with multiprocessing.get_context("fork").Pool(workers, initializer=_worker_init) as mp:
            jobs = [(self.seed, k, self.cfg, self.labels, self._index(k)) for k in todo]
            for k, frame, labels in mp.imap_unordered(_pool_frame, jobs, chunksize=16):
                self._frames[k] = frame
                if labels is not None:
                    self._labels[k] = labels
        log.info("drew %d frames of stream %d in %.0f s (%d processes)", len(todo), self.seed, time.time() - t0,
                 workers)

    def batch(self, start: int, n: int) -> tuple[list[Scene], Any]:
        import torch

        scenes, px = [], []
        for i in range(start, start + n):
            k = i % self.size
            if k not in self._frames:
                self._make(k)
            s, p = self._frames[k]
            scenes.append(s)
            px.append(p)
        if self.labels:
            ks = [i % self.size for i in range(start, start + n)]
            self.last_labels = tuple(torch.from_numpy(np.stack([self._labels[k][j] for k in ks])) for j in range(8))
        return scenes, torch.from_numpy(np.stack(px))


class SoftPrompt:
    """What the decoder should receive at the 16 image positions for a scene's keyword slots:
    E[keyword] + offset[slot] + delta[keyword], offsets and deltas learned through the frozen decoder
    ("prompt" stage; zero before it, so the "keywords" stage targets the plain embeddings)."""

    def __init__(self, embeddings: Any, kw: Keywords) -> None:
        import torch

        self.embeddings, self.kw = embeddings, kw
        self.offsets = torch.zeros(N_IMAGE_TOKENS, TEXT_WIDTH, requires_grad=True)
        self.deltas = torch.zeros(len(kw.vocab), TEXT_WIDTH, requires_grad=True)
        self.index = torch.full((VOCAB_SIZE,), -1, dtype=torch.long)
        self.index[torch.tensor(kw.vocab)] = torch.arange(len(kw.vocab))

    def __call__(self, slot_ids: Any) -> Any:
        """(B, 16) token ids -> (B, 16, 576)."""
        return self.embeddings[slot_ids] + self.offsets + self.deltas[self.index[slot_ids]]

    def candidates(self) -> Any:
        """(16, K, 576): every keyword's target at every slot."""
        cand = self.embeddings[self.kw.vocab] + self.deltas
        return cand.unsqueeze(0) + self.offsets.unsqueeze(1)

    def state(self) -> dict[str, Any]:
        return {"offsets": self.offsets.detach().clone(), "deltas": self.deltas.detach().clone(),
                "vocab": list(self.kw.vocab)}

    def load(self, state: dict[str, Any]) -> list[int]:
        """Takes a saved soft prompt; a keyword vocabulary that has grown since keeps the saved deltas of
        the words it had and starts the new words' deltas at zero. Returns the new words' token ids."""
        saved = [int(t) for t in state["vocab"]]
        if not set(saved) <= set(self.kw.vocab):
            lacking = sorted(set(saved) - set(self.kw.vocab))
            raise ValueError(f"saved soft prompt has keywords this vocabulary lacks: {lacking}")
        torch = __import__("torch")
        with torch.no_grad():
            self.offsets.copy_(state["offsets"])
            self.deltas.zero_()
            self.deltas[self.index[torch.tensor(saved)]] = state["deltas"]
        return sorted(set(self.kw.vocab) - set(saved))


def train_vision(name: str, vs: VisionSide, soft: SoftPrompt, kw: Keywords, args: argparse.Namespace,
                 cfg: PreprocessConfig, steps: int, lr: float, warmup: int, deadline: float) -> dict[str, Any]:
    """Tower + connector regress the soft prompt of each frame's keyword slots (no decoder involved),
    plus the dense per-patch colour / shape head."""
    import torch

    from edgevlm_ros.demo.scenes import COLOURS, SHAPES, SIZES

    n_col, n_shp, n_size = len(COLOURS) + 1, len(SHAPES) + 1, len(SIZES) + 1
    aux = torch.nn.Linear(WIDTH, n_col + n_shp + n_size + 1)  # dense per-patch head, not exported
    params = [p for m in [*vs.modules(), aux] for p in m.parameters()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.05, betas=(0.9, 0.98))
    with torch.no_grad():
        cand = soft.candidates()  # (16, K, 576)
        scale = float(cand.pow(2).sum(-1).mean())

    def slot_logits(out: Any) -> Any:
        return nearest_target_logits(out, cand)

    vs.train()
    t0 = time.time()
    step = 0
    acc_hist: list[float] = []
    dense_shape_hist: list[float] = []  # per-patch shape accuracy on object patches (the aux head)
    # The regress stage may take every n-th frame of a batch from frames with two or more alike objects
    # of one size in one third (--regress-pair-every, --pair-size), the frames its count slots miss most.
    n_pair = args.batch1 // args.regress_pair_every if name == "regress" and args.regress_pair_every > 0 else 0
    n_main = args.batch1 - n_pair
    pool = FramePool(args.seed, args.pool1, cfg, labels=True, first=args.pool1_first)
    flips = np.random.default_rng([args.seed, args.pool1_first, 0xF11B])
    pool.fill(min(args.pool1, steps * n_main), args.draw_workers)
    pairs: FramePool | None = None
    if n_pair:
        size = min(max(args.pool1 // args.regress_pair_every, 1), steps * n_pair)
        pairs = FramePool(args.seed, size, cfg, labels=True,
                          indices=pair_frames(args.seed, args.pair_first, size, args.pair_size))
        pairs.fill(size, args.draw_workers)
    # Per-slot weights of the slot loss: the shape slots (4th of each group) can count more.
    slot_weight = torch.ones(N_IMAGE_TOKENS)
    slot_weight[[5 * g + 3 for g in range(len(POSITIONS))]] = args.shape_weight
    slot_weight[COUNT_SLOTS] = args.count_weight
    slot_weight[N_IMAGE_TOKENS - 1] = args.end_weight  # the object / no-object decision
    slot_weight = slot_weight.repeat(args.batch1) / slot_weight.mean()
    for step in range(steps):
        if time.time() > deadline:
            log.warning("%s: time budget reached after %d steps", name, step)
            break
        scenes, px = pool.batch(step * n_main, n_main)
        if pairs is not None:
            p_scenes, p_px = pairs.batch(step * n_pair, n_pair)
            assert pool.last_labels is not None and pairs.last_labels is not None
            pool.last_labels = tuple(torch.cat([a, b]) for a, b in zip(pool.last_labels, pairs.last_labels,
                                                                          strict=True))
            scenes, px = scenes + p_scenes, torch.cat([px, p_px])
        if args.flip:
            assert pool.last_labels is not None
            scenes, px, pool.last_labels = flip_batch(scenes, px, pool.last_labels, flips)
        tgt = torch.tensor([kw.slots(s) for s in scenes])  # (B, 16) token ids
        tgt_idx = soft.index[tgt]
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr, warmup)
        out, patches = vs(px, with_patches=True)  # (B, 16, 576), (B, patches, WIDTH) entering the routing layer
        logits = slot_logits(out)
        ce = (torch.nn.functional.cross_entropy(logits.reshape(-1, len(kw.vocab)), tgt_idx.reshape(-1),
                                                reduction="none") * slot_weight).mean()
        with torch.no_grad():
            target = soft(tgt)
        mse = (out - target).pow(2).sum(-1).mean() / scale
        assert pool.last_labels is not None
        col_t, shp_t, size_t, centre_t, route_t, route_m, group_t, group_m = pool.last_labels
        # Routing (optional): head 0 of the routing layer is told where each mention's tokens must look.
        att = vs.attentions[ROUTE_LAYER][:, 0]  # (B, patches, patches)
        route = -(route_t * torch.log(att + 1e-9)).sum(-1)[route_m].mean() if bool(route_m.any()) else att.sum() * 0
        group = sum(-(group_t * torch.log(vs.attentions[layer][:, 0] + 1e-9)).sum(-1)[group_m].mean()
                    for layer in GROUP_LAYERS) / len(GROUP_LAYERS) if bool(group_m.any()) else att.sum() * 0
        a = aux(patches)
        ce_of = torch.nn.functional.cross_entropy
        a_col, a_shp, a_size, a_ctr = a.split([n_col, n_shp, n_size, 1], -1)
        dense = (ce_of(a_col.reshape(-1, n_col), col_t.reshape(-1)) + ce_of(a_shp.reshape(-1, n_shp), shp_t.reshape(-1))
                 + ce_of(a_size.reshape(-1, n_size), size_t.reshape(-1))
                 + (a_ctr.squeeze(-1) - centre_t).pow(2).mean())
        with torch.no_grad():
            obj_patch = (shp_t >= 0) & (shp_t < len(SHAPES))
            dense_shape_hist.append(float((a_shp.argmax(-1) == shp_t)[obj_patch].float().mean()))
        loss = ce + 0.5 * mse + args.dense_weight * dense + args.route_weight * route + args.group_weight * group
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        acc = float((logits.argmax(-1) == tgt_idx).float().mean())
        acc_hist.append(acc)
        if step % 10 == 0 or step == steps - 1:
            log.info("%s step %d/%d loss %.4f ce %.4f mse %.4f dense %.4f route %.4f slot-acc %.3f "
                     "patch-shape-acc %.3f group %.3f (%.0f s)", name, step, steps, loss.item(), ce.item(), mse.item(),
                     dense.item(), route.item(), float(np.mean(acc_hist[-10:])), float(np.mean(dense_shape_hist[-10:])),
                     group.item(), time.time() - t0)
    vs.train(False)
    with torch.no_grad():
        held = FramePool(args.seed + 2, 128, cfg)
        scenes, px = held.batch(0, 128)
        tgt = torch.tensor([kw.slots(s) for s in scenes])
        out = vs(px)
        pred = slot_logits(out).argmax(-1)
        right = pred == soft.index[tgt]
        held_slot = float(right.float().mean())
        held_frame = float(right.all(-1).float().mean())
        held_mse = float((out - soft(tgt)).pow(2).sum(-1).mean() / scale)
        used = tgt != kw.pad
        by_kind = {}
        for j, kind in enumerate(("count", "size", "colour", "shape", "position")):
            cols = [5 * g + j for g in range(len(POSITIONS))]
            sel = used[:, cols]
            by_kind[kind] = round(float(right[:, cols][sel].float().mean()), 4) if bool(sel.any()) else None
        empty = torch.tensor([not s.objects for s in scenes])
        end_right = right[:, -1]
        end_slot = {"frames_without_objects": int(empty.sum()),
                    "said_none": round(float(end_right[empty].float().mean()), 4) if bool(empty.any()) else None,
                    "frames_with_objects_not_said_none": round(float(end_right[~empty].float().mean()), 4)}
    log.info("%s held-out (stream %d, 128 frames): slot accuracy %.3f, frames with every slot right %.3f, "
             "relative mse %.4f, by kind %s, end slot %s", name, args.seed + 2, held_slot, held_frame, held_mse,
             by_kind, end_slot)
    return {"held_out_slot_accuracy": round(held_slot, 4), "held_out_frames_all_slots_right": round(held_frame, 4),
            "held_out_accuracy_of_used_slots_by_kind": by_kind, "held_out_end_slot": end_slot,
            "held_out_relative_mse": round(held_mse, 4), "steps": len(acc_hist), "frames": len(acc_hist) * args.batch1,
            "distinct_frames": min(args.pool1, len(acc_hist) * args.batch1),
            "pool_first_frame": args.pool1_first, "seconds": round(time.time() - t0, 1),
            "final_slot_accuracy_train_avg20": round(float(np.mean(acc_hist[-20:])), 4) if acc_hist else None,
            **({"pair_size": args.pair_size, "frames_with_a_pair_added": n_pair * len(acc_hist),
                "distinct_pair_frames": pairs.size, "pair_first_frame": args.pair_first,
                "next_pair_frame": next_frame(pairs.indices or [], pairs.size, args.pair_first)}
               if pairs is not None else {})}


def train_prompt(soft: SoftPrompt, dec: Decoder, tok: Tokenizer, kw: Keywords, prompt: Prompt,
                 args: argparse.Namespace, deadline: float, first_scene: int = 0) -> dict[str, Any]:
    """Learns the slot offsets and keyword deltas through the frozen decoder, on scene descriptions
    only (no pixels): the decoder must write the caption when the image positions hold soft(slots)."""
    import torch

    params = [soft.offsets, soft.deltas]
    opt = torch.optim.Adam(params, lr=args.lr_prompt, betas=(0.9, 0.98))
    t0 = time.time()
    hist: list[tuple[float, float]] = []
    step = 0
    for step in range(args.steps_prompt):
        if time.time() > deadline:
            log.warning("prompt: time budget reached after %d steps", step)
            break
        first = first_scene + step * args.batch2
        scenes = [generate_scene(args.seed + 1, i, *frame_size(args.seed + 1, i))
                  for i in range(first, first + args.batch2)]
        if args.prompt_empty_every:  # more frames without objects than the world draws (one caption to learn)
            scenes = [replace(s, objects=(), caption=NO_OBJECTS) if s.index % args.prompt_empty_every == 0 else s
                      for s in scenes]
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps_prompt, args.lr_prompt, 5)
        loss, tok_acc, seq_acc = caption_loss(dec, tok, prompt, soft(torch.tensor([kw.slots(s) for s in scenes])),
                                              scenes)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        hist.append((tok_acc, seq_acc))
        if step % 5 == 0 or step == args.steps_prompt - 1:
            log.info("prompt step %d/%d loss %.4f token-acc %.3f caption-exact(teacher forced) %.3f (%.0f s)",
                     step, args.steps_prompt, loss.item(), tok_acc, seq_acc, time.time() - t0)
    last = hist[-10:]
    n_done = len(hist)
    exact, n_held, no_objects = probe_prompt(soft, dec, tok, kw, prompt, args.seed)
    return {"steps": n_done, "scenes": n_done * args.batch2, "next_scene": first_scene + n_done * args.batch2,
            "lr": args.lr_prompt, "seconds": round(time.time() - t0, 1),
            "final_token_accuracy_train_avg10": round(float(np.mean([a for a, _ in last])), 4) if last else None,
            "final_caption_exact_train_avg10": round(float(np.mean([q for _, q in last])), 4) if last else None,
            "held_out_greedy_captions_exact": f"{exact} / {n_held}", "no_objects_greedy": no_objects,
            "empty_every": args.prompt_empty_every}


def probe_prompt(soft: SoftPrompt, dec: Decoder, tok: Tokenizer, kw: Keywords, prompt: Prompt, seed: int
                 ) -> tuple[int, int, str]:
    """What the decoder writes from the soft prompt alone (a perfect tower), greedy, on 16 held-out
    scenes (stream seed + 2), the first made a frame without objects: (captions exact, scenes, the
    text for the frame without objects)."""
    import torch

    held = [generate_scene(seed + 2, i, *frame_size(seed + 2, i)) for i in range(16)]
    held[0] = replace(held[0], objects=(), caption=NO_OBJECTS)
    with torch.no_grad():
        out, _ = greedy_from_features(dec, prompt, soft(torch.tensor([kw.slots(s) for s in held])),
                                      set(tok.eot_ids), MAX_NEW_TOKENS)  # the engine's stop ids
    texts = [tok.decode(t, skip_special=True) for t in out]
    exact = sum(t == s.caption for t, s in zip(texts, held, strict=True))
    log.info("greedy from the soft prompt alone: %d / %d held-out captions exact; no objects -> %r",
             exact, len(held), texts[0])
    return exact, len(held), texts[0]


def recover_prompt(soft: SoftPrompt, vs: VisionSide, kw: Keywords, args: argparse.Namespace,
                   cfg: PreprocessConfig) -> dict[str, Any]:
    """The soft prompt a tower was trained against, estimated from that tower (for when --work lost
    prompt.pt and no copy was kept): its outputs on training frames, minus each slot keyword's
    embedding, are fitted as offset[slot] + delta[keyword] by alternating means (least squares),
    first on every slot, then only on the slots whose nearest target is the right one. The targets
    E[k] + offset[s] + delta[k] are what the fit determines; a constant moved between the offsets
    and the deltas changes none of them."""
    import torch

    vs.train(False)
    pool = FramePool(args.seed, args.recover_frames, cfg)
    pool.fill(args.recover_frames, args.draw_workers)
    outs, tgts = [], []
    with torch.no_grad():
        for start in range(0, args.recover_frames, 32):
            scenes, px = pool.batch(start, min(32, args.recover_frames - start))
            outs.append(vs(px))
            tgts.append(torch.tensor([kw.slots(sc) for sc in scenes]))
    out, tgt = torch.cat(outs), torch.cat(tgts)  # (N, 16, 576), (N, 16)
    idx = soft.index[tgt]
    resid = out - soft.embeddings[tgt]  # offset[slot] + delta[keyword] + the tower's error
    n_kw = len(kw.vocab)
    keep = torch.ones_like(idx, dtype=torch.bool)
    rounds: list[dict[str, float]] = []
    for _ in range(2):
        offsets = torch.zeros_like(soft.offsets)
        deltas = torch.zeros_like(soft.deltas)
        w = keep.float().unsqueeze(-1)
        for _ in range(20):
            offsets = ((resid - deltas[idx]) * w).sum(0) / w.sum(0).clamp(min=1)
            r = ((resid - offsets.unsqueeze(0)) * w).reshape(-1, resid.shape[-1])
            count = torch.zeros(n_kw).index_add_(0, idx.reshape(-1), keep.float().reshape(-1)).clamp(min=1)
            deltas = torch.zeros(n_kw, resid.shape[-1]).index_add_(0, idx.reshape(-1), r) / count.unsqueeze(-1)
        with torch.no_grad():
            soft.offsets.copy_(offsets)
            soft.deltas.copy_(deltas)
            pred = (-(out.unsqueeze(-2) - soft.candidates()).pow(2).sum(-1)).argmax(-1)
        right = pred == idx
        rounds.append({"slots_used": int(keep.sum()), "slot_accuracy": round(float(right.float().mean()), 4)})
        log.info("recover-prompt: fit on %d slots; the tower's slot accuracy against it %.4f", int(keep.sum()),
                 float(right.float().mean()))
        keep = right
    return {"frames": args.recover_frames, "rounds": rounds, "from_mmproj": str(args.regress_from_mmproj)}


def caption_logits(dec: Decoder, tok: Tokenizer, prompt: Prompt, image: Any, scenes: Sequence[Scene]
                   ) -> tuple[Any, Any]:
    """Teacher-forced logits (B, L, vocabulary) of the scenes' captions (and <|im_end|>) when the image
    positions of the prompt hold `image` (B, 16, 576), and their targets (B, L; -100 past the end)."""
    import torch

    tgt, inp = caption_batch(tok, scenes)
    b = len(scenes)
    x = dec.embed(torch.tensor(prompt.rest)).unsqueeze(0).repeat(b, 1, 1)
    x[:, torch.from_numpy(prompt.image_slots)] = image
    x = torch.cat([x, dec.embed(inp)], 1)
    h = dec.hidden(x, dec.prefix_cache(prompt.prefix, b))
    # The answer's token j is predicted at the position before it: the last prompt token for j = 0.
    n_rest = len(prompt.rest)
    return dec.logits(h[:, n_rest - 1 : n_rest - 1 + tgt.shape[1]]), tgt


def caption_loss(dec: Decoder, tok: Tokenizer, prompt: Prompt, image: Any, scenes: Sequence[Scene]
                 ) -> tuple[Any, float, float]:
    """Teacher-forced cross-entropy of the scenes' captions (and <|im_end|>) when the image positions
    of the prompt hold `image` (B, 16, 576); also the token accuracy and the fraction of captions
    with every token right."""
    import torch

    logits, tgt = caption_logits(dec, tok, prompt, image, scenes)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB_SIZE), tgt.reshape(-1), ignore_index=-100)
    with torch.no_grad():
        ok = (logits.argmax(-1) == tgt) | (tgt == -100)
        tok_acc = float(ok[tgt != -100].float().mean())
        seq_acc = float(ok.all(-1).float().mean())
    return loss, tok_acc, seq_acc


def worst_token_losses(dec: Decoder, tok: Tokenizer, prompt: Prompt, image: Any, scenes: Sequence[Scene]
                       ) -> np.ndarray:
    """Per scene: the largest teacher-forced cross-entropy of any token of its caption (one wrong count
    or shape word is one token; a mean over the caption would dilute it)."""
    import torch

    logits, tgt = caption_logits(dec, tok, prompt, image, scenes)
    ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), tgt, ignore_index=-100, reduction="none")
    return ce.max(-1).values.detach().numpy()


def hard_frames(vs: VisionSide, dec: Decoder, tok: Tokenizer, prompt: Prompt, seed: int, cfg: PreprocessConfig,
                first: int, scan: int, keep: int, workers: int, chunk: int = 256) -> dict[str, Any]:
    """The `keep` frames among frames first .. first + scan - 1 of stream `seed` whose captions the tower
    (in evaluation mode) leaves most in doubt: the largest worst-token loss (worst_token_losses). Their
    numbers in stream order, and what the scan found."""
    import torch

    if keep > scan:
        raise SystemExit(f"caption stage: {keep} hard frames wanted from a scan of {scan}")
    training = vs.vision.training
    vs.train(False)
    t0 = time.time()
    worst = np.zeros(scan, np.float32)
    with torch.no_grad():
        for c in range(0, scan, chunk):
            n = min(chunk, scan - c)
            pool = FramePool(seed, n, cfg, first=first + c)
            pool.fill(n, workers)
            for b in range(0, n, 32):
                scenes, px = pool.batch(b, min(32, n - b))
                worst[c + b : c + b + len(scenes)] = worst_token_losses(dec, tok, prompt, vs(px), scenes)
    vs.train(training)
    order = np.argsort(-worst, kind="stable")[:keep]
    chosen = sorted(int(first + k) for k in order)
    threshold = float(worst[order[-1]]) if keep else float("nan")
    log.info("caption stage: scanned %d frames of stream %d from %d in %.0f s; kept the %d hardest (worst-token "
             "loss >= %.3f; median of the scan %.3f)", scan, seed, first, time.time() - t0, keep, threshold,
             float(np.median(worst)))
    return {"frames": chosen, "first_frame": first, "frames_scanned": scan, "kept": keep,
            "worst_token_loss_kept_from": round(threshold, 4),
            "worst_token_loss_median": round(float(np.median(worst)), 4),
            "seconds": round(time.time() - t0, 1)}


def count_slot_loss(image: Any, scenes: Sequence[Scene], soft: SoftPrompt, kw: Keywords) -> Any:
    """The regress stage's slot cross-entropy (nearest target wins) on the count slots of the thirds
    that hold an object."""
    import torch

    with torch.no_grad():
        cand = soft.candidates()  # (16, K, 576)
    tgt = torch.tensor([kw.slots(s) for s in scenes])[:, COUNT_SLOTS]
    logits = nearest_target_logits(image[:, COUNT_SLOTS], cand[COUNT_SLOTS])  # (B, 3, K)
    want = soft.index[tgt]
    used = tgt != kw.pad
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), want.reshape(-1), reduction="none")
    return (ce * used.reshape(-1)).sum() / used.sum().clamp(min=1)


def caption_batch(tok: Tokenizer, scenes: Sequence[Scene]) -> tuple[Any, Any]:
    """(targets (B, L) padded with -100, input ids (B, L) padded with <|im_end|>) for caption + <|im_end|>."""
    import torch

    end = tok.token_to_id("<|im_end|>")
    seqs = [tok.encode(s.caption, add_bos=False) + [end] for s in scenes]
    n = max(len(s) for s in seqs)
    tgt = torch.full((len(seqs), n), -100, dtype=torch.long)
    inp = torch.full((len(seqs), n), end, dtype=torch.long)
    for i, s in enumerate(seqs):
        tgt[i, : len(s)] = torch.tensor(s)
        inp[i, : len(s)] = torch.tensor(s)
    return tgt, inp


def frames_where(seed: int, first: int, count: int, keep: Callable[[Scene], bool]) -> list[int]:
    """The numbers of the first `count` frames of stream `seed`, from `first` on, whose scene `keep`
    accepts. The scene's layout is drawn before its size matters, so a 64x48 scan finds them at ~1 ms
    a frame (test_demo_model.py checks that at their training sizes)."""
    out: list[int] = []
    i = first
    while len(out) < count:
        if keep(generate_scene(seed, i, 64, 48)):
            out.append(i)
        i += 1
    return out


def empty_frames(seed: int, first: int, count: int) -> list[int]:
    """Frames that hold no known object (~8% of a stream)."""
    return frames_where(seed, first, count, lambda s: not s.objects)


def has_count(scene: Scene) -> bool:
    """Two or more alike objects in one third: the caption says a count ("Two large red squares on
    the left."; ~25% of a stream)."""
    return any(n > 1 for n, _ in mentions(scene.objects))


def count_frames(seed: int, first: int, count: int) -> list[int]:
    return frames_where(seed, first, count, has_count)


def has_pair(scene: Scene, size: str = "large") -> bool:
    """Two or more alike objects of `size` in one third: large ones (~5% of a stream), where they
    overlap the count slot has to tell two from one large object; small ones, which at the tile's
    scale in a large frame are a few pixels apart."""
    return any(n > 1 and o.size == size for n, o in mentions(scene.objects))


def pair_frames(seed: int, first: int, count: int, size: str = "large") -> list[int]:
    return frames_where(seed, first, count, lambda s: has_pair(s, size))


def next_frame(ids: Sequence[int], used: int, first: int) -> int:
    """Where a later run's scan continues after `used` of the frames `ids` (found from `first` on)."""
    return ids[used] if used < len(ids) else (ids[-1] + 1 if ids else first)


def caption_monitor(seed: int, cfg: PreprocessConfig, frames: int = 64, empty: int = 16
                    ) -> tuple[list[Scene], Any]:
    """The caption stage's fixed held-out frames: the first `frames` of stream `seed` (the monitor
    stream) and `empty` more without objects from it."""
    import torch

    scenes, px = FramePool(seed, frames, cfg).batch(0, frames)
    e_scenes, e_px = FramePool(seed, empty, cfg, indices=empty_frames(seed, frames, empty)).batch(0, empty)
    return scenes + e_scenes, torch.cat([px, e_px])


def caption_scores(vs: VisionSide, dec: Decoder, tok: Tokenizer, prompt: Prompt, scenes: Sequence[Scene], px: Any
                   ) -> dict[str, float]:
    """Teacher-forced loss, token accuracy and captions with every token right (means over frames),
    overall and on the frames without objects; in evaluation mode (the tower's mode is restored after)."""
    import torch

    training = vs.vision.training
    vs.train(False)
    rows: list[tuple[float, float, float, bool]] = []
    with torch.no_grad():
        for j in range(len(scenes)):
            loss, tok_acc, seq_acc = caption_loss(dec, tok, prompt, vs(px[j : j + 1]), scenes[j : j + 1])
            rows.append((float(loss), tok_acc, seq_acc, not scenes[j].objects))
    vs.train(training)
    empty = [r for r in rows if r[3]]
    return {"loss": round(float(np.mean([r[0] for r in rows])), 4),
            "token_accuracy": round(float(np.mean([r[1] for r in rows])), 4),
            "captions_exact": round(float(np.mean([r[2] for r in rows])), 4),
            "without_objects_exact": round(float(np.mean([r[2] for r in empty])), 4) if empty else float("nan")}


# The caption stage's frames without objects come from stream seed + 1 from this frame number on,
# apart from its other frames (which start at 0); its frames with a count from COUNT_FRAMES_FIRST on.
EMPTY_FRAMES_FIRST = 1 << 24
COUNT_FRAMES_FIRST = 1 << 25
HARD_FRAMES_FIRST = 3 << 24  # the scan for hard frames (--caption-hard-every)


def train_captions(vs: VisionSide, dec: Decoder, tok: Tokenizer, prompts: list[Prompt], args: argparse.Namespace,
                   cfg: PreprocessConfig, deadline: float, first: int = 0, first_empty: int = EMPTY_FRAMES_FIRST,
                   first_count: int = COUNT_FRAMES_FIRST, first_hard: int = HARD_FRAMES_FIRST,
                   slots: tuple[SoftPrompt, Keywords] | None = None) -> dict[str, Any]:
    """Connector, post-layernorm and the top encoder layers fine-tuned through the frozen decoder on
    teacher-forced captions of new frames of stream seed + 1 (each seen once; frames `first`, first + 1,
    ...), every --caption-empty-every-th frame one without objects (those from `first_empty` on) and
    every --caption-count-every-th one with two or more alike objects in a third (from `first_count` on)
    and every --caption-hard-every-th one of the hardest for the starting tower among --caption-hard-scan
    frames from `first_hard` on (hard_frames); scored before and after on a fixed held-out set (stream
    seed + 2). With `slots` (the regress stage's targets) and --caption-count-slot-weight, the count slots
    keep the regress stage's loss too: each stays nearest its count word's target, wherever the captions
    move it within that."""
    import torch

    trainable: list[Any] = [*vs.connector.parameters(), *vs.vision.post_layernorm.parameters()]
    for layer in vs.vision.encoder.layers[-args.train_layers:]:
        trainable += list(layer.parameters())
    if args.train_patch_embedding:
        trainable += list(vs.vision.embeddings.patch_embedding.parameters())
    for m in vs.modules():
        for p in m.parameters():
            p.requires_grad_(False)
    monitor = caption_monitor(args.seed + 2, cfg)
    before = caption_scores(vs, dec, tok, prompts[0], *monitor)
    log.info("caption stage, held-out before: %s", before)
    for p in trainable:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(trainable, lr=args.lr2, weight_decay=0.0, betas=(0.9, 0.98))
    vs.train()
    t0 = time.time()
    hist: list[tuple[float, float]] = []
    step = 0
    n_empty = args.batch2 // args.caption_empty_every if args.caption_empty_every else 0
    n_count = args.batch2 // args.caption_count_every if args.caption_count_every else 0
    n_hard = args.batch2 // args.caption_hard_every if args.caption_hard_every else 0
    n_plain = args.batch2 - n_empty - n_count - n_hard
    if n_plain < 0:
        raise SystemExit("caption stage: --caption-empty-every, --caption-count-every and --caption-hard-every leave "
                         "no room in the batch")
    pool = FramePool(args.seed + 1, 1 << 30, cfg, first=first)  # every frame once
    empty_ids = empty_frames(args.seed + 1, first_empty, n_empty * args.steps2)
    empties = FramePool(args.seed + 1, 1 << 30, cfg, indices=empty_ids) if n_empty else None
    count_ids = count_frames(args.seed + 1, first_count, n_count * args.steps2)
    counted = FramePool(args.seed + 1, 1 << 30, cfg, indices=count_ids) if n_count else None
    hard_scan = (hard_frames(vs, dec, tok, prompts[0], args.seed + 1, cfg, first_hard, args.caption_hard_scan,
                             n_hard * args.steps2, args.draw_workers) if n_hard else None)
    hard = FramePool(args.seed + 1, 1 << 30, cfg, indices=hard_scan["frames"]) if hard_scan else None
    for step in range(args.steps2):
        if time.time() > deadline:
            log.warning("caption stage: time budget reached after %d steps", step)
            break
        prompt = prompts[step % len(prompts)]
        scenes, px = pool.batch(step * n_plain, n_plain)
        for extra, n_extra in ((empties, n_empty), (counted, n_count), (hard, n_hard)):
            if extra is not None:
                e_scenes, e_px = extra.batch(step * n_extra, n_extra)
                scenes, px = scenes + e_scenes, torch.cat([px, e_px])
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps2, args.lr2, 10)
        image = vs(px)
        loss, tok_acc, seq_acc = caption_loss(dec, tok, prompt, image, scenes)
        if slots is not None and args.caption_count_slot_weight > 0:
            loss = loss + args.caption_count_slot_weight * count_slot_loss(image, scenes, *slots)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        hist.append((tok_acc, seq_acc))
        if step % 5 == 0 or step == args.steps2 - 1:
            log.info("caption step %d/%d loss %.4f token-acc %.3f caption-exact(teacher forced) %.3f (%.0f s)",
                     step, args.steps2, loss.item(), tok_acc, seq_acc, time.time() - t0)
        if args.caption_monitor_every and (step + 1) % args.caption_monitor_every == 0:
            log.info("caption stage, held-out after %d steps: %s", step + 1,
                     caption_scores(vs, dec, tok, prompts[0], *monitor))
    vs.train(False)
    after = caption_scores(vs, dec, tok, prompts[0], *monitor)
    log.info("caption stage, held-out after: %s", after)
    last = hist[-20:]
    n_done = len(hist)
    return {"steps": n_done, "frames": n_done * args.batch2, "frames_without_objects": n_done * n_empty,
            "pool_first_frame": first, "next_frame": first + n_done * n_plain,
            "next_empty_frame": next_frame(empty_ids, n_done * n_empty, first_empty),
            "frames_with_a_count_added": n_done * n_count,
            "next_count_frame": next_frame(count_ids, n_done * n_count, first_count),
            **({"hard_frames_added": n_done * n_hard,
                "hard_scan": {k: v for k, v in hard_scan.items() if k != "frames"}} if hard_scan else {}),
            "next_hard_frame": first_hard + (args.caption_hard_scan if hard_scan else 0),
            "seconds": round(time.time() - t0, 1), "lr": args.lr2,
            "trained": f"connector, post_layernorm, last {args.train_layers} encoder layer(s)"
                       + (", patch embedding" if args.train_patch_embedding else ""),
            "held_out_teacher_forced": {"frames": len(monitor[0]), "before": before, "after": after},
            "final_token_accuracy_train_avg20": round(float(np.mean([a for a, _ in last])), 4) if last else None,
            "final_caption_exact_train_avg20": round(float(np.mean([q for _, q in last])), 4) if last else None}


def _runs(rec: dict[str, Any]) -> list[dict[str, Any]]:
    """The single runs behind a caption-stage record, the first first: each without its earlier runs,
    with its own frames and wall time (a continued run's record counts those of all runs; `finish`)."""
    earlier = rec.get("continued_from")
    own = {k: v for k, v in rec.items() if k not in ("continued_from", "wall_seconds_earlier_runs")}
    if earlier is not None:
        own["frames"] = rec["frames"] - earlier.get("frames", 0)
        own["wall_seconds"] = round(rec["wall_seconds"] - rec.get("wall_seconds_earlier_runs", 0.0), 1)
    return [*(_runs(earlier) if earlier is not None else []), own]


def average_caption_runs(works: Sequence[Path]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The mean of the weights of caption-stage runs that started from the same regress weights (a
    "model soup": each run's errors differ, the mean keeps what they share), and its record: the
    averaged runs' records, the distinct runs' steps, frames and wall time summed, and the frames after
    the last any of them used (so that a caption run from the mean sees new ones)."""
    import torch

    recs = [_stage_record(w, "caption") for w in works]
    for w, rec in zip(works, recs, strict=True):
        if not (w / "caption.pt").exists() or rec is None:
            raise SystemExit(f"average: {w} holds no caption-stage run (caption.pt and caption.json)")
    starts = [_stage_record(w, "regress") for w in works]
    if any(r != starts[0] for r in starts[1:]):
        raise SystemExit("average: the runs did not start from the same regress weights (their regress.json differ)")
    states = [torch.load(w / "caption.pt") for w in works]
    for w, sd in zip(works[1:], states[1:], strict=True):
        if sd.keys() != states[0].keys() or any(sd[k].shape != states[0][k].shape for k in sd):
            raise SystemExit(f"average: {w}'s weights differ in layout from {works[0]}'s")
    mean = {k: (sum(sd[k].double() for sd in states) / len(states)).to(states[0][k].dtype)
            if states[0][k].is_floating_point() else states[0][k] for k in states[0]}
    runs = list({json.dumps(r, sort_keys=True): r for rec in recs for r in _runs(rec)}.values())
    total = {key: sum(r.get(key, 0) for r in runs)
             for key in ("steps", "frames", "frames_without_objects", "frames_with_a_count_added", "hard_frames_added")}
    wall = round(sum(r.get("wall_seconds", 0.0) for r in runs), 1)
    hard = [r["next_hard_frame"] for r in recs if "next_hard_frame" in r]  # runs before hard frames have none
    return mean, {"averaged": recs, "distinct_runs": len(runs), **total, "started_from": "regress.pt",
                  **{key: max(r[key] for r in recs) for key in ("next_frame", "next_empty_frame", "next_count_frame")},
                  **({"next_hard_frame": max(hard)} if hard else {}), "wall_seconds_earlier_runs": wall}


# -- export -----------------------------------------------------------------------------------------


def export(vs: VisionSide, config: Any, hf_dir: Path, out: Path) -> Path:
    """A transformers-layout checkpoint of the vision side, then our converter to an F16 mmproj."""
    import torch
    from safetensors.torch import save_file

    from edgevlm_ros.tools.convert import convert_mmproj

    if hf_dir.exists():
        shutil.rmtree(hf_dir)
    hf_dir.mkdir(parents=True)
    config.save_pretrained(str(hf_dir))
    tensors = {k: v.detach().to(torch.float32).contiguous() for k, v in vs.state_dict().items()}
    save_file(tensors, str(hf_dir / "model.safetensors"))
    pre = {
        "image_processor_type": "Idefics3ImageProcessor", "do_resize": True, "do_rescale": True,
        "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "do_image_splitting": False, "size": {"longest_edge": IMAGE_SIZE},
        "max_image_size": {"longest_edge": IMAGE_SIZE}, "resample": 1,
    }
    (hf_dir / "preprocessor_config.json").write_text(json.dumps(pre, indent=2))
    return convert_mmproj(hf_dir, out, "f16", name="edgevlm-demo")


_MMPROJ_LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                       "attn_out": "self_attn.out_proj", "ln1": "layer_norm1", "ln2": "layer_norm2",
                       "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2"}
_MMPROJ_NAMES = {"v.patch_embd.weight": "model.vision_model.embeddings.patch_embedding.weight",
                 "v.patch_embd.bias": "model.vision_model.embeddings.patch_embedding.bias",
                 "v.position_embd.weight": "model.vision_model.embeddings.position_embedding.weight",
                 "v.post_ln.weight": "model.vision_model.post_layernorm.weight",
                 "v.post_ln.bias": "model.vision_model.post_layernorm.bias",
                 "mm.model.fc.weight": "model.connector.modality_projection.proj.weight"}


def load_mmproj(vs: VisionSide, path: Path) -> None:
    """Loads an mmproj GGUF written by export() back into the torch model (the inverse of the
    converter's vision plan: same names, no permutation; F16 widened to F32), so that the committed
    file can be checked against torch without the training checkpoint. A file of another tile
    geometry (position embeddings and connector sized for it) is carried over to the current one by
    `VisionSide.load_state_dict`."""
    import torch
    from gguf import GGUFReader

    want = vs.state_dict()
    got: dict[str, Any] = {}
    for t in GGUFReader(str(path)).tensors:
        if t.name.startswith("v.blk."):
            _, _, layer, kind, part = t.name.split(".")
            name = f"model.vision_model.encoder.layers.{layer}.{_MMPROJ_LAYER_NAMES[kind]}.{part}"
        else:
            name = _MMPROJ_NAMES[t.name]
        data = np.asarray(t.data, dtype=np.float32)
        if name in want and data.size == want[name].numel():
            shape = tuple(want[name].shape)
        elif name in (POS_NAME, PROJ_NAME):  # another tile geometry: as `retiled` reads it
            shape = (-1, WIDTH) if name == POS_NAME else (int(want[name].shape[0]), -1)
        else:
            wanted = tuple(want[name].shape) if name in want else "no such tensor"
            raise ValueError(f"{path}: {t.name} holds {data.size} values, the tower wants {wanted}")
        got[name] = torch.from_numpy(data.reshape(shape).copy())
    missing = sorted(set(want) - set(got))
    if missing:
        raise ValueError(f"{path}: no tensors for {missing[:4]}")
    vs.load_state_dict(got)


def round_like_f16_file(vs: VisionSide) -> None:
    """Rounds the weights the converter stores as F16 (matrices but the patch/position embeddings)."""
    import torch

    with torch.no_grad():
        for name, p in vs.state_dict().items():
            if p.ndim == 2 and "position_embedding" not in name:
                p.copy_(p.to(torch.float16).to(torch.float32))


# -- evaluation -------------------------------------------------------------------------------------


def torch_greedy(vs: VisionSide, dec: Decoder, prompt: Prompt, pixels: Any, stop_ids: set[int],
                 max_new: int) -> tuple[list[list[int]], list[list[tuple[float, float]]]]:
    """Batched greedy decoding in torch; per row the tokens and, per step, (top-1 logit, top-1 - top-2)."""
    import torch

    with torch.no_grad():
        return greedy_from_features(dec, prompt, vs(pixels), stop_ids, max_new)


def greedy_from_features(dec: Decoder, prompt: Prompt, feats: Any, stop_ids: set[int], max_new: int
                         ) -> tuple[list[list[int]], list[list[tuple[float, float]]]]:
    """torch_greedy from the image positions' inputs (B, 16, 576): a tower's output or a soft prompt."""
    import torch

    b = feats.shape[0]
    with torch.no_grad():
        x = dec.embed(torch.tensor(prompt.rest)).unsqueeze(0).repeat(b, 1, 1)
        x[:, torch.from_numpy(prompt.image_slots)] = feats
        cache = dec.prefix_cache(prompt.prefix, b)
        h = dec.hidden(x, cache)[:, -1]
        tokens: list[list[int]] = [[] for _ in range(b)]
        margins: list[list[tuple[float, float]]] = [[] for _ in range(b)]
        done = [False] * b
        for _ in range(max_new):
            logits = dec.logits(h)
            top = logits.topk(2, dim=-1)
            nxt = top.indices[:, 0]
            for i in range(b):
                if not done[i]:
                    t = int(nxt[i])
                    margins[i].append((float(top.values[i, 0]), float(top.values[i, 0] - top.values[i, 1])))
                    done[i] = t in stop_ids
                    if not done[i]:  # the engine does not return the stop token either
                        tokens[i].append(t)
            if all(done):
                break
            h = dec.hidden(dec.embed(nxt).unsqueeze(1), cache)[:, -1]
    return tokens, margins


def colour_and_shape_right(text: str, scene: Any) -> int:
    """Objects whose colour and shape the text names (position and count aside), each mention used once."""
    named = Counter((m.colour, m.shape) for m in parse_caption(text) for _ in range(m.count))
    right = 0
    for o in scene.objects:
        if named[(o.colour, o.shape)] > 0:
            named[(o.colour, o.shape)] -= 1
            right += 1
    return right


def evaluate(mmproj: Path, text_gguf: Path, vs: VisionSide, dec: Decoder, tok: Tokenizer, prompt: Prompt,
             args: argparse.Namespace, cfg: PreprocessConfig, n: int, compare_torch: bool = True,
             scenes: Sequence[Any] | None = None, world: str = "training world (held out)") -> dict[str, Any]:
    """Greedy captions of held-out frames through our engine (and torch), scored by scenes.score.
    Frames: `scenes` (any objects with .image(), .objects, .caption), else n frames of --eval-seed."""
    import torch

    from edgevlm_ros.engine.vlm import load_vlm

    vlm = load_vlm(text_gguf, mmproj, threads=args.engine_threads, image_mode="single")
    if scenes is None:
        scenes = [generate_scene(args.eval_seed, i, *frame_size(args.eval_seed, i)) for i in range(n)]
    n = len(scenes)
    t0 = time.time()
    eng: list[Any] = []
    for s in scenes:
        eng.append(vlm.describe(s.image(), prompt=prompt.text, max_new_tokens=MAX_NEW_TOKENS))
    engine_s = time.time() - t0
    if list(vlm.prompt_ids(prompt.text, vlm.images.plan(*scenes[0].image().shape[:2]))) != [prompt.prefix, prompt.rest]:
        raise RuntimeError("the engine's prompt tokens differ from the ones used in training")

    t0 = time.time()
    stop = set(vlm.text.stop_ids)
    torch_tokens: list[list[int]] = []
    torch_margins: list[list[tuple[float, float]]] = []
    for start in range(0, n if compare_torch else 0, 100):
        px = torch.from_numpy(np.stack([preprocess(s.image(), cfg).pixel_values[0] for s in scenes[start:start + 100]]))
        t, m = torch_greedy(vs, dec, prompt, px, stop, MAX_NEW_TOKENS)
        torch_tokens += t
        torch_margins += m
    torch_s = time.time() - t0

    objects = objects_right = frames_count_right = frames_all_right = exact = colour_shape = 0
    empty = empty_said = 0
    same = same_ids = 0
    diffs = []
    added_tokens = 0
    min_top1 = math.inf
    examples = []
    for i, (s, r) in enumerate(zip(scenes, eng, strict=True)):
        sc = score(r.text, s)
        objects += sc.count_true
        objects_right += sc.n_right
        frames_count_right += sc.count_right
        frames_all_right += sc.all_right
        exact += sc.exact
        colour_shape += colour_and_shape_right(r.text, s)
        if not s.objects:
            empty += 1
            empty_said += sc.all_right
        added_tokens += any(t >= BASE_VOCAB for t in r.token_ids)
        if compare_torch:
            min_top1 = min([min_top1] + [m[0] for m in torch_margins[i]])
        torch_text = tok.decode(torch_tokens[i], skip_special=True) if compare_torch else None
        if not compare_torch:
            pass
        elif r.text == torch_text:
            same += 1
            same_ids += r.token_ids == torch_tokens[i]
        else:
            j = next((k for k, (a, b) in enumerate(zip(r.token_ids, torch_tokens[i], strict=False)) if a != b),
                     min(len(r.token_ids), len(torch_tokens[i])))
            margin = torch_margins[i][j][1] if j < len(torch_margins[i]) else None
            diffs.append({"frame": i, "first_diff_token": j, "torch_top1_minus_top2": margin,
                          "engine": r.text, "torch": torch_text})
        if len(examples) < 8:
            examples.append({"frame": i, "truth": s.caption, "engine": r.text})
    timings = {k: round(float(np.median([r.timings_ms[k] for r in eng])), 1) for k in eng[0].timings_ms}
    return {
        "prompt": prompt.text,
        "world": world,
        "frames": n,
        "frame_sizes": sorted({f"{s.width}x{s.height}" for s in scenes}),
        "seed": getattr(scenes[0], "seed", EVAL_SEED),
        "objects": objects,
        "objects_fully_right": round(objects_right / objects, 4) if objects else None,
        "colour_and_shape_right": round(colour_shape / objects, 4) if objects else None,
        "frames_without_objects": empty,
        "frames_without_objects_said_so": round(empty_said / empty, 4) if empty else None,
        "count_right": round(frames_count_right / n, 4),
        "frames_all_right": round(frames_all_right / n, 4),
        "captions_exact": round(exact / n, 4),
        "engine_equals_torch_text": round(same / n, 4) if compare_torch else None,
        "engine_equals_torch_token_ids": round(same_ids / n, 4) if compare_torch else None,
        "differing_frames": diffs if compare_torch else None,
        "frames_with_added_token_in_output": added_tokens,
        "min_top1_logit_torch": round(min_top1, 3) if compare_torch else None,
        "engine_median_ms": timings,
        "engine_seconds": round(engine_s, 1),
        "torch_seconds": round(torch_s, 1),
        "examples": examples,
    }


# -- main -------------------------------------------------------------------------------------------


def command(argv: Sequence[str] | None) -> str:
    return " ".join([".venv/bin/python tools/train_demo_vlm.py", *(argv if argv is not None else sys.argv[1:])])


STAGES = ("keywords", "recover-prompt", "prompt", "regress", "caption", "average", "eval")
DEFAULT_STAGES = tuple(x for x in STAGES if x != "average")  # average needs --average-of


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", default=",".join(DEFAULT_STAGES),
                   help=f"comma-separated subset of {','.join(STAGES)}, run in that order; each stage reads what "
                   "the earlier ones saved in --work (so stages may run as separate commands: 'prompt' needs no "
                   "vision weights and may run beside 'keywords')")
    p.add_argument("--seed", type=int, default=1, help="training seed (streams seed, seed+1, seed+2; torch init)")
    p.add_argument("--steps1", type=int, default=3000, help="keywords stage steps")
    p.add_argument("--batch1", type=int, default=16, help="vision stages batch")
    p.add_argument("--lr1", type=float, default=4e-4)
    p.add_argument("--pool1", type=int, default=2500, help="distinct frames of the vision stages (reused after)")
    p.add_argument("--pool1-first", type=int, default=0,
                   help="the vision stages' pool starts at this frame of the stream (a further run on frames "
                        "the earlier runs did not see)")
    p.add_argument("--minutes1", type=float, default=25.0, help="keywords stage stops early after this long")
    p.add_argument("--steps-prompt", type=int, default=200, help="prompt stage steps")
    p.add_argument("--lr-prompt", type=float, default=2e-3)
    p.add_argument("--minutes-prompt", type=float, default=25.0)
    p.add_argument("--prompt-empty-every", type=int, default=0,
                   help="prompt stage: every Nth scene description is one without objects (0: as the world draws)")
    p.add_argument("--continue-prompt", action="store_true",
                   help="prompt stage: start from the saved soft prompt (a further run of the stage)")
    p.add_argument("--steps3", type=int, default=1000, help="regress stage steps")
    p.add_argument("--lr3", type=float, default=2e-4)
    p.add_argument("--minutes3", type=float, default=10.0)
    p.add_argument("--route-weight", type=float, default=0.0,
                   help="weight of an attention-routing loss (head 0 of layer 3 told where a mention's tokens must "
                   "look); tried in a 5-minute run without a clear gain, unused (0) for the shipped model")
    p.add_argument("--tile", default=None, metavar="SIZE/PATCH/SCALE",
                   help="another tile geometry with the same 16 image tokens, e.g. 192/16/3 (a from-scratch "
                        "vision stage; the shipped model is 128/16/2)")
    p.add_argument("--pos-init", choices=["default", "sincos", "routing"], default="default",
                   help="position embedding init of a fresh tower (default: transformers' own; routing: a start "
                   "for the routing head, see VisionSide)")
    p.add_argument("--group-weight", type=float, default=1.0,
                   help="weight of the object-grouping attention loss (see grouping_target)")
    p.add_argument("--flip", action="store_true",
                   help="vision stages: mirror frames left-right / upside down at random (four frames per drawn one)")
    p.add_argument("--dense-weight", type=float, default=0.5, help="weight of the per-patch colour/shape loss")
    p.add_argument("--shape-weight", type=float, default=1.0, help="weight of the shape slots in the slot loss")
    p.add_argument("--count-weight", type=float, default=1.0, help="weight of the count slots in the slot loss")
    p.add_argument("--regress-pair-every", type=int, default=0,
                   help="regress stage: every n-th frame of a batch is one with two or more alike objects of "
                        "--pair-size in one third (0: as the world draws; large ones ~1 in 20)")
    p.add_argument("--pair-size", choices=("large", "small"), default="large",
                   help="regress stage: the size of --regress-pair-every's alike objects")
    p.add_argument("--pair-first", type=int, default=1 << 25,
                   help="regress stage: the scan for --regress-pair-every's frames starts at this frame of the "
                        "training stream (a further run continues at the record's next_pair_frame)")
    p.add_argument("--end-weight", type=float, default=1.0,
                   help="weight of the end slot (object / no-object decision) in the slot loss")
    p.add_argument("--continue-regress", action="store_true",
                   help="regress stage: start from its own saved weights (a further run of the stage)")
    p.add_argument("--regress-from-scratch", action="store_true",
                   help="regress stage: start from a fresh tower instead of the keywords stage's")
    p.add_argument("--regress-from-mmproj", type=Path, default=None,
                   help="regress stage: start from the tower and connector of an mmproj GGUF written by export() "
                        "(e.g. the shipped edgevlm_ros/data/edgevlm-demo-mmproj-f16.gguf)")
    p.add_argument("--recover-frames", type=int, default=2048,
                   help="recover-prompt stage: training frames the soft prompt is estimated from")
    p.add_argument("--steps2", type=int, default=0, help="caption stage steps (0: skip)")
    p.add_argument("--batch2", type=int, default=16, help="decoder stages batch")
    p.add_argument("--lr2", type=float, default=1e-4)
    p.add_argument("--train-layers", type=int, default=1, help="caption stage: encoder layers trained (from the top)")
    p.add_argument("--train-patch-embedding", action="store_true",
                   help="caption stage: the patch embedding trains too (the position embeddings stay fixed)")
    p.add_argument("--caption-empty-every", type=int, default=0,
                   help="caption stage: every n-th frame of a batch is one without objects (0: as the world draws)")
    p.add_argument("--caption-count-every", type=int, default=0,
                   help="caption stage: every n-th frame of a batch is one with two or more alike objects in a third "
                        "(a count in its caption; 0: as the world draws, ~1 in 4)")
    p.add_argument("--caption-hard-every", type=int, default=0,
                   help="caption stage: every n-th frame of a batch is one of the hardest for the starting tower "
                        "(largest teacher-forced loss of any caption token) among --caption-hard-scan new frames")
    p.add_argument("--caption-hard-scan", type=int, default=6000,
                   help="caption stage: frames scanned for the hard ones (--caption-hard-every)")
    p.add_argument("--caption-hard-first", type=int, default=HARD_FRAMES_FIRST,
                   help="caption stage: where the scan for hard frames starts in stream seed + 1 (a run that "
                        "continues one that scanned continues after its scan)")
    p.add_argument("--caption-count-slot-weight", type=float, default=0.0,
                   help="caption stage: weight of the regress stage's loss on the count slots, kept beside the "
                        "caption loss (0: captions only)")
    p.add_argument("--caption-first-frames", type=int, nargs=3, default=[0, EMPTY_FRAMES_FIRST, COUNT_FRAMES_FIRST],
                   metavar=("PLAIN", "EMPTY", "COUNT"),
                   help="caption stage, a run from regress weights: where its frames of stream seed + 1 start (frames "
                        "as drawn, the scan for frames without objects, the scan for frames with a count), so that "
                        "runs from the same start see different frames (a run from caption.pt continues after its own)")
    p.add_argument("--average-of", type=Path, nargs="+", default=[], metavar="WORK",
                   help="average stage: the work folders whose caption.pt are averaged (runs of the caption stage "
                        "from the same regress weights)")
    p.add_argument("--caption-monitor-every", type=int, default=50,
                   help="caption stage: held-out teacher-forced scores every n steps (0: before and after only)")
    p.add_argument("--minutes2", type=float, default=15.0)
    p.add_argument("--eval-seed", type=int, default=999)
    p.add_argument("--eval-frames", type=int, default=300)
    p.add_argument("--independent-frames", type=int, default=150,
                   help="frames of each set of the independent evaluation world (edgevlm_ros.demo.eval_world)")
    p.add_argument("--extra-eval-frames", type=int, default=100,
                   help="frames for the untrained prompts (engine only; 0: skip)")
    # One torch thread: on this 2-core machine shared with other jobs (load 5-8), a backward pass of the
    # tower took 10 s with 2 threads and 0.25 s with 1 (2026-11-30): two OpenMP threads that wait for
    # each other at every barrier lose most of their time slices. The engine (evaluation) takes 2.
    p.add_argument("--draw-workers", type=int, default=2, help="processes drawing the vision stages' frames ahead")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1, see the comment)")
    p.add_argument("--engine-threads", type=int, default=1,
                   help="engine threads in the evaluation (1: the same contention argument as above)")
    p.add_argument("--work", type=Path, default=ROOT / "build" / "demo-train")
    p.add_argument("--out", type=Path, default=DEMO_MMPROJ_PATH, help="the mmproj to write")
    p.add_argument("--record", type=Path, default=DEMO_RECORD_PATH)
    args = p.parse_args(argv)
    args.stages = [x.strip() for x in args.stages.split(",") if x.strip()]
    bad = [x for x in args.stages if x not in STAGES]
    if bad:
        p.error(f"unknown stage(s) {bad}; known: {', '.join(STAGES)}")
    if "average" in args.stages and len(args.average_of) < 2:
        p.error("the average stage needs two or more work folders in --average-of")
    if args.eval_seed in (args.seed, args.seed + 1, args.seed + 2):
        p.error("--eval-seed must differ from the training streams")
    return args


WARM_START_RECORD = "warm_start_record.json"  # in --work: the record of the model a warm start began from


def _stage_record(work: Path, name: str) -> dict[str, Any] | None:
    path = work / f"{name}.json"
    if path.exists():
        return json.loads(path.read_text())
    legacy = work / "stages.json"  # the first keywords run of the shipped model wrote this name
    if name == "keywords" and legacy.exists():
        return json.loads(legacy.read_text()).get("stage1")
    return None


def _commands(rec: dict[str, Any] | None) -> list[str]:
    """The commands of a stage record, earlier runs (continued_from, or the runs it averaged) first,
    each once."""
    if not rec:
        return []
    earlier = [c for r in rec.get("averaged", [rec.get("continued_from")]) for c in _commands(r)]
    return [*dict.fromkeys(earlier), rec["command"]] if "command" in rec else []


def _first_start(rec: dict[str, Any] | None) -> str:
    """Where the first run of a continued stage started from."""
    while rec and rec.get("continued_from"):
        rec = rec["continued_from"]
    return (rec or {}).get("started_from", "")


# The soft prompt the shipped mmproj was trained against (the eval stage writes it beside the model):
# a later run in a fresh --work starts from it. Training state only; nothing at run time reads it.
COMMITTED_PROMPT = ROOT / "tools" / "demo-soft-prompt.npz"


def saved_prompt(work: Path) -> dict[str, Any]:
    """The soft prompt of --work (prompt.pt), else the committed one (COMMITTED_PROMPT)."""
    import torch

    if (work / "prompt.pt").exists():
        return torch.load(work / "prompt.pt")
    if COMMITTED_PROMPT.exists():
        with np.load(COMMITTED_PROMPT) as z:
            return {"offsets": torch.from_numpy(z["offsets"]), "deltas": torch.from_numpy(z["deltas"]),
                    "vocab": [int(t) for t in z["vocab"]]}
    raise SystemExit(f"no soft prompt in {work} nor {COMMITTED_PROMPT.relative_to(ROOT)}: run the prompt stage, or "
                     "recover the shipped model's (--stages recover-prompt --regress-from-mmproj <its mmproj>)")


def write_committed_prompt(state: dict[str, Any]) -> None:
    np.savez(COMMITTED_PROMPT, offsets=state["offsets"].numpy().astype(np.float32),
             deltas=state["deltas"].numpy().astype(np.float32), vocab=np.asarray(state["vocab"], np.int64))


def _latest_vision(work: Path) -> Path | None:
    for name in ("caption.pt", "regress.pt", "stage1.pt"):
        if (work / name).exists():
            return work / name
    return None


def starting_weights(args: argparse.Namespace) -> Path | None:
    """The weights in --work that the first of the stages to load a tower starts from (None: it starts
    from a fresh tower or an mmproj file, or none are saved)."""
    for stage in args.stages:
        if stage in ("caption", "eval"):
            return _latest_vision(args.work)
        if stage == "regress":
            if args.regress_from_mmproj is not None or args.regress_from_scratch:
                return None
            path = args.work / ("regress.pt" if args.continue_regress else "stage1.pt")
            return path if path.exists() else None
        if stage in ("keywords", "recover-prompt"):
            return None
    return None


def work_tile(args: argparse.Namespace) -> tuple[int, int, int] | None:
    """The tile geometry of the weights the run starts from in --work (`starting_weights`), so that a
    later stage without --tile goes on at that tile instead of carrying the weights over to the default."""
    import torch

    start = starting_weights(args)
    return tile_of(torch.load(start)) if start is not None else None


def main(argv: Sequence[str] | None = None) -> int:
    import torch

    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    if args.tile:
        try:
            set_tile(*(int(v) for v in args.tile.split("/")))
        except (TypeError, ValueError) as e:
            raise SystemExit(f"--tile {args.tile}: {e}") from None
    elif (saved := work_tile(args)) is not None:
        set_tile(*saved)
        log.info("tile %d/%d/%d: the geometry of the weights in %s (--tile to carry them over to another)",
                 *saved, args.work)

    text_gguf = ensure_demo_text_model()
    from edgevlm_ros import _engine

    meta = _engine.GGUFFile(str(text_gguf)).metadata()
    tok = Tokenizer.from_gguf_metadata(meta)
    prompts = [make_prompt(tok, meta["tokenizer.chat_template"], t) for t in PROMPTS]
    cfg = preprocess_config()
    config = idefics3_config()
    vs = VisionSide(config, args.seed, args.pos_init)
    kw = Keywords(tok)
    log.info("vision side: %.2f M parameters; keyword vocabulary %d; prompt prefix %d tokens, rest %d",
             sum(p.numel() for m in vs.modules() for p in m.parameters()) / 1e6, len(kw.vocab),
             len(prompts[0].prefix), len(prompts[0].rest))
    dec = Decoder(ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    soft = SoftPrompt(dec.embeddings, kw)

    def finish(name: str, rec: dict[str, Any], t0: float, earlier: dict[str, Any] | None = None,
               count: str = "frames") -> None:
        """Writes the stage's record. `earlier`: the record of the run this one continued, kept as
        continued_from; the count (`count`: frames or scenes) and the wall time then cover all runs
        (an earlier record's own wall_seconds already covers the runs before it; a record that
        carries wall_seconds_earlier_runs itself, the average stage's, adds those). A record's
        started_from notes weights carried over from another tile geometry."""
        rec["command"] = command(argv)
        if vs.retiled_from and "started_from" in rec:
            rec["started_from"] += f", carried over from tile {vs.retiled_from} (retiled)"
        if earlier is not None:
            rec["continued_from"] = earlier
            rec[count] += earlier.get(count, 0)
            rec["wall_seconds_earlier_runs"] = earlier.get("wall_seconds", 0.0)
        rec["wall_seconds"] = round(time.time() - t0 + rec.get("wall_seconds_earlier_runs", 0.0), 1)
        (args.work / f"{name}.json").write_text(json.dumps(rec, indent=2))

    for stage in args.stages:
        t0 = time.time()
        if stage == "keywords":
            rec = train_vision("keywords", vs, soft, kw, args, cfg, args.steps1, args.lr1, 30,
                               time.time() + 60 * args.minutes1)
            torch.save(vs.state_dict(), args.work / "stage1.pt")
            finish(stage, rec, t0)
        elif stage == "recover-prompt":
            if args.regress_from_mmproj is None:
                raise SystemExit("recover-prompt: name the model whose prompt to recover (--regress-from-mmproj)")
            load_mmproj(vs, args.regress_from_mmproj)
            rec = recover_prompt(soft, vs, kw, args, cfg)
            exact, n_held, no_objects = probe_prompt(soft, dec, tok, kw, prompts[0], args.seed)
            rec |= {"held_out_greedy_captions_exact": f"{exact} / {n_held}", "no_objects_greedy": no_objects}
            torch.save(soft.state(), args.work / "prompt.pt")
            finish(stage, rec, t0)
        elif stage == "prompt":
            earlier = None
            if args.continue_prompt:  # another run of this stage, starting where the saved one ended
                new_words = soft.load(saved_prompt(args.work))
                if new_words:
                    log.info("prompt: keywords new since the saved soft prompt (deltas start at zero): %s",
                             [tok.decode([t]) for t in new_words])
                earlier = _stage_record(args.work, "prompt")
            rec = train_prompt(soft, dec, tok, kw, prompts[0], args, time.time() + 60 * args.minutes_prompt,
                               first_scene=(earlier or {}).get("next_scene", (earlier or {}).get("scenes", 0)))
            torch.save(soft.state(), args.work / "prompt.pt")
            finish(stage, rec, t0, earlier, count="scenes")
        elif stage == "regress":
            earlier = None
            if args.continue_regress:  # another run of this stage, starting where the saved one ended
                vs.load_state_dict(torch.load(args.work / "regress.pt"))
                earlier = _stage_record(args.work, "regress")
            elif args.regress_from_mmproj is not None:
                load_mmproj(vs, args.regress_from_mmproj)
                # The evaluation's record keeps how the starting model was trained: when it starts from
                # the model at --out, its record (--record) is overwritten by the new one.
                start = args.regress_from_mmproj
                same = start.resolve() == args.out.resolve() and args.record.exists()
                started = json.loads(args.record.read_text()) if same else {}
                started["mmproj_sha256"] = hashlib.sha256(start.read_bytes()).hexdigest()
                (args.work / WARM_START_RECORD).write_text(json.dumps(started, indent=2))
            elif not args.regress_from_scratch:
                vs.load_state_dict(torch.load(args.work / "stage1.pt"))
            if soft.load(saved_prompt(args.work)):
                raise SystemExit("regress: the saved soft prompt predates the keyword vocabulary; run the prompt "
                                 "stage (--continue-prompt) first")
            rec = train_vision("regress", vs, soft, kw, args, cfg, args.steps3, args.lr3,
                               50 if args.regress_from_scratch else 10,
                               time.time() + 60 * args.minutes3)
            rec["started_from"] = ("regress.pt" if args.continue_regress else
                                   f"the tower of {args.regress_from_mmproj.name}" if args.regress_from_mmproj
                                   else f"a fresh tower (--pos-init {args.pos_init})" if args.regress_from_scratch
                                   else "stage1.pt")
            torch.save(vs.state_dict(), args.work / "regress.pt")
            finish(stage, rec, t0, earlier)
        elif stage == "caption":
            latest = _latest_vision(args.work)
            if latest is None:
                raise SystemExit("caption stage: no vision weights in --work (run keywords / regress first)")
            vs.load_state_dict(torch.load(latest))
            # From caption.pt: another run of this stage, after the saved one.
            earlier = _stage_record(args.work, "caption") if latest.name == "caption.pt" else None
            if args.caption_count_slot_weight > 0 and soft.load(saved_prompt(args.work)):
                raise SystemExit("caption: the saved soft prompt predates the keyword vocabulary")
            rec = train_captions(vs, dec, tok, prompts, args, cfg, time.time() + 60 * args.minutes2,
                                 slots=(soft, kw) if args.caption_count_slot_weight > 0 else None,
                                 first=(earlier or {}).get("next_frame", args.caption_first_frames[0]),
                                 first_empty=(earlier or {}).get("next_empty_frame", args.caption_first_frames[1]),
                                 first_count=(earlier or {}).get("next_count_frame", args.caption_first_frames[2]),
                                 first_hard=(earlier or {}).get("next_hard_frame", args.caption_hard_first))
            rec["started_from"] = latest.name
            torch.save(vs.state_dict(), args.work / "caption.pt")
            finish(stage, rec, t0, earlier)
        elif stage == "average":
            mean, rec = average_caption_runs(args.average_of)
            # The runs' shared start: the records of the stages before and the soft prompt they trained against.
            for name in (*(f"{n}.json" for n in STAGES[:STAGES.index("caption")]), WARM_START_RECORD, "prompt.pt"):
                if (args.average_of[0] / name).exists():
                    shutil.copy(args.average_of[0] / name, args.work / name)
            vs.load_state_dict(mean)
            torch.save(vs.state_dict(), args.work / "caption.pt")  # as the caption stage saves (retiled to --tile)
            finish("caption", rec, t0)
            log.info("average: the mean of %d caption runs (%d distinct runs, %d steps, %.0f s) -> %s",
                     len(args.average_of), rec["distinct_runs"], rec["steps"], rec["wall_seconds"],
                     args.work / "caption.pt")
        elif stage == "eval":
            latest = _latest_vision(args.work)
            if latest is None:
                raise SystemExit("eval: no vision weights in --work")
            vs.load_state_dict(torch.load(latest))
            evaluate_and_record(args, argv, vs, dec, tok, prompts, meta, cfg, config, text_gguf, latest)
    return 0


def evaluate_and_record(args: argparse.Namespace, argv: Sequence[str] | None, vs: VisionSide, dec: Decoder,
                        tok: Tokenizer, prompts: list[Prompt], meta: dict[str, Any], cfg: PreprocessConfig,
                        config: Any, text_gguf: Path, weights: Path) -> None:
    import torch

    vs.train(False)
    out = export(vs, config, args.work / "hf", args.out)
    write_committed_prompt(saved_prompt(args.work))
    round_like_f16_file(vs)
    log.info("wrote %s (%.1f MB) from %s; evaluating", out, out.stat().st_size / 1e6, weights.name)
    evals = [evaluate(out, text_gguf, vs, dec, tok, prompts[0], args, cfg, args.eval_frames)]
    independent = {name: evaluate(out, text_gguf, vs, dec, tok, prompts[0], args, cfg, 0, compare_torch=False,
                                  scenes=list(eval_scenes(name, args.independent_frames)),
                                  world=f"edgevlm_ros.demo.eval_world, set {name}") for name in EVAL_SETS}
    scored = [independent[k] for k in ("single", "multi")]
    independent["overall_objects_fully_right"] = round(
        sum(e["objects_fully_right"] * e["objects"] for e in scored) / sum(e["objects"] for e in scored), 4)
    for name in EVAL_SETS:
        e = independent[name]
        log.info("independent %s: objects fully right %s, colour+shape %s, count %.3f, no-object frames said so %s",
                 name, e["objects_fully_right"], e["colour_and_shape_right"], e["count_right"],
                 e["frames_without_objects_said_so"])
    if args.extra_eval_frames:
        evals += [evaluate(out, text_gguf, vs, dec, tok, make_prompt(tok, meta["tokenizer.chat_template"], t), args,
                           cfg, args.extra_eval_frames, compare_torch=False) for t in EXTRA_EVAL_PROMPTS]
    for e in evals:
        log.info("%s: objects fully right %.3f, count right %.3f, exact %.3f, engine == torch %s",
                 e["prompt"], e["objects_fully_right"], e["count_right"], e["captions_exact"],
                 e["engine_equals_torch_text"])
    stages = {name: _stage_record(args.work, name) for name in STAGES[:-1]}
    used = {"caption.pt": ["keywords", "prompt", "regress", "caption"], "regress.pt": ["keywords", "prompt", "regress"],
            "stage1.pt": ["keywords"]}[weights.name]
    if stages.get("recover-prompt") and "prompt" in used:  # the prompt was recovered from the starting model
        used.insert(used.index("prompt"), "recover-prompt")
    first = _first_start(stages.get("regress")) if weights.name != "stage1.pt" else ""
    warm_start = None
    if first.startswith(("a fresh tower", "the tower of")):
        used.remove("keywords")
    if first.startswith("the tower of") and (args.work / WARM_START_RECORD).exists():
        earlier = json.loads((args.work / WARM_START_RECORD).read_text())
        kept = ("mmproj_sha256", "date", "training_commands", "training_frames", "training_wall_seconds",
                "warm_start")
        warm_start = {"from": first, **{k: earlier[k] for k in kept if k in earlier}}
    record = {
        "model": "edgevlm demo: SigLIP-style tower + idefics3 connector on frozen SmolLM2-135M-Instruct (Q4_1)",
        "mmproj": out.name,
        "mmproj_bytes": out.stat().st_size,
        "text_model": "models/edgevlm-demo-text.gguf, written by edgevlm_ros.demo.demo_model.ensure_demo_text_model()",
        "world": "edgevlm_ros.demo.scenes (synthetic shapes only); evaluated also on edgevlm_ros.demo.eval_world",
        "training_commands": [c for n in used for c in _commands(stages.get(n))],
        "evaluation_command": command(argv),
        "seed": args.seed,
        "training_streams": {"vision": args.seed, "prompt_and_caption": args.seed + 1, "monitor": args.seed + 2},
        "vision": {"image_size": IMAGE_SIZE, "patch_size": PATCH_SIZE, "width": WIDTH, "layers": LAYERS,
                   "heads": HEADS, "mlp": MLP, "scale_factor": SCALE, "image_tokens": N_IMAGE_TOKENS,
                   "parameters": sum(p.numel() for m in vs.modules() for p in m.parameters())},
        "prompts_trained": list(PROMPTS),
        "frame_sizes": [list(f) for f in FRAME_SIZES],
        "stages": {n: stages[n] for n in used},
        "training_frames": sum((stages[n] or {}).get("frames", 0) for n in used),
        "training_scene_descriptions_prompt_stage": (stages.get("prompt") or {}).get("scenes", 0),
        "training_wall_seconds": round(sum((stages[n] or {}).get("wall_seconds", 0.0) for n in used), 1),
        "warm_start": warm_start,  # the earlier model the vision stage started from, and its own training
        "evaluation": evals,
        "evaluation_independent_renderer": independent,
        "machine": f"{platform.machine()}, 2 cores shared with other jobs; torch {torch.__version__} with "
                   f"{args.threads} thread(s), engine {args.engine_threads} threads",
        "date": time.strftime("%Y-%m-%d"),
    }
    args.record.write_text(json.dumps(record, indent=2) + "\n")
    log.info("wrote %s", args.record)


if __name__ == "__main__":
    sys.exit(main())
