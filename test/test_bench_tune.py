"""`edgevlm bench` and `edgevlm tune` smoke tests: tiny sizes, no timed assertions.

The bench must run without llama.cpp (the peer is hidden here even where it is installed) and
print the table with every row; tune must write a table the engine accepts and whose rules then
decide which kernel variant serves each (format, phase, shape).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from edgevlm_ros import _engine
from edgevlm_ros.demo.demo_model import DEMO_PROMPT
from edgevlm_ros.engine import optable
from edgevlm_ros.engine.vlm import DEFAULT_PROMPT
from edgevlm_ros.tools import bench, hw_limits, tune

ROOT = Path(__file__).resolve().parents[1]
BENCH_CACHE = ROOT / "build" / "test-fixtures" / "bench"  # the random vision model, reused across runs

EXPECTED_ROWS = [
    "prefill 8 tokens",
    "prefill 16 tokens",
    "decode 8 tokens",
    "first token, no prefix cache",
    "first token, prefix cache",
    "vision encode",
    "peak RSS",
    "decode time per token",
    "decode: bandwidth floor / time",
]


@pytest.fixture
def restore_optable():
    """Tests here activate other tables: put the default lookup back afterwards."""
    saved = optable.TUNED_TABLE
    try:
        yield
    finally:
        optable.TUNED_TABLE = saved
        optable.activate()


def _table_rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in text.splitlines() if line.startswith("| ") and not line.startswith("| measure")]


def test_bench_quick_without_llama_cpp(tmp_path, monkeypatch, capsys, text_model_path):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` now fails
    # ...and llama.cpp's vision CLI, which the bench extra also installs into the venv, is not found.
    monkeypatch.setattr(bench, "find_mtmd_cli", lambda explicit=None, peer_dir=None: None)
    out_json = tmp_path / "bench.json"
    png = tmp_path / "bench.png"
    rc = bench.main(["--quick", "--model", str(text_model_path), "--json", str(out_json), "--png", str(png),
                     "--cache-dir", str(BENCH_CACHE), "--peer-omp-wait", "default"])
    assert rc == 0
    printed = capsys.readouterr()
    text = printed.out
    assert "peer: llama-cpp-python is not installed" in text
    rows = _table_rows(text)
    labels = [r[0] for r in rows]
    for want in EXPECTED_ROWS:
        assert any(label.startswith(want) for label in labels), (want, labels)
    for r in rows:
        assert r[3] == "-" and r[4] == "-", r  # no peer numbers, no ratios
    assert "decode roofline:" in text and "decode time vs floor: ours" in text

    result = json.loads(out_json.read_text())
    by_key = {r["key"]: r for r in result["rows"]}
    for key in ("prefill_8", "prefill_16", "decode_8", "ttft_nocache", "ttft_cache", "decode_ms"):
        assert by_key[key]["ours"] > 0, key
        assert by_key[key]["peer"] is None and by_key[key]["ratio_ours_over_peer"] is None
    assert by_key["peak_rss"]["ours"] > 0
    vision = by_key["vision_encode"]
    assert vision["ours"] is not None and vision["ours"] > 0 or vision["note"].startswith("skipped"), vision
    rf = result["roofline"]
    assert rf["weight_bytes_per_token"]["total"] > 90e6  # SmolLM2-135M Q4_1: 96.6 MB
    assert rf["bandwidth"]["single_gbs"] > 0 and rf["floor_ms"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_no_peer_flag_and_json_on_stdout(capsys, text_model_path):
    rc = bench.main(["--quick", "--model", str(text_model_path), "--no-peer", "--no-vision", "--no-rss",
                     "--prefill-tokens", "4", "--decode-tokens", "2", "--bandwidth-mib", "8", "--json"])
    assert rc == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)  # stdout is the JSON alone
    assert result["peer_status"] == "not run (--no-peer)"
    assert [r["key"] for r in result["rows"]][:2] == ["prefill_4", "decode_2"]
    assert "| measure |" in captured.err  # the table went to stderr


def test_bench_speculation_quick(capsys):
    """`edgevlm bench --speculation --quick`: both streams measured, the same text with and without
    drafts on every frame, the drafts used on the slowly changing view, a table with the floor."""
    rc = bench.main(["--speculation", "--quick", "--json"])
    assert rc == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert set(result["streams"]) == {"drift", "independent"} and result["frames"] == 6
    assert result["prompt"] == DEMO_PROMPT and DEMO_PROMPT in captured.err  # the node's default request
    for row in result["streams"].values():
        assert row["text_mismatches"] == 0 and row["decoded_tokens"] > 0
        assert row["plain_tokens_per_s"] > 0 and row["spec_tokens_per_s"] > 0 and row["speedup"] > 0
    assert result["streams"]["drift"]["accepted"] > 0
    assert result["floor"]["floor_ms"] > 0
    assert "| drift |" in captured.err and "floor" in captured.err
    # The decoder's measured pass times (1..8 rows): a one-row step and at least one pass measured.
    assert len(result["pass_ms"]) == 8 and result["pass_ms"][0] > 0 and any(x > 0 for x in result["pass_ms"][1:])


def test_bench_speculation_question(capsys):
    """`--question` sends another request with each frame (the engine's generic one: the demo model
    was not trained on it and answers at greater length), recorded in the JSON and the table."""
    rc = bench.main(["--speculation", "--quick", "--frames", "2", "--json", "--question", DEFAULT_PROMPT])
    assert rc == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert result["prompt"] == DEFAULT_PROMPT != DEMO_PROMPT and DEFAULT_PROMPT in captured.err
    assert all(row["text_mismatches"] == 0 for row in result["streams"].values())


def test_bench_kv_cache_quick(capsys):
    """`edgevlm bench --kv-cache --quick`: every kv_type at both contexts, its bytes per position
    (f16 half of f32, q8_0 34 / 128 of it), a decode time and its ratio to f32, and the floor."""
    rc = bench.main(["--kv-cache", "--quick", "--json"])
    assert rc == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    rows = {(r["context"], r["kv_type"]): r for r in result["rows"]}
    assert set(rows) == {(c, kv) for c in (64, 128) for kv in ("f32", "f16", "q8_0")}
    for c in (64, 128):
        f32 = rows[(c, "f32")]["kv_bytes_per_token"]
        assert rows[(c, "f16")]["kv_bytes_per_token"] * 2 == f32
        assert rows[(c, "q8_0")]["kv_bytes_per_token"] * 128 == f32 * 34
        assert rows[(c, "f32")]["vs_f32"] == 1.0
        for kv in ("f32", "f16", "q8_0"):
            r = rows[(c, kv)]
            assert r["ms_per_token"] > 0 and r["floor_ms"] > 0
            assert r["kv_bytes_at_context"] == r["kv_bytes_per_token"] * c
            # llama.cpp with the same cache type, where it is installed (set-up builds it).
            if importlib.util.find_spec("llama_cpp") is not None:
                assert r["peer_ms_per_token"] > 0
                assert r["ours_speed_vs_peer"] == pytest.approx(r["peer_ms_per_token"] / r["ms_per_token"])
            else:
                assert r["peer_ms_per_token"] is None and "not installed" in result["peer"]
    assert "| 128 | q8_0 |" in captured.err and "floor" in captured.err and "llama.cpp ms/token" in captured.err


def test_bench_table_ratios():
    """format_table with peer numbers: ratio ours/peer and which side is better, per direction."""
    rows = [
        bench.Row("prefill_64", "prefill 64 tokens", "tokens/s", True, 300.0, 150.0),
        bench.Row("ttft_cache", "first token, prefix cache", "ms", False, 20.0, 40.0),
        bench.Row("peak_rss", "peak RSS", "MiB", False, 200.0, 100.0),
    ]
    result = {
        "date": "2026-01-01 00:00 UTC", "machine": {"cpu": "Test CPU", "cores": 2, "arch": "x86_64", "features": []},
        "model": "/m/model.gguf", "threads": 2, "repeats": 3, "peer_status": "llama-cpp-python 0.3.36",
        "rows": [r.as_dict() for r in rows], "wall_s": 1.0,
        "roofline": {"weight_bytes_per_token": {"total": 96.6e6, "layers": 66.5e6, "head": 30.1e6, "head_type": "Q8_0",
                                                "layer_types": ["Q4_1"]},
                     "bandwidth": {"single_gbs": 12.0, "all_gbs": 20.0, "threads": 2.0, "mib": 1024.0},
                     "floor_ms": 4.83, "ours_ms": 10.0, "peer_ms": 20.0},
    }
    text = bench.format_table(result)
    table = {r[0]: r for r in _table_rows(text)}
    assert table["prefill 64 tokens"][4:6] == ["2.00", "ours"]
    assert table["first token, prefix cache"][4:6] == ["0.50", "ours"]
    assert table["peak RSS"][4:6] == ["2.00", "llama.cpp"]
    assert "ours 10.00 ms vs 4.83 ms (48% of the bound)" in text
    assert "llama.cpp 20.00 ms vs 4.83 ms (24% of the bound)" in text


def test_bandwidth_and_weight_bytes(text_model_path):
    bw = hw_limits.measure_bandwidth(8, 2, repeats=1)
    assert bw["single_gbs"] > 0 and bw["all_gbs"] > 0
    # The floor uses the highest bandwidth of the runs around the decode measurement.
    runs = [dict(bw, all_gbs=20.0, single_gbs=13.0), dict(bw, all_gbs=25.0, single_gbs=12.0),
            dict(bw, all_gbs=19.0, single_gbs=11.0)]
    best = hw_limits.highest_bandwidth(runs)
    assert best["all_gbs"] == 25.0 and best["single_gbs"] == 13.0 and best["all_runs_gbs"] == [20.0, 25.0, 19.0]
    wb = hw_limits.weight_bytes_per_token(text_model_path)
    # 30 layers of Q4_1 (66.5 MB) + the tied Q8_0 head (30.1 MB) + norm + one embedding row
    assert wb["layers"] == 30 * (3 * 552960 + 2 * 69120 + 2 * 207360 + 2 * 2304)
    assert wb["head"] == 30081024 and wb["head_type"] == "Q8_0" and wb["layer_types"] == ["Q4_1"]
    # A recurrent state (none in SmolLM2) is read and written once per token: 2 x 4 bytes a float.
    assert wb["recurrent_state"] == 0
    assert hw_limits.weight_bytes_per_token(text_model_path, 1000)["total"] == wb["total"] + 8000


def _first_rules(text: str) -> dict[tuple[str, str, str], str]:
    """(format, phase, shape) -> the first variant the table names for it (as written)."""
    first: dict[tuple[str, str, str], str] = {}
    for line in text.replace(";", "\n").splitlines():
        cols = line.split("#", 1)[0].split()
        if len(cols) == 6 and cols[0] == "matmul":
            first.setdefault((cols[1], cols[2], cols[3]), cols[5])
    return first


def test_tune_quick_writes_a_table_the_engine_uses(tmp_path, capsys, restore_optable):
    out = tmp_path / "optable.tsv"
    rc = tune.main(["--quick", "--out", str(out), "--threads", "2"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "Q4_1  decode" in printed and "attention" in printed and f"wrote {out}" in printed
    text = out.read_text()
    assert optable.activate(out) == str(out)  # the engine's parser accepts it
    assert _engine.optable_source() == str(out)
    first = _first_rules(text)
    available = {v["name"] for v in _engine.list_variants() if v["op"] == "matmul" and v["available"]}
    for fmt in tune.weight_formats():
        for phase in ("decode", "prefill"):
            variant = first[(fmt, phase, "any")]
            assert variant in available
            # A layer-sized matrix (below any rows>= head rule; k = 256, whole blocks of every
            # format, which a packed layout needs) gets exactly the written winner.
            assert _engine.choose_matmul(fmt, phase, 96, 256) == variant, (fmt, phase)
            # ...and the reference closes every (format, phase) block.
            tuned = text.split("# built-in rules", 1)[0]
            block = [ln.split()[5] for ln in tuned.splitlines() if ln.split()[:4] == ["matmul", fmt, phase, "any"]]
            assert block[-1] == "ref" and "ref" not in block[:-1]
    # The matrix-free operators are measured too: each written fastest first, closed by the reference.
    for op in ("attention", *tune.elementwise_ops()):
        names = tune.op_candidates(op)
        assert f"  {op} " in printed or f"  {op} (" in printed, op
        block = [ln.split("#", 1)[0].split()[5] for ln in tuned.splitlines() if ln.split()[:1] == [op]]
        assert sorted(block) == sorted(names) and block[-1] == "ref", (op, block)


def _measure(fmt, phase, secs, rows=576, k=576, head=False):
    return tune.Measure(fmt, phase, rows, k, 1 if phase == "decode" else 64, rows, secs, head)


def test_tune_table_order_changes_the_choice(tmp_path, restore_optable):
    """A table ranked from (made-up) measures that contradict the built-in choice changes what
    choose_matmul picks, per phase and per shape class (the output head gets its own rule)."""
    measures = [
        _measure("Q4_1", "decode", {"avx2_q8act": 3e-5, "avx2_f32act": 1e-5, "ref": 9e-5}),
        _measure("Q4_1", "prefill", {"avx2_gemm": 3e-3, "avx2_f32act": 1e-3, "ref": 9e-3}),
        _measure("Q8_0", "decode", {"avx2_q8act": 5e-5, "avx2_f32act": 4e-5, "ref": 1e-4}, rows=1536),
        _measure("Q8_0", "decode", {"avx2_q8act": 1e-3, "avx2_f32act": 2e-3, "ref": 9e-3}, rows=49152, head=True),
    ]
    available = {v["name"] for v in _engine.list_variants() if v["op"] == "matmul" and v["available"]}
    if not {"avx2_q8act", "avx2_f32act", "avx2_gemm"} <= available:
        pytest.skip("needs the AVX2 variants")
    text = tune.build_table(measures, {}, optable._builtin_text(), ["test"])
    path = tmp_path / "t.tsv"
    path.write_text(text)
    optable.activate()
    cpu = _engine.cpu_features()
    builtin = ("avxvnni_q8act_x8" if cpu["avxvnni"]
               else "avx512vnni_q8act_x8" if cpu["avx512vnni"] and cpu["avx512bw"] and cpu["avx512vl"]
               else "avx2_q8act_x8")
    assert _engine.choose_matmul("Q4_1", "decode", 576, 576) == builtin  # built-in default
    optable.activate(path)
    assert _engine.choose_matmul("Q4_1", "decode", 576, 576) == "avx2_f32act"
    assert _engine.choose_matmul("Q4_1", "prefill", 576, 576) == "avx2_f32act"
    assert _engine.choose_matmul("Q8_0", "decode", 1536, 576) == "avx2_f32act"
    assert "matmul  Q8_0  decode  rows>=2048" in text
    assert _engine.choose_matmul("Q8_0", "decode", 49152, 576) == "avx2_q8act"  # the head's own winner
    # Formats not measured fall through to the built-in rules appended after the tuned ones.
    builtin_prefill = next(v for v in ("amx_gemm", "avx512_gemm", "avx2_gemm") if v in available)
    assert _engine.choose_matmul("F16", "prefill", 576, 576) == builtin_prefill
    # The built-in int8 rules (vision_int8) come before the tuned ones: a tuned prefill rule for a
    # format never takes a product whose user allowed int8.
    first_rule = next(ln for ln in text.splitlines() if ln and not ln.startswith("#"))
    assert first_rule.split()[2] == "int8"
    measures.append(_measure("F16", "prefill", {"avx2_gemm": 3e-3, "ref": 9e-3}))
    optable.activate()
    want_int8 = _engine.choose_matmul("F16", "int8", 576, 576)
    path.write_text(tune.build_table(measures, {}, optable._builtin_text(), ["test"]))
    optable.activate(path)
    assert _engine.choose_matmul("F16", "prefill", 576, 576) == "avx2_gemm"
    assert _engine.choose_matmul("F16", "int8", 576, 576) == want_int8
    # On any CPU: the built-in table puts AMX's GEMM above its int8 rules (AMX serves a product allowed
    # int8), so the tuned table's int8 block does too, before the first int8 kernel's rule.
    rules = [ln.split() for ln in path.read_text().splitlines() if ln and not ln.startswith("#")]
    int8_variants = [r[5] for r in rules if r[2] == "int8"]
    assert ["F16", "int8", "amx_gemm"] in [[r[1], r[2], r[5]] for r in rules]
    assert int8_variants.index("amx_gemm") < int8_variants.index("avxvnni_q8act_gemm")
    assert max(i for i, r in enumerate(rules) if r[2] == "int8") < min(
        i for i, r in enumerate(rules) if r[2] in ("decode", "prefill"))


def test_int8_rules_serve_only_products_allowed_int8(tmp_path, restore_optable):
    """The table's int8 phase: a rule of it serves a prefill product whose user allowed int8
    (vision_int8) and nothing else; such a product falls through to the prefill rules where no int8
    rule runs here; the phase is parsed, a misspelt one refused."""
    available = {v["name"] for v in _engine.list_variants() if v["op"] == "matmul" and v["available"]}
    int8 = next((v for v in ("avxvnni_q8act_gemm", "avx512vnni_q8act_gemm_ymm") if v in available), None)
    if int8 is None or "avx2_gemm" not in available:
        pytest.skip("needs an int8 GEMM (AVX-VNNI or AVX512-VNNI)")
    feats = variant_features_of(int8)
    path = tmp_path / "t.tsv"
    path.write_text(f"matmul  F16  int8  any  {feats}  {int8}\nmatmul  *  *  any  avx2,fma,f16c  avx2_gemm\n")
    optable.activate(path)
    assert _engine.choose_matmul("F16", "int8", 1152, 1152) == int8
    assert _engine.choose_matmul("F16", "prefill", 1152, 1152) == "avx2_gemm"  # not allowed: float
    assert _engine.choose_matmul("BF16", "int8", 1152, 1152) == "avx2_gemm"  # no int8 rule for it
    path.write_text(f"matmul  F16  prefill  any  avx2,fma,f16c  avx2_gemm\nmatmul  F16  int8  any  {feats}  {int8}\n")
    optable.activate(path)
    assert _engine.choose_matmul("F16", "int8", 1152, 1152) == "avx2_gemm"  # the first matching rule wins
    with pytest.raises(ValueError, match="unknown phase 'int9'"):
        _engine.load_optable("matmul  F16  int9  any  -  ref\n", "test")
    with pytest.raises(ValueError, match="phase must be"):
        _engine.choose_matmul("F16", "int9", 64, 64)


def variant_features_of(name: str) -> str:
    """The features the built-in table's rules name for a variant."""
    return tune.variant_features(optable._builtin_text())[("matmul", name)]


