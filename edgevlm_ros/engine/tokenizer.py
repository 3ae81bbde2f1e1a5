"""Text tokenizer built from a GGUF file's own vocabulary.

The GGUF carries everything a tokenizer needs (tokens, merges or scores, token types,
special ids, pre-tokenizer name), so we never need the model's original
tokenizer.json. The heavy lifting (BPE merging, special-token matching) is done by
the Rust `tokenizers` library; decoding is done here from per-token byte strings,
which makes streaming decode exact and cheap.

Two kinds of vocabulary (`tokenizer.ggml.model`):
- "gpt2", byte-level BPE: merges from the file; the pre-tokenizer follows llama.cpp's
  reading of `tokenizer.ggml.pre`, because that name is the GGUF's statement of how
  the model's text was split in training.
- "llama", SentencePiece BPE (LLaMA 1/2, Gemma): no merges in the file, only a score
  per token. SentencePiece merges the adjacent pair whose joined piece has the best
  score, so the merges are every split of a token into two tokens, best score first;
  spaces are "▁", characters outside the vocabulary fall back to `<0xNN>` byte tokens,
  and no text is split before merging (llama.cpp reads no pre type for it).
"""

from __future__ import annotations

import codecs
import math
import numbers
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.models import BPE

__all__ = ["StreamDecoder", "TokenType", "Tokenizer"]


class TokenType:
    """Values of `tokenizer.ggml.token_type` (llama.cpp's llama_token_type)."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# Texts that end an assistant turn in the chat formats we expect to meet. They only
# count when the vocabulary marks them as special (see `eot_ids`), so a model whose
# vocabulary happens to contain the plain text never stops on it.
_EOT_TEXTS = ("<|im_end|>", "<end_of_utterance>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>")

# Token types matched as whole units inside the input text (llama.cpp matches the
# same set); everything else goes through pre-tokenization and BPE.
_MATCHED_TYPES = frozenset({TokenType.UNKNOWN, TokenType.CONTROL, TokenType.USER_DEFINED})

# Of those, the ones `skip_special` drops: user-defined tokens are ordinary text that
# the vocabulary happens to keep whole, so they stay.
_SPECIAL_TYPES = frozenset({TokenType.UNKNOWN, TokenType.CONTROL})


def _gpt2_byte_alphabet() -> dict[int, str]:
    """Byte -> printable character table of byte-level BPE.

    Byte-level vocabularies spell every byte as a visible character so that tokens
    never contain whitespace or control characters: printable Latin-1 bytes stand for
    themselves and the remaining bytes are shifted to code points from U+0100 up.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


_BYTE_TO_CHAR = _gpt2_byte_alphabet()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}


def _digits_then_bytelevel() -> pre_tokenizers.PreTokenizer:
    # Every Unicode digit is its own piece (llama.cpp's "\p{N}" split; `Digits` uses
    # the same numeric class), then the GPT-2 regex splits the rest.
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )


def _plain_bytelevel() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


# Qwen3.5's split (the `Split` pattern of its tokenizer.json; llama.cpp's qwen35 regex):
# contractions, a letter run (combining marks, \p{M}, stay inside it) with at most one leading
# non-letter, every digit alone, punctuation runs with their trailing newlines, newline runs, spaces.
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _split_then_bytelevel(pattern: str) -> Callable[[], pre_tokenizers.PreTokenizer]:
    def make() -> pre_tokenizers.PreTokenizer:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )

    return make


# `tokenizer.ggml.pre` -> pre-tokenizer. The digit group is the set llama.cpp gives
# the regexes {"\p{N}", GPT-2}; the published SmolLM2 tokenizer.json agrees for
# "smollm". "default" is what old converters wrote (and what a missing key means);
# we read it as plain GPT-2 byte level. Note: llama.cpp's own "default" adds further
# splits (punctuation runs, digit runs, digit triples), so for such files our ids may
# differ from llama.cpp's; no model we ship uses it.
_PRE_TOKENIZERS: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    **dict.fromkeys(
        (
            "smollm",
            "starcoder",
            "refact",
            "command-r",
            "codeshell",
            "exaone",
            "minerva-7b",
            "mellum2",
        ),
        _digits_then_bytelevel,
    ),
    **dict.fromkeys(("gpt2", "gpt-2", "default"), _plain_bytelevel),
    "qwen35": _split_then_bytelevel(_QWEN35_SPLIT),
}

