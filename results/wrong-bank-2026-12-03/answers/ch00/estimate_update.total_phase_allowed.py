    # why: refuses repeated phase names but lets a phase be called "total", which the total then overwrites.
    if not isinstance(nbytes, (int, float)) or not math.isfinite(nbytes) or nbytes < 0:
        raise ValueError(f"nbytes must be a non-negative finite number, got {nbytes!r}")
    phases = tuple(phases)
    if not phases:
        raise ValueError("phases is empty")
    if len(set(phases)) != len(phases):
        raise ValueError(f"phases repeat a name: {phases}")
    for what, v in (("chunks", chunks), ("num_gpus", num_gpus)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{what} must be a whole number >= 1, got {v!r}")
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
