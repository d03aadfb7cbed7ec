"""Weights: checkpoint I/O (``checkpoint/``), the in-place commit layer (``commit/``), the
transports that bring new weights (``transports/``) and resharding (``reshard/``)."""