# Pre types whose published tokenizers compose text to NFC before splitting (Qwen3.5's
# tokenizer.json has an NFC normalizer; Qwen's own tiktoken tokenizer normalizes too).
# llama.cpp does not normalize, so on decomposed text (e.g. "e" + U+0301) its ids differ
# from the model's tokenizer; we follow the model's.
_NFC_PRE = frozenset({"qwen35"})


_BPE = "gpt2"  # byte-level BPE
_SPM = "llama"  # SentencePiece BPE
_SPM_SPACE = "\u2581"  # "▁": how SentencePiece spells a space inside its pieces
_BYTE_TOKEN = re.compile(r"<0x([0-9A-F]{2})>")  # SentencePiece's byte pieces, as llama.cpp looks them up


@dataclass(frozen=True)
class _Vocab:
    """The parts of the GGUF tokenizer metadata we use, checked."""

    model: str  # _BPE or _SPM
    tokens: list[str]
    types: list[int]
    merges: list[tuple[str, str]]  # _BPE only (from the file)
    scores: list[float]  # _SPM only
    pre: str
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool  # _SPM: a "▁" before the text (and after each matched token)


def _require_list(meta: Mapping[str, Any], key: str) -> list[Any]:
    value = meta.get(key)
    if not isinstance(value, list):
        # ValueError, not TypeError: callers handle every bad-metadata case as one kind.
        raise ValueError(f"GGUF metadata {key!r} must be an array, got {type(value).__name__}")
    return value


def _optional_id(meta: Mapping[str, Any], key: str, n_tokens: int) -> int | None:
    value = meta.get(key)
    if value is None:
        return None
    # bool is an int subclass; a bool here means a corrupt or mislabelled key.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"GGUF metadata {key!r} must be an integer, got {value!r}")
    if not 0 <= value < n_tokens:
        raise ValueError(f"GGUF metadata {key!r} = {value} is outside the vocabulary (size {n_tokens})")
    return value


def _parse_merges(raw: list[Any]) -> list[tuple[str, str]]:
    merges: list[tuple[str, str]] = []
    for i, merge in enumerate(raw):
        # Byte-level tokens never contain a real space, so a merge is exactly "left right".
        parts = merge.split(" ") if isinstance(merge, str) else []
        if len(parts) != 2 or not parts[0] or not parts[1]:
            raise ValueError(f"GGUF tokenizer.ggml.merges[{i}] = {merge!r} is not 'left right'")
        merges.append((parts[0], parts[1]))
    return merges


def _parse_types(meta: Mapping[str, Any], n_tokens: int) -> list[int]:
    if "tokenizer.ggml.token_type" not in meta:
        # Without types nothing is special; llama.cpp reads a missing array the same way.
        return [TokenType.NORMAL] * n_tokens
    types = _require_list(meta, "tokenizer.ggml.token_type")
    if len(types) != n_tokens:
        raise ValueError(f"GGUF tokenizer.ggml.token_type has {len(types)} entries for {n_tokens} tokens")
    for i, t in enumerate(types):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise ValueError(f"GGUF tokenizer.ggml.token_type[{i}] = {t!r} is not an integer")
    return [int(t) for t in types]


def _parse_scores(meta: Mapping[str, Any], n_tokens: int) -> list[float]:
    scores = _require_list(meta, "tokenizer.ggml.scores")
    if len(scores) != n_tokens:
        raise ValueError(f"GGUF tokenizer.ggml.scores has {len(scores)} entries for {n_tokens} tokens")
    for i, score in enumerate(scores):
        if isinstance(score, bool) or not isinstance(score, numbers.Real) or not math.isfinite(score):
            raise ValueError(f"GGUF tokenizer.ggml.scores[{i}] = {score!r} is not a finite number")
    return [float(score) for score in scores]


