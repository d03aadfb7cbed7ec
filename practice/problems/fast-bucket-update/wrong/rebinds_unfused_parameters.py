"""Wrong: fused shards are copied in place, but every unfused parameter (norms, o_proj,
down_proj, embeddings) gets new memory: the address audit and a captured graph catch it."""
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
    param = getattr(module, attr)
    if shard_id is None:
        return param                       # the parameter itself: apply rebinds it
    data = param.data
    return data.narrow(0, *module.shard_rows(shard_id))  # a view: writing it writes the parameter


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
            work.append((dest, m))
            nbytes += span
        for dest, m in work:               # 2. one in-place copy per tensor
            new = flat[m.start_idx:m.end_idx].view(m.dtype).view(m.shape)
            if isinstance(dest, torch.nn.Parameter):
                dest.data = new.to(dest.dtype).clone()  # new memory: a captured graph never sees it
            elif dest is not None:
                dest.copy_(new)
        return nbytes
