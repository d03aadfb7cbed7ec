"""The in-place commit layer: new weights validated, then written into the live tensors
without moving them (the copy plan, the address audit, the layer-by-layer reload and its
rollback point, direct requantization, registered copy tables, the bucket cache)."""
