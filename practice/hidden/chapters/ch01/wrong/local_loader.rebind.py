# Builds a new tensor and binds it to param.data: right values, moved storage.
offset, rows = self.shard_rows(shard_id)
if tuple(local.shape) != (rows,) + tuple(param.shape[1:]):
    raise ValueError(f"shard has shape {tuple(local.shape)}")
new = param.data.clone()
new[offset:offset + rows] = local
param.data = new
