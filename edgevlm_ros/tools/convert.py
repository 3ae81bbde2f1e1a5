"""Hugging Face SmolVLM / Idefics3 checkpoint -> two GGUF files in llama.cpp's layouts.
(Qwen3.5 text decoders, MiniCPM-V 4.6's included, take the same command: tools/convert_qwen35.py.)

    edgevlm convert HF_DIR OUT_DIR [--type f32|f16|bf16|q8_0|q4_0|q4_1|q4_k_m|q5_k_m] [--name NAME]

writes `OUT_DIR/<name>-<type>.gguf` (the llama-family text decoder, with its tokenizer and chat
template) and `OUT_DIR/mmproj-<name>-<type>.gguf` (SigLIP vision tower + Idefics3 connector, clip
layout). Nothing is instantiated: config files are read as JSON and tensors one at a time from the
safetensors files, so peak memory is about one tensor plus its encoding.

Input checkpoint: config.json (`model_type` idefics3 or smolvlm, `text_config` of a llama model,
`vision_config`, `scale_factor`, `image_token_id`), model.safetensors or a sharded set listed by
model.safetensors.index.json (F32, F16 or BF16 weights), tokenizer.json + tokenizer_config.json
(+ chat_template.jinja / chat_template.json), preprocessor_config.json or processor_config.json.
Anything the engine could not run faithfully is refused with a ValueError that says what is wrong.

Tensor formats per `--type` (llama.cpp's choices where it has one):
* norms, biases: F32 always;
* the vision patch and position embeddings: F32 always (llama.cpp forces F32 for them);
* every other matrix: the requested type; rows whose length is not a multiple of 32 fall back to F16;
* q4_0 / q4_1: the output head (`output.weight`, or `token_embd.weight` when the head is tied to
  it) is written as Q8_0 — llama.cpp's quantizer keeps the head at a higher precision too;
* q4_k_m / q5_k_m: the text decoder is written as the K-quant mix `edgevlm quantize` writes (Q4_K or
  Q5_K, Q6_K for the head and some attn_v / ffn_down, Q5_0 / Q5_1 / Q8_0 for rows that are not whole
  256-blocks: tools/quant_mix.py); the mmproj's matrices as Q8_0 (llama.cpp's quantizer takes no
  mmproj file, and vision towers are shipped in F16 or Q8_0).

Text decoder q/k weights are permuted for the interleaved-pair ("normal") RoPE that llama GGUFs use
(Hugging Face rotates halves); the vision tower has no RoPE and is written as given.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..engine.tokenizer import PRE_TOKENIZER_REGEXES
from .gguf_writer import GGMLType, GGUFValueType, GGUFWriter
from .quant_mix import MIXES, TensorSpec, plan_types

__all__ = ["WEIGHT_TYPES", "convert", "convert_mmproj"]

log = logging.getLogger(__name__)

_K_MIXES = tuple(n for n, m in MIXES.items() if m.base != GGMLType.Q8_0)
# --type -> (tensor type of the matrices, general.file_type as llama.cpp's llama_ftype)
WEIGHT_TYPES: dict[str, tuple[GGMLType, int]] = {
    "f32": (GGMLType.F32, 0),
    "f16": (GGMLType.F16, 1),
    "bf16": (GGMLType.BF16, 32),  # LLAMA_FTYPE_MOSTLY_BF16: the checkpoints' own format (MiniCPM-V 4.6, Qwen3.5)
    "q8_0": (GGMLType.Q8_0, 7),
    "q4_0": (GGMLType.Q4_0, 2),
    "q4_1": (GGMLType.Q4_1, 3),
    **{n: (MIXES[n].base, MIXES[n].file_type) for n in _K_MIXES},  # q4_k_m, q5_k_m: base type of the mix
}

_MODEL_TYPES = ("idefics3", "smolvlm")
_TEXT_PREFIXES = ("model.text_model.", "model.language_model.")
_VISION_PREFIXES = ("model.vision_model.",)
_CONNECTOR = "model.connector.modality_projection.proj.weight"
_LM_HEAD = "lm_head.weight"
# Tanh-approximated GELU, which is what ggml_gelu (clip.use_gelu) computes.
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast")
_IGNORED = re.compile(r".*\.rotary_emb\.inv_freq$")
_DTYPES = ("F32", "F16", "BF16", "F64")  # safetensors dtypes we read


# -- reading the checkpoint -----------------------------------------------------------------------


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{what}: {path} is missing") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{what}: cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what}: {path} is not a JSON object")
    return data


def _require(cfg: Mapping[str, Any], key: str, where: str, kind: type | tuple[type, ...] = int) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ValueError(f"config.json: {where} has no {key!r}")
    value = cfg[key]
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if not ok:
        raise ValueError(f"config.json: {where}.{key} = {value!r} is not {getattr(kind, '__name__', kind)}")
    if kind is int and value <= 0:
        raise ValueError(f"config.json: {where}.{key} = {value} must be positive")
    return value


@dataclass(frozen=True)
class _TensorInfo:
    file: Path
    dtype: str  # safetensors dtype name: F32, F16, BF16, ...
    shape: tuple[int, ...]


class _SafeTensors:
    """The checkpoint's tensors by name: shapes and dtypes from the headers, data loaded on demand."""

    def __init__(self, hf_dir: Path) -> None:
        from safetensors import safe_open

        index = hf_dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = _read_json(index, "safetensors index").get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError(f"{index} has no weight_map")
            files = sorted({hf_dir / str(f) for f in weight_map.values()})
        elif (hf_dir / "model.safetensors").is_file():
            files = [hf_dir / "model.safetensors"]
        else:
            raise ValueError(f"{hf_dir} has no model.safetensors (nor model.safetensors.index.json)")
        self._safe_open = safe_open
        self.infos: dict[str, _TensorInfo] = {}
        for f in files:
            if not f.is_file():
                raise ValueError(f"safetensors shard {f} (listed in the index) is missing")
            try:
                with safe_open(str(f), framework="numpy") as st:
                    for name in st.keys():
                        sl = st.get_slice(name)
                        if name in self.infos:
                            first = self.infos[name].file.name
                            raise ValueError(f"tensor {name!r} is stored twice ({first}, {f.name})")
                        self.infos[name] = _TensorInfo(f, str(sl.get_dtype()), tuple(int(d) for d in sl.get_shape()))
            except ValueError:
                raise
            except Exception as exc:  # safetensors raises its own error types for corrupt headers
                raise ValueError(f"cannot read safetensors file {f}: {exc}") from None

    def __contains__(self, name: str) -> bool:
        return name in self.infos

    def shape(self, name: str) -> tuple[int, ...]:
        return self.infos[name].shape

    def load(self, name: str) -> np.ndarray:
        """The tensor as float32, numpy order."""
        info = self.infos[name]
        if info.dtype == "BF16":
            return _load_bf16(info.file, name)
        if info.dtype not in _DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {info.dtype}; supported: {', '.join(_DTYPES)}")
        with self._safe_open(str(info.file), framework="numpy") as st:
            return np.asarray(st.get_tensor(name), dtype=np.float32)

    def loader(self, name: str, transform: Callable[[np.ndarray], np.ndarray] | None = None
               ) -> Callable[[], np.ndarray]:
        def load() -> np.ndarray:
            x = self.load(name)
            return transform(x) if transform is not None else x

        return load