def test_tune_default_path_is_the_tuned_table(tmp_path, monkeypatch, capsys, restore_optable):
    """Without --out the table goes to optable.TUNED_TABLE (pointed into tmp here), which the
    default lookup then picks up."""
    monkeypatch.delenv("EDGEVLM_OPTABLE", raising=False)
    optable.TUNED_TABLE = tmp_path / "cache" / "optable.tsv"
    rc = tune.main(["--quick", "--formats", "Q8_0"])
    assert rc == 0
    assert "the engine loads it at its next start" in capsys.readouterr().out
    assert optable.TUNED_TABLE.is_file()
    assert optable.activate() == str(optable.TUNED_TABLE)


# -- the operator-table loader, the robot profile, both bandwidth floors -------------------------

def _choices_here() -> dict:
    sys.path.insert(0, str(ROOT / "test"))
    try:
        import optable_probe
    finally:
        sys.path.pop(0)
    return optable_probe.choices()  # the same code the child runs


def _choices_in_child(env_table: Path) -> dict:
    import os
    import subprocess

    env = dict(os.environ, EDGEVLM_OPTABLE=str(env_table), PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "test" / "optable_probe.py")], capture_output=True, text=True,
                          env=env, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_shipped_optable_through_env_matches_builtin(tmp_path, restore_optable):
    """A copy of kernels/optable.tsv, comments and all (its prose has ';' in it), loaded through
    $EDGEVLM_OPTABLE by a separate process, makes every choice the built-in table makes."""
    shipped = (ROOT / "kernels" / "optable.tsv").read_text(encoding="utf-8")
    assert any(";" in line.split("#", 1)[1] for line in shipped.splitlines() if "#" in line)  # the old failure
    copy = tmp_path / "optable.tsv"
    copy.write_text(shipped, encoding="utf-8")
    optable.activate_text(optable._builtin_text(), "built-in default (kernels/optable.tsv)")
    here = _choices_here()
    child = _choices_in_child(copy)
    assert child["source"] == str(copy)
    assert child["matmul"] == here["matmul"] and child["ops"] == here["ops"]


