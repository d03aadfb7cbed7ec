"""Building blocks of the model: each parameter carries the ``weight_loader`` that puts a
checkpoint tensor into it (sharded, fused) by an in-place copy, and the ``local_loader``
that puts this rank's already-cut part of one there (the second half of the first)."""
