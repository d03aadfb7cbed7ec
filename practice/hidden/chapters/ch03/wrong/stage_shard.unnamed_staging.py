if layer.staging is None:
    # no param_name: the loaders' error messages have nothing to name
    layer.staging = torch.empty(param.shape, dtype=param.dtype, device=layer.qweight.device)
if shard_id is None:
    loader(layer.staging, loaded)
else:
    loader(layer.staging, loaded, shard_id)
layer.staged_shards.add(shard_id)
