"""Tokenizer and chat template tests against the real SmolLM2-135M-Instruct GGUF.

References:
- transformers' tokenizer built from the same GGUF, with its pre-tokenizer replaced by
  the published SmolLM2 one (see `reference`): exact id equality on every string;
- llama.cpp (llama-cpp-python), when installed;
- transformers' `apply_chat_template` for chat rendering.
"""

from __future__ import annotations

import concurrent.futures
import random
import sys
import time
import unicodedata
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from edgevlm_ros.engine import chat_template
from edgevlm_ros.engine.chat_template import ChatTemplateError, render_chat
from edgevlm_ros.engine.tokenizer import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tokenizer_cases import CHAT_CONVERSATIONS, text_cases  # noqa: E402

MODELS = Path(__file__).resolve().parents[1] / "models"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_PATH = MODELS / GGUF_NAME



@pytest.fixture(autouse=True, scope="module")
def _model_fetched(text_model_path: Path) -> None:
    """scripts/setup.sh fetches the model: a missing one fails here (conftest says why), never skips."""
    assert text_model_path == GGUF_PATH

Meta = dict[str, Any]


# --- fixtures ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def meta() -> Meta:
    """GGUF metadata as plain Python values (str, int, bool, lists), keyed as in the file."""
    import gguf
    reader = gguf.GGUFReader(GGUF_PATH)
    # "GGUF.*" entries are the reader's header fields, not metadata keys.
    return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


@pytest.fixture(scope="module")
def tok(meta: Meta) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(meta)


@pytest.fixture(scope="module")
def hf() -> Any:
    """transformers' tokenizer converted from the same GGUF (loaded once: ~5 s)."""
    import transformers
    return transformers.AutoTokenizer.from_pretrained(MODELS, gguf_file=GGUF_NAME)


@pytest.fixture(scope="module")
def reference(hf: Any) -> Callable[[str], list[int]]:
    """transformers' GGUF tokenizer with the published SmolLM2 pre-tokenizer.

    transformers' GGUF conversion gives every gpt2-type GGUF a plain ByteLevel
    pre-tokenizer, ignoring `tokenizer.ggml.pre = "smollm"`, so it does not split
    digits. The published SmolLM2 tokenizer.json (what the model was trained with)
    and llama.cpp both split every digit first. The GGUF's `tokenizer.ggml.pre` is
    the truth, so the reference is transformers' tokenizer (same vocabulary, merges
    and special tokens) with the backend pre-tokenizer set to the published one:
    Sequence[Digits(individual_digits=True), ByteLevel(add_prefix_space=False,
    use_regex=True)]. `test_unpatched_transformers_agrees_without_digits` shows the
    patch touches nothing but digits.
    """
    from tokenizers import Tokenizer as Backend
    from tokenizers import pre_tokenizers

    backend = Backend.from_str(hf.backend_tokenizer.to_str())  # a copy: `hf` stays unpatched
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    return lambda text: backend.encode(text, add_special_tokens=False).ids


@pytest.fixture(scope="module")
def template(meta: Meta) -> str:
    return meta["tokenizer.chat_template"]


@pytest.fixture(scope="module")
def cases(template: str) -> list[str]:
    """All text cases plus conversations rendered with the GGUF's own chat template."""
    chats = [
        render_chat(template, conv, add_generation_prompt=gen) for conv in CHAT_CONVERSATIONS for gen in (True, False)
    ]
    return [*text_cases(), *chats]


def _mismatches(
    cases: Sequence[str], ours: Callable[[str], list[int]], theirs: Callable[[str], list[int]]
) -> list[str]:
    out = []
    for text in cases:
        a, b = ours(text), theirs(text)
        if a != b:
            out.append(f"{text[:60]!r}: ours {a[:20]} vs reference {b[:20]}")
    return out


def _has_number(text: str) -> bool:
    # The same class `Digits` and llama.cpp's \p{N} split on: Unicode categories N*.
    return any(unicodedata.category(c).startswith("N") for c in text)


