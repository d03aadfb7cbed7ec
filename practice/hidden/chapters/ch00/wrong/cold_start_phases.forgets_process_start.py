# Starts the clock at the first mark: the time from the spawn to the first line is lost.
phases = {}
previous = marks[0][1] if marks else spawned_at
for name, at in marks:
    if name == "total" or name in phases:
        raise ValueError(f"phase name {name!r} is repeated or reserved")
    if not math.isfinite(at) or at < previous:
        raise ValueError(f"phase {name!r}: bad mark {at!r}")
    phases[name] = at - previous
    previous = at
phases["total"] = sum(phases.values())
return phases
