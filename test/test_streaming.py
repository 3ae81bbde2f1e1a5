"""Streaming the text so far (`describe(..., on_partial=, partial_every=)`, Decoder.progress): while
the native decoder runs, a helper thread hands out the text every N tokens; the token counts grow,
each partial text is the decoding of a prefix of the final tokens, the last call carries exactly
the final text, and streaming changes nothing in the result. The demo model, on its own frames."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from edgevlm_ros.demo.scenes import generate_scene, render_scene


@pytest.fixture(scope="module")
def vlm() -> Any:
    import edgevlm_ros
    from edgevlm_ros.demo.demo_model import resolve_pair

    return edgevlm_ros.load_vlm(*resolve_pair(None, None), threads=2)  # the embedded demo pair


@pytest.mark.parametrize("every", [1, 3])
def test_partial_text_grows_to_exactly_the_final_text(vlm: Any, every: int) -> None:
    rgb = render_scene(generate_scene(seed=11))
    plain = vlm.describe(rgb, max_new_tokens=24)
    calls: list[tuple[str, int, str]] = []

    def on_partial(text: str, tokens: int) -> None:
        calls.append((text, tokens, threading.current_thread().name))

    streamed = vlm.describe(rgb, max_new_tokens=24, on_partial=on_partial, partial_every=every)
    assert streamed.token_ids == plain.token_ids and streamed.text == plain.text
    assert calls[-1][:2] == (plain.text, len(plain.token_ids))
    during = calls[:-1]
    assert during, "no partial text while decoding"
    assert all(name == "edgevlm-stream" for _, _, name in during)
    counts = [n for _, n, _ in during]
    assert counts == sorted(set(counts)) and all(b - a >= every for a, b in zip([0, *counts], counts, strict=False))
    tok = vlm.text.tokenizer
    for text, n, _ in during:
        assert text == tok.decode(plain.token_ids[:n], skip_special=True)
    assert vlm.text.native.progress() == []  # nothing between calls


def test_a_failing_callback_does_not_end_the_generation(vlm: Any) -> None:
    rgb = render_scene(generate_scene(seed=12))
    plain = vlm.describe(rgb, max_new_tokens=16)
    seen = []

    def broken(text: str, tokens: int) -> None:
        seen.append(tokens)
        if len(seen) == 1:
            raise RuntimeError("a subscriber failed")

    streamed = vlm.describe(rgb, max_new_tokens=16, on_partial=broken, partial_every=1)
    assert streamed.text == plain.text and len(seen) >= 2
