"""Checkpoints for the canary-rollback tests: a served version, the right new version, and bad ones.

``corrupted_copy`` replaces one decoder-layer weight with noise of the same scale (what a
shard copied from the wrong run looks like); ``kernel_weights`` copies every tensor the
engine's kernels read, to compare before and after bitwise.
"""
from __future__ import annotations

import random

import torch

from course_lib import Engine
from course_lib.layers.quant import kernel_tensors
from course_lib.weights.checkpoint import CheckpointReader, make_random, preset, write_checkpoint


def corrupted_copy(src, dst, name: str = "model.layers.1.mlp.down_proj.weight", seed: int = 0):
    reader = CheckpointReader(src)
    tensors = dict(reader.iter_tensors())
    gen = torch.Generator().manual_seed(seed)
    tensors[name] = torch.randn(tensors[name].shape, generator=gen) * tensors[name].std()
    return write_checkpoint(dst, reader.config, tensors)


def random_layer_name(path, rng: random.Random) -> str:
    names = sorted(n for n in CheckpointReader(path).metadata() if n.startswith("model.layers.") and n.endswith("proj.weight"))
    return rng.choice(names)


def with_nan(src, dst, name: str, seed: int = 0):
    """A copy of ``src`` whose tensor ``name`` holds a NaN (a diverged trainer's checkpoint)."""
    reader = CheckpointReader(src)
    tensors = dict(reader.iter_tensors())
    t = tensors[name].clone()
    t.view(-1)[torch.randint(t.numel(), (1,), generator=torch.Generator().manual_seed(seed))] = float("nan")
    tensors[name] = t
    return write_checkpoint(dst, reader.config, tensors)


def misshapen(path, seed: int = 0):
    """A checkpoint the engine must refuse: another hidden size."""
    return make_random(path, preset("tiny", hidden_size=32, head_dim=8), seed=seed)


def kernel_weights(engine) -> dict:
    return {n: t.detach().clone() for n, t in kernel_tensors(engine.model).items()}


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def expected_answers(path, prompts, n_tokens) -> list[list[int]]:
    """Greedy answers on ``path``; ``n_tokens`` is one length for all or a list, one per prompt."""
    lengths = n_tokens if isinstance(n_tokens, (list, tuple)) else [n_tokens] * len(prompts)
    params = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in lengths]
    return [o["output_ids"] for o in Engine(path).generate(list(prompts), params)]


__all__ = ["Engine", "corrupted_copy", "random_layer_name", "with_nan", "misshapen", "kernel_weights", "same_weights",
           "expected_answers", "make_random"]
