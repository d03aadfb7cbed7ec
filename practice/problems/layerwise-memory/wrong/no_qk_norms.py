"""Wrong: forgets the q and k norms (head_dim values each) of every decoder layer."""
from __future__ import annotations

FLOAT32_BYTES = 4  # a CPU engine computes, and stages, in float32


def linear_values(config) -> int:
    """Values in one decoder layer's linear weights: q, k, v, o, gate, up, down."""
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    return q * h + 2 * kv * h + h * q + 2 * i * h + h * i


def reload_groups(config) -> dict[str, int]:
    """{group key: checkpoint bytes} for the groups a layer-by-layer reload buffers."""
    h, v, d = config.hidden_size, config.vocab_size, config.head_dim
    b = config.dtype.itemsize
    norms = 2 * h  # input and post-attention norms
    groups = {"model.embed_tokens.weight": v * h * b}
    for n in range(config.num_hidden_layers):
        groups[f"model.layers.{n}"] = (linear_values(config) + norms) * b
    groups["model.norm.weight"] = h * b
    if not config.tie_word_embeddings:
        groups["lm_head.weight"] = v * h * b
    return groups


def peak_held_bytes(config, quantization) -> int:
    """The engine's peak_held_bytes for a layer-by-layer update (CPU engine, float32)."""
    groups = reload_groups(config)
    if quantization is not None:
        # While a decoder layer is processed, its float32 staging buffers sit next to the
        # buffered checkpoint tensors until requantization frees them.
        staging = linear_values(config) * FLOAT32_BYTES
        groups = {k: v + staging if k.startswith("model.layers.") else v for k, v in groups.items()}
    return max(groups.values())