# --- the metadata and the case set ---------------------------------------------------


def test_gguf_tokenizer_metadata_is_what_we_expect(meta: Meta) -> None:
    assert meta["tokenizer.ggml.model"] == "gpt2"
    assert meta["tokenizer.ggml.pre"] == "smollm"
    assert len(meta["tokenizer.ggml.tokens"]) == 49152


def test_case_set_is_large_and_varied(cases: list[str]) -> None:
    assert len(cases) >= 300
    assert "" in cases
    assert any(len(c) > 5000 for c in cases)
    assert any("\u200d" in c for c in cases)  # ZWJ emoji sequences
    assert any("<|im_start|>" in c for c in cases)


# --- encoding parity -----------------------------------------------------------------


def test_encode_matches_reference_exactly(
    tok: Tokenizer, reference: Callable[[str], list[int]], cases: list[str]
) -> None:
    bad = _mismatches(cases, lambda t: tok.encode(t, add_bos=False), reference)
    assert not bad, f"{len(bad)} of {len(cases)} strings differ:\n" + "\n".join(bad[:20])


def test_unpatched_transformers_agrees_without_digits(tok: Tokenizer, hf: Any, cases: list[str]) -> None:
    no_digits = [c for c in cases if not _has_number(c)]
    assert len(no_digits) >= 150
    bad = _mismatches(no_digits, tok.encode, lambda t: hf(t, add_special_tokens=False)["input_ids"])
    assert not bad, "\n".join(bad[:20])


def test_digits_are_split_as_the_published_smollm2_tokenizer_does(tok: Tokenizer, hf: Any) -> None:
    ids = tok.encode("0x1F  99")
    # Digits first, then byte-level: "F  " -> "F" + "ĠĠ" (two spaces, one token).
    assert [tok.id_to_token(i) for i in ids] == ["0", "x", "1", "F", "ĠĠ", "9", "9"]
    unpatched = hf("0x1F  99", add_special_tokens=False)["input_ids"]
    if unpatched == ids:
        pytest.skip("transformers now converts smollm's digit splitting; the reference patch is a no-op")
    # transformers' conversion keeps " 99" together, so the space before it stands alone.
    assert [hf.convert_ids_to_tokens(i) for i in unpatched] == ["0", "x", "1", "F", "Ġ", "Ġ", "9", "9"]


def test_plain_gpt2_pre_type_matches_unpatched_transformers(meta: Meta, hf: Any, cases: list[str]) -> None:
    # With a plain byte-level pre type our tokenizer must equal transformers' plain
    # conversion everywhere, digits included: the pre type is the only difference.
    plain = Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.pre": "gpt-2"})
    bad = _mismatches(cases, plain.encode, lambda t: hf(t, add_special_tokens=False)["input_ids"])
    assert not bad, "\n".join(bad[:20])


def _import_llama_cpp() -> Any:
    try:
        import llama_cpp
    except ImportError:
        return None
    return llama_cpp


_llama_cpp = _import_llama_cpp()


@pytest.mark.skipif(_llama_cpp is None, reason="llama-cpp-python is the optional bench extra (not installed)")
def test_encode_matches_llama_cpp(tok: Tokenizer, cases: list[str]) -> None:
    llama = _llama_cpp.Llama(str(GGUF_PATH), vocab_only=True, verbose=False)

    def theirs(text: str) -> list[int]:
        return llama.tokenize(text.encode("utf-8"), add_bos=False, special=True)

    bad = _mismatches(cases, lambda t: tok.encode(t, add_bos=False), theirs)
    assert not bad, f"{len(bad)} of {len(cases)} strings differ:\n" + "\n".join(bad[:20])


# --- decoding ------------------------------------------------------------------------


def _present_bytes(tok: Tokenizer) -> set[int]:
    return {tok.token_bytes(i)[0] for i in range(tok.vocab_size) if len(tok.token_bytes(i)) == 1}