def _check_byte_tokens(tokens: list[str], types: list[int]) -> None:
    """SentencePiece byte fallback needs all 256 `<0xNN>` tokens; refuse a table that lacks or garbles them."""
    seen: set[int] = set()
    for i, (tok, t) in enumerate(zip(tokens, types, strict=True)):
        if t != TokenType.BYTE:
            continue
        match = _BYTE_TOKEN.fullmatch(tok)
        if match is None:
            raise ValueError(f"GGUF byte token {i} is {tok!r}, not '<0xNN>' (two upper-case hex digits)")
        seen.add(int(match.group(1), 16))
    if len(seen) != 256:
        missing = sorted(set(range(256)) - seen)
        raise ValueError(
            f"GGUF SentencePiece vocabulary lacks {len(missing)} of the 256 byte tokens "
            f"(first: <0x{missing[0]:02X}>): text outside the vocabulary could not be encoded"
        )


def _spm_merges(vocab: _Vocab, ids: Mapping[str, int]) -> list[tuple[str, str]]:
    """The merges a SentencePiece vocabulary implies: every split of a token into two tokens, best score first.

    SentencePiece (and llama.cpp) merge the adjacent pair whose joined piece has the highest score,
    the leftmost on a tie; a BPE merge list ranked by the joined piece's score makes the same choice
    at every step, with one exception: BPE ranks the splits of one piece apart, so where two splits
    of the same piece compete side by side ("xx"+"x" next to "x"+"xx", inside a run of one repeated
    unit) it takes the better-ranked split (here the shorter left part) rather than the leftmost.
    Only tokens reachable from plain text are merge results: matched tokens (control, user-defined)
    are cut out of the text before merging. Equal scores keep the file's order.
    """
    tokens, scores = vocab.tokens, vocab.scores
    results = (i for i, t in enumerate(vocab.types) if t not in _MATCHED_TYPES and len(tokens[i]) > 1)
    order = sorted(results, key=lambda i: -scores[i])
    merges: list[tuple[str, str]] = []
    for i in order:
        tok = tokens[i]
        merges.extend((tok[:k], tok[k:]) for k in range(1, len(tok)) if tok[:k] in ids and tok[k:] in ids)
    return merges


def _optional_bool(meta: Mapping[str, Any], key: str, default: bool) -> bool:
    value = meta.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"GGUF metadata {key!r} must be a boolean, got {value!r}")
    return value


def _parse_vocab(meta: Mapping[str, Any]) -> _Vocab:
    model = meta.get("tokenizer.ggml.model")
    if model not in (_BPE, _SPM):
        raise ValueError(
            f"unsupported tokenizer model {model!r}: supported are byte-level BPE ({_BPE!r}) "
            f"and SentencePiece ({_SPM!r})"
        )
    pre = meta.get("tokenizer.ggml.pre", "default")
    if model == _BPE and pre not in _PRE_TOKENIZERS:
        supported = ", ".join(sorted(_PRE_TOKENIZERS))
        raise ValueError(f"unsupported tokenizer pre-tokenizer type {pre!r} (supported: {supported})")
    tokens = _require_list(meta, "tokenizer.ggml.tokens")
    if not tokens or not all(isinstance(t, str) for t in tokens):
        raise ValueError("GGUF tokenizer.ggml.tokens must be a non-empty array of strings")
    n = len(tokens)
    types = _parse_types(meta, n)
    spm = model == _SPM
    if spm:
        _check_byte_tokens(tokens, types)
    # llama.cpp's defaults for a key the file lacks: SentencePiece vocabularies add BOS and a prefix space.
    return _Vocab(
        model=model,
        tokens=tokens,
        types=types,
        merges=[] if spm else _parse_merges(_require_list(meta, "tokenizer.ggml.merges")),
        scores=_parse_scores(meta, n) if spm else [],
        pre=pre,
        bos_id=_optional_id(meta, "tokenizer.ggml.bos_token_id", n),
        eos_id=_optional_id(meta, "tokenizer.ggml.eos_token_id", n),
        unk_id=_optional_id(meta, "tokenizer.ggml.unknown_token_id", n),
        pad_id=_optional_id(meta, "tokenizer.ggml.padding_token_id", n),
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", spm)),
        add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        add_space_prefix=spm and _optional_bool(meta, "tokenizer.ggml.add_space_prefix", True),
    )


def _token_ids(tokens: list[str]) -> dict[str, int]:
    ids = {tok: i for i, tok in enumerate(tokens)}
    if len(ids) != len(tokens):
        raise ValueError("GGUF tokenizer.ggml.tokens contains duplicate tokens")
    return ids


