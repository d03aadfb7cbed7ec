# Reports the longest phase as the total, as if the phases overlapped.
if not math.isfinite(spawned_at):
    raise ValueError("spawned_at must be finite")
phases = {}
previous = spawned_at
for name, at in marks:
    if name == "total" or name in phases:
        raise ValueError(f"phase name {name!r} is repeated or reserved")
    if not math.isfinite(at) or at < previous:
        raise ValueError(f"phase {name!r}: bad mark {at!r}")
    phases[name] = at - previous
    previous = at
phases["total"] = max(phases.values(), default=0.0)
return phases
