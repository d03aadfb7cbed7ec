if layer.staging is None:
    layer.staging = torch.empty(param.shape, dtype=param.dtype, device=layer.qweight.device)
    layer.staging.param_name = getattr(param, "param_name", "weight")
# Moves the checkpoint shard to the kernel tensors' device and dtype before the loader
# copies it: one more device copy of every shard.
loaded = loaded.to(layer.qweight.device, param.dtype)
if shard_id is None:
    loader(layer.staging, loaded)
else:
    loader(layer.staging, loaded, shard_id)
layer.staged_shards.add(shard_id)
