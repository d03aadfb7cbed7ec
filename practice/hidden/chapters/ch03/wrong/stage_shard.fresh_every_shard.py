# a new staging tensor for every shard: the q and k rows written earlier are lost
layer.staging = torch.zeros(param.shape, dtype=param.dtype, device=layer.qweight.device)
layer.staging.param_name = getattr(param, "param_name", "weight")
if shard_id is None:
    loader(layer.staging, loaded)
else:
    loader(layer.staging, loaded, shard_id)
layer.staged_shards.add(shard_id)