def test_round_trip(tok: Tokenizer, cases: list[str]) -> None:
    present = _present_bytes(tok)
    # SmolLM2's vocabulary lacks a few bytes (some ASCII controls, bytes that never occur
    # in UTF-8); like llama.cpp and transformers we drop them, so those strings are lossy.
    lossless = [c for c in cases if set(c.encode("utf-8")) <= present]
    assert len(lossless) >= len(cases) - 5
    bad = [c[:60] for c in lossless if tok.decode(tok.encode(c)) != c]
    assert not bad, bad[:20]


def test_missing_bytes_are_dropped_like_the_references(tok: Tokenizer, hf: Any) -> None:
    text = "a\x04b"
    assert tok.encode(text) == hf(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(tok.encode(text)) == "ab"


def test_decode_matches_transformers(tok: Tokenizer, hf: Any, cases: list[str]) -> None:
    backend = hf.backend_tokenizer
    for skip in (False, True):
        bad = [
            c[:60]
            for c in cases
            if tok.decode(ids := tok.encode(c), skip_special=skip) != backend.decode(ids, skip_special_tokens=skip)
        ]
        assert not bad, (skip, bad[:20])


def _stream(tok: Tokenizer, ids: Sequence[int], skip_special: bool = False) -> list[str]:
    decoder = tok.stream_decoder(skip_special=skip_special)
    return [*(decoder.push(i) for i in ids), decoder.flush()]


def test_stream_decode_equals_full_decode(tok: Tokenizer, cases: list[str]) -> None:
    for text in cases:
        ids = tok.encode(text)
        chunks = _stream(tok, ids)
        assert "".join(chunks) == tok.decode(ids)
        if "\ufffd" not in text:
            assert not any("\ufffd" in chunk for chunk in chunks), text[:60]


@pytest.mark.parametrize("text", ["👋🏽", "👨‍👩‍👧‍👦", "机器人看到一只猫", "🇯🇵 and 漢字 and 𠀀"])
def test_stream_holds_back_partial_characters(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    # The point of the test: some token of these strings ends inside a character.
    assert any(_invalid_alone(tok.token_bytes(i)) for i in ids)
    chunks = _stream(tok, ids)
    assert "".join(chunks) == text
    assert "" in chunks[:-1]  # a push that had to wait for the rest of a character
    assert all("\ufffd" not in chunk for chunk in chunks)


def _invalid_alone(piece: bytes) -> bool:
    try:
        piece.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def test_stream_equals_decode_for_random_ids(tok: Tokenizer) -> None:
    # Even for arbitrary ids (invalid UTF-8 included) stream and batch decode agree.
    rng = random.Random(7)
    for _ in range(300):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 12))]
        for skip in (False, True):
            assert "".join(_stream(tok, ids, skip)) == tok.decode(ids, skip_special=skip)


def test_stream_flush_marks_an_unfinished_character(tok: Tokenizer) -> None:
    ids = tok.encode("👋")
    decoder = tok.stream_decoder()
    assert decoder.push(ids[0]) == ""
    assert decoder.flush() == "\ufffd"


# --- special tokens and properties ---------------------------------------------------


def test_special_tokens_are_single_ids(tok: Tokenizer) -> None:
    assert tok.encode("<|im_start|>") == [1]
    assert tok.encode("<|im_end|>") == [2]
    assert tok.encode("<|endoftext|>") == [0]
    ids = tok.encode("a<|im_end|>b")
    assert ids[1] == 2 and len(ids) == 3
    # Near misses are ordinary text.
    assert 1 not in tok.encode("<|im_start") and 1 not in tok.encode("<| im_start |>")


def test_skip_special_drops_control_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>"
    assert tok.decode(ids, skip_special=True) == "user\nhi"
    assert "".join(_stream(tok, ids, skip_special=True)) == "user\nhi"


