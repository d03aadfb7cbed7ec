if layer.staging is None:
    layer.staging = torch.empty(param.shape, dtype=param.dtype, device=layer.qweight.device)
# the shard's rows, copied straight in: no shape check, no tensor-parallel slice
start, rows = layer.shard_rows(shard_id)
layer.staging[start:start + rows].copy_(loaded)
layer.staged_shards.add(shard_id)
