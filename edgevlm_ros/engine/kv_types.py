"""The KV cache's element types (the decoder's `kv_type`), without importing the native engine, so
that the node's parameters and the command line can check a value before the engine loads."""

from __future__ import annotations

# float, half, and int8 blocks of 32 along each head with an fp16 scale (ggml's q8_0 layout).
KV_TYPES = ("f32", "f16", "q8_0")


def check_kv_type(kv_type: str) -> str:
    """kv_type when it is one of KV_TYPES; ValueError naming them otherwise."""
    if kv_type not in KV_TYPES:
        raise ValueError(f"kv_type must be one of {', '.join(KV_TYPES)}, not '{kv_type}'")
    return kv_type
