    # why: compares each mark with the previous mark only, so a first mark earlier than spawned_at gives a negative phase.
    if not isinstance(spawned_at, (int, float)) or not math.isfinite(spawned_at):
        raise ValueError(f"spawned_at is not a finite number: {spawned_at!r}")
    out, prev = {}, None
    for name, t in marks:
        if name in out or name == "total":
            raise ValueError(f"bad phase name {name!r}")
        if not isinstance(t, (int, float)) or not math.isfinite(t):
            raise ValueError(f"mark {name!r} is not a finite number: {t!r}")
        if prev is not None and t < prev:
            raise ValueError(f"mark {name!r} is earlier than the one before it")
        out[name] = t - (spawned_at if prev is None else prev)
        prev = t
    out["total"] = (prev - spawned_at) if prev is not None else 0.0
    return out
