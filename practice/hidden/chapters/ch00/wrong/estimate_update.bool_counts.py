# Checks that chunks and num_gpus are ints >= 1, but bool is a subclass of int: num_gpus=True
# (or chunks=True) passes as the count 1.
if not math.isfinite(nbytes) or nbytes < 0:
    raise ValueError(f"nbytes must be a non-negative number of bytes, got {nbytes!r}")
for name, value in (("chunks", chunks), ("num_gpus", num_gpus)):
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
phases = tuple(phases)
if not phases or len(set(phases)) != len(phases) or "total" in phases:
    raise ValueError(f"phases must be distinct names other than 'total', got {phases!r}")
share = nbytes / num_gpus
seconds: dict[str, float] = {}
for phase in phases:
    gbps = bandwidths.get(phase)
    if gbps is None or not math.isfinite(gbps) or gbps <= 0:
        raise ValueError(f"phase {phase!r} needs a positive bandwidth in GB/s, got {gbps!r}")
    seconds[phase] = share / (gbps * 1e9)
busy = list(seconds.values())
seconds["total"] = (sum(busy) + (chunks - 1) * max(busy)) / chunks
return seconds
