"""Constrained answers: `choices` makes the answer exactly one of the given strings (the native
ChoiceTrie over their token encodings; greedy among the allowed continuations, per token in native
code). Validation happens here, before anything runs, with one line saying what is wrong."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .. import _engine

MAX_CHOICES = 256
MAX_CHOICE_TOKENS = 64

__all__ = ["MAX_CHOICES", "MAX_CHOICE_TOKENS", "choice_constraint"]


def choice_constraint(tokenizer: Any, n_vocab: int, choices: Sequence[str]) -> Any:
    """An _engine.Choices for these strings, each encoded as the answer's text (no BOS); ValueError
    for no choices, a choice that is not a non-empty string or encodes to no tokens, too many, or
    too long. Duplicates count once."""
    if isinstance(choices, (str, bytes)) or not isinstance(choices, Sequence):
        raise ValueError(f"choices must be a list of strings, got {type(choices).__name__}")
    if not choices:
        raise ValueError("choices is empty: give at least one allowed answer")
    if len(choices) > MAX_CHOICES:
        raise ValueError(f"{len(choices)} choices, at most {MAX_CHOICES}")
    encoded: dict[tuple[int, ...], str] = {}
    for i, c in enumerate(choices):
        if not isinstance(c, str) or not c:
            raise ValueError(f"choice {i} must be a non-empty string, got {c!r}"[:200])
        ids = tuple(tokenizer.encode(c, add_bos=False, add_eos=False))
        if not ids:
            raise ValueError(f"choice {i} ({c!r}) encodes to no tokens"[:200])
        if len(ids) > MAX_CHOICE_TOKENS:
            raise ValueError(f"choice {i} is {len(ids)} tokens, at most {MAX_CHOICE_TOKENS}")
        encoded.setdefault(ids, c)
    return _engine.Choices([list(ids) for ids in encoded], n_vocab)
