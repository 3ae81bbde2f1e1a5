"""Constrained answers (`describe(..., choices=[...])`, native/constraint.*): the answer is exactly
one of the given strings, and it is the greedy one among the allowed continuations — checked
token by token against a Python reference that masks the same engine's full logits, on 6 frames of
the demo model's world; one choice a prefix of another; bad choices refused in one line.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from edgevlm_ros import _engine
from edgevlm_ros.demo.scenes import generate_scene, render_scene

N_FRAMES = 6


@pytest.fixture(scope="module")
def vlm() -> Any:
    import edgevlm_ros
    from edgevlm_ros.demo.demo_model import resolve_pair

    return edgevlm_ros.load_vlm(*resolve_pair(None, None), threads=2)  # the embedded demo pair


def _reference(vlm: Any, rgb: np.ndarray, prompt: str, choices: list[str]) -> list[int]:
    """Masked greedy from the engine's unconstrained logits, recomputed from scratch each step:
    among the trie's continuations (token order breaks ties), ending where a choice ends and a
    stop token's logit is at least the best continuation's."""
    tok = vlm.text.tokenizer
    seqs = [tok.encode(c, add_bos=False, add_eos=False) for c in choices]
    plan = vlm.images.plan(*rgb.shape[:2])
    pre, rest = vlm.prompt_ids(prompt, plan)
    ids = pre + rest
    feats = vlm.images.encode(vlm.vision, vlm.images.prepare(rgb, plan))
    slots = np.flatnonzero(np.asarray(ids) == vlm.image_token_id)
    native, out = vlm.text.native, []
    while True:
        live = [s for s in seqs if s[:len(out)] == out]
        nexts = sorted({s[len(out)] for s in live if len(s) > len(out)})
        ends = any(len(s) == len(out) for s in live)
        if not nexts:
            return out
        native.reset()
        logits = native.forward(np.asarray(ids + out, np.int32), features=feats, slots=slots)
        best = nexts[int(np.argmax(logits[nexts]))]
        if ends:
            stops = sorted(vlm.text.stop_ids)
            stop = stops[int(np.argmax(logits[stops]))]
            if logits[stop] > logits[best] or (logits[stop] == logits[best] and stop < best):
                return out
        out.append(best)


@pytest.mark.parametrize(("prompt", "choices"), [
    ("Is there a circle?", ["yes", "no"]),
    ("What colour is the largest object?", ["red", "green", "blue", "yellow", "white", "black", "orange",
                                             "purple"]),
    # One choice a prefix of another: ending competes with going on.
    ("Describe the image in one sentence.", ["A", "A red", "A red circle", "Two", "Three objects"]),
])
def test_answer_is_a_choice_and_the_masked_greedy_one(vlm: Any, prompt: str, choices: list[str]) -> None:
    seen = set()
    for i in range(N_FRAMES):
        rgb = render_scene(generate_scene(seed=77, index=i))
        r = vlm.describe(rgb, prompt, max_new_tokens=16, choices=choices)
        assert r.text in choices, (i, r.text)
        assert r.stop_reason in ("complete", "stop_token"), r.stop_reason
        assert r.token_ids == _reference(vlm, rgb, prompt, choices), (i, r.text)
        seen.add(r.text)
    print(f"{prompt!r}: answers {sorted(seen)}")


def test_unconstrained_answer_is_not_a_choice(vlm: Any) -> None:
    """The demo model describes; only the constraint makes it answer yes or no."""
    rgb = render_scene(generate_scene(seed=77, index=0))
    free = vlm.describe(rgb, "Is there a circle?", max_new_tokens=16)
    assert free.text not in ("yes", "no")
    assert vlm.describe(rgb, "Is there a circle?", max_new_tokens=16, choices=["yes", "no"]).text in ("yes", "no")


@pytest.mark.parametrize(("choices", "message"), [
    ([], "choices is empty"),
    (["yes", ""], "choice 1 must be a non-empty string"),
    (["yes", 3], "choice 1 must be a non-empty string"),
    ("yes", "choices must be a list of strings"),
    (["x" * 2000], "at most 64"),
    ([f"c{i}" for i in range(300)], "300 choices, at most 256"),
])
def test_bad_choices_refused_in_one_line(vlm: Any, choices: Any, message: str) -> None:
    rgb = render_scene(generate_scene(seed=77, index=0))
    with pytest.raises(ValueError) as err:
        vlm.describe(rgb, "Is there a circle?", max_new_tokens=16, choices=choices)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert vlm.describe(rgb, "Is there a circle?", max_new_tokens=4, choices=["yes", "no"]).text in ("yes", "no")


def test_budget_below_the_longest_choice_refused(vlm: Any) -> None:
    rgb = render_scene(generate_scene(seed=77, index=0))
    with pytest.raises(ValueError, match="fewer than the longest choice"):
        vlm.describe(rgb, "Describe.", max_new_tokens=1, choices=["A red circle"])


def test_native_trie_refuses_bad_sequences() -> None:
    with pytest.raises(ValueError, match="at least one"):
        _engine.Choices([], 10)
    with pytest.raises(ValueError, match="choice 1 has no tokens"):
        _engine.Choices([[1], []], 10)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        _engine.Choices([[1, 10]], 10)
    trie = _engine.Choices([[1, 2, 3], [1, 2], [4]], 10)
    assert (trie.n_nodes, trie.longest) == (5, 3)


def test_text_model_generate_takes_choices_and_schemas() -> None:
    """TextModel.generate (SmolLM2, no image) with choices answers one of them, with a schema valid
    JSON; the constraints are the same cached objects describe() uses (one place: TextModel.constraint)."""
    import json

    import jsonschema

    from edgevlm_ros.engine.text_model import load

    model = load(threads=2)
    r = model.generate("Is the sky blue? Answer yes or no.", max_new_tokens=8, choices=["yes", "no"])
    assert r.text in ("yes", "no") and r.stop_reason in ("complete", "stop_token")
    schema = {"type": "object", "properties": {"answer": {"type": "boolean"}, "why": {"type": "string",
                                                                                     "maxLength": 20}},
              "required": ["answer"]}
    r = model.generate("Is the sky blue? Reply in JSON.", max_new_tokens=64, schema=schema)
    jsonschema.validate(json.loads(r.text), schema)
    assert model.constraint(choices=["yes", "no"]) is model.constraint(choices=("yes", "no"))
    with pytest.raises(ValueError, match="not both"):
        model.generate("x", choices=["a"], schema=schema)
    with pytest.raises(ValueError, match="fewer than the longest choice"):
        model.generate("x", max_new_tokens=0, choices=["a b c d"])
