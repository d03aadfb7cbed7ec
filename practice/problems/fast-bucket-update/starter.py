"""fast-bucket-update: apply flattened buckets of checkpoint tensors to a live model, fast.

This first version goes through the engine's general load path. It puts the right values
in the right memory, but it is not yet what the problem asks for: read problem.md.
"""
from __future__ import annotations

from course_lib.weights.transports import bucket


class BucketUpdater:
    def __init__(self, model):
        self.model = model

    def apply(self, b) -> int:
        """Copy every tensor of bucket ``b`` into the model in place; return the bytes applied."""
        pairs = bucket.unpack(b)  # views into the bucket's buffer (offsets checked)
        self.model.load_weights(pairs)  # one name lookup and one loader call per tensor
        return sum(t.numel() * t.element_size() for _, t in pairs)
