"""Weights on disk and in flight: checkpoints, and (later) the update transaction and transports."""
