"""Checkpoints made from a seed: named sizes, the random values, and the writer.

Nothing is ever downloaded: ``make_random`` writes a real Hugging Face checkpoint
directory (``config.json`` plus ``model.safetensors``, or shards with
``model.safetensors.index.json``) from a seed, in sizes from ``tiny`` (CPU tests,
milliseconds) to ``qwen3-8b`` (GPU benchmarks). Every value is a function of (seed,
tensor name) alone, so tests can recompute any tensor without reading the file.
Reading checkpoints back is ``checkpoint.py``'s job (which also re-exports these names).
"""
from __future__ import annotations

import json
import zlib
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from course_lib.config import ModelConfig
from course_lib.dtypes import dtype_name, parse_dtype
from course_lib.models.qwen3 import hf_tensor_shapes

PRESETS: dict[str, ModelConfig] = {
    # CPU tests and chapters: well under a second to make and to load.
    "tiny": ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "small": ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=16),
    # GPU benchmark sizes: the shapes of the public Qwen3 models, random values.
    "qwen3-0.6b": ModelConfig(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                              num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                              head_dim=128, max_position_embeddings=40960, tie_word_embeddings=True,
                              torch_dtype="bfloat16", bos_token_id=151643, eos_token_id=151645),
    "qwen3-1.7b": ModelConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                              num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                              head_dim=128, max_position_embeddings=40960, tie_word_embeddings=True,
                              torch_dtype="bfloat16", bos_token_id=151643, eos_token_id=151645),
    "qwen3-8b": ModelConfig(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                            num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                            head_dim=128, max_position_embeddings=40960, tie_word_embeddings=False,
                            torch_dtype="bfloat16", bos_token_id=151643, eos_token_id=151645),
}


def preset(name: str, **overrides) -> ModelConfig:
    """A copy of a named preset config, with fields overridden."""
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    return replace(PRESETS[name], **overrides)


def random_tensor(name: str, shape, seed: int, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """The tensor ``make_random`` writes for ``name``: a function of (seed, name) alone,
    so sharding or the order of writing never changes a value."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    if name.endswith("norm.weight"):
        # Norm gains near 1, perturbed so that a wrongly loaded norm shows in the logits.
        t = 1.0 + 0.1 * torch.randn(shape, generator=gen, device=device)
    elif name.endswith("embed_tokens.weight"):
        t = torch.randn(shape, generator=gen, device=device)
    else:
        # 1/sqrt(fan_in) keeps activations O(1), so logits are decisive (no near-ties
        # that would make greedy outputs fragile to rounding).
        t = torch.randn(shape, generator=gen, device=device) * shape[-1] ** -0.5
    return t.to(dtype)


def random_state_dict(config: ModelConfig, seed: int = 0, dtype=None, device="cpu") -> dict[str, torch.Tensor]:
    dtype = dtype or config.dtype
    return {name: random_tensor(name, shape, seed, dtype, device)
            for name, shape in hf_tensor_shapes(config).items()}


def write_checkpoint(path, config: ModelConfig, tensors: dict[str, torch.Tensor],
                     max_shard_size: int | None = None) -> Path:
    """Write ``tensors`` as an HF checkpoint dir: one safetensors file, or shards of at most
    ``max_shard_size`` bytes with ``model.safetensors.index.json``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2))
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    if max_shard_size is None:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map, total = {}, 0
    for k, shard in enumerate(shards, 1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / file), metadata={"format": "pt"})
        for name, t in shard.items():
            weight_map[name] = file
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return path


def make_random(path, config: ModelConfig | str = "tiny", seed: int = 0, dtype=None,
                max_shard_size: int | None = None, device="cpu") -> Path:
    """Write a random Qwen3 checkpoint to ``path`` (a preset name or a ModelConfig).

    ``dtype`` defaults to the config's ``torch_dtype``; the written config records it.
    ``device="cuda"`` draws the numbers on the GPU (fast for multi-GB presets; the values
    differ from a CPU draw but are just as reproducible).
    """
    config = preset(config) if isinstance(config, str) else config
    if dtype is not None:
        config = replace(config, torch_dtype=dtype_name(parse_dtype(dtype)))
    tensors = random_state_dict(config, seed, config.dtype, device)
    return write_checkpoint(path, config, tensors, max_shard_size)