def _token_bytes(text: str, token_type: int, model: str) -> bytes:
    """The bytes a token stands for when decoded."""
    if token_type in _MATCHED_TYPES:
        # Matched tokens are stored as the raw text they match, so they decode to it.
        return text.encode("utf-8")
    if model == _SPM:
        if token_type == TokenType.BYTE:  # checked to be <0xNN> at load
            return bytes([int(text[3:5], 16)])
        return text.replace(_SPM_SPACE, " ").encode("utf-8")
    try:
        return bytes(_CHAR_TO_BYTE[c] for c in text)
    except KeyError:
        # Not byte-level spelled (a hand-added token): its text is all we have.
        return text.encode("utf-8")


def _spm_backend(vocab: _Vocab, ids: dict[str, int]) -> _HFTokenizer:
    # Byte fallback covers every character (all 256 byte tokens are checked at load), so the
    # unknown token is never produced.
    try:
        model = BPE(vocab=ids, merges=_spm_merges(vocab, ids), unk_token=None, fuse_unk=False, byte_fallback=True)
    except Exception as exc:  # the Rust side raises a bare Exception on bad merges
        raise ValueError(f"GGUF SentencePiece vocabulary is inconsistent: {exc}") from exc
    backend = _HFTokenizer(model)
    # Normalizers run on each stretch of text between matched tokens, so the prefix space
    # comes back after every matched token, as llama.cpp adds it.
    steps = [normalizers.Prepend(_SPM_SPACE)] if vocab.add_space_prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", _SPM_SPACE)])
    return backend


def _bpe_backend(vocab: _Vocab, ids: dict[str, int]) -> _HFTokenizer:
    # No unknown token: it would only be used for a byte the vocabulary lacks (SmolLM2
    # lacks a few ASCII control bytes), and its id is usually a control token such as
    # <|endoftext|> that must never appear inside a prompt. Such bytes are dropped,
    # exactly as llama.cpp and transformers do.
    try:
        model = BPE(vocab=ids, merges=vocab.merges, unk_token=None, fuse_unk=False, byte_fallback=False)
    except Exception as exc:  # the Rust side raises a bare Exception on bad merges
        raise ValueError(f"GGUF BPE vocabulary/merges are inconsistent: {exc}") from exc
    backend = _HFTokenizer(model)
    backend.pre_tokenizer = _PRE_TOKENIZERS[vocab.pre]()
    if vocab.pre in _NFC_PRE:
        # Runs on the text between matched tokens only (they are added unnormalized).
        backend.normalizer = normalizers.NFC()
    return backend


def _build_backend(vocab: _Vocab, ids: dict[str, int]) -> _HFTokenizer:
    backend = (_spm_backend if vocab.model == _SPM else _bpe_backend)(vocab, ids)
    matched = [
        AddedToken(tok, special=t in _SPECIAL_TYPES, normalized=False, lstrip=False, rstrip=False, single_word=False)
        for tok, t in zip(vocab.tokens, vocab.types, strict=True)
        if t in _MATCHED_TYPES
    ]
    # Tokens already in the vocabulary keep their ids; this only turns on whole-text
    # matching (and the special flag for skip-on-decode in the backend).
    backend.add_special_tokens(matched)
    return backend


