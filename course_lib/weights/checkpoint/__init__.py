"""Checkpoint I/O: Hugging Face checkpoint directories read, written and made from a seed.

The one place to import checkpoint things from: the reader (``reader.py``), the
safetensors header parsing and file-identity checks (``safetensors_format.py``), the
parallel pinned reader and the optional InstantTensor reader (``pinned_reader.py``,
``instanttensor_reader.py``), checkpoints made from a seed (``random_checkpoint.py``),
models built from a checkpoint (``model_loader.py``), and the list of tensors a Qwen3
checkpoint holds (``hf_tensor_shapes``, beside the model in ``models/qwen3.py``).
"""
from course_lib.models.qwen3 import hf_tensor_shapes
from course_lib.weights.checkpoint.random_checkpoint import (PRESETS, make_random, preset, random_state_dict,
                                                             random_tensor, write_checkpoint)
from course_lib.weights.checkpoint.reader import CheckpointReader
from course_lib.weights.checkpoint.safetensors_format import CheckpointError

__all__ = ["CheckpointError", "CheckpointReader", "PRESETS", "hf_tensor_shapes", "make_random", "preset",
           "random_state_dict", "random_tensor", "write_checkpoint"]
