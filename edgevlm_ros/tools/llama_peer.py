"""llama.cpp as the peer of `edgevlm bench` (and its --kv-cache form): llama-cpp-python's
low-level API, loaded where it is installed (scripts/install_bench_extra.sh, run by the set-up)."""

from __future__ import annotations

import ctypes
import importlib
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

__all__ = ["LlamaPeer", "import_peer", "loaded_llama_libraries", "silence_llama"]


_PEER_LOG_SINK: Any = None  # the no-op log callback handed to llama.cpp (kept alive here)


def silence_llama(llama_cpp: ModuleType) -> None:
    global _PEER_LOG_SINK
    if _PEER_LOG_SINK is None:
        _PEER_LOG_SINK = llama_cpp.llama_log_callback(lambda level, text, user: None)
        llama_cpp.llama_log_set(_PEER_LOG_SINK, ctypes.c_void_p(0))


class LlamaPeer:
    """llama.cpp through llama-cpp-python's low-level API (the C functions): the prompt in one
    llama_decode (batches of n_batch = 512, logits of the last token only), then one-token
    decodes, greedy argmax over the logits in numpy."""

    def __init__(self, llama_cpp: ModuleType, path: Path, threads: int, n_ctx: int, flash_attn: bool,
                 extra_bufts: bool, kv_type: str | None = None) -> None:
        self.L = L = llama_cpp
        silence_llama(L)
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = 0
        if hasattr(mp, "use_extra_bufts"):
            mp.use_extra_bufts = extra_bufts  # weight repacking / AMX buffers
        self.model = L.llama_model_load_from_file(str(path).encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        cp = L.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = cp.n_ubatch = 512
        cp.n_threads = cp.n_threads_batch = threads
        cp.no_perf = True
        cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        if kv_type is not None:  # the KV cache's element type (llama.cpp's default: f16)
            cp.type_k = cp.type_v = {"f32": L.GGML_TYPE_F32, "f16": L.GGML_TYPE_F16, "q8_0": L.GGML_TYPE_Q8_0}[kv_type]
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            L.llama_model_free(self.model)
            raise RuntimeError("llama.cpp could not create a context")
        self.n_vocab = int(L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model)))
        self.mem = L.llama_get_memory(self.ctx)
        self.n_pre = -1
        # A recurrent state cannot be cut back to the prefix (llama_memory_seq_rm refuses), so for
        # such a model the prefix's sequence state is saved once and restored per request, as ours is.
        self.recurrent = bool(L.llama_model_is_recurrent(self.model) or L.llama_model_is_hybrid(self.model))
        self.saved: Any = None

    def _eval(self, ids: Sequence[int]) -> None:
        for i in range(0, len(ids), 512):
            chunk = ids[i:i + 512]
            arr = (ctypes.c_int32 * len(chunk))(*chunk)
            rc = self.L.llama_decode(self.ctx, self.L.llama_batch_get_one(arr, len(chunk)))
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")

    def _argmax(self) -> int:
        ptr = self.L.llama_get_logits_ith(self.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))))

    def _clear(self) -> None:
        self.L.llama_memory_clear(self.mem, True)
        self.n_pre = -1
        self.saved = None

    def prefill(self, ids: Sequence[int]) -> float:
        self._clear()
        t0 = time.perf_counter()
        self._eval(ids)
        return time.perf_counter() - t0

    def decode(self, prompt: Sequence[int], n: int) -> tuple[float, list[int]]:
        self._clear()
        self._eval(prompt)
        tok = self._argmax()
        tokens = [tok]
        t0 = time.perf_counter()
        for _ in range(n):
            self._eval([tok])
            tok = self._argmax()
            tokens.append(tok)
        return time.perf_counter() - t0, tokens

    def ttft(self, ids: Sequence[int]) -> float:
        self._clear()
        t0 = time.perf_counter()
        self._eval(ids)
        self._argmax()
        return time.perf_counter() - t0

    def make_prefix(self, prefix_ids: Sequence[int]) -> int:
        return len(prefix_ids)

    def ttft_cached(self, n_pre: int, ids: Sequence[int]) -> float:
        if self.n_pre != n_pre:  # put the system prompt's KV in place (not timed)
            self._clear()
            self._eval(ids[:n_pre])
            self.n_pre = n_pre
            if self.recurrent:
                size = int(self.L.llama_state_seq_get_size(self.ctx, 0))
                self.saved = (ctypes.c_uint8 * size)()
                if self.L.llama_state_seq_get_data(self.ctx, self.saved, size, 0) != size:
                    raise RuntimeError("llama_state_seq_get_data did not save the prefix state")
        t0 = time.perf_counter()
        if self.recurrent:
            self.L.llama_memory_seq_rm(self.mem, 0, -1, -1)
            if self.L.llama_state_seq_set_data(self.ctx, self.saved, len(self.saved), 0) == 0:
                raise RuntimeError("llama_state_seq_set_data did not restore the prefix state")
        elif not self.L.llama_memory_seq_rm(self.mem, 0, n_pre, -1):  # keep the system prompt, drop the rest
            raise RuntimeError("llama_memory_seq_rm could not drop the tokens after the prefix")
        self._eval(ids[n_pre:])
        self._argmax()
        return time.perf_counter() - t0

    def close(self) -> None:
        if self.ctx:
            self.L.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            self.L.llama_model_free(self.model)
            self.model = None


def import_peer() -> tuple[ModuleType | None, str]:
    """llama_cpp, or None and why not."""
    try:
        mod = importlib.import_module("llama_cpp")
    except ImportError as exc:
        return None, (f"llama-cpp-python is not installed ({exc}); install it with "
                      "scripts/install_bench_extra.sh")
    except OSError as exc:  # the shared library failed to load
        return None, f"llama-cpp-python failed to load: {exc}"
    version = getattr(mod, "__version__", "?")
    return mod, f"llama-cpp-python {version}"


def loaded_llama_libraries() -> list[str]:
    """The libllama / libggml files mapped into this process (/proc/self/maps): which build of
    llama.cpp the peer really is."""
    try:
        maps = Path("/proc/self/maps").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    paths = (line.split(None, 5)[-1].strip() for line in maps.splitlines() if line.count(" ") >= 5)
    return sorted({p for p in paths if Path(p).name.startswith(("libllama", "libggml"))})
