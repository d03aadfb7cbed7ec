    # why: validates every mark's timestamp but never checks that spawned_at itself is finite.
    out, prev = {}, spawned_at
    for name, t in marks:
        if name in out or name == "total":
            raise ValueError(f"bad phase name {name!r}")
        if not isinstance(t, (int, float)) or not math.isfinite(t):
            raise ValueError(f"mark {name!r} is not a finite number: {t!r}")
        if t < prev:
            raise ValueError(f"mark {name!r} is earlier than the one before it")
        out[name] = t - prev
        prev = t
    out["total"] = prev - spawned_at
    return out
