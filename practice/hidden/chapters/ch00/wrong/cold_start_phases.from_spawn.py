# Every phase counted from the spawn: cumulative times, not durations.
phases = {}
previous = spawned_at
for name, at in marks:
    if name == "total" or name in phases:
        raise ValueError(f"phase name {name!r} is repeated or reserved")
    if not math.isfinite(at) or at < previous:
        raise ValueError(f"phase {name!r}: bad mark {at!r}")
    phases[name] = at - spawned_at
    previous = at
phases["total"] = previous - spawned_at
return phases
