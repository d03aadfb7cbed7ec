"""Wrong: each tensor is written as soon as it passes its checks, so a bad entry late in
a bucket leaves the model half updated (a mix of two versions) when the error comes."""
from __future__ import annotations

import torch

from course_lib.weights.checkpoint import hf_tensor_shapes

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def destination(model, name):
    """The view of the model's memory that checkpoint tensor ``name`` fills, or None
    when the model keeps no separate copy of it (e.g. ``lm_head.weight`` when tied)."""
    target = model.map_checkpoint_name(name)
    if target is None:
        return None
    param_name, shard_id = target
    module_name, attr = param_name.rsplit(".", 1)
    module = model.get_submodule(module_name)
    data = getattr(module, attr).data      # .data: the storage the kernels read
    if shard_id is None:
        return data
    if hasattr(module, "offsets"):         # qkv_proj: shard "q", "k" or "v"
        start, size = module.offsets[shard_id]
    else:                                  # gate_up_proj: shard 0 (gate) or 1 (up)
        start = sum(module.output_sizes[:shard_id]) // module.tp_size
        size = module.output_sizes[shard_id] // module.tp_size
    return data.narrow(0, start, size)     # a view: writing it writes the parameter


class BucketUpdater:
    def __init__(self, model):
        shapes = hf_tensor_shapes(model.config)
        self.plan = {name: (destination(model, name), tuple(shape)) for name, shape in shapes.items()}

    def apply(self, bucket) -> int:
        flat, metadata = bucket["flattened_tensor"], bucket["metadata"]
        size = flat.numel()
        seen, work, nbytes = set(), [], 0
        for m in metadata:                 # 1. validate everything, write nothing
            if m.name not in self.plan:
                raise ValueError(f"{m.name}: not a tensor of this model")
            if m.name in seen:
                raise ValueError(f"{m.name}: appears twice in the bucket")
            seen.add(m.name)
            dest, shape = self.plan[m.name]
            if tuple(m.shape) != shape:
                raise ValueError(f"{m.name}: shape {tuple(m.shape)}, expected {shape}")
            if m.dtype not in FLOAT_DTYPES:
                raise ValueError(f"{m.name}: dtype {m.dtype} is not a floating-point dtype")
            span = m.numel * m.dtype.itemsize
            if not 0 <= m.start_idx <= m.end_idx <= size or m.end_idx - m.start_idx != span:
                raise ValueError(f"{m.name}: bytes [{m.start_idx}, {m.end_idx}) do not hold "
                                 f"{m.numel} {m.dtype} values inside a buffer of {size} bytes")
            if m.start_idx % m.dtype.itemsize:
                raise ValueError(f"{m.name}: offset {m.start_idx} is not aligned to {m.dtype}")
            nbytes += span
            if dest is not None:           # written as soon as it is checked
                dest.copy_(flat[m.start_idx:m.end_idx].view(m.dtype).view(m.shape))
        return nbytes