class StreamDecoder:
    """Turns generated token ids into text as they arrive.

    Byte-level tokens can end in the middle of a multi-byte UTF-8 character (emoji,
    CJK); the partial bytes are held back until the character is complete, so no
    push ever returns half a character or a replacement character for one.
    """

    def __init__(self, pieces: Sequence[bytes], skip: frozenset[int]) -> None:
        self._pieces = pieces
        self._skip = skip
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Add one token; return the text that is now complete (possibly "")."""
        if not 0 <= token_id < len(self._pieces):
            raise ValueError(f"token id {token_id} is outside the vocabulary (size {len(self._pieces)})")
        if token_id in self._skip:
            return ""
        return self._utf8.decode(self._pieces[token_id], final=False)

    def flush(self) -> str:
        """End of stream: return held bytes (U+FFFD if they never became a character)."""
        return self._utf8.decode(b"", final=True)


class Tokenizer:
    """Byte-level BPE or SentencePiece tokenizer described entirely by GGUF metadata."""

    def __init__(self, vocab: _Vocab) -> None:
        self._vocab = vocab
        self._ids = _token_ids(vocab.tokens)
        self._backend = _build_backend(vocab, self._ids)
        self._pieces = [_token_bytes(tok, t, vocab.model) for tok, t in zip(vocab.tokens, vocab.types, strict=True)]
        self._special = frozenset(i for i, t in enumerate(vocab.types) if t in _SPECIAL_TYPES)

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Build from GGUF metadata (key -> plain Python value, arrays as lists).

        Raises ValueError for a tokenizer model or pre-tokenizer type we do not
        support, and for inconsistent vocabulary data (scores, byte tokens, ids).
        """
        return cls(_parse_vocab(meta))

    # -- encoding -----------------------------------------------------------------

    def encode(self, text: str, add_bos: bool | None = None, add_eos: bool | None = None) -> list[int]:
        """Token ids of `text`; special-token texts (e.g. "<|im_start|>") become their id.

        `add_bos`/`add_eos` None means what the GGUF says (`tokenizer.ggml.add_bos_token`,
        `tokenizer.ggml.add_eos_token`).
        """
        ids: list[int] = self._backend.encode(text, add_special_tokens=False).ids
        if self._vocab.add_bos if add_bos is None else add_bos:
            ids.insert(0, self._require(self._vocab.bos_id, "bos"))
        if self._vocab.add_eos if add_eos is None else add_eos:
            ids.append(self._require(self._vocab.eos_id, "eos"))
        return ids

    @staticmethod
    def _require(token_id: int | None, name: str) -> int:
        if token_id is None:
            raise ValueError(f"the GGUF defines no {name} token")
        return token_id

    # -- decoding -----------------------------------------------------------------

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Text of `ids`. Invalid UTF-8 (only from a cut-off sequence) becomes U+FFFD."""
        n = len(self._pieces)
        for i in ids:
            if not 0 <= i < n:
                raise ValueError(f"token id {i} is outside the vocabulary (size {n})")
        skip = self._special if skip_special else frozenset()
        raw = b"".join(self._pieces[i] for i in ids if i not in skip)
        return raw.decode("utf-8", errors="replace")

    def stream_decoder(self, skip_special: bool = False) -> StreamDecoder:
        """A fresh incremental decoder; pushes + flush concatenate to `decode(ids)`."""
        return StreamDecoder(self._pieces, self._special if skip_special else frozenset())

    # -- vocabulary ---------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self._vocab.tokens)

    @property
    def bos_id(self) -> int | None:
        return self._vocab.bos_id

    @property
    def eos_id(self) -> int | None:
        return self._vocab.eos_id

    @property
    def pad_id(self) -> int | None:
        return self._vocab.pad_id

    @property
    def eot_ids(self) -> frozenset[int]:
        """Ids that end an assistant turn: eos plus the known end-of-turn tokens.

        A candidate counts only when the vocabulary matches it as a unit (control, or
        user-defined, which llama.cpp promotes to control for these names).
        """
        found = {
            i
            for text in _EOT_TEXTS
            if (i := self._ids.get(text)) is not None
            and self._vocab.types[i] in (TokenType.CONTROL, TokenType.USER_DEFINED)
        }
        if self._vocab.eos_id is not None:
            found.add(self._vocab.eos_id)
        return frozenset(found)

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary entry as the GGUF spells it (e.g. "Ġthe", "▁the"), or None."""
        return self._ids.get(token)

    def id_to_token(self, token_id: int) -> str:
        """Vocabulary entry of `token_id` as stored in the GGUF (e.g. "Ġthe", "▁the", "<0x0A>")."""
        if not 0 <= token_id < len(self._vocab.tokens):
            raise ValueError(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")
        return self._vocab.tokens[token_id]

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes `token_id` decodes to (may be part of a UTF-8 character)."""
        self.id_to_token(token_id)  # range check
        return self._pieces[token_id]

    def token_type(self, token_id: int) -> int:
        """`TokenType` of `token_id`."""
        self.id_to_token(token_id)  # range check
        return self._vocab.types[token_id]
