"""Building blocks of the model: each parameter carries the ``weight_loader`` that puts a
checkpoint tensor into it (sharded, fused) by an in-place copy."""
