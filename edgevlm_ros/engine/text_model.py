"""A llama-family text model: the native decoder plus the GGUF's own tokenizer and chat template."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .. import _engine
from . import optable, prefix_cache
from .chat_template import render_chat
from .paths import default_threads, resolve_model
from .tokenizer import Tokenizer

log = logging.getLogger("edgevlm")


@dataclass
class GenerationResult:
    """What one generation produced and how long each stage took."""

    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    timings_ms: dict[str, float]
    stop_reason: str
    tokens_per_s: float = 0.0
    cached_prefix_tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "prompt_token_ids": self.prompt_token_ids,
            "timings_ms": self.timings_ms,
            "tokens_per_s": self.tokens_per_s,
            "stop_reason": self.stop_reason,
            "cached_prefix_tokens": self.cached_prefix_tokens,
            **self.extra,
        }


@dataclass(frozen=True)
class PrefixState:
    """The KV cache after a fixed token prefix (e.g. a system prompt), restorable many times."""

    token_ids: tuple[int, ...]
    snapshot: Any  # _engine.KVSnapshot


class TextModel:
    """Load with `edgevlm_ros.load()`. Not thread-safe: one generation at a time."""

    def __init__(self, path: str | os.PathLike[str] | None = None, threads: int | None = None,
                 n_ctx: int = 2048, n_batch: int = 64) -> None:
        optable.ensure_active()
        self.path: Path = resolve_model(path)
        self.file = _engine.GGUFFile(str(self.path))
        self.metadata: dict[str, Any] = self.file.metadata()
        self.tokenizer = Tokenizer.from_gguf_metadata(self.metadata)
        self.native = _engine.LlamaModel(self.file, threads=threads or default_threads(), n_ctx=n_ctx, n_batch=n_batch)
        self.config: dict[str, Any] = self.native.config
        log.info("%s: kernels %s (operator table: %s)", self.path.name, self.native.variants(),
                 _engine.optable_source())
        if self.tokenizer.vocab_size > self.config["n_vocab"]:
            raise ValueError(
                f"bad GGUF file '{self.path}': tokenizer has {self.tokenizer.vocab_size} tokens "
                f"but the output head only {self.config['n_vocab']}"
            )
        self.chat_template: str | None = self.metadata.get("tokenizer.chat_template")
        self.stop_ids: list[int] = sorted(self.tokenizer.eot_ids)

    # -- prompts ---------------------------------------------------------------------------
    def chat_text(self, prompt: str, system: str | None = None) -> str:
        """The prompt as the user turn of the model's chat template, ready for the assistant."""
        messages = ([{"role": "system", "content": system}] if system is not None else [])
        messages.append({"role": "user", "content": prompt})
        bos = self._token_text(self.tokenizer.bos_id)
        eos = self._token_text(self.tokenizer.eos_id)
        return render_chat(self.chat_template, messages, add_generation_prompt=True, bos_token=bos, eos_token=eos)

    def encode_prompt(self, prompt: str, raw: bool = False, system: str | None = None) -> list[int]:
        """Token ids of a prompt. raw: the text as it is (BOS only if the GGUF asks for one)."""
        if raw:
            return self.tokenizer.encode(prompt)
        # The template writes any BOS it wants itself, so none is added on top.
        return self.tokenizer.encode(self.chat_text(prompt, system), add_bos=False)

    def _token_text(self, token_id: int | None) -> str:
        return self.tokenizer.id_to_token(token_id) if token_id is not None else ""

    # -- compute ---------------------------------------------------------------------------
    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Logits at every position of token_ids, computed on an empty cache: shape (n, vocab)."""
        self.native.reset()
        return self.native.forward(np.asarray(token_ids, dtype=np.int32), all_logits=True)

    def prefix(self, token_ids: Sequence[int]) -> PrefixState:
        """Runs a fixed prefix once and keeps its KV cache for generate_ids(prefix=...)."""
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
        key = prefix_cache.cache_key(self.path, ids)
        path = prefix_cache.cache_path(cache_dir, key)
        status = "built"
        if path.exists():
            try:
                cached_ids, snapshot = prefix_cache.load(path, key)
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

    def generate_ids(self, token_ids: Sequence[int], max_new_tokens: int = 64, prefix: PrefixState | None = None,
                     deadline_ms: float | None = None) -> GenerationResult:
        """Greedy generation after token_ids. With a prefix whose ids start token_ids, the cached
        KV state is restored and only the rest is prefilled."""
        t0 = time.perf_counter()
        ids = [int(t) for t in token_ids]
        if not ids:
            raise ValueError("empty prompt")
        cached = 0
        # The prefix is used only when the prompt extends it: the logits of the last prompt
        # token must come from this call, and the snapshot holds none.
        n_pre = len(prefix.token_ids) if prefix is not None else 0
        if prefix is not None and 0 < n_pre < len(ids) and tuple(ids[:n_pre]) == prefix.token_ids:
            self.native.restore(prefix.snapshot)
            cached = n_pre
        else:
            self.native.reset()
        rest = np.asarray(ids[cached:], dtype=np.int32)
        r = self.native.generate(rest, max_new_tokens, self.stop_ids, float(deadline_ms or 0.0))
        t1 = time.perf_counter()
        text = self.tokenizer.decode(r["tokens"], skip_special=True)
        t2 = time.perf_counter()
        n_gen = len(r["tokens"])
        decode_ms = r["decode_ms"]
        timings = {
            "prefill": r["prefill_ms"],
            "decode": decode_ms,
            "detokenize": (t2 - t1) * 1e3,
            "total": (t2 - t0) * 1e3,
        }
        # The first generated token comes from the prefill's logits: decode ran n_gen - 1 steps.
        steps = max(n_gen - 1, 0)
        tps = steps / (decode_ms / 1e3) if steps and decode_ms > 0 else 0.0
        return GenerationResult(text, list(r["tokens"]), ids, timings, r["stop_reason"], tps, cached)

    def generate(self, prompt: str, max_new_tokens: int = 64, raw: bool = False, system: str | None = None,
                 deadline_ms: float | None = None) -> GenerationResult:
        """Greedy answer to `prompt` (the user turn of the chat template unless raw)."""
        t0 = time.perf_counter()
        ids = self.encode_prompt(prompt, raw=raw, system=system)
        t1 = time.perf_counter()
        result = self.generate_ids(ids, max_new_tokens=max_new_tokens, deadline_ms=deadline_ms)
        result.timings_ms = {"tokenize": (t1 - t0) * 1e3, **result.timings_ms}
        result.timings_ms["total"] += result.timings_ms["tokenize"]
        return result


def load(model: str | os.PathLike[str] | None = None, threads: int | None = None, n_ctx: int = 2048) -> TextModel:
    """Loads a GGUF text model (the default SmolLM2-135M-Instruct when model is None)."""
    return TextModel(model, threads=threads, n_ctx=n_ctx)