def test_bos_follows_the_gguf_unless_asked(meta: Meta, tok: Tokenizer) -> None:
    assert meta["tokenizer.ggml.add_bos_token"] is False
    assert tok.encode("hi") == tok.encode("hi", add_bos=False)
    assert tok.encode("hi", add_bos=True) == [tok.bos_id, *tok.encode("hi")]
    with_bos = Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.add_bos_token": True})
    assert with_bos.encode("hi") == [1, *tok.encode("hi")]
    assert with_bos.encode("hi", add_bos=False) == tok.encode("hi")
    with_eos = Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.add_eos_token": True})
    assert with_eos.encode("hi") == [*tok.encode("hi"), 2]


def test_properties(tok: Tokenizer, hf: Any) -> None:
    assert tok.vocab_size == 49152
    assert tok.bos_id == 1 and tok.eos_id == 2
    assert tok.eot_ids == frozenset({0, 2})  # <|endoftext|>, <|im_end|> (= eos)
    assert hf.convert_tokens_to_ids(hf.eos_token) == tok.eos_id
    assert tok.token_to_id("<|im_start|>") == 1
    assert tok.token_to_id("Ġworld") == hf.convert_tokens_to_ids("Ġworld")
    assert tok.token_to_id("no such token ever") is None
    assert tok.id_to_token(1) == "<|im_start|>"
    assert tok.token_bytes(tok.token_to_id("Ġworld")) == b" world"
    for bad_id in (-1, tok.vocab_size):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            tok.id_to_token(bad_id)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            tok.decode([bad_id])
        with pytest.raises(ValueError, match="outside the vocabulary"):
            tok.stream_decoder().push(bad_id)


def test_eot_ids_need_control_type(meta: Meta) -> None:
    types = list(meta["tokenizer.ggml.token_type"])
    types[0] = 1  # <|endoftext|> as a normal token no longer ends a turn
    tok = Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.token_type": types})
    assert tok.eot_ids == frozenset({2})


# --- unsupported and broken metadata -------------------------------------------------


@pytest.mark.parametrize("pre", ["llama3", "qwen2", "deepseek-llm", "no-such-pre"])
def test_unsupported_pre_type_raises(meta: Meta, pre: str) -> None:
    with pytest.raises(ValueError, match=f"unsupported tokenizer pre-tokenizer type '{pre}'"):
        Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.pre": pre})


@pytest.mark.parametrize("model", ["llama", "bert", "t5", None])
def test_unsupported_model_raises(meta: Meta, model: str | None) -> None:
    with pytest.raises(ValueError, match=f"unsupported tokenizer model {model!r}"):
        Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.model": model})


def test_missing_pre_means_default_byte_level(meta: Meta, hf: Any) -> None:
    without = {k: v for k, v in meta.items() if k != "tokenizer.ggml.pre"}
    text = "0x1F  99 bottles"
    assert Tokenizer.from_gguf_metadata(without).encode(text) == hf(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("tokenizer.ggml.merges", ["Ġ t", "not-a-pair"], "not 'left right'"),
        ("tokenizer.ggml.merges", ["Ġ t", "nosuch tokens"], "inconsistent"),
        ("tokenizer.ggml.token_type", [1, 3], "entries for"),
        ("tokenizer.ggml.bos_token_id", 10**6, "outside the vocabulary"),
        ("tokenizer.ggml.eos_token_id", "2", "must be an integer"),
        ("tokenizer.ggml.tokens", "abc", "must be an array"),
    ],
)
def test_broken_metadata_raises(meta: Meta, key: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Tokenizer.from_gguf_metadata({**meta, key: value})


# --- chat template -------------------------------------------------------------------


def _hf_render(hf: Any, messages: list[dict[str, str]], gen: bool, template: str | None = None) -> str:
    return hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen, chat_template=template)


@pytest.mark.parametrize("conv", range(len(CHAT_CONVERSATIONS)))
@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_transformers(
    template: str, hf: Any, tok: Tokenizer, reference: Callable[[str], list[int]], conv: int, gen: bool
) -> None:
    messages = CHAT_CONVERSATIONS[conv]
    ours = render_chat(template, messages, add_generation_prompt=gen, bos_token=hf.bos_token, eos_token=hf.eos_token)
    assert ours == _hf_render(hf, messages, gen)
    assert tok.encode(ours) == reference(ours)
    # transformers' own tokenized chat agrees too where its missing digit split cannot show.
    if not any(_has_number(m["content"]) for m in messages):
        hf_ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen, return_dict=False)
        assert tok.encode(ours) == list(hf_ids)