def test_optable_comments_keep_their_semicolons_and_lines(restore_optable):
    text = ("# prose; with semicolons; a b c d e f g h\n"
            "matmul  Q4_0  decode  any  -  ref ; rmsnorm  *  *  any  -  ref   # two rules; one line\n")
    assert optable.activate_text(text, "t") == "t"
    assert _engine.choose_matmul("Q4_0", "decode", 96, 128) == "ref"
    # Errors still name the physical line, also after a comment with ';' in it.
    with pytest.raises(ValueError, match="operator table line 3: expected 6 columns"):
        optable.activate_text("# a; b\n\nmatmul Q4_0 decode any -\n", "t")
    with pytest.raises(ValueError, match="operator table line 1: unknown operator 'softmaxx'"):
        optable.activate_text("matmul Q4_0 decode any - ref;softmaxx * * any - ref", "t")
    with pytest.raises(ValueError, match="line 1: bad shape class 'rows>=9999999999999999999'"):
        optable.activate_text("matmul Q4_0 decode rows>=9999999999999999999 - ref", "t")


def test_operators_follow_the_table_activated_last(restore_optable, text_model_path):
    """Attention and the element-wise operators come from the table active when a model loads, also
    after a switch in the same process (they were fixed at the first use: a robot-profile bench run
    after a default one kept the AVX-512 attention); a model loaded before keeps its own."""
    optable.activate_text(optable._builtin_text(), "built-in")
    first = _engine.kernel_variants()["attention"]
    before = _engine.Decoder(_engine.GGUFFile(str(text_model_path)), threads=1, n_ctx=8)
    optable.activate_text("attention  *  *  any  -  ref\n", "reference attention")
    assert _engine.kernel_variants()["attention"] == "ref"
    after = _engine.Decoder(_engine.GGUFFile(str(text_model_path)), threads=1, n_ctx=8)
    assert "attention=ref;" in after.variants()
    assert f"attention={first};" in before.variants()
    optable.activate_text(optable._builtin_text(), "built-in")
    assert _engine.kernel_variants()["attention"] == first == _engine.choose("attention")


