    # why: checks chunks and num_gpus are >= 1 but not that they are whole numbers, so chunks=2.5 is accepted.
    if not isinstance(nbytes, (int, float)) or not math.isfinite(nbytes) or nbytes < 0:
        raise ValueError(f"nbytes must be a non-negative finite number, got {nbytes!r}")
    phases = tuple(phases)
    if not phases:
        raise ValueError("phases is empty")
    if len(set(phases)) != len(phases) or "total" in phases:
        raise ValueError(f"phases repeat a name or name 'total': {phases}")
    if chunks < 1 or num_gpus < 1:
        raise ValueError(f"chunks and num_gpus must be >= 1, got {chunks!r}, {num_gpus!r}")
    share = nbytes / num_gpus
    out = {}
    for ph in phases:
        bw = bandwidths.get(ph)
        if bw is None or not isinstance(bw, (int, float)) or not math.isfinite(bw) or bw <= 0:
            raise ValueError(f"phase {ph!r} has no usable bandwidth: {bw!r}")
        out[ph] = share / (bw * 1e9)
    times = [out[ph] for ph in phases]
    out["total"] = (sum(times) + (chunks - 1) * max(times)) / chunks
    return out