# HF-style templates that use the helpers and Jinja features real templates rely on.
_FEATURE_TEMPLATES = [
    # bos/eos, loop.last, trim_blocks/lstrip_blocks whitespace control
    """{{ bos_token }}{% for m in messages %}
    {% if m['role'] == 'user' %}
        {{ '[INST] ' + m['content'] + ' [/INST]' }}
    {% elif m['role'] == 'assistant' %}
        {{ m['content'] + eos_token }}
    {% else %}
        {{ '<<SYS>>' + m['content'] + '<</SYS>>' }}
    {% endif %}
    {% if loop.last and add_generation_prompt %}{{ ' ' }}{% endif %}
{% endfor %}""",
    # namespace, tojson, break/continue, raise_exception guard that does not fire
    """{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role not in ['system', 'user', 'assistant'] %}"""
    """{{ raise_exception('bad role') }}{% endif %}{% set ns.n = ns.n + 1 %}{% if ns.n > 2 %}{% break %}{% endif %}"""
    """{{ m | tojson }}\n{% endfor %}{{ ns.n }}""",
    # filters, string ops, the {% generation %} tag, loop.index
    """{% for m in messages %}{{ loop.index }}:{{ m.role | upper }}:{% if m.role == 'assistant' %}"""
    """{% generation %}{{ m.content | trim }}{% endgeneration %}"""
    """{% else %}{{ m.content.strip() | replace('  ', ' ') }}"""
    """{% endif %}|{% endfor %}{{ messages | length }}{{ '%d-%s' | format(3, 'x') }}""",
]


@pytest.mark.parametrize("index", range(len(_FEATURE_TEMPLATES)))
def test_template_features_match_transformers(hf: Any, index: int) -> None:
    source = _FEATURE_TEMPLATES[index]
    for messages in CHAT_CONVERSATIONS:
        for gen in (True, False):
            ours = render_chat(source, messages, gen, bos_token=hf.bos_token, eos_token=hf.eos_token)
            assert ours == _hf_render(hf, messages, gen, source)


def test_chatml_fallback_without_template(template: str) -> None:
    messages = CHAT_CONVERSATIONS[0]
    # With a system message SmolLM2's template is plain ChatML, i.e. our fallback.
    for gen in (True, False):
        assert render_chat(None, messages, gen) == render_chat(template, messages, gen)
        assert render_chat("", messages, gen) == render_chat(template, messages, gen)


def test_raise_exception_becomes_an_error() -> None:
    source = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}{% endif %}"
    with pytest.raises(ChatTemplateError, match="system first"):
        render_chat(source, [{"role": "user", "content": "hi"}])


def test_messages_need_role_and_content() -> None:
    with pytest.raises(ChatTemplateError, match="message 0"):
        render_chat(None, [{"role": "user"}])


_HOSTILE = {
    "mro": "{{ ().__class__.__mro__ }}",
    "subclasses": "{{ ().__class__.__mro__[1].__subclasses__() }}",
    "subclasses_base": "{{ ''.__class__.__base__.__subclasses__() }}",
    "function_globals": "{{ raise_exception.__globals__ }}",
    "cycler_globals": "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "attr_filter": "{{ messages | attr('__class__') }}",
    "format_attr": "{{ '{0.__class__.__mro__}'.format(messages) }}",
    "mutate": "{% set x = messages.append({'role': 'x', 'content': 'y'}) %}",
    "import": "{% import 'os' as os %}{{ os.system('true') }}",
    "include": "{% include '/etc/passwd' %}",
}


