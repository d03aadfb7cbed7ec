    # why: writes each layer's kernel tensors as soon as it is quantized, so an error in a later layer leaves earlier ones changed.
    done = []
    try:
        for name, layer in layers.items():
            missing = [s for s in layer.shard_ids if s not in layer.staged_shards]
            if missing:
                if allow_pending:
                    continue
                raise ValueError(f"{name}: shards {missing} did not arrive")
            q, scale = layer.quant_method.quantize(layer.staging)
            layer.qweight.copy_(q)
            layer.weight_scale.copy_(scale)
            layer.staging, layer.staged_shards = None, set()
            done.append(name)
    except ValueError:
        for layer in layers.values():
            layer.staging, layer.staged_shards = None, set()
        raise
    return done