def test_robot_table_is_shipped_and_runs_no_avx512(restore_optable):
    """config/optable-robot-avx2-vnni.tsv is the robot table (regenerate it when optable.tsv
    changes: python -m edgevlm_ros.engine.optable robot > config/optable-robot-avx2-vnni.tsv)."""
    text = optable.robot_table()
    shipped = ROOT / "config" / optable.ROBOT_TABLE_NAME
    assert shipped.read_text(encoding="utf-8") == text, "regenerate " + str(shipped)
    rules = [ln.split() for ln in text.splitlines() if ln and not ln.startswith("#")]
    assert rules and all(len(r) == 6 for r in rules)
    assert any("avxvnni" in r[4] for r in rules) and any(r[5] == "avx2_gemm" for r in rules)
    for r in rules:
        assert r[4] == "-" or set(r[4].split(",")) <= set(optable.ROBOT_FEATURES.split(",")), r
    # The built-in rules with AVX-512 / AMX are the ones left out, nothing else.
    builtin = optable.restrict_rules(optable._builtin_text(), [f for f in _engine.cpu_features()])
    assert len(builtin) > len(rules)
    assert all(any(f.startswith(("avx512", "amx", "neon", "dotprod")) for f in r.split()[4].split(","))
               for r in builtin if r.split() not in rules)
    optable.activate(shipped)
    cpu = _engine.cpu_features()
    if not cpu["avx2"]:
        pytest.skip("needs an AVX2 CPU")
    want = "avxvnni_q8act_x8" if cpu["avxvnni"] else "avx2_q8act_x8"
    for fmt in ("Q4_0", "Q4_1", "Q8_0"):
        assert _engine.choose_matmul(fmt, "decode", 576, 576) == want
    for fmt in ("F32", "F16", "Q8_0"):
        assert _engine.choose_matmul(fmt, "prefill", 96, 576) == "avx2_gemm"