@pytest.mark.parametrize("name", sorted(_HOSTILE))
def test_sandbox_refuses_hostile_template(name: str) -> None:
    with pytest.raises(ChatTemplateError):
        render_chat(_HOSTILE[name], [{"role": "user", "content": "hi"}])


_BOMBS = {
    "output_loop": "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
    "output_nested": "{% for i in range(100000) %}{% for j in range(100000) %}ab{% endfor %}{% endfor %}",
    "silent_nested_loop": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "repeat": "{{ 'x' * 10**12 }}",
    "doubling_concat": "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}{{ ns.s | length }}",
    "doubling_plus": "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "doubling_block": "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set t %}{{ ns.s }}{{ ns.s }}"
    "{% endset %}{% set ns.s = t %}{% endfor %}",
    "nested_lists": "{% set a = ['x' * 100000] * 10 %}{% set b = [a, a, a, a, a, a, a, a, a, a] %}"
    "{% set c = [b, b, b, b, b, b, b, b, b, b] %}{{ c }}",
    "join_many": "{% set a = ['x' * 1000] * 1000 %}{% set b = [a, a, a, a, a, a, a, a, a, a] %}{{ b | join }}",
    "center": "{{ 'x' | center(10**9) }}",
    "ljust": "{{ 'x'.ljust(10**9) }}",
    "printf_width": "{{ '%999999999d' % 1 }}",
    "format_filter": "{{ '%0999999999d' | format(1) }}",
    "replace": "{% set s = 'a' * 2000 %}{{ s.replace('a', s) }}",
    "power": "{{ 10 ** 100000 }}",
    "squaring": "{% set ns = namespace(x=3) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
    "expandtabs": "{{ ('\t' * 100000).expandtabs(1000) }}",
    "slice": "{{ [1] | slice(10**9) | list }}",
    "indent": "{{ ('x\n' * 1000) | indent(10**6) }}",
    "recursion": "{% macro f() %}{{ f() }}{{ f() }}{% endmacro %}{{ f() }}",
    "batch": "{{ [1] | batch(10**9, 'x') | list }}",
    "tojson_indent": "{{ messages | tojson(indent=10**8) }}",
}


@pytest.mark.parametrize("name", sorted(_BOMBS))
def test_resource_bombs_are_refused_quickly(name: str) -> None:
    start = time.monotonic()
    with pytest.raises(ChatTemplateError):
        render_chat(_BOMBS[name], [{"role": "user", "content": "hi"}])
    assert time.monotonic() - start < 10


def test_ordinary_big_numbers_are_fine() -> None:
    source = "{{ 1732900000 | string }} {{ 12345678 | abs }} {{ 2 ** 64 }} {{ 10**12 * 10**12 }} {{ '-' * 80 }}"
    assert render_chat(source, []) == f"1732900000 12345678 {2**64} {10**24} {'-' * 80}"


def test_oversized_template_is_refused() -> None:
    with pytest.raises(ChatTemplateError, match="limit"):
        render_chat("x" * (chat_template.MAX_TEMPLATE_CHARS + 1), [])


def test_output_limit_is_the_documented_one() -> None:
    fits = f"{{{{ 'x' * {chat_template.MAX_OUTPUT_CHARS} }}}}"
    assert len(render_chat(fits, [])) == chat_template.MAX_OUTPUT_CHARS
    with pytest.raises(ChatTemplateError, match="exceeds"):
        render_chat(fits + "y", [])


def test_compiled_template_is_cached(template: str) -> None:
    messages = CHAT_CONVERSATIONS[1]
    render_chat(template, messages)
    before = chat_template._compile.cache_info()
    render_chat(template, messages)
    after = chat_template._compile.cache_info()
    assert after.hits == before.hits + 1 and after.misses == before.misses


def test_concurrent_renders_have_separate_budgets(template: str) -> None:
    # Each render's step budget is its own: many renders in threads all succeed.
    expected = render_chat(template, CHAT_CONVERSATIONS[0])
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda _: render_chat(template, CHAT_CONVERSATIONS[0]), range(32)))
    assert results == [expected] * 32
