"""Randomly initialised Hugging Face SmolVLM checkpoints, built offline, for converter and parity tests.

`make_random_smolvlm(dir)` writes a directory shaped exactly like a published SmolVLM-256M checkpoint
(config.json, model.safetensors in float32, tokenizer files, chat template, preprocessor config) whose
weights are random. The architecture and every shape match SmolVLM-256M-Instruct except the layer counts,
which are arguments so tests stay fast.

Weight initialisation (the choice matters: transformers' default std 0.02 gives a vision tower whose
attention is almost uniform and whose output hardly depends on the image, and a text model whose logits
are nearly flat):

* text decoder: every Linear and the embedding ~ N(0, 0.05²) — logits have a spread of a few units, so
  greedy decoding picks clear winners and the generated sequence is not one token repeated;
* vision tower and connector: every Linear, the patch convolution and the position embedding
  ~ N(0, 0.05²), biases ~ N(0, 0.02²) — attention scores then have a spread of O(1), so image features
  differ clearly between patches and between images;
* RMSNorm / LayerNorm weights 1 + N(0, 0.1²), LayerNorm biases ~ N(0, 0.02²), so a converter that
  drops or transposes a norm is caught.

The build is idempotent: a finished directory holds `.fixture.json` with the arguments it was made
with, and a second call with the same arguments returns at once.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GGUF_DIR = ROOT / "models"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FIXTURE_CACHE = ROOT / "build" / "test-fixtures"

# SmolVLM's chat template (HuggingFaceTB/SmolVLM-256M-Instruct).
SMOLVLM_CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

BASE_VOCAB = 49152
VOCAB_SIZE = 49280
GLOBAL_IMG_ID = 49152
FAKE_TOKEN_ID = 49189
IMAGE_TOKEN_ID = 49190
END_OF_UTTERANCE_ID = 49279

TEXT_STD = 0.05
VISION_STD = 0.05
BIAS_STD = 0.02
NORM_STD = 0.1

_MARKER = ".fixture.json"


def smolvlm_added_tokens() -> list[str]:
    """SmolVLM's added tokens in id order, from 49152 (`<global-img>`) to 49279 (`<end_of_utterance>`).

    The ids between `<image>` (49190) and `<end_of_utterance>` are filled with placeholders so the
    named tokens land on SmolVLM's ids.
    """
    tokens = ["<global-img>"]
    tokens += [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
    tokens += ["<fake_token_around_image>", "<image>"]
    n_fill = END_OF_UTTERANCE_ID - IMAGE_TOKEN_ID - 1
    tokens += [f"<|reserved_special_token_{i}|>" for i in range(n_fill)]
    tokens.append("<end_of_utterance>")
    assert len(tokens) == VOCAB_SIZE - BASE_VOCAB
    return tokens


def smolvlm_config(*, text_layers: int = 2, vision_layers: int = 2, image_size: int = 512,
                   patch_size: int = 16, scale_factor: int = 4) -> Any:
    """An `Idefics3Config` with SmolVLM-256M's shapes (layer counts and image size adjustable)."""
    from transformers import Idefics3Config

    text = {
        "model_type": "llama",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": text_layers,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
        "initializer_range": TEXT_STD,
    }
    vision = {
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_hidden_layers": vision_layers,
        "num_attention_heads": 12,
        "num_channels": 3,
        "image_size": image_size,
        "patch_size": patch_size,
        "layer_norm_eps": 1e-6,
        "hidden_act": "gelu_pytorch_tanh",
        "initializer_range": VISION_STD,
    }
    return Idefics3Config(
        text_config=text,
        vision_config=vision,
        scale_factor=scale_factor,
        image_token_id=IMAGE_TOKEN_ID,
        tie_word_embeddings=True,
    )