def test_bandwidth_floors_say_which_binds():
    model = {"mib": 92.0, "all_gbs": 30.0}
    dram = {"mib": 1024.0, "all_gbs": 12.0}
    fl = hw_limits.bandwidth_floors(96_000_000, model, dram)
    assert fl["binds"] == "model_sized" and fl["floor_ms"] == pytest.approx(3.2)
    assert fl["dram"]["floor_ms"] == pytest.approx(8.0)
    assert hw_limits.bandwidth_floors(96_000_000, dict(model, all_gbs=10.0), dram)["binds"] == "dram"


def test_peer_lib_choice(tmp_path, monkeypatch):
    empty = tmp_path / "none"
    robot_cpu = dict.fromkeys(optable.ROBOT_FEATURES.split(","), True)
    lib, why = bench.choose_peer_lib(empty, "robot", robot_cpu)
    assert lib is None and "install_bench_extra.sh --robot" in why
    built = tmp_path / "robot"
    built.mkdir()
    (built / "libllama.so").write_bytes(b"")
    lib, why = bench.choose_peer_lib(built, "robot", dict(robot_cpu, avxvnni=False))
    assert lib is None and "lacks avxvnni" in why
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # not loaded in this process
    assert bench.choose_peer_lib(built, "robot", robot_cpu)[0] == built
    assert bench.choose_peer_lib(built, "native", {})[0] == built  # --peer-lib: any build, as given


def test_bench_robot_profile_quick(capsys, monkeypatch, tmp_path, text_model_path, restore_optable):
    """--profile robot: our engine on the robot table (no AVX-512 / AMX variant serves anything),
    both floors printed; the robot llama.cpp build is looked for where the script puts it."""
    monkeypatch.setenv("EDGEVLM_ROBOT_LLAMA_LIB", str(tmp_path / "no-build"))
    monkeypatch.delenv("LLAMA_CPP_LIB_PATH", raising=False)
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    rc = bench.main(["--quick", "--model", str(text_model_path), "--profile", "robot", "--no-vision", "--no-rss",
                     "--prefill-tokens", "8", "--decode-tokens", "4", "--bandwidth-mib", "16", "--json"])
    assert rc == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert result["profile"]["name"] == "robot" and result["optable"].startswith("robot profile")
    assert "no libllama.so in" in result["peer_status"]
    assert "LLAMA_CPP_LIB_PATH" not in __import__("os").environ
    used = result["ours_variants"]
    assert "avx512" not in used and "amx" not in used and "avx2" in used, used
    rf = result["roofline"]
    wb = rf["weight_bytes_per_token"]["total"]
    assert rf["floors"]["model_sized"]["mib"] == pytest.approx(wb / 2**20)
    assert rf["floors"]["dram"]["mib"] == 16.0
    assert rf["floor_ms"] == min(rf["floors"]["model_sized"]["floor_ms"], rf["floors"]["dram"]["floor_ms"])
    assert "floor (model-sized buffer" in captured.err and "floor (DRAM buffer, 16 MiB)" in captured.err
    assert "floor binds" in captured.err and "profile robot" in captured.err


