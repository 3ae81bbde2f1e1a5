"""The one generation path (as gpt-fast's generate()): text requests and image descriptions both
restore the fixed prefix (one rule), prefill the rest with the image features at their slots, decode
greedily and time each stage. The prefill and the decode are one native call (Decoder.generate with a
Prompt): no embeddings or logits travel to Python and back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np

from .. import _engine
from .latency import DECODE, DETOKENIZE, PREFILL, TOTAL


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
    """The sequence state after a fixed token prefix (e.g. a system prompt), restorable many times."""

    token_ids: tuple[int, ...]
    snapshot: Any  # _engine.KVSnapshot, or None: no prefix kept


V = TypeVar("V")


class PromptCache(Generic[V]):
    """Encoded prompts by key (prompt text, and whatever else decides the encoding): the chat template
    is rendered and tokenized once per prompt, not once per request. A request loop asks one prompt or
    a few; past `size` distinct keys the cache starts over, so memory stays bounded."""

    def __init__(self, size: int = 64) -> None:
        self.size = size
        self._items: dict[Hashable, V] = {}

    def get(self, key: Hashable, encode: Callable[[], V]) -> V:
        if key not in self._items:
            if len(self._items) >= self.size:
                self._items.clear()
            self._items[key] = encode()
        return self._items[key]


def cached_length(ids: Sequence[int], prefix: PrefixState | None) -> int:
    """How many of ids the prefix state covers: all of the prefix when ids extend it, else 0.
    The prompt must go beyond the prefix: decoding starts from the logits of its last position,
    which the prefill computes and a snapshot does not hold."""
    if prefix is None or prefix.snapshot is None:
        return 0
    n = len(prefix.token_ids)
    return n if 0 < n < len(ids) and tuple(ids[:n]) == prefix.token_ids else 0


def generate(native: Any, tokenizer: Any, stop_ids: Sequence[int], ids: Sequence[int], *,
             prefix: PrefixState | None = None, features: np.ndarray | None = None,
             image_token_id: int | None = None, max_new_tokens: int = 64, deadline_ms: float | None = None,
             t0: float | None = None, stages_ms: Mapping[str, float] | None = None,
             constraint: Any = None, on_partial: Callable[[str, int], None] | None = None,
             partial_every: int = 0, drafts_from: Sequence[Sequence[int]] | None = None) -> GenerationResult:
    """Greedy generation after the prompt `ids`: restore the prefix state if ids extend it (else an
    empty sequence), prefill the rest with `features` rows at the positions of `image_token_id`,
    decode, detokenize.

    drafts_from: token ids of earlier answers (e.g. this camera's last descriptions): speculation
    drafts from them, and from n-grams of the prompt and of the answer so far, and verifies the
    drafts in decode-phase passes; the tokens are the same as without (the engine's
    Decoder.generate, `lookup`). An empty list: n-gram drafts only; None: no speculation. Ignored
    with a constraint.

    t0 (perf_counter seconds): when the request began, so that `total` and the deadline cover the
    stages done before (stages_ms: preprocess, vision, tokenize), which come first in timings_ms.
    constraint: an _engine.Choices (constraints.choice_constraint: the answer is one of them) or an
    _engine.JsonSchema (constraints.schema_constraint: the answer is JSON valid against the schema).
    on_partial(text so far, tokens so far): called from a helper thread every `partial_every` tokens
    while decoding runs (streaming), and once more with the final text, so the last call always
    carries exactly the result's text.
    """
    t0 = time.perf_counter() if t0 is None else t0
    ids = [int(t) for t in ids]
    if not ids:
        raise ValueError("empty prompt")
    if max_new_tokens < 0:
        raise ValueError("max_new_tokens must be >= 0")
    cached = cached_length(ids, prefix)
    rest = np.asarray(ids[cached:], dtype=np.int32)
    slots = None
    if features is not None:
        slots = np.flatnonzero(rest == image_token_id).astype(np.int64)
        if len(slots) != len(features):
            raise ValueError(f"prompt has {len(slots)} image tokens for {len(features)} image embeddings")
    request = _engine.Prompt(rest, features=features, slots=slots, prefix=prefix.snapshot if cached else None)
    budget = 0.0
    if deadline_ms is not None and deadline_ms > 0:  # the deadline covers the whole request
        budget = max(deadline_ms - (time.perf_counter() - t0) * 1e3, 1e-6)
    lookup = lookup_ids(drafts_from) if drafts_from is not None and constraint is None else None
    if on_partial is not None and partial_every > 0:
        with _Streamer(native, tokenizer, on_partial, partial_every):
            r = native.generate(request, max_new_tokens, list(stop_ids), budget, constraint, lookup)
    else:
        r = native.generate(request, max_new_tokens, list(stop_ids), budget, constraint, lookup)
    t1 = time.perf_counter()
    text = tokenizer.decode(r["tokens"], skip_special=True)
    t2 = time.perf_counter()
    timings = {
        **(stages_ms or {}),
        PREFILL: r["prefill_ms"],
        DECODE: r["decode_ms"],
        DETOKENIZE: (t2 - t1) * 1e3,
        TOTAL: (t2 - t0) * 1e3,
    }
    # The first generated token comes from the prefill's logits: decode ran n_gen - 1 steps.
    if on_partial is not None:
        on_partial(text, len(r["tokens"]))
    steps = max(len(r["tokens"]) - 1, 0)
    tps = steps / (r["decode_ms"] / 1e3) if steps and r["decode_ms"] > 0 else 0.0
    result = GenerationResult(text, list(r["tokens"]), ids, timings, r["stop_reason"], tps, cached)
    if lookup is not None:
        result.extra["speculation"] = {k: int(r[f"spec_{k}"]) for k in ("passes", "drafted", "accepted")}
    return result


# How many earlier answers speculation drafts from: the node keeps each camera's last this many
# descriptions, and `edgevlm bench --speculation` does the same.
DRAFT_HISTORY = 3


def lookup_ids(answers: Sequence[Sequence[int]]) -> list[int]:
    """The engine's speculation lookup: the answers' token ids, -1 between two."""
    out: list[int] = []
    for a in answers:
        if out:
            out.append(-1)
        out.extend(int(t) for t in a)
    return out


class _Streamer:
    """While a generate() runs (GIL released), the text so far goes to a callback each time `every`
    more tokens are out. One long-lived thread ("edgevlm-stream", _POLLER) polls every running
    stream, so callbacks always run on the same thread: a thread per generation would be cheap in
    Python, but a callback that publishes on ROS leaves the middleware's per-thread state behind
    each time (measured: +1.9 MiB per 1000 frames in the node's soak). The poll is a copy of a few
    ids every STREAM_POLL_S; the decoder pays one atomic store per token for it. After __exit__
    returns, the callback is not called any more (the final text comes after, in order)."""

    def __init__(self, native: Any, tokenizer: Any, callback: Callable[[str, int], None], every: int) -> None:
        self._native, self._tokenizer, self._callback, self._every = native, tokenizer, callback, every
        self._lock = threading.Lock()  # held while polling: __exit__ waits for a poll in progress
        self._open = False
        self._sent = 0

    def __enter__(self) -> _Streamer:
        self._open = True
        _POLLER.add(self)
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._open = False
        _POLLER.remove(self)

    def poll(self) -> None:
        with self._lock:
            if not self._open:
                return
            tokens = self._native.progress()
            if len(tokens) >= self._sent + self._every:
                self._sent = len(tokens)
                try:
                    self._callback(self._tokenizer.decode(tokens, skip_special=True), self._sent)
                except Exception:  # a subscriber's failure must not end the generation
                    pass


class _StreamPoller:
    """The one thread that polls every open _Streamer (started on first use, then kept)."""

    STREAM_POLL_S = 0.01

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._streams: list[_Streamer] = []
        self._thread: threading.Thread | None = None

    def add(self, stream: _Streamer) -> None:
        with self._cond:
            self._streams.append(stream)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="edgevlm-stream", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def remove(self, stream: _Streamer) -> None:
        with self._cond:
            self._streams.remove(stream)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._streams:
                    self._cond.wait()
                streams = list(self._streams)
            for stream in streams:
                stream.poll()
            # Hold no stream while idle: a stream keeps its decoder alive (a node's cleanup frees it).
            del streams, stream
            time.sleep(self.STREAM_POLL_S)


_POLLER = _StreamPoller()
