"""Text tokenizer built from a GGUF file's own vocabulary.

The GGUF carries everything a byte-level BPE tokenizer needs (tokens, merges, token
types, special ids, pre-tokenizer name), so we never need the model's original
tokenizer.json. The heavy lifting (BPE merging, special-token matching) is done by
the Rust `tokenizers` library; decoding is done here from per-token byte strings,
which makes streaming decode exact and cheap.

Only byte-level BPE (`tokenizer.ggml.model == "gpt2"`) is supported. The
pre-tokenizer follows llama.cpp's reading of `tokenizer.ggml.pre`, because that
name is the GGUF's statement of how the model's text was split in training.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, pre_tokenizers
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
_EOT_TEXTS = ("<|im_end|>", "<end_of_utterance>", "<|endoftext|>", "<|eot_id|>")

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
}


@dataclass(frozen=True)
class _Vocab:
    """The parts of the GGUF tokenizer metadata we use, checked."""

    tokens: list[str]
    types: list[int]
    merges: list[tuple[str, str]]
    pre: str
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    add_eos: bool


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
    return [int(t) for t in types]


def _parse_vocab(meta: Mapping[str, Any]) -> _Vocab:
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"unsupported tokenizer model {model!r}: only byte-level BPE ('gpt2') is supported")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        supported = ", ".join(sorted(_PRE_TOKENIZERS))
        raise ValueError(f"unsupported tokenizer pre-tokenizer type {pre!r} (supported: {supported})")
    tokens = _require_list(meta, "tokenizer.ggml.tokens")
    if not tokens or not all(isinstance(t, str) for t in tokens):
        raise ValueError("GGUF tokenizer.ggml.tokens must be a non-empty array of strings")
    n = len(tokens)
    return _Vocab(
        tokens=tokens,
        types=_parse_types(meta, n),
        merges=_parse_merges(_require_list(meta, "tokenizer.ggml.merges")),
        pre=pre,
        bos_id=_optional_id(meta, "tokenizer.ggml.bos_token_id", n),
        eos_id=_optional_id(meta, "tokenizer.ggml.eos_token_id", n),
        unk_id=_optional_id(meta, "tokenizer.ggml.unknown_token_id", n),
        pad_id=_optional_id(meta, "tokenizer.ggml.padding_token_id", n),
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
    )


def _token_bytes(text: str, token_type: int) -> bytes:
    """The bytes a token stands for when decoded."""
    if token_type in _MATCHED_TYPES:
        # Matched tokens are stored as the raw text they match, so they decode to it.
        return text.encode("utf-8")
    try:
        return bytes(_CHAR_TO_BYTE[c] for c in text)
    except KeyError:
        # Not byte-level spelled (a hand-added token): its text is all we have.
        return text.encode("utf-8")


def _build_backend(vocab: _Vocab) -> _HFTokenizer:
    ids = {tok: i for i, tok in enumerate(vocab.tokens)}
    if len(ids) != len(vocab.tokens):
        raise ValueError("GGUF tokenizer.ggml.tokens contains duplicate tokens")
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
    """Byte-level BPE tokenizer described entirely by GGUF metadata."""

    def __init__(self, vocab: _Vocab) -> None:
        self._vocab = vocab
        self._backend = _build_backend(vocab)
        self._ids = {tok: i for i, tok in enumerate(vocab.tokens)}
        self._pieces = [_token_bytes(tok, t) for tok, t in zip(vocab.tokens, vocab.types, strict=True)]
        self._special = frozenset(i for i, t in enumerate(vocab.types) if t in _SPECIAL_TYPES)

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Build from GGUF metadata (key -> plain Python value, arrays as lists).

        Raises ValueError for a tokenizer model or pre-tokenizer type we do not
        support, and for inconsistent vocabulary data.
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
        """Id of a vocabulary entry (byte-level spelling, e.g. "Ġthe"), or None."""
        return self._ids.get(token)

    def id_to_token(self, token_id: int) -> str:
        """Vocabulary entry of `token_id` as stored in the GGUF (byte-level spelling)."""
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
