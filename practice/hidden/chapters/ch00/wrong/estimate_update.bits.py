# Bits for bytes: GB/s read as gigabits per second.
if not math.isfinite(nbytes) or nbytes < 0:
    raise ValueError(f"bad nbytes {nbytes!r}")
for name, value in (("chunks", chunks), ("num_gpus", num_gpus)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"bad {name} {value!r}")
phases = tuple(phases)
if not phases or len(set(phases)) != len(phases) or "total" in phases:
    raise ValueError(f"bad phases {phases!r}")
for phase in phases:
    gbps = bandwidths.get(phase)
    if gbps is None or not math.isfinite(gbps) or gbps <= 0:
        raise ValueError(f"phase {phase!r} needs a positive bandwidth")
seconds = {p: 8 * nbytes / num_gpus / (bandwidths[p] * 1e9) for p in phases}
busy = list(seconds.values())
seconds["total"] = (sum(busy) + (chunks - 1) * max(busy)) / chunks
return seconds
