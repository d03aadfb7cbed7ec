    # why: assigns the new tensors to qweight and weight_scale instead of copying into the existing ones.
    missing = {n: [s for s in l.shard_ids if s not in l.staged_shards] for n, l in layers.items()}
    if any(missing.values()) and not allow_pending:
        for l in layers.values():
            l.staging, l.staged_shards = None, set()
        bad = {n: m for n, m in missing.items() if m}
        raise ValueError(f"incomplete layers: {bad}")
    results = {}
    try:
        for n, l in layers.items():
            if missing[n]:
                continue
            results[n] = l.quant_method.quantize(l.staging)
            l.staging, l.staged_shards = None, set()
    except ValueError:
        for l in layers.values():
            l.staging, l.staged_shards = None, set()
        raise
    for n, (q, scale) in results.items():
        layers[n].qweight = q
        layers[n].weight_scale = scale
    return list(results)
