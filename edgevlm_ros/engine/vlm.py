"""A vision-language model: an mmproj (a vision tower + connector, e.g. SigLIP + idefics3) beside a text GGUF.

The family's image side (image_input: SmolVLM's tiles, MiniCPM-V 4.6's source view and slices) is
chosen by the mmproj's projector type; everything after the features is the same for every family.
One frame's way: plan (sizes and prompt; refuse what does not fit) -> preprocess (resize, normalize)
-> vision tower -> the one generation path
(generation.generate: restore the fixed-prefix state, prefill the rest with the image embeddings at
the `<image>` positions, greedy decode). Every stage is timed.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .. import _engine
from .chat_template import render_chat
from .generation import PromptCache, generate
from .image_input import image_family
from .latency import PREPROCESS, VISION
from .paths import DEFAULT_MMPROJ, resolve_model
from .preprocess import ImagePlan, ImageRefused, _check_rgb
from .text_model import GenerationResult, PrefixState, TextModel

DEFAULT_PROMPT = "Describe what you see."

log = logging.getLogger("edgevlm")


class VisionLanguageModel:
    """Load with load_vlm(). Not thread-safe: one describe() at a time."""

    def __init__(self, model: str | os.PathLike[str] | None = None, mmproj: str | os.PathLike[str] | None = None,
                 threads: int | None = None, image_mode: str = "single", system_prompt: str | None = None,
                 prefix_cache_dir: str | os.PathLike[str] | None = None, longest_edge: int | None = None,
                 n_ctx: int = 4096, prefix_cache: bool = True, kv_type: str = "f32", mtp: bool = False,
                 vision_int8: bool = False) -> None:
        self.text = TextModel(model, threads=threads, n_ctx=n_ctx, kv_type=kv_type, mtp=mtp)
        self.mmproj_path = resolve_model(mmproj, default=DEFAULT_MMPROJ)
        self.mmproj_file = _engine.GGUFFile(str(self.mmproj_path))
        self.mmproj_metadata: dict[str, Any] = self.mmproj_file.metadata()
        self.vision = _engine.VisionModel(self.mmproj_file, threads=self.text.native.threads, int8=vision_int8)
        log.info("%s: kernels %s (operator table: %s)", self.mmproj_path.name, self.vision.variants(),
                 _engine.optable_source())
        vcfg = self.vision.config
        if vcfg["proj_dim"] != self.text.config["n_embd"]:
            raise ValueError(
                f"'{self.mmproj_path.name}' projects to width {vcfg['proj_dim']} but '{self.text.path.name}' has "
                f"width {self.text.config['n_embd']}: the model and mmproj files do not belong together"
            )
        self.images = image_family(str(vcfg.get("projector", "")), self.mmproj_metadata, int(vcfg["tokens_per_tile"]),
                                   image_mode, longest_edge)
        placeholder = self.placeholder = self.images.placeholder
        image_id = self.text.tokenizer.token_to_id(placeholder)
        if image_id is None:
            # Beside the demo mmproj (the default when only a model is given) say how to get a pair.
            hint = (f", so it cannot take the embedded demo mmproj '{DEFAULT_MMPROJ}': give neither model nor "
                    f"mmproj for the embedded demo pair, or a vision-language text model with its own mmproj"
                    if self.mmproj_path.name == DEFAULT_MMPROJ else "")
            raise ValueError(
                f"'{self.text.path.name}' has no {placeholder} token: it is not a vision-language text model{hint}"
            )
        self.image_token_id: int = image_id
        self.system_prompt = system_prompt
        # (prefix ids, the rest) by (prompt, rows, cols): the template is rendered and tokenized
        # once per prompt (and tile grid), not once per frame.
        self._prompt_parts: PromptCache[tuple[tuple[int, ...], tuple[int, ...]]] = PromptCache()
        # The fixed prefix is everything before the image: it depends on the system prompt only,
        # because the image comes first in the user turn.
        self.prefix_text = self._render(DEFAULT_PROMPT).split(placeholder, 1)[0]
        prefix_ids = self.text.tokenizer.encode(self.prefix_text, add_bos=False)
        self.prefix: PrefixState
        if prefix_cache:
            self.prefix, self.prefix_cache_status = self.text.cached_prefix(prefix_ids, prefix_cache_dir)
        else:  # every frame prefills the whole prompt (benchmarks compare against this)
            self.prefix, self.prefix_cache_status = PrefixState((), None), "disabled"

    def _render(self, prompt: str) -> str:
        """The chat prompt with one image placeholder before the user's text."""
        messages: list[dict[str, Any]] = []
        if self.system_prompt:
            messages.append({"role": "system", "content": [{"type": "text", "text": self.system_prompt}]})
        messages.append({"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]})
        tok, placeholder = self.text.tokenizer, self.placeholder
        bos = tok.id_to_token(tok.bos_id) if tok.bos_id is not None else ""
        eos = tok.id_to_token(tok.eos_id) if tok.eos_id is not None else ""
        text = render_chat(self.text.chat_template, messages, add_generation_prompt=True, bos_token=bos, eos_token=eos)
        if placeholder not in text:
            # A text-only template that ignores content parts: put the image in the text.
            for m in messages:
                m["content"] = "".join(p.get("text", placeholder) for p in m["content"])
            text = render_chat(self.text.chat_template, messages, add_generation_prompt=True,
                               bos_token=bos, eos_token=eos)
        if text.count(placeholder) != 1:
            raise ValueError("the chat template must place exactly one image in the prompt")
        return text

    def prompt_ids(self, prompt: str, image: ImagePlan) -> tuple[list[int], list[int]]:
        """(prefix ids, the rest) for a prompt whose image placeholder expands to image.text."""

        def encode() -> tuple[tuple[int, ...], tuple[int, ...]]:
            before, after = self._render(prompt).split(self.placeholder, 1)
            tok = self.text.tokenizer
            rest = tok.encode(image.text + after, add_bos=False)
            kept = before == self.prefix_text and self.prefix.snapshot is not None
            pre = self.prefix.token_ids if kept else tok.encode(before, add_bos=False)
            return tuple(pre), tuple(rest)

        pre, rest = self._prompt_parts.get((prompt, image.key), encode)
        return list(pre), list(rest)

    def cancel(self) -> None:
        """From any thread: a describe() in progress stops before its next decoded token (stop_reason
        "cancelled"), and so does every later one. For shutdown; the vision encoder is not interrupted."""
        self.text.native.cancel()

    def describe(self, rgb: np.ndarray, prompt: str = DEFAULT_PROMPT, max_new_tokens: int = 64,
                 deadline_ms: float | None = None, max_image_pixels: int | None = None,
                 choices: Sequence[str] | None = None,
                 schema: Mapping[str, Any] | str | bytes | None = None,
                 on_partial: Callable[[str, int], None] | None = None, partial_every: int = 0,
                 drafts_from: Sequence[Sequence[int]] | None = None) -> GenerationResult:
        """Greedy description of one RGB uint8 image (H, W, 3).

        drafts_from: token ids of earlier descriptions (of the same camera: a slowly changing view
        repeats most of them): speculative decoding drafts from them; the text is the same as without.

        choices: the answer is exactly one of these strings (stop_reason "complete" or
        "stop_token" when it is; "deadline" / "cancelled" can still cut it short).
        schema (a dict or its JSON text; not with choices): the answer is JSON valid against this
        JSON schema (the subset of engine/constraints.py), also when max_new_tokens cuts it short
        (the constraint leaves room to close it); only "deadline" / "cancelled" can leave it unfinished.
        on_partial(text so far, tokens so far) every partial_every tokens while decoding, and with
        the final text at the end (generation.generate).
        A frame whose resized views exceed max_image_pixels, or whose prompt (image tokens included)
        and max_new_tokens exceed the context, is refused (ImageRefused, one line) before any
        resize or encoding."""
        if max_new_tokens < 0:
            raise ValueError("max_new_tokens must be >= 0")
        constraint = self.text.constraint(choices, schema, max_new_tokens)
        t0 = time.perf_counter()
        rgb = _check_rgb(rgb)
        height, width = rgb.shape[:2]
        plan = self.images.plan(height, width, max_image_pixels)
        prefix_ids, rest_ids = self.prompt_ids(prompt, plan)
        n_ctx = int(self.text.native.n_ctx)
        n_prompt = len(prefix_ids) + len(rest_ids)
        if n_prompt + max_new_tokens > n_ctx:
            views = f"{plan.n_views} view(s)" + (f", a {plan.grid[0]}x{plan.grid[1]} grid" if plan.grid[0] else "")
            raise ImageRefused(
                f"image {width}x{height} needs {plan.n_image_tokens} image tokens ({views}): the prompt is "
                f"{n_prompt} tokens, with max_new_tokens {max_new_tokens} more than the context of {n_ctx}: use "
                f"image_mode single, fewer new tokens or a larger context")
        image = self.images.prepare(rgb, plan)
        t1 = time.perf_counter()
        features = self.images.encode(self.vision, image)
        t2 = time.perf_counter()
        stages = {PREPROCESS: (t1 - t0) * 1e3, VISION: (t2 - t1) * 1e3}
        result = generate(self.text.native, self.text.tokenizer, self.text.stop_ids, prefix_ids + rest_ids,
                          prefix=self.prefix, features=features, image_token_id=self.image_token_id,
                          max_new_tokens=max_new_tokens, deadline_ms=deadline_ms, t0=t0, stages_ms=stages,
                          constraint=constraint, on_partial=on_partial, partial_every=partial_every,
                          drafts_from=drafts_from)
        result.extra |= {"n_image_tokens": plan.n_image_tokens, "tiles": plan.n_views, "grid": list(plan.grid)}
        return result


def load_vlm(model: str | os.PathLike[str] | None = None, mmproj: str | os.PathLike[str] | None = None,
             threads: int | None = None, image_mode: str = "single", system_prompt: str | None = None,
             prefix_cache_dir: str | os.PathLike[str] | None = None,
             longest_edge: int | None = None, prefix_cache: bool = True, kv_type: str = "f32",
             mtp: bool = False, vision_int8: bool = False) -> VisionLanguageModel:
    """Loads a text GGUF and its mmproj; refuses pairs that do not fit together.

    prefix_cache=False prefills the whole prompt for every frame (status "disabled"); kv_type: the
    text model's KV cache (f32, f16, q8_0); mtp: draft from the text file's multi-token-prediction
    block too (TextModel); vision_int8: the vision tower's matrices on int8 products where the operator
    table has an int8 kernel for this CPU (AVX-VNNI, AVX512-VNNI, Arm dotprod: weights requantized to
    int8 blocks at load, activations to int8 blocks; the features move by int8's rounding;
    docs/kernels/vision-int8-gemm.md)."""
    return VisionLanguageModel(model, mmproj, threads=threads, image_mode=image_mode, system_prompt=system_prompt,
                               prefix_cache_dir=prefix_cache_dir, longest_edge=longest_edge, prefix_cache=prefix_cache,
                               kv_type=kv_type, mtp=mtp, vision_int8=vision_int8)
