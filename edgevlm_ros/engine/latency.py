"""The latency stages of one request, named once for the engine API, the node, the demo and the
bench; and latency percentiles over a sliding window. Plain Python.

A frame's way (`VisionLanguageModel.describe`) runs the FRAME_STAGES in this order, and its
`timings_ms` has one entry per stage plus TOTAL (all of them, end to end). A text generation
(`TextModel.generate`) runs the TEXT_STAGES. The node publishes REPORTED_STAGES as
`latency/<stage>_ms` (with its frame conversion added to preprocess and total) and AGE, the
demo prints and summarises REPORTED_STAGES, and time to first token is FIRST_TOKEN_STAGES.
"""

from __future__ import annotations

import math
from collections import deque

__all__ = [
    "AGE",
    "DECODE",
    "DETOKENIZE",
    "FIRST_TOKEN_STAGES",
    "FRAME_STAGES",
    "PREFILL",
    "PREPROCESS",
    "REPORTED_STAGES",
    "TEXT_STAGES",
    "TOKENIZE",
    "TOTAL",
    "VISION",
    "LatencyWindow",
    "first_token_ms",
    "percentile",
]

PREPROCESS, VISION, TOKENIZE = "preprocess", "vision", "tokenize"  # before the generation path
PREFILL, DECODE, DETOKENIZE = "prefill", "decode", "detokenize"  # the generation path's own (generation.py)
FRAME_STAGES = (PREPROCESS, VISION, PREFILL, DECODE, DETOKENIZE)
TEXT_STAGES = (TOKENIZE, PREFILL, DECODE, DETOKENIZE)
TOTAL = "total"
# The detokenizer's fraction of a millisecond is left to TOTAL.
REPORTED_STAGES = (PREPROCESS, VISION, PREFILL, DECODE, TOTAL)
AGE = "age"  # from the image's header stamp to the publication of its description
# The first generated token comes from the prefill's logits: no decode step before it.
FIRST_TOKEN_STAGES = (PREPROCESS, VISION, PREFILL)


def first_token_ms(timings_ms: dict[str, float]) -> float:
    """Time to first token of a frame: the sum of its FIRST_TOKEN_STAGES."""
    return float(sum(timings_ms[stage] for stage in FIRST_TOKEN_STAGES))


def percentile(values: list[float] | tuple[float, ...], q: float) -> float:
    """The q-th percentile (0..100) of values, linear between closest ranks (numpy's default).

    NaN for no values.
    """
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile {q} is outside 0..100")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


class LatencyWindow:
    """The last `size` latencies (ms) and their percentiles. Not thread-safe: one owner."""

    def __init__(self, size: int = 200) -> None:
        if size < 1:
            raise ValueError(f"window size must be >= 1, got {size}")
        self._values: deque[float] = deque(maxlen=size)
        self.count = 0  # all values ever added, not only those in the window

    def add(self, value_ms: float) -> None:
        self._values.append(float(value_ms))
        self.count += 1

    def __len__(self) -> int:
        return len(self._values)

    def percentile(self, q: float) -> float:
        return percentile(tuple(self._values), q)

    @property
    def p50(self) -> float:
        return self.percentile(50.0)

    @property
    def p99(self) -> float:
        return self.percentile(99.0)
