"""Building a model and loading its weights: from a checkpoint, or seeded random ones.

Both go through the model's own loaders (``load_weights``: name mapping, q/k/v and
gate/up fusion, tensor-parallel slicing) and then ``process_weights_after_loading``
(quantization into kernel format): the same path every hot update takes later.
"""
from __future__ import annotations

import contextlib

import torch

from course_lib.config import ModelConfig
from course_lib.layers.quant import process_weights_after_loading
from course_lib.models.qwen3 import Qwen3ForCausalLM
from course_lib.weights.checkpoint import CheckpointError, CheckpointReader, hf_tensor_shapes, random_tensor


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Parameters created inside are ``dtype`` (torch's default dtype, restored after)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_model(config: ModelConfig, device, dtype: torch.dtype, tp_rank: int = 0, tp_size: int = 1,
                quantization: str | None = None) -> Qwen3ForCausalLM:
    """The empty model (this rank's shard) on ``device``, parameters in ``dtype``."""
    with default_dtype(dtype), torch.device(device):
        return Qwen3ForCausalLM(config, tp_rank, tp_size, quantization)


def load_model(reader: CheckpointReader, device: str, dtype: torch.dtype, tp_rank: int = 0, tp_size: int = 1,
               quantization: str | None = None):
    """Build the model on ``device``, load every checkpoint tensor through its loaders, and
    turn the loaded weights into kernel format (``quantization``: None, "int8" or "fp8").
    A checkpoint that lacks tensors or holds ones the model cannot take raises
    ``CheckpointError`` naming them."""
    model = build_model(reader.config, device, dtype, tp_rank, tp_size, quantization)
    missing = sorted(set(hf_tensor_shapes(reader.config)) - set(reader.metadata()))
    if missing:
        raise CheckpointError(f"{reader.path}: checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    try:
        model.load_weights(reader.iter_tensors(device=device))
    except (KeyError, ValueError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"{reader.path}: {exc.args[0] if exc.args else exc}") from exc
    process_weights_after_loading(model)
    return model.eval()


def dummy_model(config: ModelConfig, device: str, dtype: torch.dtype, tp_rank: int = 0, tp_size: int = 1,
                quantization: str | None = None, seed: int = 0):
    """``load_format="dummy"``: the model ``config`` describes, with seeded random weights
    (nothing read from disk), loaded one tensor at a time through the usual loaders."""
    model = build_model(config, device, dtype, tp_rank, tp_size, quantization)
    model.load_weights((name, random_tensor(name, shape, seed, dtype, device))
                       for name, shape in hf_tensor_shapes(config).items())
    process_weights_after_loading(model)
    return model.eval()
