"""A text model: the native decoder (whichever architecture the registry picks) plus the GGUF's own
tokenizer and chat template."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .. import _engine
from . import optable, prefix_cache
from .chat_template import render_chat
from .constraints import choice_constraint, parse_schema, schema_constraint
from .generation import GenerationResult, PrefixState, PromptCache, generate
from .kv_types import check_kv_type
from .latency import TOKENIZE
from .paths import default_threads, resolve_model
from .tokenizer import Tokenizer

log = logging.getLogger("edgevlm")


class TextModel:
    """Load with `edgevlm_ros.load()`. Not thread-safe: one generation at a time."""

    def __init__(self, path: str | os.PathLike[str] | None = None, threads: int | None = None,
                 n_ctx: int = 2048, n_batch: int = _engine.DEFAULT_BATCH, kv_type: str = "f32",
                 mtp: bool = False) -> None:
        optable.ensure_active()
        self.path: Path = resolve_model(path)
        self.file = _engine.GGUFFile(str(self.path))
        self.metadata: dict[str, Any] = self.file.metadata()
        self.tokenizer = Tokenizer.from_gguf_metadata(self.metadata)
        # kv_type: how the KV cache stores keys and values (KV_TYPES); ValueError for a head size
        # f16 / q8_0 cannot take.
        check_kv_type(kv_type)
        # mtp: load the file's multi-token-prediction block where it has one (Qwen3.5's); generate() then
        # drafts from it where the earlier answers propose nothing (the text stays greedy's).
        self.native = _engine.Decoder(self.file, threads=threads or default_threads(), n_ctx=n_ctx, n_batch=n_batch,
                                      kv_type=kv_type, mtp=mtp)
        self.config: dict[str, Any] = self.native.config
        if mtp:
            log.info("%s: %s", self.path.name,
                     "drafts from its multi-token-prediction block too" if self.native.has_mtp else
                     "mtp: the file has no multi-token-prediction block; drafts come from earlier answers only")
        log.info("%s: kernels %s (operator table: %s)", self.path.name, self.native.variants(),
                 _engine.optable_source())
        if self.tokenizer.vocab_size > self.config["n_vocab"]:
            raise ValueError(
                f"bad GGUF file '{self.path}': tokenizer has {self.tokenizer.vocab_size} tokens "
                f"but the output head only {self.config['n_vocab']}"
            )
        # None or "": a base (pretrained) model, whose prompts are fed as they are (encode_prompt).
        self.chat_template: str | None = self.metadata.get("tokenizer.chat_template") or None
        self.stop_ids: list[int] = sorted(self.tokenizer.eot_ids)
        # Rendered and tokenized prompts, by (prompt, raw, system): a prompt that repeats is encoded once.
        self._encoded: PromptCache[tuple[int, ...]] = PromptCache()
        # Constraints (constraint()): Choices by ("choices", the strings), JsonSchemas by ("schema", its text).
        self._constraints: PromptCache[Any] = PromptCache(16)

    # -- prompts ---------------------------------------------------------------------------
    def chat_text(self, prompt: str, system: str | None = None) -> str:
        """The prompt as the user turn of the model's chat template, ready for the assistant."""
        messages = ([{"role": "system", "content": system}] if system is not None else [])
        messages.append({"role": "user", "content": prompt})
        bos = self._token_text(self.tokenizer.bos_id)
        eos = self._token_text(self.tokenizer.eos_id)
        return render_chat(self.chat_template, messages, add_generation_prompt=True, bos_token=bos, eos_token=eos)

    @property
    def raw_note(self) -> str | None:
        """The one line a front end prints when prompts go in raw because the file has no chat
        template (a base model, e.g. Gemma 3 270M pretrained); None for a chat model."""
        if self.chat_template:
            return None
        bos = "with BOS" if self.metadata.get("tokenizer.ggml.add_bos_token", False) else "without BOS"
        return f"{self.path.name} has no chat template (a base model): the prompt is fed raw, {bos} as the file says"

    def encode_prompt(self, prompt: str, raw: bool = False, system: str | None = None) -> list[int]:
        """Token ids of a prompt. raw, or a file without a chat template: the text as it is (BOS
        only if the GGUF asks for one)."""
        raw = raw or not self.chat_template

        def encode() -> tuple[int, ...]:
            # The template writes any BOS it wants itself, so none is added on top.
            if raw:
                return tuple(self.tokenizer.encode(prompt))
            return tuple(self.tokenizer.encode(self.chat_text(prompt, system), add_bos=False))

        return list(self._encoded.get((prompt, raw, system), encode))

    def _token_text(self, token_id: int | None) -> str:
        return self.tokenizer.id_to_token(token_id) if token_id is not None else ""

    # -- compute ---------------------------------------------------------------------------
    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Logits at every position of token_ids, computed on an empty cache: shape (n, vocab)."""
        self.native.reset()
        return self.native.forward(np.asarray(token_ids, dtype=np.int32), all_logits=True)

    def prefix(self, token_ids: Sequence[int]) -> PrefixState:
        """Runs a fixed prefix once and keeps its sequence state for generate_ids(prefix=...)."""
        self.native.reset()
        if token_ids:
            self.native.forward(np.asarray(token_ids, dtype=np.int32))
        return PrefixState(tuple(int(t) for t in token_ids), self.native.snapshot())

    def cached_prefix(self, token_ids: Sequence[int],
                      cache_dir: str | os.PathLike[str] | None = None) -> tuple[PrefixState, str]:
        """prefix(), loaded from or saved to a file in cache_dir keyed by model, tokens and engine.

        Returns the state and what happened: "built", "loaded from <file>", "rebuilt (<why>)";
        a stale or corrupt file is never used.
        """
        ids = [int(t) for t in token_ids]
        if not cache_dir:
            return self.prefix(ids), "built (no cache dir)"
        key = prefix_cache.cache_key(self.path, ids, self.native.kv_type)
        path = prefix_cache.cache_path(cache_dir, key)
        status = "built"
        if path.exists():
            try:
                cached_ids, snapshot = prefix_cache.load(path, key, prefix_cache.StateShape.of(self.native))
                if cached_ids != ids:
                    raise prefix_cache.PrefixCacheError(f"{path.name}: holds other tokens")
                self.native.restore(snapshot)  # checks layers, width and context fit
                return PrefixState(tuple(ids), snapshot), f"loaded from {path}"
            except ValueError as exc:  # PrefixCacheError, or a snapshot that does not fit
                status = f"rebuilt ({exc})"
        state = self.prefix(ids)
        try:
            prefix_cache.save(path, key, ids, state.snapshot)
        except OSError as exc:
            status += f" (not saved: {exc.strerror})"
        return state, status

    def constraint(self, choices: Sequence[str] | None = None, schema: Mapping[str, Any] | str | bytes | None = None,
                   max_new_tokens: int | None = None) -> Any:
        """The native constraint of `choices` (the answer is exactly one of these strings) or of a JSON
        `schema` (engine/constraints.py's subset), built once per list or schema text; None for
        neither. ValueError (one line) when bad, when both are given, or when max_new_tokens cannot
        hold the longest choice or the schema's shortest answer."""
        if choices is not None and schema is not None:
            raise ValueError("give choices or schema, not both")
        if schema is not None:
            _, text = parse_schema(schema)
            c = self._constraints.get(("schema", text), lambda: schema_constraint(self.tokenizer, text))
            if max_new_tokens is not None and max_new_tokens < c.min_tokens:
                raise ValueError(f"max_new_tokens {max_new_tokens} is fewer than the {c.min_tokens} tokens "
                                 f"the schema's shortest answer may need")
            return c
        if choices is None:
            return None

        def build() -> Any:
            return choice_constraint(self.tokenizer, int(self.config["n_vocab"]), choices)

        if isinstance(choices, (list, tuple)) and all(isinstance(x, str) for x in choices):
            c = self._constraints.get(("choices", tuple(choices)), build)
        else:
            c = build()
        if max_new_tokens is not None and max_new_tokens < c.longest:
            raise ValueError(f"max_new_tokens {max_new_tokens} is fewer than the longest choice's {c.longest} tokens")
        return c

    def generate_ids(self, token_ids: Sequence[int], max_new_tokens: int = 64, prefix: PrefixState | None = None,
                     deadline_ms: float | None = None, choices: Sequence[str] | None = None,
                     schema: Mapping[str, Any] | str | bytes | None = None,
                     drafts_from: Sequence[Sequence[int]] | None = None) -> GenerationResult:
        """Greedy generation after token_ids. With a prefix whose ids start token_ids, the cached
        state is restored and only the rest is prefilled (generation.generate). choices / schema
        constrain the answer (constraint()); drafts_from: earlier answers' ids to speculate from
        (the same tokens, sooner when they repeat)."""
        constraint = self.constraint(choices, schema, max_new_tokens)
        return generate(self.native, self.tokenizer, self.stop_ids, token_ids, prefix=prefix,
                        max_new_tokens=max_new_tokens, deadline_ms=deadline_ms, constraint=constraint,
                        drafts_from=drafts_from)

    def generate(self, prompt: str, max_new_tokens: int = 64, raw: bool = False, system: str | None = None,
                 deadline_ms: float | None = None, choices: Sequence[str] | None = None,
                 schema: Mapping[str, Any] | str | bytes | None = None,
                 drafts_from: Sequence[Sequence[int]] | None = None) -> GenerationResult:
        """Greedy answer to `prompt` (the user turn of the chat template unless raw); choices /
        schema constrain it (constraint()); drafts_from as for generate_ids."""
        t0 = time.perf_counter()
        constraint = self.constraint(choices, schema, max_new_tokens)
        ids = self.encode_prompt(prompt, raw=raw, system=system)
        tokenize_ms = (time.perf_counter() - t0) * 1e3
        return generate(self.native, self.tokenizer, self.stop_ids, ids, max_new_tokens=max_new_tokens,
                        deadline_ms=deadline_ms, t0=t0, stages_ms={TOKENIZE: tokenize_ms}, constraint=constraint,
                        drafts_from=drafts_from)

def load(model: str | os.PathLike[str] | None = None, threads: int | None = None, n_ctx: int = 2048,
         kv_type: str = "f32") -> TextModel:
    """Loads a GGUF text model (the default SmolLM2-135M-Instruct when model is None)."""
    return TextModel(model, threads=threads, n_ctx=n_ctx, kv_type=kv_type)
