missing = {name: [s for s in m.shard_ids if s not in m.staged_shards] for name, m in layers.items()}
missing = {name: ids for name, ids in missing.items() if ids}
ready = [(name, m) for name, m in layers.items() if name not in missing]
results = []
try:
    if missing and not allow_pending:
        name, ids = next(iter(missing.items()))
        raise ValueError(f"{name}: received shards {sorted(map(str, layers[name].staged_shards))} but not "
                         f"{[str(s) for s in ids]}")
    for _, m in ready:
        results.append(m.quant_method.quantize(m.staging))
        m.staging = None
except Exception:
    for m in layers.values():
        m.staging, m.staged_shards = None, set()
    raise
for (_, m), (q, scale) in zip(ready, results):
    m.qweight = q                # rebinds: a captured graph keeps reading the old memory
    m.weight_scale = scale
    m.staged_shards = set()
return [name for name, _ in ready]