def test_bench_optable_file_option(tmp_path, text_model_path, restore_optable):
    """--optable FILE: our engine runs that table (here: AVX2 f32-activation kernels for every
    product, which no built-in rule picks for these formats), over the profile's."""
    import argparse

    if not _engine.cpu_features()["avx2"]:
        pytest.skip("needs an AVX2 CPU")
    table = tmp_path / "f32act.tsv"
    table.write_text("# every product; one kernel\nmatmul  *  *  any  avx2,fma,f16c  avx2_f32act\n", encoding="utf-8")
    parser = bench.add_bench_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--model", str(text_model_path), "--profile", "robot", "--optable", str(table),
                              "--no-peer"])
    cfg = bench.config_from_args(args)
    assert bench.apply_profile(cfg) == {"name": "robot", "optable": str(table)}  # --no-peer: no library chosen
    assert _engine.optable_source() == str(table)
    for fmt in ("Q4_1", "Q8_0"):
        for phase in ("decode", "prefill"):
            assert _engine.choose_matmul(fmt, phase, 576, 576) == "avx2_f32act"
    with pytest.raises(SystemExit):
        parser.parse_args(["--profile", "xeon"])


def test_install_bench_extra_arguments():
    import subprocess

    script = ROOT / "scripts" / "install_bench_extra.sh"

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(script), *args], capture_output=True, text=True, timeout=30, check=False)

    assert "--robot" in run("--help").stdout and "robot llama-mtmd-cli" in run("--help").stdout
    for args, msg in ((["--sdist", "x"], "--sdist goes with --robot"),
                      (["--robot", "--sdist"], "--sdist needs a path"),
                      (["--robot", "--sdist", "/nonexistent/sdist"], "not found"),
                      (["--bogus"], "unknown argument")):
        proc = run(*args)
        assert proc.returncode == 2 and msg in proc.stderr, (args, proc.stderr)


def test_mtmd_cli_of_the_profile_comes_first(tmp_path, monkeypatch):
    """The robot profile's llama-mtmd-cli (in its peer folder) is preferred to the venv's native one;
    --mtmd-cli and $EDGEVLM_LLAMA_MTMD_CLI still win; a folder without one falls back."""
    native, robot = tmp_path / "venv" / "llama-mtmd-cli", tmp_path / "robot" / "llama-mtmd-cli"
    for f in (native, robot):
        f.parent.mkdir()
        f.write_text("#!/bin/sh\n")
        f.chmod(0o755)
    monkeypatch.delenv("EDGEVLM_LLAMA_MTMD_CLI", raising=False)
    monkeypatch.setattr(bench.sys, "executable", str(native.parent / "python"))
    assert bench.find_mtmd_cli(None, robot.parent) == str(robot)
    assert bench.find_mtmd_cli(None, tmp_path / "empty") == str(native)
    assert bench.find_mtmd_cli(str(native), robot.parent) == str(native)
    monkeypatch.setenv("EDGEVLM_LLAMA_MTMD_CLI", str(native))
    assert bench.find_mtmd_cli(None, robot.parent) == str(native)


