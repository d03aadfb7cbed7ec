# Checks the shape only after copying: a broadcastable wrong shape has already been written.
offset, rows = self.shard_rows(shard_id)
dest = param.data.narrow(0, offset, rows)
dest.copy_(local)
if tuple(local.shape) != tuple(dest.shape):
    raise ValueError(f"shard has shape {tuple(local.shape)}, expected {tuple(dest.shape)}")
