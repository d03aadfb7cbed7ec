"""Support for layerwise-memory: what the engine and the checkpoint say, to compare answers with."""
from __future__ import annotations

from course_lib import Engine
from course_lib.weights.checkpoint import CheckpointReader, random_state_dict, write_checkpoint
from course_lib.weights.commit.layerwise import layer_key


def write_pair(tmp_path, config, seeds=(1, 2)):
    """Two checkpoints of ``config`` (old and new weights)."""
    return tuple(write_checkpoint(tmp_path / f"ckpt-{s}", config, random_state_dict(config, s)) for s in seeds)


def groups_on_disk(path) -> dict[str, int]:
    """{layer_key: bytes} read from a checkpoint's headers: the reload's own grouping."""
    out: dict[str, int] = {}
    for name, (shape, dtype) in CheckpointReader(path).metadata().items():
        n = 1
        for s in shape:
            n *= s
        out[layer_key(name)] = out.get(layer_key(name), 0) + n * dtype.itemsize
    return out


def measured_peak(old, new, quantization) -> int:
    """peak_held_bytes of a layer-by-layer update from ``old`` to ``new`` on a CPU engine."""
    engine = Engine(old, quantization=quantization, max_num_seqs=2, max_model_len=64)
    return engine.update_weights_from_disk(new)["memory"]["peak_held_bytes"]


def describe(config) -> str:
    return (f"vocab {config.vocab_size}, hidden {config.hidden_size}, intermediate {config.intermediate_size}, "
            f"{config.num_attention_heads} heads / {config.num_key_value_heads} kv heads of {config.head_dim}, "
            f"{config.num_hidden_layers} layers, tied {config.tie_word_embeddings}, {config.torch_dtype}")
