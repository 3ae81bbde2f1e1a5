"""One frame's work for the node, as plain functions (no node, no clock, no publisher): convert the
image message, describe it with the engine, and say what to report. The node's worker calls
`describe_frame()` and publishes what it returns; tests call it with any message-shaped object.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..engine.latency import REPORTED_STAGES, TOTAL
from ..engine.preprocess import ImageRefused
from . import frames
from .node_params import NodeParams

__all__ = ["FrameFailure", "FrameResult", "describe_frame", "describe_message", "report"]


class FrameFailure(Exception):
    """A frame that produced no description; the message says why, for the log and the diagnostic.
    in_engine: the engine failed (not the message), which is not worth reporting while stopping."""

    def __init__(self, message: str, in_engine: bool) -> None:
        super().__init__(message)
        self.in_engine = in_engine


@dataclass(frozen=True)
class FrameResult:
    """What the node publishes for a described frame."""

    text: str
    ms: dict[str, float]  # REPORTED_STAGES; the message conversion is in preprocess and total
    convert_ms: float
    tokens: int
    tokens_per_s: float
    stop_reason: str
    token_ids: tuple[int, ...] = ()
    drafts_accepted: int = 0  # tokens that came from speculation's drafts (0 without)

    @property
    def deadline_miss(self) -> bool:
        return self.stop_reason == "deadline"


def describe_message(msg: Any) -> str:
    """An image message in a few words (size and encoding, or format and bytes)."""
    if hasattr(msg, "encoding"):
        return f"{msg.width}x{msg.height} {msg.encoding}"
    return f"{msg.format or 'compressed'} ({len(msg.data)} bytes)"


def describe_frame(vlm: Any, msg: Any, p: NodeParams, prompt: str | None = None, max_new_tokens: int | None = None,
                   choices: Sequence[str] | None = None, schema: str | None = None,
                   on_partial: Callable[[str, int], None] | None = None,
                   drafts_from: Sequence[Sequence[int]] | None = None) -> FrameResult:
    """The description of one image message with the parameters p (a question overrides the prompt,
    the token budget and the constraint; on_partial streams the text so far every p.partial_every
    tokens, or every token when that is 0: the caller asked for a stream; drafts_from: earlier
    descriptions' token ids for speculative decoding). Raises FrameFailure."""
    t0 = time.perf_counter()
    try:
        rgb = frames.to_rgb(msg, p.max_image_pixels)
    except ValueError as exc:
        raise FrameFailure(f"bad image message ({describe_message(msg)}): {exc}", in_engine=False) from None
    convert_ms = (time.perf_counter() - t0) * 1e3
    try:
        constraint: dict[str, Any] = {"choices": choices} if choices else {}
        if schema:
            constraint["schema"] = schema
        result = vlm.describe(rgb, prompt or p.prompt, max_new_tokens or p.max_new_tokens, deadline_ms=p.deadline_ms,
                              max_image_pixels=p.max_image_pixels, on_partial=on_partial,
                              partial_every=p.partial_every or 1, drafts_from=drafts_from, **constraint)
    except ImageRefused as exc:  # refused before any encoding: the frame's size, not the engine
        raise FrameFailure(f"frame refused ({describe_message(msg)}): {exc}", in_engine=False) from None
    except Exception as exc:  # an engine failure is reported per frame, not fatal
        raise FrameFailure(f"engine failure on a {rgb.shape[1]}x{rgb.shape[0]} frame: {type(exc).__name__}: {exc}",
                           in_engine=True) from exc
    t = result.timings_ms
    ms = {stage: float(t.get(stage, math.nan)) for stage in REPORTED_STAGES}
    # The message-to-RGB conversion is part of this node's preprocessing and of its total.
    ms["preprocess"] += convert_ms
    ms[TOTAL] += convert_ms
    return FrameResult(result.text, ms, convert_ms, len(result.token_ids), float(result.tokens_per_s),
                       result.stop_reason, tuple(result.token_ids),
                       int(result.extra.get("speculation", {}).get("accepted", 0)))


def report(r: FrameResult, msg: Any, p: NodeParams, age_ms: float | None) -> tuple[str, str, list[tuple[str, Any]]]:
    """(level "ok" | "warn", message, key/values) of a described frame's diagnostic."""
    if r.deadline_miss:
        level = "warn"
        message = f"deadline of {p.deadline_ms:.0f} ms missed: published the text after {r.tokens} tokens"
    else:
        level = "ok"
        message = f"described in {r.ms[TOTAL]:.0f} ms ({r.tokens} tokens, {r.stop_reason})"
    values = [
        ("text", r.text),
        ("tokens", r.tokens),
        ("tokens_per_s", r.tokens_per_s),
        ("stop_reason", r.stop_reason),
        ("drafts_accepted", r.drafts_accepted),
        *((f"{stage}_ms", value) for stage, value in r.ms.items()),
        ("convert_ms", r.convert_ms),
        ("age_ms", math.nan if age_ms is None else age_ms),
        ("image", describe_message(msg)),
        ("frame_id", msg.header.frame_id),
    ]
    return level, message, values
