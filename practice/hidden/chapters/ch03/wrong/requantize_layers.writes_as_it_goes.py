missing = {name: [s for s in m.shard_ids if s not in m.staged_shards] for name, m in layers.items()}
missing = {name: ids for name, ids in missing.items() if ids}
ready = [(name, m) for name, m in layers.items() if name not in missing]
if missing and not allow_pending:
    name, ids = next(iter(missing.items()))
    raise ValueError(f"{name}: received shards {sorted(map(str, layers[name].staged_shards))} but not "
                     f"{[str(s) for s in ids]}")
for _, m in ready:   # a later layer's refusal leaves the earlier ones written
    q, scale = m.quant_method.quantize(m.staging)
    m.qweight.copy_(q)
    m.weight_scale.copy_(scale)
    m.staging, m.staged_shards = None, set()
return [name for name, _ in ready]