def _load_bf16(path: Path, name: str) -> np.ndarray:
    """A BF16 tensor read straight from the file (numpy has no bfloat16): upper halves of float32."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        begin, end = header[name]["data_offsets"]
        shape = tuple(header[name]["shape"])
        f.seek(8 + n + begin)
        raw = np.frombuffer(f.read(end - begin), dtype="<u2")
    return (raw.astype(np.uint32) << 16).view(np.float32).reshape(shape)


# -- hyper-parameters -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _TextParams:
    n_vocab: int
    n_embd: int
    n_ff: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ctx: int
    rope_theta: float
    rms_eps: float
    tied: bool


@dataclass(frozen=True)
class _VisionParams:
    image_size: int
    patch_size: int
    width: int
    n_ff: int
    n_layer: int
    n_head: int
    ln_eps: float
    scale_factor: int

    @property
    def n_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


def _rope_theta(tc: Mapping[str, Any]) -> float:
    params = tc.get("rope_parameters") or {}
    scaling = tc.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise ValueError("config.json: text_config rope_parameters / rope_scaling must be objects")
    rope_type = params.get("rope_type", params.get("type")) or scaling.get("rope_type", scaling.get("type"))
    if rope_type not in (None, "default"):
        raise ValueError(f"config.json: text_config uses RoPE scaling {rope_type!r}; only plain RoPE is supported")
    theta = params.get("rope_theta", tc.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise ValueError(f"config.json: text_config rope_theta = {theta!r} is not a positive number")
    return float(theta)


def _text_params(config: Mapping[str, Any]) -> _TextParams:
    tc = config.get("text_config")
    if not isinstance(tc, dict):
        raise ValueError("config.json has no 'text_config' object")
    if tc.get("model_type", "llama") != "llama":
        raise ValueError(f"config.json: text_config.model_type {tc.get('model_type')!r} is not supported (only llama)")
    w = "text_config"
    n_embd = _require(tc, "hidden_size", w)
    n_head = _require(tc, "num_attention_heads", w)
    n_head_kv = tc.get("num_key_value_heads") or n_head
    head_dim = tc.get("head_dim") or n_embd // n_head
    if not isinstance(n_head_kv, int) or n_head % n_head_kv:
        raise ValueError(f"config.json: text_config num_key_value_heads {n_head_kv!r} does not divide {n_head} heads")
    if not isinstance(head_dim, int) or head_dim % 2:
        raise ValueError(f"config.json: text_config head_dim {head_dim!r} must be an even integer")
    act = tc.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json: text_config.hidden_act {act!r} is not supported (llama uses silu)")
    for flag in ("attention_bias", "mlp_bias"):
        if tc.get(flag):
            raise ValueError(f"config.json: text_config.{flag} is true; biases are not part of the llama layout")
    return _TextParams(
        n_vocab=_require(tc, "vocab_size", w),
        n_embd=n_embd,
        n_ff=_require(tc, "intermediate_size", w),
        n_layer=_require(tc, "num_hidden_layers", w),
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        n_ctx=_require(tc, "max_position_embeddings", w),
        rope_theta=_rope_theta(tc),
        rms_eps=float(_require(tc, "rms_norm_eps", w, float)),
        tied=False,  # decided with the tensors at hand: _tied_head
    )


def _vision_params(config: Mapping[str, Any]) -> _VisionParams:
    vc = config.get("vision_config")
    if not isinstance(vc, dict):
        raise ValueError("config.json has no 'vision_config' object")
    w = "vision_config"
    p = _VisionParams(
        image_size=_require(vc, "image_size", w),
        patch_size=_require(vc, "patch_size", w),
        width=_require(vc, "hidden_size", w),
        n_ff=_require(vc, "intermediate_size", w),
        n_layer=_require(vc, "num_hidden_layers", w),
        n_head=_require(vc, "num_attention_heads", w),
        # transformers' default for Idefics3 / SmolVLM vision configs
        ln_eps=float(vc.get("layer_norm_eps", 1e-6)),
        scale_factor=_require(config, "scale_factor", "the top level"),
    )
    if vc.get("num_channels", 3) != 3:
        raise ValueError(f"config.json: vision_config.num_channels {vc['num_channels']} is not 3")
    act = vc.get("hidden_act", "gelu_pytorch_tanh")
    if act not in _GELU_TANH:
        raise ValueError(f"config.json: vision_config.hidden_act {act!r} is not supported (tanh GELU only)")
    if p.image_size % p.patch_size:
        raise ValueError(f"config.json: image_size {p.image_size} is not a multiple of patch_size {p.patch_size}")
    if (p.image_size // p.patch_size) % p.scale_factor:
        raise ValueError(f"config.json: {p.image_size // p.patch_size} patches per side are not divisible by "
                         f"scale_factor {p.scale_factor}")
    if p.width % p.n_head:
        raise ValueError(f"config.json: vision hidden_size {p.width} is not divisible by {p.n_head} heads")
    return p


def _preprocessor(hf_dir: Path) -> dict[str, Any]:
    pre = hf_dir / "preprocessor_config.json"
    proc = hf_dir / "processor_config.json"
    if pre.is_file():
        cfg = _read_json(pre, "preprocessor config")
    elif proc.is_file():
        cfg = _read_json(proc, "processor config").get("image_processor")
        if not isinstance(cfg, dict):
            raise ValueError(f"{proc} has no 'image_processor' object")
    else:
        raise ValueError(f"{hf_dir} has no preprocessor_config.json (nor processor_config.json)")
    for key in ("image_mean", "image_std"):
        v = cfg.get(key)
        if not (isinstance(v, list) and len(v) == 3 and all(isinstance(x, (int, float)) for x in v)):
            raise ValueError(f"image processor config: {key} must be 3 numbers, got {v!r}")
    return cfg


def _longest_edge(cfg: Mapping[str, Any], key: str) -> int | None:
    v = cfg.get(key)
    if v is None:
        return None
    edge = v.get("longest_edge") if isinstance(v, dict) else v
    if isinstance(edge, bool) or not isinstance(edge, int) or edge <= 0:
        raise ValueError(f"image processor config: {key}.longest_edge = {edge!r} is not a positive integer")
    return edge


# -- tokenizer ------------------------------------------------------------------------------------


def _classify_pre_tokenizer(pre: Any) -> str:
    """tokenizer.json pre_tokenizer -> tokenizer.ggml.pre."""

    def is_bytelevel(p: Any) -> bool:
        return (isinstance(p, dict) and p.get("type") == "ByteLevel" and not p.get("add_prefix_space", False)
                and p.get("use_regex", True))

    def is_split(p: Any, pattern: str) -> bool:
        return (isinstance(p, dict) and p.get("type") == "Split" and p.get("pattern") == {"Regex": pattern}
                and p.get("behavior") == "Isolated" and not p.get("invert", False))

    if is_bytelevel(pre):
        return "gpt2"
    if isinstance(pre, dict) and pre.get("type") == "Sequence":
        seq = pre.get("pretokenizers") or []
        if (len(seq) == 2 and isinstance(seq[0], dict) and seq[0].get("type") == "Digits"
                and seq[0].get("individual_digits") is True and is_bytelevel(seq[1])):
            return "smollm"
        if (len(seq) == 2 and is_split(seq[0], PRE_TOKENIZER_REGEXES["qwen35"]) and isinstance(seq[1], dict)
                and seq[1].get("type") == "ByteLevel" and not seq[1].get("add_prefix_space", False)
                and seq[1].get("use_regex") is False):
            return "qwen35"
    raise ValueError(
        "tokenizer.json: unsupported pre-tokenizer "
        f"{json.dumps(pre)[:200]}; supported: ByteLevel(add_prefix_space=false) ('gpt2'), "
        "Sequence[Digits(individual_digits=true), ByteLevel(add_prefix_space=false)] ('smollm') or "
        "Sequence[Split(Qwen3.5's regex, isolated), ByteLevel(use_regex=false)] ('qwen35')"
    )


# The normalizer each pre type's tokenizer.json carries (none elsewhere).
_NORMALIZERS = {"qwen35": {"type": "NFC"}}


def _looks_special(text: str) -> bool:
    """llama.cpp's converter stores an added token that reads like a control token ("<|...|>") as
    one, whatever tokenizer.json's `special` says (e.g. Qwen's <|fim_prefix|>)."""
    return text.startswith("<|") and text.endswith("|>")


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _chat_template(hf_dir: Path, tok_cfg: Mapping[str, Any]) -> str | None:
    jinja = hf_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    candidates: list[Any] = []
    js = hf_dir / "chat_template.json"
    if js.is_file():
        candidates.append(_read_json(js, "chat template").get("chat_template"))
    candidates.append(tok_cfg.get("chat_template"))
    for c in candidates:
        if isinstance(c, str) and c:
            return c
        if isinstance(c, list):  # named templates: use the default one
            named = {t.get("name"): t.get("template") for t in c if isinstance(t, dict)}
            if isinstance(named.get("default"), str):
                return named["default"]
    return None


@dataclass
class _Vocab:
    tokens: list[str]
    types: list[int]
    merges: list[str]
    pre: str
    special_ids: dict[str, int]
    add_bos: bool
    add_eos: bool
    chat_template: str | None


def _post_processor_adds(post: Any) -> tuple[bool, bool]:
    """(adds a token before, adds a token after) the sequence in a TemplateProcessing post-processor."""
    if not isinstance(post, dict) or post.get("type") != "TemplateProcessing":
        return False, False
    single = post.get("single") or []
    kinds = ["Sequence" if isinstance(s, dict) and "Sequence" in s else "Special" for s in single]
    if "Sequence" not in kinds:
        return False, False
    i = kinds.index("Sequence")
    return "Special" in kinds[:i], "Special" in kinds[i + 1 :]


def _read_vocab(hf_dir: Path, config: Mapping[str, Any], n_vocab: int) -> _Vocab:
    tj = _read_json(hf_dir / "tokenizer.json", "tokenizer")
    tok_cfg_path = hf_dir / "tokenizer_config.json"
    tok_cfg = _read_json(tok_cfg_path, "tokenizer config") if tok_cfg_path.is_file() else {}
    model = tj.get("model")
    if not isinstance(model, dict) or model.get("type") != "BPE":
        raise ValueError("tokenizer.json: only byte-level BPE tokenizers are supported "
                         f"(model type {model.get('type') if isinstance(model, dict) else None!r})")
    if model.get("byte_fallback"):
        raise ValueError("tokenizer.json: BPE with byte_fallback is not byte-level BPE; not supported")
    pre = _classify_pre_tokenizer(tj.get("pre_tokenizer"))
    if tj.get("normalizer") != _NORMALIZERS.get(pre):
        normalizer = tj.get("normalizer")
        kind = normalizer.get("type") if isinstance(normalizer, dict) else normalizer
        raise ValueError(f"tokenizer.json: a normalizer ({kind}) is not supported with pre-tokenizer {pre!r}")

    by_id: dict[int, str] = {}
    vocab = model.get("vocab")
    if not isinstance(vocab, dict):
        raise ValueError("tokenizer.json: model.vocab is missing")
    for text, i in vocab.items():
        if not isinstance(i, int) or i < 0 or i in by_id:
            raise ValueError(f"tokenizer.json: bad or duplicate id {i!r} for token {text!r}")
        by_id[i] = text
    added_special: dict[int, bool] = {}
    stripping: list[str] = []
    for entry in tj.get("added_tokens") or []:
        i, text = entry.get("id"), entry.get("content")
        if not isinstance(i, int) or i < 0 or not isinstance(text, str):
            raise ValueError(f"tokenizer.json: bad added token {entry!r}")
        if by_id.get(i, text) != text:
            raise ValueError(f"tokenizer.json: id {i} is both {by_id[i]!r} and added token {text!r}")
        by_id[i] = text
        added_special[i] = bool(entry.get("special", False)) or _looks_special(text)
        if entry.get("lstrip") or entry.get("rstrip") or entry.get("single_word"):
            stripping.append(text)
    if stripping:
        # GGUF has no field for these matching rules (llama.cpp drops them too): text around such a
        # token may tokenize differently from transformers.
        log.warning("added tokens with lstrip/rstrip/single_word lose that rule in GGUF: %s", ", ".join(stripping))
    if not by_id:
        raise ValueError("tokenizer.json: the vocabulary is empty")
    if max(by_id) >= n_vocab:
        raise ValueError(f"tokenizer has token id {max(by_id)} but the model has only {n_vocab} embedding rows")

    tokens: list[str] = []
    types: list[int] = []
    for i in range(n_vocab):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(5)  # unused
        elif i in added_special:
            tokens.append(by_id[i])
            types.append(3 if added_special[i] else 4)  # control / user-defined
        else:
            tokens.append(by_id[i])
            types.append(1)  # normal
    if len(set(tokens)) != len(tokens):
        raise ValueError("tokenizer: the vocabulary contains duplicate token texts")

    merges: list[str] = []
    for m in model.get("merges") or []:
        pair = m.split(" ") if isinstance(m, str) else m
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(p, str) and p and " " not in p
                                                                  for p in pair)):
            raise ValueError(f"tokenizer.json: merge {m!r} is not a pair of space-free tokens")
        merges.append(f"{pair[0]} {pair[1]}")

    ids = {t: i for i, t in enumerate(tokens)}
    tc = config.get("text_config") or {}
    special_ids: dict[str, int] = {}
    # GGUF role -> (tokenizer_config.json key, config.json key)
    roles = {"bos": ("bos_token", "bos_token_id"), "eos": ("eos_token", "eos_token_id"),
             "unknown": ("unk_token", "unk_token_id"), "padding": ("pad_token", "pad_token_id")}
    for role, (tok_key, cfg_key) in roles.items():
        text = _token_text(tok_cfg.get(tok_key))
        if text is not None:
            if text not in ids:
                raise ValueError(f"tokenizer_config.json: {role} token {text!r} is not in the vocabulary")
            special_ids[role] = ids[text]
            continue
        fallback = tc.get(cfg_key, config.get(cfg_key))
        if isinstance(fallback, list):
            fallback = fallback[0] if fallback else None
        if isinstance(fallback, int) and not isinstance(fallback, bool) and 0 <= fallback < n_vocab:
            special_ids[role] = fallback

    pp_bos, pp_eos = _post_processor_adds(tj.get("post_processor"))
    add_bos = tok_cfg.get("add_bos_token")
    add_eos = tok_cfg.get("add_eos_token")
    return _Vocab(
        tokens=tokens,
        types=types,
        merges=merges,
        pre=pre,
        special_ids=special_ids,
        add_bos=bool(pp_bos if add_bos is None else add_bos),
        add_eos=bool(pp_eos if add_eos is None else add_eos),
        chat_template=_chat_template(hf_dir, tok_cfg),
    )


# -- tensor plans ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Planned:
    gguf_name: str
    hf_name: str
    shape: tuple[int, ...]
    wtype: GGMLType
    transform: Callable[[np.ndarray], np.ndarray] | None = None


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Rows of a q/k projection reordered from Hugging Face's rotate-half RoPE pairing to the
    interleaved-pair pairing of llama GGUFs (llama.cpp's converter does the same)."""
    head_dim = w.shape[0] // n_head
    return w.reshape(n_head, 2, head_dim // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tied_head(config: Mapping[str, Any], st: _SafeTensors) -> bool:
    """Whether the output head is the token embedding (then no output.weight is written).

    The top-level `tie_word_embeddings` decides, as in transformers 5; when it is absent, the text
    config's. A checkpoint without `lm_head.weight` can only be tied.
    """
    tc = config.get("text_config") or {}
    flag = config.get("tie_word_embeddings", tc.get("tie_word_embeddings"))
    if _LM_HEAD not in st:
        if flag is False and not tc.get("tie_word_embeddings"):
            raise ValueError(f"checkpoint is missing tensor {_LM_HEAD!r} and config.json says the output head "
                             "is not tied to the embeddings (tie_word_embeddings false)")
        return True
    return bool(flag)


def _find_prefix(st: _SafeTensors, prefixes: Sequence[str], probe: str, what: str) -> str:
    for p in prefixes:
        if p + probe in st:
            return p
    raise ValueError(f"checkpoint is missing tensor {prefixes[0] + probe!r} ({what})")


def _check_planned(st: _SafeTensors, plan: list[_Planned]) -> None:
    for p in plan:
        if p.hf_name not in st:
            raise ValueError(f"checkpoint is missing tensor {p.hf_name!r} (for {p.gguf_name})")
        if st.shape(p.hf_name) != p.shape:
            raise ValueError(f"tensor {p.hf_name!r} has shape {list(st.shape(p.hf_name))}, "
                             f"config.json implies {list(p.shape)}")
        if st.infos[p.hf_name].dtype not in _DTYPES:
            raise ValueError(f"tensor {p.hf_name!r} has dtype {st.infos[p.hf_name].dtype}; "
                             f"supported: {', '.join(_DTYPES)}")


def _matrix_type(wtype: GGMLType, shape: Sequence[int]) -> GGMLType:
    return GGMLType.F32 if len(shape) == 1 else wtype


def _text_plan(st: _SafeTensors, tp: _TextParams, wtype: GGMLType) -> list[_Planned]:
    pre = _find_prefix(st, _TEXT_PREFIXES, "embed_tokens.weight", "text decoder embeddings")
    head_wtype = GGMLType.Q8_0 if wtype in (GGMLType.Q4_0, GGMLType.Q4_1) else wtype
    q_out, kv_out = tp.n_head * tp.head_dim, tp.n_head_kv * tp.head_dim
    plan = [
        _Planned("token_embd.weight", pre + "embed_tokens.weight", (tp.n_vocab, tp.n_embd),
                 head_wtype if tp.tied else wtype),
    ]
    for i in range(tp.n_layer):
        lp = f"{pre}layers.{i}."
        b = f"blk.{i}."
        plan += [
            _Planned(b + "attn_norm.weight", lp + "input_layernorm.weight", (tp.n_embd,), GGMLType.F32),
            _Planned(b + "attn_q.weight", lp + "self_attn.q_proj.weight", (q_out, tp.n_embd), wtype,
                     lambda w: permute_qk(w, tp.n_head)),
            _Planned(b + "attn_k.weight", lp + "self_attn.k_proj.weight", (kv_out, tp.n_embd), wtype,
                     lambda w: permute_qk(w, tp.n_head_kv)),
            _Planned(b + "attn_v.weight", lp + "self_attn.v_proj.weight", (kv_out, tp.n_embd), wtype),
            _Planned(b + "attn_output.weight", lp + "self_attn.o_proj.weight", (tp.n_embd, q_out), wtype),
            _Planned(b + "ffn_norm.weight", lp + "post_attention_layernorm.weight", (tp.n_embd,), GGMLType.F32),
            _Planned(b + "ffn_gate.weight", lp + "mlp.gate_proj.weight", (tp.n_ff, tp.n_embd), wtype),
            _Planned(b + "ffn_up.weight", lp + "mlp.up_proj.weight", (tp.n_ff, tp.n_embd), wtype),
            _Planned(b + "ffn_down.weight", lp + "mlp.down_proj.weight", (tp.n_embd, tp.n_ff), wtype),
        ]
    plan.append(_Planned("output_norm.weight", pre + "norm.weight", (tp.n_embd,), GGMLType.F32))
    if not tp.tied:
        plan.append(_Planned("output.weight", _LM_HEAD, (tp.n_vocab, tp.n_embd), head_wtype))
    _check_planned(st, plan)
    return plan


def _mixed(plan: list[_Planned], wtype: str, n_layer: int) -> list[_Planned]:
    """The plan's types as the K-quant mix `wtype` chooses them (the same rules as edgevlm quantize)."""
    types = plan_types([TensorSpec(p.gguf_name, p.shape, GGMLType.F32) for p in plan], wtype, n_layer)
    return [dataclasses.replace(p, wtype=types[p.gguf_name]) for p in plan]


def _vision_type(wtype: str, matrix_type: GGMLType) -> GGMLType:
    """The mmproj's matrix type: Q8_0 for a K-quant mix (see the module docstring), else as asked."""
    return GGMLType.Q8_0 if wtype in _K_MIXES else matrix_type


def siglip_layers_plan(prefix: str, vp: _VisionParams, wtype: GGMLType) -> list[_Planned]:
    """The SigLIP encoder layers `<prefix><i>.` -> `v.blk.<i>.` (shared with convert_minicpmv.py)."""
    w, ff = vp.width, vp.n_ff
    plan: list[_Planned] = []
    for i in range(vp.n_layer):
        lp = f"{prefix}{i}."
        b = f"v.blk.{i}."
        pairs = [
            ("attn_q", "self_attn.q_proj", (w, w)),
            ("attn_k", "self_attn.k_proj", (w, w)),
            ("attn_v", "self_attn.v_proj", (w, w)),
            ("attn_out", "self_attn.out_proj", (w, w)),
            ("ln1", "layer_norm1", (w,)),
            ("ln2", "layer_norm2", (w,)),
            ("ffn_up", "mlp.fc1", (ff, w)),
            ("ffn_down", "mlp.fc2", (w, ff)),
        ]
        for g, h, shape in pairs:
            plan.append(_Planned(f"{b}{g}.weight", f"{lp}{h}.weight", shape, _matrix_type(wtype, shape)))
            plan.append(_Planned(f"{b}{g}.bias", f"{lp}{h}.bias", (shape[0],), GGMLType.F32))
    return plan


def _vision_plan(st: _SafeTensors, vp: _VisionParams, n_embd_text: int, wtype: GGMLType) -> list[_Planned]:
    pre = _find_prefix(st, _VISION_PREFIXES, "embeddings.patch_embedding.weight", "vision patch embedding")
    w = vp.width
    plan = [
        _Planned("v.patch_embd.weight", pre + "embeddings.patch_embedding.weight",
                 (w, 3, vp.patch_size, vp.patch_size), GGMLType.F32),
        _Planned("v.patch_embd.bias", pre + "embeddings.patch_embedding.bias", (w,), GGMLType.F32),
        _Planned("v.position_embd.weight", pre + "embeddings.position_embedding.weight", (vp.n_patches, w),
                 GGMLType.F32),
    ]
    plan += siglip_layers_plan(f"{pre}encoder.layers.", vp, wtype)
    plan += [
        _Planned("v.post_ln.weight", pre + "post_layernorm.weight", (w,), GGMLType.F32),
        _Planned("v.post_ln.bias", pre + "post_layernorm.bias", (w,), GGMLType.F32),
        _Planned("mm.model.fc.weight", _CONNECTOR, (n_embd_text, w * vp.scale_factor**2), wtype),
    ]
    _check_planned(st, plan)
    return plan


# -- writing --------------------------------------------------------------------------------------


def _add_tensors(writer: GGUFWriter, st: _SafeTensors, plan: list[_Planned]) -> None:
    for p in plan:
        writer.add_tensor(p.gguf_name, st.loader(p.hf_name, p.transform), p.wtype, shape=p.shape)


def add_bpe_vocab(w: GGUFWriter, vocab: _Vocab) -> None:
    """The byte-level BPE vocabulary's keys: model, pre type, tokens, types, merges, special ids."""
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", vocab.pre)
    w.add_array("tokenizer.ggml.tokens", vocab.tokens, GGUFValueType.STRING)
    w.add_array("tokenizer.ggml.token_type", vocab.types, GGUFValueType.INT32)
    w.add_array("tokenizer.ggml.merges", vocab.merges, GGUFValueType.STRING)
    for role, i in vocab.special_ids.items():
        w.add_uint32(f"tokenizer.ggml.{role}_token_id", i)


def _text_writer(name: str, file_type: int, quantized: bool, tp: _TextParams, vocab: _Vocab) -> GGUFWriter:
    w = GGUFWriter()
    w.add_string("general.architecture", "llama")
    w.add_string("general.type", "model")
    w.add_string("general.name", name)
    w.add_uint32("general.file_type", file_type)
    if quantized:
        w.add_uint32("general.quantization_version", 2)
    w.add_uint32("llama.vocab_size", tp.n_vocab)
    w.add_uint32("llama.context_length", tp.n_ctx)
    w.add_uint32("llama.embedding_length", tp.n_embd)
    w.add_uint32("llama.feed_forward_length", tp.n_ff)
    w.add_uint32("llama.block_count", tp.n_layer)
    w.add_uint32("llama.attention.head_count", tp.n_head)
    w.add_uint32("llama.attention.head_count_kv", tp.n_head_kv)
    w.add_float32("llama.rope.freq_base", tp.rope_theta)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", tp.rms_eps)
    w.add_uint32("llama.rope.dimension_count", tp.head_dim)
    if tp.head_dim * tp.n_head != tp.n_embd:
        w.add_uint32("llama.attention.key_length", tp.head_dim)
        w.add_uint32("llama.attention.value_length", tp.head_dim)
    add_bpe_vocab(w, vocab)
    w.add_bool("tokenizer.ggml.add_bos_token", vocab.add_bos)
    w.add_bool("tokenizer.ggml.add_eos_token", vocab.add_eos)
    w.add_bool("tokenizer.ggml.add_space_prefix", False)
    if vocab.chat_template is not None:
        w.add_string("tokenizer.chat_template", vocab.chat_template)
    return w


def _mmproj_writer(name: str, file_type: int, quantized: bool, vp: _VisionParams, n_embd_text: int,
                   pre: Mapping[str, Any], projector: str = "idefics3") -> GGUFWriter:
    w = GGUFWriter()
    w.add_string("general.architecture", "clip")
    w.add_string("general.type", "mmproj")
    w.add_string("general.name", name)
    w.add_uint32("general.file_type", file_type)
    if quantized:
        w.add_uint32("general.quantization_version", 2)
    w.add_bool("clip.has_vision_encoder", True)
    w.add_bool("clip.has_text_encoder", False)
    w.add_string("clip.projector_type", projector)
    w.add_bool("clip.use_gelu", True)
    w.add_uint32("clip.vision.image_size", vp.image_size)
    w.add_uint32("clip.vision.patch_size", vp.patch_size)
    w.add_uint32("clip.vision.embedding_length", vp.width)
    w.add_uint32("clip.vision.feed_forward_length", vp.n_ff)
    w.add_uint32("clip.vision.block_count", vp.n_layer)
    w.add_uint32("clip.vision.attention.head_count", vp.n_head)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", vp.ln_eps)
    w.add_uint32("clip.vision.projection_dim", n_embd_text)
    w.add_array("clip.vision.image_mean", [float(x) for x in pre["image_mean"]], GGUFValueType.FLOAT32)
    w.add_array("clip.vision.image_std", [float(x) for x in pre["image_std"]], GGUFValueType.FLOAT32)
    w.add_uint32("clip.vision.projector.scale_factor", vp.scale_factor)
    w.add_uint32("clip.vision.preproc_image_size", _longest_edge(pre, "size") or vp.image_size)
    return w


def _safe_name(name: str) -> str:
    cleaned = re.sub(r"[^A-Za-z0-9._+-]+", "-", name).strip("-.")
    if not cleaned:
        raise ValueError(f"model name {name!r} gives an empty file name")
    return cleaned


def _open_checkpoint(hf_dir: str | Path, wtype: str) -> tuple[Path, GGMLType, int, bool, dict[str, Any]]:
    """The checks every conversion starts with: (folder, matrix type, file type, quantized?, config)."""
    hf = Path(hf_dir)
    if not hf.is_dir():
        raise ValueError(f"{hf} is not a directory")
    if wtype not in WEIGHT_TYPES:
        raise ValueError(f"unknown weight type {wtype!r} (choose from {', '.join(WEIGHT_TYPES)})")
    matrix_type, file_type = WEIGHT_TYPES[wtype]
    quantized = matrix_type not in (GGMLType.F32, GGMLType.F16)
    config = _read_json(hf / "config.json", "model config")
    model_type = config.get("model_type")
    if model_type not in _MODEL_TYPES:
        supported = ", ".join(_MODEL_TYPES)
        raise ValueError(f"config.json: model_type {model_type!r} is not supported (supported: {supported})")
    return hf, matrix_type, file_type, quantized, config


def _checkpoint_params(hf: Path, config: dict[str, Any]) -> tuple[_TextParams, _VisionParams, dict[str, Any]]:
    """Text and vision parameters and the image processor config, the tile size checked."""
    tp = _text_params(config)
    vp = _vision_params(config)
    pre = _preprocessor(hf)
    tile = _longest_edge(pre, "max_image_size")
    if tile is not None and tile != vp.image_size:
        raise ValueError(f"image processor tile size (max_image_size.longest_edge) {tile} differs from the "
                         f"vision tower's image_size {vp.image_size}; not supported")
    return tp, vp, pre


def convert(hf_dir: str | Path, out_dir: str | Path, wtype: str = "f16", *, name: str | None = None
            ) -> tuple[Path, Path]:
    """Converts a SmolVLM / Idefics3 checkpoint; returns (text GGUF path, mmproj GGUF path).

    `wtype`: f32, f16, q8_0, q4_0, q4_1, q4_k_m or q5_k_m (see the module docstring for which tensors follow it).
    `name`: general.name and the file stem; default the checkpoint folder's name.
    Everything is checked before anything is written; a ValueError says what is unsupported.
    """
    hf, matrix_type, file_type, quantized, config = _open_checkpoint(hf_dir, wtype)
    _require(config, "image_token_id", "the top level")
    tp, vp, pre = _checkpoint_params(hf, config)
    vocab = _read_vocab(hf, config, tp.n_vocab)

    st = _SafeTensors(hf)
    tp = dataclasses.replace(tp, tied=_tied_head(config, st))
    text_plan = _text_plan(st, tp, matrix_type)
    if wtype in _K_MIXES:
        text_plan = _mixed(text_plan, wtype, tp.n_layer)
    vision_plan = _vision_plan(st, vp, tp.n_embd, _vision_type(wtype, matrix_type))
    known = {p.hf_name for p in text_plan + vision_plan}
    if tp.tied:
        known.add(_LM_HEAD)  # some tied checkpoints store the head anyway; token_embd serves as it
    unknown = sorted(n for n in st.infos if n not in known and not _IGNORED.match(n))
    if unknown:
        shown = ", ".join(unknown[:8]) + (f" and {len(unknown) - 8} more" if len(unknown) > 8 else "")
        raise ValueError(f"checkpoint has tensors this converter does not know: {shown}")

    model_name = name or hf.resolve().name
    stem = _safe_name(model_name)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text_path = out / f"{stem}-{wtype}.gguf"
    mmproj_path = out / f"mmproj-{stem}-{wtype}.gguf"

    tw = _text_writer(model_name, file_type, quantized, tp, vocab)
    _add_tensors(tw, st, text_plan)
    log.info("writing %s (%d tensors)", text_path, len(text_plan))
    tw.write(text_path)

    mw = _mmproj_writer(model_name, file_type, quantized, vp, tp.n_embd, pre)
    _add_tensors(mw, st, vision_plan)
    log.info("writing %s (%d tensors)", mmproj_path, len(vision_plan))
    mw.write(mmproj_path)
    return text_path, mmproj_path


def convert_mmproj(hf_dir: str | Path, out_path: str | Path, wtype: str = "f16", *, name: str | None = None
                   ) -> Path:
    """Only the vision half of convert(): writes the mmproj GGUF to `out_path` and returns it.

    For checkpoints that carry the vision tower and connector but not (or not yet) the text decoder's
    weights, such as the demo model trained by tools/train_demo_vlm.py: config.json still needs its
    `text_config` (the connector's output width is checked against it) and the image processor
    config; text tensors, when present, are ignored. Same tensor formats and checks as convert().
    """
    hf, matrix_type, file_type, quantized, config = _open_checkpoint(hf_dir, wtype)
    tp, vp, pre = _checkpoint_params(hf, config)
    st = _SafeTensors(hf)
    plan = _vision_plan(st, vp, tp.n_embd, _vision_type(wtype, matrix_type))
    known = {p.hf_name for p in plan}
    unknown = sorted(n for n in st.infos if n not in known and not n.startswith(_TEXT_PREFIXES)
                     and n != _LM_HEAD and not _IGNORED.match(n))
    if unknown:
        shown = ", ".join(unknown[:8]) + (f" and {len(unknown) - 8} more" if len(unknown) > 8 else "")
        raise ValueError(f"checkpoint has tensors this converter does not know: {shown}")
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    mw = _mmproj_writer(name or hf.resolve().name, file_type, quantized, vp, tp.n_embd, pre)
    _add_tensors(mw, st, plan)
    log.info("writing %s (%d tensors)", out, len(plan))
    return mw.write(out)
