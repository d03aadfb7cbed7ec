"""Reference answer for fast-bucket-update: plan once, validate the whole bucket, then copy.

Where the time goes in a bucketed update of many small tensors is not the copies but
what surrounds each one: finding the parameter, working out the rows of a fused shard,
checking. So everything that depends only on the model is worked out once, in
``__init__``: for each checkpoint name, the destination view (a ``narrow`` of the fused
parameter for q/k/v and gate/up, from ``course_lib.weights.commit.copy_plan.checkpoint_view``)
and the shape it must have. ``apply`` then costs one
dictionary lookup, a few integer checks and one ``copy_`` per tensor.
"""
from __future__ import annotations

import torch

from course_lib.weights.checkpoint import hf_tensor_shapes
from course_lib.weights.commit.copy_plan import checkpoint_view

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class BucketUpdater:
    def __init__(self, model):
        shapes = hf_tensor_shapes(model.config)
        # checkpoint_view: the parameter, or the rows of a fused one (a narrow: a view)
        self.plan = {name: (checkpoint_view(model, name), tuple(shape)) for name, shape in shapes.items()}

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
            if dest is not None:
                dest.copy_(flat[m.start_idx:m.end_idx].view(m.dtype).view(m.shape))
        return nbytes
