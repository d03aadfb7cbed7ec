"""The judge's reference BucketUpdater, the yardstick of the speed cases: a table from
checkpoint name to destination view, built once; per bucket, checks then copies."""
from __future__ import annotations

from course_lib.weights.checkpoint import hf_tensor_shapes
from course_lib.weights.commit.copy_plan import checkpoint_view


class BucketUpdater:
    def __init__(self, model):
        self.table = {name: (checkpoint_view(model, name), tuple(shape))
                      for name, shape in hf_tensor_shapes(model.config).items()}

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