def test_bench_peer_lib_loads_that_build(tmp_path, text_model_path):
    """--peer-lib DIR: llama.cpp is the libllama in DIR (through LLAMA_CPP_LIB_PATH, with the
    libggml beside it), in a bench process of its own (this one may have loaded llama_cpp)."""
    import importlib.util
    import os
    import shutil
    import subprocess

    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        pytest.skip("llama-cpp-python is not installed (scripts/setup.sh builds it)")
    lib = tmp_path / "peer-lib"
    shutil.copytree(Path(spec.origin).parent / "lib", lib, symlinks=True)
    out = tmp_path / "bench.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("LLAMA_CPP_LIB_PATH", None)
    proc = subprocess.run([sys.executable, "-m", "edgevlm_ros.tools.bench", "--quick", "--model", str(text_model_path),
                           "--peer-lib", str(lib), "--no-vision", "--no-rss", "--prefill-tokens", "4",
                           "--decode-tokens", "2", "--bandwidth-mib", "8", "--peer-extra-bufts", "off",
                           "--json", str(out)], capture_output=True, text=True, env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["profile"]["peer_lib"] == str(lib)
    libs = result["peer_libraries"]
    assert any(Path(p).name.startswith("libllama") for p in libs), libs
    assert all(p.startswith(str(lib)) for p in libs), libs
    assert result["rows"][0]["peer"] > 0 and "libraries: " + str(lib) in proc.stdout


GEMMA = ROOT / "models" / "gemma-3-270m-q4_k_m.gguf"


def test_bench_gemma_text_only(capsys):
    """The Gemma 3 270M Q4_K_M file: a text-only base model (no chat template, no mmproj); the
    bench feeds its prompts raw and counts its tied 262k x 640 Q8_0 head in the bytes a token reads."""
    if not GEMMA.is_file():
        pytest.skip(f"{GEMMA} is missing (scripts/fetch_models.sh fetches it)")
    rc = bench.main(["--quick", "--model", str(GEMMA), "--no-peer", "--no-vision", "--no-rss",
                     "--prefill-tokens", "4", "--decode-tokens", "2", "--bandwidth-mib", "8", "--json"])
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    wb = result["roofline"]["weight_bytes_per_token"]
    assert wb["head_type"] == "Q8_0" and wb["head"] == 262144 * 640 // 32 * 34
    assert set(wb["layer_types"]) >= {"Q4_K", "Q6_K", "Q5_0"}
    assert result["roofline"]["floors"]["model_sized"]["mib"] == pytest.approx(wb["total"] / 2**20)
    assert {r["key"]: r["ours"] for r in result["rows"]}["decode_2"] > 0


def test_peer_prefix_cache_on_a_recurrent_model(tmp_path):
    """llama.cpp cannot cut a recurrent state back to the prefix (llama_memory_seq_rm refuses), so
    the bench's peer saves the prefix's sequence state once and restores it per request: each
    cached request then gives the logits of the whole prompt run at once."""
    llama_cpp = pytest.importorskip("llama_cpp",
                                    reason="llama-cpp-python is not installed (scripts/setup.sh builds it)")
    import numpy as np

    sys.path.insert(0, str(ROOT / "test"))
    import qwen35_tiny

    path = tmp_path / "qwen35.gguf"
    qwen35_tiny.write(path, tied=True, layer_list=False, vocab=True)
    from edgevlm_ros.tools.llama_peer import LlamaPeer

    peer = LlamaPeer(llama_cpp, path, 1, 64, False, False)
    try:
        assert peer.recurrent
        ids = [1, 2, 3, 4, 5, 6, 7, 8, 9]

        def logits():
            ptr = llama_cpp.llama_get_logits_ith(peer.ctx, -1)
            return np.ctypeslib.as_array(ptr, shape=(peer.n_vocab,)).copy()

        peer.ttft(ids)
        whole = logits()
        assert not llama_cpp.llama_memory_seq_rm(peer.mem, 0, 5, -1)  # why the state is restored instead
        cached = []
        for _ in range(3):
            peer.ttft_cached(5, ids)
            cached.append(logits())
        np.testing.assert_array_equal(cached[0], cached[2])  # every request starts from the same state
        np.testing.assert_allclose(cached[0], whole, rtol=1e-4, atol=1e-5)
    finally:
        peer.close()


# -- MiniCPM-V 4.6: the encode of one 448 slice, its flop count and the GEMM peak -----------------

# A random MiniCPMV4_6ForConditionalGeneration at small widths (so transformers' forward, our encode
# and llama.cpp's take a fraction of a second) but the real slice: 448 px at patch 14 (1024 tokens),
# 3 vision layers with the window merger after layer 0, eager attention so torch's flop counter sees
# every product; its text half 4 layers of width 32 with the real vocabulary and MiniCPM-V's tokenizer
# (minicpmv_fixtures), so load_vlm and llama-mtmd-cli both run the pair.
TINY_VISION = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4}
TINY_TEXT = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1,
             "head_dim": 64, "linear_num_key_heads": 2, "linear_num_value_heads": 2, "linear_key_head_dim": 16,
             "linear_value_head_dim": 16}
TINY_MROPE = [3, 3, 2]  # 16 rotary dimensions (head_dim 64, partial_rotary_factor 0.25)


@pytest.fixture(scope="module")
def tiny_minicpmv(tmp_path_factory):
    """(the transformers model, {"16x", "4x": our mmproj of it, "text": our text GGUF})."""
    torch = pytest.importorskip("torch")
    import shutil

    sys.path.insert(0, str(ROOT / "test"))
    try:
        from hf_fixtures import _MARKER
        from minicpmv_fixtures import minicpmv_config_dict, minicpmv_tokenizer_dir
    finally:
        sys.path.pop(0)
    from transformers import MiniCPMV4_6Config, MiniCPMV4_6ForConditionalGeneration
    from transformers.models.minicpmv4_6.image_processing_pil_minicpmv4_6 import MiniCPMV4_6ImageProcessorPil

    from edgevlm_ros.tools.convert_minicpmv import convert_minicpmv_mmproj
    from edgevlm_ros.tools.convert_qwen35 import convert_qwen35

    cfg = minicpmv_config_dict(3, 0, 4)
    cfg["vision_config"].update(TINY_VISION)
    text = cfg["text_config"]
    text.update(TINY_TEXT, rope_parameters=dict(text["rope_parameters"], mrope_section=TINY_MROPE))
    config = MiniCPMV4_6Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    config._attn_implementation = config.vision_config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = MiniCPMV4_6ForConditionalGeneration(config).eval()
    hf = tmp_path_factory.mktemp("tiny-minicpmv")
    model.save_pretrained(str(hf))
    MiniCPMV4_6ImageProcessorPil().save_pretrained(str(hf))
    for f in minicpmv_tokenizer_dir().iterdir():
        if f.is_file() and f.name != _MARKER:
            shutil.copy2(f, hf / f.name)
    files = {m: convert_minicpmv_mmproj(hf, hf / m, "f32", downsample_mode=m) for m in ("16x", "4x")}
    return model, {**files, "text": convert_qwen35(hf, hf / "text", "f32")}


_TORCH_FLOPS: dict[tuple[int, int, str], int] = {}


def _torch_flops(model, gh: int, gw: int, mode: str) -> int:
    """torch's own count (FlopCounterMode: convolutions, addmm, bmm) of transformers' encode of one
    gh x gw-patch slice (counted once per module run)."""
    if (gh, gw, mode) in _TORCH_FLOPS:
        return _TORCH_FLOPS[gh, gw, mode]
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    pv = torch.randn(1, 3, 14, gh * gw * 14)  # the processor's packing: one slice's patches side by side
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model.model.get_image_features(pixel_values=pv, target_sizes=torch.tensor([[gh, gw]]), downsample_mode=mode)
    _TORCH_FLOPS[gh, gw, mode] = int(counter.get_total_flops())
    return _TORCH_FLOPS[gh, gw, mode]


