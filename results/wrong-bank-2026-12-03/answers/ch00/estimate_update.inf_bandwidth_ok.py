    # why: checks that a bandwidth is positive but not that it is finite, so an infinite bandwidth gives a 0 s phase.
    if not isinstance(nbytes, (int, float)) or not math.isfinite(nbytes) or nbytes < 0:
        raise ValueError(f"nbytes must be a non-negative finite number, got {nbytes!r}")
    phases = tuple(phases)
    if not phases:
        raise ValueError("phases is empty")
    if len(set(phases)) != len(phases) or "total" in phases:
        raise ValueError(f"phases repeat a name or name 'total': {phases}")
    for what, v in (("chunks", chunks), ("num_gpus", num_gpus)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{what} must be a whole number >= 1, got {v!r}")
    share = nbytes / num_gpus
    out = {}
    for ph in phases:
        if ph not in bandwidths:
            raise ValueError(f"phase {ph!r} has no bandwidth")
        bw = bandwidths[ph]
        if not bw > 0:
            raise ValueError(f"phase {ph!r} has bandwidth {bw!r}")
        out[ph] = share / (bw * 1e9)
    times = [out[ph] for ph in phases]
    out["total"] = (sum(times) + (chunks - 1) * max(times)) / chunks
    return out
