"""Developer tools: the checkpoint converter, the GGUF writer and quantizers, bench and tune
(see README.md)."""
