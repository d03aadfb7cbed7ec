# No validation: a missing bandwidth, a zero bandwidth or negative bytes go through.
seconds = {p: nbytes / num_gpus / (bandwidths[p] * 1e9) if bandwidths.get(p) else math.inf for p in phases}
busy = list(seconds.values()) or [0.0]
seconds["total"] = (sum(busy) + (chunks - 1) * max(busy)) / chunks
return seconds
