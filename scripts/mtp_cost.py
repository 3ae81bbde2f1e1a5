#!/usr/bin/env python3
"""What drafting from a model's multi-token-prediction block costs, and what it needs to pay (issue 19).

A file with an MTP block (Qwen3.5's `nextn` tensors) decodes N tokens after a fixed prompt in two kinds
of child process, alternated REPS times: `plain` (the block not loaded) and `mtp` (loaded: it runs
beside the decoder on every position, and generate() drafts from it when its policy expects a gain).
The `mtp` child also times, on the same sequence state, one draft step of the block (draft_mtp, k=1)
and decode-phase passes of 1 + k rows (k = 1..7, the verification pass speculation runs). Every run's
tokens must equal plain greedy's. Prints ms per decoded token (median), the measured costs in one-row
steps, and from them the acceptance rate the block's drafts need before a pass of k drafts pays:
gain(k, p) = (1 + p + ... + p^k) / (pass(k) + k * draft), p the chance a draft is accepted given the
one before it was.

    scripts/mtp_cost.py MODEL [--tokens 64] [--reps 3] [--threads 2] [--json OUT]
    EDGEVLM_OPTABLE=config/optable-robot-avx2-vnni.tsv scripts/mtp_cost.py MODEL   # the robot profile

A random-weight file's block never predicts the decoder's tokens, so `mtp` there measures the price
of having it on where its drafts fail (the catch-up rows and the policy's probes); what it gains
with a trained block follows from the acceptance its drafts reach, through the table printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from edgevlm_ros import _engine  # noqa: E402
from edgevlm_ros.engine.text_model import TextModel  # noqa: E402
from edgevlm_ros.tools.bench import _prefill_ids  # noqa: E402

PROMPT_TOKENS = 40
MAX_DRAFT = 7


def _median_ms(fn: Any, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def child(args: argparse.Namespace) -> dict[str, Any]:
    mtp = args.child == "mtp"
    model = TextModel(args.model, threads=args.threads, n_ctx=PROMPT_TOKENS + args.tokens + 64, mtp=mtp)
    if mtp and not model.native.has_mtp:
        raise SystemExit(f"{args.model}: the file has no multi-token-prediction block")
    native = model.native
    prompt = np.asarray(_prefill_ids(model, PROMPT_TOKENS), dtype=np.int32)
    native.reset()
    r = native.generate(prompt, args.tokens, [], 0.0, None, None)
    out: dict[str, Any] = {"tokens": [int(t) for t in r["tokens"]], "ms_per_token": r["decode_ms"] / (args.tokens - 1),
                           "optable": _engine.optable_source(), "variants": native.variants(),
                           "passes": int(r["spec_passes"]), "drafted": int(r["spec_drafted"]),
                           "accepted": int(r["spec_accepted"])}
    if mtp:
        # On the sequence the call left: one draft step, and passes of 1 + k rows (state restored after each).
        tok = out["tokens"][-1]
        snap = native.snapshot()
        out["draft_ms"] = _median_ms(lambda: native.draft_mtp(tok, 1), 9)
        rows = np.asarray(out["tokens"][: 1 + MAX_DRAFT], dtype=np.int32)

        def pass_ms(n: int) -> float:
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                native.forward(rows[:n], all_logits=True, decode_phase=True)
                times.append((time.perf_counter() - t0) * 1e3)
                native.restore(snap)  # not timed
            return statistics.median(times)

        out["pass_ms"] = [pass_ms(n) for n in range(1, 2 + MAX_DRAFT)]
    return out


def _gain(p: float, k: int, pass_cost: list[float], draft: float) -> float:
    return sum(p**i for i in range(k + 1)) / (pass_cost[k] + k * draft)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None, help="write the results here too")
    ap.add_argument("--child", choices=("plain", "mtp"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.tokens < 2 or args.reps < 1:
        ap.error("--tokens must be >= 2 and --reps >= 1")
    if args.child:
        print(json.dumps(child(args)))
        return 0
    runs: dict[str, list[dict[str, Any]]] = {"plain": [], "mtp": []}
    for _ in range(args.reps):
        for kind in runs:  # alternated, each in a fresh process
            cmd = [sys.executable, str(Path(__file__).resolve()), str(args.model), "--tokens", str(args.tokens),
                   "--threads", str(args.threads), "--child", kind]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                print(done.stderr[-3000:], file=sys.stderr)
                return 1
            runs[kind].append(json.loads(done.stdout.strip().splitlines()[-1]))
    want = runs["plain"][0]["tokens"]
    for kind, rs in runs.items():
        for r in rs:
            if r["tokens"] != want:
                print(f"error: a {kind} run's tokens differ from plain greedy's", file=sys.stderr)
                return 1
    plain_ms = statistics.median(r["ms_per_token"] for r in runs["plain"])
    mtp_ms = statistics.median(r["ms_per_token"] for r in runs["mtp"])
    one = statistics.median(r["pass_ms"][0] for r in runs["mtp"])
    passes = [statistics.median(r["pass_ms"][k] for r in runs["mtp"]) / one for k in range(1 + MAX_DRAFT)]
    draft = statistics.median(r["draft_ms"] for r in runs["mtp"]) / one
    print(f"{args.model.name}: {args.tokens} tokens, {args.threads} threads, median of {args.reps} (alternated); "
          f"operator table: {runs['mtp'][0]['optable']} ($EDGEVLM_OPTABLE picks another, e.g. "
          "config/optable-robot-avx2-vnni.tsv)")
    print(f"  plain decode                      {plain_ms:7.2f} ms/token")
    m = runs["mtp"][0]
    print(f"  block on, its drafts failing      {mtp_ms:7.2f} ms/token  ({mtp_ms / plain_ms:.3f}x plain; "
          f"{m['passes']} passes, {m['accepted']}/{m['drafted']} drafts accepted)")
    print(f"  one-row step with the block on    {one:7.2f} ms  ({one / plain_ms:.3f}x a plain step)")
    print(f"  one draft step of the block       {draft:7.3f} one-row steps")
    costs = ", ".join(f"k={k} {passes[k]:.2f}" for k in range(1, 1 + MAX_DRAFT))
    print(f"  pass of 1 + k rows (one-row steps): {costs}")
    print("  expected speed-up over a block-on step, best k, by acceptance p:")
    table = {}
    for p in (0.5, 0.6, 0.7, 0.8, 0.9):
        k, g = max(((k, _gain(p, k, passes, draft)) for k in range(1, 1 + MAX_DRAFT)), key=lambda kg: kg[1])
        table[p] = (k, g)
        print(f"    p {p:.1f}: k={k} {g:.2f}x")
    breakeven = next((p / 100 for p in range(0, 101) if _gain(p / 100, 1, passes, draft) >= 1.0), None)
    print(f"  break-even acceptance for one draft a pass: {breakeven}")
    if args.json:
        args.json.write_text(json.dumps({"model": str(args.model), "tokens": args.tokens, "threads": args.threads,
                                         "plain_ms_per_token": plain_ms, "mtp_ms_per_token": mtp_ms,
                                         "one_row_step_ms": one, "draft_step": draft, "pass": passes,
                                         "best_k_gain": {str(p): kg for p, kg in table.items()},
                                         "breakeven_p": breakeven, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
