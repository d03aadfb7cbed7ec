"""Wrong: right values and careful validation, but the lookups are redone for every
tensor (every parameter's name listed, every checkpoint shape recomputed): the work
around each copy grows with the model and swamps the copies."""
from __future__ import annotations

import torch

from course_lib.weights.checkpoint import hf_tensor_shapes


def destination(model, name):
    target = model.map_checkpoint_name(name)
    if target is None:
        return None
    param_name, shard_id = target
    data = dict(model.named_parameters())[param_name].data
    if shard_id is None:
        return data
    module = model.get_submodule(param_name.rsplit(".", 1)[0])
    start, size = module.shard_rows(shard_id)
    return data.narrow(0, start, size)


class BucketUpdater:
    def __init__(self, model):
        self.model = model

    def apply(self, b) -> int:
        flat, metadata = b["flattened_tensor"], b["metadata"]
        names = [m.name for m in metadata]
        if len(set(names)) != len(names):
            raise ValueError("a tensor appears twice in the bucket")
        nbytes = 0
        for m in metadata:
            shapes = hf_tensor_shapes(self.model.config)
            if m.name not in shapes or tuple(m.shape) != tuple(shapes[m.name]):
                raise ValueError(f"{m.name}: unknown name or wrong shape {tuple(m.shape)}")
            if not m.dtype.is_floating_point or m.dtype.itemsize == 1:
                raise ValueError(f"{m.name}: dtype {m.dtype}")
            span = m.numel * m.dtype.itemsize
            if not 0 <= m.start_idx <= m.end_idx <= flat.numel() or m.end_idx - m.start_idx != span \
                    or m.start_idx % m.dtype.itemsize:
                raise ValueError(f"{m.name}: bad offsets [{m.start_idx}, {m.end_idx})")
            nbytes += span
        for m in metadata:
            dest = destination(self.model, m.name)
            if dest is not None:
                dest.copy_(flat[m.start_idx:m.end_idx].view(m.dtype).view(m.shape))
        return nbytes
