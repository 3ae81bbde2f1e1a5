"""Reference numbers for Qwen3.5's multi-token-prediction (MTP, "nextn") head, computed by llama.cpp itself.

Runs llama.cpp's own MTP graph (`llama_model_qwen35::graph_mtp`) through the low-level bindings of the installed
llama-cpp-python (0.3.36): nothing here reimplements the math, every number comes out of libllama. Our engine's MTP
implementation is compared to these numbers in tests, in process (`llama_cpp_mtp`) or through the CLI:

    python test/llama_mtp_reference.py GGUF --prompt 1,2,3 --k 3 --out ref.npz

which writes the fields of `MtpReference` to an .npz and exits 0.

Conventions (those of llama.cpp's `common_speculative_impl_draft_mtp` in common/speculative.cpp):

* one model, loaded with `load_mtp = true`, and two contexts on it: the target (`LLAMA_CONTEXT_TYPE_DEFAULT`) and
  the MTP draft context (`LLAMA_CONTEXT_TYPE_MTP`, `n_rs_seq = 0`, `ctx_other` = the target, as common does). For
  Qwen3.5 the MTP context does NOT share the target's memory: it owns a plain attention KV cache for the one MTP
  layer (`llama_get_ctx_other` stays NULL, the driver's `is_mem_shared` is false), filled by its own decodes;
* "h" is the target's `h_nextn`: the last layer's output after the final RMSNorm (`output_norm`), the row the LM head
  multiplies. The target decodes the whole prompt at positions 0..n-1 in one batch with nextn embeddings on and
  unmasked (`llama_set_embeddings_nextn(ctx, true, false)`), so every position's h is readable; only the last
  position's logits are requested;
* MTP input at position p = token embedding of the token at p + the h of position p - 1 (zeros for p = 0: the driver's
  `pending_h` starts as zeros). The prompt goes through the MTP context teacher-forced in one batch, positions
  0..n-1, logits requested for every position (`prompt_mtp_logits[p]` predicts the token at p + 2);
* the draft chain continues in the MTP context: step 0 decodes (next_token, position n, h_last), where next_token is
  the target's argmax after the prompt and h_last the target's h at position n - 1; step i > 0 decodes (draft i - 1,
  position n + i, the MTP's own `h_nextn` of step i - 1, i.e. its `shared_head_norm` output). Each step's token is
  the argmax (first maximum) of its logits, not llama.cpp's top-k sampler, and k steps give k drafts;
* CPU only, F32 weights and compute; n_ubatch = n_batch so each pass is a single ubatch. Attention is F32 throughout
  by default: F32 KV caches and flash attention off (llama.cpp's flash-attention path casts K and V to F16 whatever
  the cache type, see build_attn_mha in src/llama-graph.cpp). `f32_attention=False` gives llama.cpp's own defaults
  instead (F16 KV caches, flash attention auto, i.e. on for the CPU), whose attention rounds K and V to F16.

The staging API that MTP needs (`llama_set_embeddings_nextn`, `llama_get_embeddings_nextn[_ith]`,
`llama_get_ctx_other`, from src/llama-ext.h) is exported from libllama.so under C++ mangled names only; it is bound
here with ctypes from the library the package already loaded.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass
class MtpReference:
    next_token: int  # the target's greedy token after the prompt (argmax of its last logits)
    target_logits: np.ndarray  # [vocab] the target's logits at the prompt's last position
    h_last: np.ndarray  # [n_embd] the target's h_nextn (final-normed hidden) at the prompt's last position
    prompt_mtp_logits: np.ndarray  # [n_prompt, vocab] MTP logits at each prompt position p, teacher-forced:
    #                                input token prompt[p] with the target's h of p - 1 (zeros for p = 0)
    drafts: list[int]  # k tokens chained greedily (argmax) from (next_token, position n_prompt, h_last)
    draft_logits: np.ndarray  # [k, vocab] the MTP logits of each chained step
    target_h: np.ndarray | None = None  # [n_prompt, n_embd] the target's h_nextn at every prompt position
    draft_h: np.ndarray | None = None  # [k, n_embd] the MTP's own h_nextn of each chained step

    def arrays(self) -> dict[str, np.ndarray]:
        """The fields as arrays, for np.savez."""
        out = {
            "next_token": np.asarray(self.next_token, dtype=np.int64),
            "target_logits": self.target_logits,
            "h_last": self.h_last,
            "prompt_mtp_logits": self.prompt_mtp_logits,
            "drafts": np.asarray(self.drafts, dtype=np.int64),
            "draft_logits": self.draft_logits,
        }
        if self.target_h is not None:
            out["target_h"] = self.target_h
        if self.draft_h is not None:
            out["draft_h"] = self.draft_h
        return out


# --- libllama access -------------------------------------------------------------------------------------------------

_LOG_CALLBACK: Any = None  # kept alive: libllama holds the pointer
_STAGING: dict[str, Any] = {}

_MANGLED = {  # name -> (mangled symbol, argtypes, restype), from `nm -D libllama.so`
    "set_embeddings_nextn": (
        "_Z26llama_set_embeddings_nextnP13llama_contextbb",
        [ctypes.c_void_p, ctypes.c_bool, ctypes.c_bool],
        None,
    ),
    "get_embeddings_nextn": (
        "_Z26llama_get_embeddings_nextnP13llama_context",
        [ctypes.c_void_p],
        ctypes.POINTER(ctypes.c_float),
    ),
    "get_embeddings_nextn_ith": (
        "_Z30llama_get_embeddings_nextn_ithP13llama_contexti",
        [ctypes.c_void_p, ctypes.c_int32],
        ctypes.POINTER(ctypes.c_float),
    ),
    "get_ctx_other": ("_Z19llama_get_ctx_otherP13llama_context", [ctypes.c_void_p], ctypes.c_void_p),
}


def _llama() -> Any:
    """The low-level bindings module (`llama_cpp.llama_cpp`), with the staging functions bound on first use."""
    import llama_cpp.llama_cpp as lc

    if not _STAGING:
        for name, (symbol, argtypes, restype) in _MANGLED.items():
            fn = getattr(lc._lib, symbol)
            fn.argtypes = argtypes
            fn.restype = restype
            _STAGING[name] = fn
    return lc


def _quiet_logs(lc: Any, verbose: bool) -> None:
    """Keep libllama's log on stderr only for errors (everything when verbose)."""
    global _LOG_CALLBACK
    if _LOG_CALLBACK is None:
        state = {"show": False}

        def log(level: int, text: bytes | None, _user: Any) -> None:
            if level != 5:  # GGML_LOG_LEVEL_CONT continues the previous message
                state["show"] = verbose or level >= 4  # GGML_LOG_LEVEL_ERROR
            if state["show"] and text:
                sys.stderr.write(text.decode("utf-8", "replace"))

        _LOG_CALLBACK = lc.llama_log_callback(log)
        lc.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))


