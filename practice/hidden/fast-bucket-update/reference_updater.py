"""The judge's reference BucketUpdater, the yardstick of the speed cases: a table from
checkpoint name to destination view, built once; per bucket, checks then copies."""
from __future__ import annotations

import torch

from course_lib.weights.checkpoint import hf_tensor_shapes


def _rows(module, shard_id) -> tuple[int, int]:
    if shard_id in ("q", "k", "v"):
        return module.offsets[shard_id]
    per_rank = [n // module.tp_size for n in module.output_sizes]
    return sum(per_rank[:shard_id]), per_rank[shard_id]


class BucketUpdater:
    def __init__(self, model):
        self.table = {}
        for name, shape in hf_tensor_shapes(model.config).items():
            target, view = model.map_checkpoint_name(name), None
            if target is not None:
                owner, _, attr = target[0].rpartition(".")
                module = model.get_submodule(owner)
                view = getattr(module, attr).data
                if target[1] is not None:
                    view = view.narrow(0, *_rows(module, target[1]))
            self.table[name] = (view, tuple(shape))

    def apply(self, b) -> int:
        flat, entries = b["flattened_tensor"], b["metadata"]
        limit, todo, total = flat.numel(), [], 0
        for e in entries:
            view, shape = self.table.get(e.name, (None, None))
            n = e.numel * e.dtype.itemsize
            ok = (shape is not None and tuple(e.shape) == shape and e.dtype.is_floating_point
                  and e.dtype.itemsize > 1 and 0 <= e.start_idx and e.start_idx + n == e.end_idx <= limit
                  and e.start_idx % e.dtype.itemsize == 0)
            if not ok:
                raise ValueError(f"{e.name}: refused (unknown, wrong shape or dtype, or bad offsets)")
            todo.append((view, e))
            total += n
        if len({e.name for e in entries}) != len(entries):
            raise ValueError("a tensor appears twice in the bucket")
        for view, e in todo:
            if view is not None:
                view.copy_(flat[e.start_idx:e.end_idx].view(e.dtype).view(e.shape))
        return total
