"""Models the engine can serve."""
