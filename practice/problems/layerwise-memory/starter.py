"""layerwise-memory: your answer. Read problem.md, then run

    python practice/judge.py test layerwise-memory
"""
from __future__ import annotations


def reload_groups(config) -> dict[str, int]:
    """{group key: checkpoint bytes} for the groups a layer-by-layer reload buffers."""
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    per_layer = (q * h + 2 * kv * h + h * q + 2 * i * h + h * i) * config.dtype.itemsize
    return {f"model.layers.{n}": per_layer for n in range(config.num_hidden_layers)}


def peak_held_bytes(config, quantization) -> int:
    """The engine's peak_held_bytes for a layer-by-layer update (CPU engine, float32)."""
    return max(reload_groups(config).values())
