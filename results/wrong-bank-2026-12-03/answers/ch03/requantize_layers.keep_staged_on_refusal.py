    # why: refuses an incomplete layer before touching anything but leaves every staged weight in place.
    missing = {n: [s for s in l.shard_ids if s not in l.staged_shards] for n, l in layers.items()}
    if any(missing.values()) and not allow_pending:
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
        layers[n].qweight.copy_(q)
        layers[n].weight_scale.copy_(scale)
    return list(results)
