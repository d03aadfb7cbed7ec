if layer.staging is None:
    layer.staging = torch.empty(param.shape, dtype=param.dtype, device=layer.qweight.device)
    layer.staging.param_name = getattr(param, "param_name", "weight")
if shard_id is None:
    loader(layer.staging, loaded)
else:
    loader(layer.staging, loaded, shard_id)
