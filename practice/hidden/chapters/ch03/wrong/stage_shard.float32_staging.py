if layer.staging is None:
    # "full precision" read as float32: a bfloat16 engine requantizes values it never holds
    layer.staging = torch.empty(param.shape, dtype=torch.float32, device=layer.qweight.device)
    layer.staging.param_name = getattr(param, "param_name", "weight")
if shard_id is None:
    loader(layer.staging, loaded)
else:
    loader(layer.staging, loaded, shard_id)
layer.staged_shards.add(shard_id)