def _floats(ptr: Any, n: int, what: str) -> np.ndarray:
    if not ptr:
        raise RuntimeError(f"llama.cpp returned no {what}")
    return np.ctypeslib.as_array(ptr, shape=(n,)).astype(np.float32, copy=True)


@dataclass
class _Session:
    lc: Any
    model: Any
    target: Any
    mtp: Any
    n_vocab: int
    n_embd: int

    def decode(self, ctx: Any, tokens: Sequence[int], positions: Sequence[int], outputs: Sequence[bool],
               h: np.ndarray | None = None) -> None:
        """One llama_process(DECODE) of a single-sequence batch; h (if any) gives each entry its "h" row, attached
        as the entry's embedding next to its token id (as common_batch::set_embd does for the MTP hook)."""
        lc = self.lc
        batch = lc.llama_batch_ext_init(ctx)
        if not batch:
            raise RuntimeError("llama_batch_ext_init failed")
        try:
            rows = None if h is None else np.ascontiguousarray(h, dtype=np.float32).reshape(len(tokens), self.n_embd)
            for i, (tok, pos, out) in enumerate(zip(tokens, positions, outputs, strict=True)):
                idx = lc.llama_batch_ext_add_token(batch, 0, int(tok))
                if idx != i:
                    raise RuntimeError(f"llama_batch_ext_add_token({tok}) returned {idx} (n_batch too small?)")
                p = lc.llama_pos(int(pos))
                if not lc.llama_batch_ext_set_pos(batch, idx, ctypes.byref(p)):
                    raise RuntimeError("llama_batch_ext_set_pos failed")
                if rows is not None:
                    embd = lc.llama_embd(rows[i].ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, self.n_embd)
                    if not lc.llama_batch_ext_set_embd_token(batch, idx, embd):  # copies the row
                        raise RuntimeError("llama_batch_ext_set_embd_token failed")
                if out and not lc.llama_batch_ext_set_output_logits(batch, idx, True):
                    raise RuntimeError("llama_batch_ext_set_output_logits failed")
            rc = lc.llama_process(ctx, lc.LLAMA_PROCESS_TYPE_DECODE, batch)
            if rc != 0:
                raise RuntimeError(f"llama_process returned {rc}")
        finally:
            lc.llama_batch_ext_free(batch)

    def logits(self, ctx: Any, i: int) -> np.ndarray:
        return _floats(self.lc.llama_get_logits_ith(ctx, i), self.n_vocab, f"logits for batch entry {i}")

    def target_prompt(self, prompt: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """The target on the prompt (positions 0..n-1): (logits of the last position [vocab], h of every
        position [n, n_embd])."""
        n = len(prompt)
        self.decode(self.target, prompt, range(n), [i == n - 1 for i in range(n)])
        h = _floats(_STAGING["get_embeddings_nextn"](self.target), n * self.n_embd, "target h_nextn")
        return self.logits(self.target, n - 1), h.reshape(n, self.n_embd)

    def mtp_step(self, tokens: Sequence[int], positions: Sequence[int], h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The MTP context on (tokens[i], positions[i], h[i]), all outputs: (logits [n, vocab], MTP h_nextn of each
        entry [n, n_embd])."""
        n = len(tokens)
        self.decode(self.mtp, tokens, positions, [True] * n, h)
        logits = np.stack([self.logits(self.mtp, i) for i in range(n)])
        get_h = _STAGING["get_embeddings_nextn_ith"]
        hs = np.stack([_floats(get_h(self.mtp, i), self.n_embd, f"MTP h_nextn of entry {i}") for i in range(n)])
        return logits, hs

    def clear_mtp(self) -> None:
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.mtp), True)

    def mtp_shares_target_memory(self) -> bool:
        return _STAGING["get_ctx_other"](self.mtp) == self.target


@contextmanager
def _session(gguf: str | Path, n_ctx: int, n_batch: int, n_threads: int, f32_attention: bool,
             verbose: bool) -> Iterator[_Session]:
    lc = _llama()
    _quiet_logs(lc, verbose)
    lc.llama_backend_init()

    mparams = lc.llama_model_default_params()
    mparams.n_gpu_layers = 0
    mparams.load_mtp = True
    model = lc.llama_model_load_from_file(str(gguf).encode(), mparams)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {gguf}")
    target = mtp = None
    try:
        if lc.llama_model_n_layer_nextn(model) < 1:
            raise RuntimeError(f"{gguf} has no MTP (nextn) layer")

        def params(ctx_type: int, other: Any) -> Any:
            cp = lc.llama_context_default_params()
            cp.n_ctx = n_ctx
            cp.n_batch = cp.n_ubatch = n_batch
            cp.n_seq_max = 1
            cp.n_threads = cp.n_threads_batch = n_threads
            cp.ctx_type = ctx_type
            cp.no_perf = True
            if f32_attention:
                cp.type_k = cp.type_v = lc.GGML_TYPE_F32
                cp.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
            if ctx_type == lc.LLAMA_CONTEXT_TYPE_MTP:
                cp.n_rs_seq = 0  # as common_speculative_init_result does for the draft context
                cp.ctx_other = other
            return cp

        target = lc.llama_init_from_model(model, params(lc.LLAMA_CONTEXT_TYPE_DEFAULT, None))
        if not target:
            raise RuntimeError("llama.cpp could not create the target context")
        mtp = lc.llama_init_from_model(model, params(lc.LLAMA_CONTEXT_TYPE_MTP, target))
        if not mtp:
            raise RuntimeError("llama.cpp could not create the MTP context")
        # as the MTP driver's constructor: every target position's h readable, MTP rows only for outputs
        _STAGING["set_embeddings_nextn"](target, True, False)
        _STAGING["set_embeddings_nextn"](mtp, True, True)
        n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
        n_embd = lc.llama_model_n_embd_out(model)
        yield _Session(lc, model, target, mtp, n_vocab, n_embd)
    finally:
        if mtp:
            lc.llama_free(mtp)
        if target:
            lc.llama_free(target)
        lc.llama_model_free(model)


def _argmax(logits: np.ndarray) -> int:
    return int(np.argmax(logits))  # first maximum


def _shifted(h: np.ndarray) -> np.ndarray:
    """Row p = h[p - 1], row 0 = zeros: the h each position's token is paired with."""
    return np.concatenate([np.zeros((1, h.shape[1]), dtype=np.float32), h[:-1]])


def llama_cpp_mtp(gguf: str | Path, prompt: Sequence[int], k: int, n_threads: int = 2, *, n_ctx: int = 512,
                  f32_attention: bool = True, verbose: bool = False) -> MtpReference:
    """llama.cpp's target and MTP head on prompt, then k greedy MTP drafts (see the module docstring)."""
    prompt = [int(t) for t in prompt]
    n = len(prompt)
    if n < 1 or k < 0 or n + k > n_ctx:
        raise ValueError(f"need 1 <= len(prompt) and len(prompt) + k <= n_ctx ({n} + {k} > {n_ctx}?)")
    with _session(gguf, n_ctx, max(512, n + 1), n_threads, f32_attention, verbose) as s:
        target_logits, target_h = s.target_prompt(prompt)
        next_token = _argmax(target_logits)
        h_last = target_h[-1].copy()

        prompt_mtp_logits, _ = s.mtp_step(prompt, range(n), _shifted(target_h))

        drafts: list[int] = []
        draft_logits: list[np.ndarray] = []
        draft_h: list[np.ndarray] = []
        tok, h = next_token, h_last
        for i in range(k):
            logits, hs = s.mtp_step([tok], [n + i], h[None, :])
            tok, h = _argmax(logits[0]), hs[0]
            drafts.append(tok)
            draft_logits.append(logits[0])
            draft_h.append(h)

    def rows(xs: list[np.ndarray], width: int) -> np.ndarray:
        return np.stack(xs) if xs else np.zeros((0, width), dtype=np.float32)

    return MtpReference(next_token=next_token, target_logits=target_logits, h_last=h_last,
                        prompt_mtp_logits=prompt_mtp_logits, drafts=drafts,
                        draft_logits=rows(draft_logits, s.n_vocab), target_h=target_h,
                        draft_h=rows(draft_h, s.n_embd))


def llama_cpp_mtp_teacher_forced(gguf: str | Path, tokens: Sequence[int], h: np.ndarray, n_threads: int = 2, *,
                                 n_ctx: int = 512, f32_attention: bool = True,
                                 verbose: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's MTP head alone, on a fresh MTP context: tokens[p] at position p paired with h[p] (any rows, e.g.
    an engine's own h), one batch. Returns (logits [n, vocab], the MTP's h_nextn [n, n_embd])."""
    tokens = [int(t) for t in tokens]
    with _session(gguf, n_ctx, max(512, len(tokens)), n_threads, f32_attention, verbose) as s:
        return s.mtp_step(tokens, range(len(tokens)), np.asarray(h, dtype=np.float32))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--prompt", required=True, help="comma-separated token ids")
    ap.add_argument("--k", type=int, default=3, help="number of chained drafts")
    ap.add_argument("--out", type=Path, required=True, help=".npz to write")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-ctx", type=int, default=512)
    ap.add_argument("--llama-defaults", action="store_true",
                    help="llama.cpp's default attention (F16 KV caches, flash attention auto) instead of F32")
    ap.add_argument("--verbose", action="store_true", help="libllama's full log on stderr")
    args = ap.parse_args(argv)

    prompt = [int(t) for t in args.prompt.split(",") if t.strip()]
    t0 = time.perf_counter()
    ref = llama_cpp_mtp(args.gguf, prompt, args.k, args.threads, n_ctx=args.n_ctx,
                        f32_attention=not args.llama_defaults, verbose=args.verbose)
    np.savez(args.out, **ref.arrays())
    print(f"next_token {ref.next_token}  drafts {ref.drafts}  ({time.perf_counter() - t0:.1f} s) -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