@pytest.mark.parametrize(("mode", "grid"), [("16x", (32, 32)), ("4x", (32, 32)), ("16x", (8, 12))])
def test_minicpmv_flop_count_matches_torch(tiny_minicpmv, mode, grid):
    """vision_cost's count, from the mmproj alone, equals torch's flop counter on transformers' forward."""
    from edgevlm_ros.tools import vision_cost

    model, mmproj = tiny_minicpmv
    vis = _engine.VisionModel(_engine.GGUFFile(str(mmproj[mode])), 1)
    shape = vision_cost.MiniCPMVShape.from_mmproj(mmproj[mode], vis.config)
    assert (shape.insert_layer, shape.merger_ffn) == ((0, 4 * 96) if mode == "16x" else (None, 0))
    ours = vision_cost.minicpmv_slice_flops(shape, *grid)
    assert ours["total"] == _torch_flops(model, *grid, mode)
    assert ours["total"] == sum(v for k, v in ours.items() if k not in ("total", "attention"))


def test_bench_minicpmv_rows(tiny_minicpmv, capsys, monkeypatch):
    """--mmproj of a MiniCPM-V 4.6 pair: the encode of one 448 slice (encode_slice) with its share of
    the FP32 GEMM peak, and the first token of a 640x480 frame through load_vlm, appear with numbers
    (the flops in the JSON being the independent count); where llama-mtmd-cli is installed, its numbers
    too, from the same pair and frame, with the same views and image tokens as ours."""
    model, files = tiny_minicpmv
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # the text rows' peer: not what this test is about
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # llama-mtmd-cli's threads on a shared machine (restored after)
    rc = bench.main(["--quick", "--model", str(files["text"]), "--mmproj", str(files["16x"]), "--no-rss",
                     "--prefill-tokens", "4", "--decode-tokens", "2", "--bandwidth-mib", "8", "--json"])
    assert rc == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    by_key = {r["key"]: r for r in result["rows"]}
    encode, share, ttft = by_key["vision_encode"], by_key["vision_encode_peak"], by_key["frame_ttft"]
    assert encode["label"] == "vision encode, one 448x448 slice" and encode["ours"] > 0
    vision = result["vision"]
    assert vision["flops"]["total"] == _torch_flops(model, 32, 32, "16x")
    peak = vision["gemm_peak"]
    assert peak["gflops"] > 0 and set(peak["by_format"]) == {"F32"}  # the tiny tower is F32
    assert share["ours"] == pytest.approx(vision["flops"]["total"] / (encode["ours"] / 1e3) / peak["gflops"] / 1e7)
    assert "| vision encode: FLOP/s / FP32 GEMM peak | % |" in captured.err
    ours_stages = result["frame_ttft"]["ours_stages_ms"][0]
    assert ttft["ours"] == ours_stages["total"] > 0 and ours_stages["views"] == 3  # source view + 1x2 slices
    assert ttft["ours"] >= ours_stages["vision"] + ours_stages["prefill"]
    if vision["peer_cli"] is None:
        return
    assert encode["peer"] > 0 and share["peer"] > 0 and ttft["peer"] > 0, (encode, ttft)
    peer = result["frame_ttft"]["peer"][0]
    assert len(peer["encode_ms"]) == 3 and peer["image_tokens"] == ours_stages["n_image"], peer


MTMD_LOG = """\
0.07.196.586 W       For normal use cases, please use the standard llama-cli
0.08.744.189 I encoding mtmd batch, n_chunks = 1 (done = 1, total = 7)
0.24.013.985 I mtmd batch encoding done in 15270 ms
0.24.014.005 I decoding image batch 1/1, n_tokens_batch = 63
0.25.840.787 I image decoded (batch 1/1) in 1827 ms
0.43.497.086 I encoding mtmd batch, n_chunks = 1 (done = 5, total = 7)
0.57.307.810 I mtmd batch encoding done in 13811 ms
0.57.307.828 I decoding image batch 1/1, n_tokens_batch = 70
0.59.320.778 I image decoded (batch 1/1) in 2013 ms

1.00.260.846 I llama_perf_context_print:        load time =    2931.87 ms
1.00.260.867 I llama_perf_context_print: prompt eval time =       0.00 ms /     1 tokens
"""


def test_parse_mtmd_log():
    """llama-mtmd-cli's -lv 4 lines (as it printed them for a 640x480 frame, trimmed): the first token's
    time runs from the warning before the turn to the perf report, minutes included."""
    got = bench.parse_mtmd_log(MTMD_LOG)
    assert got is not None
    assert got["ttft_ms"] == pytest.approx(60260.846 - 7196.586)
    assert got["encode_ms"] == [15270.0, 13811.0] and got["image_decode_ms"] == [1827.0, 2013.0]
    assert got["image_tokens"] == 133
    assert bench.parse_mtmd_log(MTMD_LOG.replace("llama_perf_context_print", "x")) is None  # no end: no number


def test_gemm_peak_follows_the_profile(restore_optable):
    """The peak is the GEMM of the active operator table: on the robot profile no AVX-512 / AMX one."""
    import argparse

    from edgevlm_ros.tools import vision_cost

    if not _engine.cpu_features()["avx2"]:
        pytest.skip("needs an AVX2 CPU")
    args = bench.add_bench_arguments(argparse.ArgumentParser()).parse_args(["--profile", "robot", "--no-peer"])
    bench.apply_profile(bench.config_from_args(args))
    peak = vision_cost.measure_gemm_peak(["F32", "F16"], 2, (256, 256, 64), repeats=1)
    assert peak["variant"] == "avx2_gemm" and set(peak["by_format"]) == {"F32", "F16"}
    assert peak["gflops"] == max(p["gflops"] for p in peak["by_format"].values()) > 0
