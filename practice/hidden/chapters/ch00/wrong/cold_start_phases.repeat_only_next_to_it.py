if not math.isfinite(spawned_at):
    raise ValueError(f"spawned_at must be finite, got {spawned_at!r}")
phases = {}
previous, previous_name = spawned_at, None
for name, at in marks:
    if name == "total" or name == previous_name:
        raise ValueError(f"phase {name!r}: repeated or reserved name")
    if not math.isfinite(at) or at < previous:
        raise ValueError(f"phase {name!r}: bad mark {at!r} (the one before was {previous!r})")
    phases[name] = at - previous
    previous, previous_name = at, name
phases["total"] = previous - spawned_at
return phases
