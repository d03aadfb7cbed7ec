"""Ways new weights reach the engine: in-memory handles (ipc), torch.distributed broadcast (dist)."""
