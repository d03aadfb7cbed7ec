# Checks only the element count and reshapes: a transposed shard is silently scrambled in.
offset, rows = self.shard_rows(shard_id)
dest = param.data.narrow(0, offset, rows)
if local.numel() != dest.numel():
    raise ValueError(f"shard has {local.numel()} elements, expected {dest.numel()}")
dest.copy_(local.reshape(dest.shape))
