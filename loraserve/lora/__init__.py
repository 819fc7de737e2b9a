"""Adapters in the engine: residency in the unified pool, the weights layout in pages, the
per-step batch metadata, and the LoRA appliers of each kernel backend."""