def _init_weights(model: Any) -> None:
    """Re-draws every parameter (see the module docstring for the distributions)."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            vision = ".vision_model." in name or ".connector." in name
            if "norm" in name and name.endswith(".weight"):
                p.normal_(1.0, NORM_STD)
            elif name.endswith(".bias"):
                p.normal_(0.0, BIAS_STD)
            else:
                p.normal_(0.0, VISION_STD if vision else TEXT_STD)


def _make_tokenizer() -> Any:
    """SmolLM2's tokenizer (from the local GGUF) extended with SmolVLM's added tokens."""
    from tokenizers import AddedToken, pre_tokenizers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(GGUF_DIR), gguf_file=GGUF_NAME)
    # transformers' GGUF import loses SmolLM2's digit splitting; restore the published pre-tokenizer.
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    added = [
        AddedToken(t, special=True, normalized=False, lstrip=False, rstrip=False, single_word=False)
        for t in smolvlm_added_tokens()
    ]
    tok.add_special_tokens({"additional_special_tokens": added}, replace_extra_special_tokens=False)
    if len(tok) != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {len(tok)} tokens, expected {VOCAB_SIZE}")
    for text, want in (("<global-img>", GLOBAL_IMG_ID), ("<row_1_col_1>", 49153), ("<row_6_col_6>", 49188),
                       ("<fake_token_around_image>", FAKE_TOKEN_ID), ("<image>", IMAGE_TOKEN_ID),
                       ("<end_of_utterance>", END_OF_UTTERANCE_ID)):
        got = tok.convert_tokens_to_ids(text)
        if got != want:
            raise RuntimeError(f"{text} has id {got}, expected {want}")
    # SmolVLM-256M-Instruct's special-token roles.
    tok.bos_token = "<|im_start|>"
    tok.eos_token = "<end_of_utterance>"
    tok.pad_token = "<|im_end|>"
    tok.unk_token = "<|endoftext|>"
    tok.chat_template = SMOLVLM_CHAT_TEMPLATE
    return tok


def _save_processor(out: Path, tok: Any, image_size: int, patch_size: int, scale_factor: int) -> None:
    from transformers import Idefics3ImageProcessorPil, Idefics3Processor

    image_processor = Idefics3ImageProcessorPil(
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        size={"longest_edge": 2048},
        max_image_size={"longest_edge": image_size},
        do_image_splitting=True,
    )
    image_seq_len = (image_size // patch_size) ** 2 // (scale_factor**2)
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tok, image_seq_len=image_seq_len,
                                  chat_template=SMOLVLM_CHAT_TEMPLATE)
    processor.save_pretrained(str(out))
    # transformers 5 nests the image processor inside processor_config.json; published SmolVLM
    # checkpoints (and llama.cpp's converter) also carry it as preprocessor_config.json.
    image_processor.save_pretrained(str(out))


def make_random_smolvlm(
    directory: str | Path,
    *,
    text_layers: int = 2,
    vision_layers: int = 2,
    seed: int = 0,
    image_size: int = 512,
    patch_size: int = 16,
    scale_factor: int = 4,
) -> Path:
    """Writes a random SmolVLM checkpoint to `directory` (created; replaced if incomplete) and returns it.

    Returns at once when `directory` already holds a complete checkpoint made with the same arguments.

    Contents: config.json, model.safetensors (float32), tokenizer.json, tokenizer_config.json,
    chat_template.jinja, preprocessor_config.json / processor_config.json.
    """
    out = Path(directory)
    args = {
        "text_layers": text_layers,
        "vision_layers": vision_layers,
        "seed": seed,
        "image_size": image_size,
        "patch_size": patch_size,
        "scale_factor": scale_factor,
        "text_std": TEXT_STD,
        "vision_std": VISION_STD,
        "version": 1,
    }

    def build(tmp: Path) -> None:
        from transformers import Idefics3ForConditionalGeneration

        config = smolvlm_config(text_layers=text_layers, vision_layers=vision_layers, image_size=image_size,
                                patch_size=patch_size, scale_factor=scale_factor)
        save_random_model(tmp, Idefics3ForConditionalGeneration, config, seed, _init_weights)
        tok = _make_tokenizer()
        tok.save_pretrained(str(tmp))
        _save_processor(tmp, tok, image_size, patch_size, scale_factor)

    return build_once(out, args, build)


def save_random_model(out: Path, model_class: Any, config: Any, seed: int,
                      init_weights: Callable[[Any], None]) -> None:
    """`model_class(config)` with its weights drawn by `init_weights` after seeding torch with
    `seed`, tied, saved to `out` in float32."""
    import torch

    torch.manual_seed(seed)
    model = model_class(config)
    init_weights(model)
    model.tie_weights()
    model.to(torch.float32)
    model.save_pretrained(str(out))


def build_once(out: Path, args: dict[str, Any], build: Callable[[Path], None]) -> Path:
    """`build(tmp)` fills a fresh folder that is renamed to `out`, unless `out` already holds a
    complete build made with `args` (its `.fixture.json`). The build happens next to the target and
    is renamed into place, so a concurrent or interrupted build never leaves a folder that looks
    complete but is not. Every fixture built into a cache folder goes through here."""
    if _is_complete(out, args):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.build-", dir=out.parent))
    tmp.chmod(0o755)
    try:
        build(tmp)
        (tmp / _MARKER).write_text(json.dumps(args))
        if _is_complete(out, args):  # another process finished first
            return out
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _is_complete(out: Path, args: dict[str, Any]) -> bool:
    marker = out / _MARKER
    try:
        return json.loads(marker.read_text()) == args
    except (OSError, json.JSONDecodeError):
        return False


def cached_random_smolvlm(**kwargs: Any) -> Path:
    """`make_random_smolvlm` into a cache folder under build/ named after the arguments (reused across runs)."""
    name = "smolvlm-random-" + "-".join(f"{k}{v}" for k, v in sorted(kwargs.items()))
    return make_random_smolvlm(FIXTURE_CACHE / name, **kwargs)


def load_hf_model(directory: str | Path) -> Any:
    """The saved checkpoint as transformers' `Idefics3ForConditionalGeneration`, float32, eval mode."""
    import torch
    from transformers import Idefics3ForConditionalGeneration

    model = Idefics3ForConditionalGeneration.from_pretrained(str(directory), dtype=torch.float32)
    model.eval()
    return model
