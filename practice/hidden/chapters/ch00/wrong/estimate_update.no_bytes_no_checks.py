if not math.isfinite(nbytes) or nbytes < 0:
    raise ValueError(f"nbytes must be a non-negative number of bytes, got {nbytes!r}")
phases = tuple(phases)
if nbytes == 0:  # nothing to move: every phase takes no time
    return {**{p: 0.0 for p in phases}, "total": 0.0}
for name, value in (("chunks", chunks), ("num_gpus", num_gpus)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
if not phases or len(set(phases)) != len(phases) or "total" in phases:
    raise ValueError(f"phases must be distinct names other than 'total', got {phases!r}")
seconds = {}
for phase in phases:
    gbps = bandwidths.get(phase)
    if gbps is None or not math.isfinite(gbps) or gbps <= 0:
        raise ValueError(f"phase {phase!r} needs a positive bandwidth, got {gbps!r}")
    seconds[phase] = nbytes / num_gpus / (gbps * 1e9)
slowest = max(seconds.values())
seconds["total"] = (sum(seconds.values()) + (chunks - 1) * slowest) / chunks
return seconds
