    # why: refuses repeated phase names but forgets that a phase may not be called "total".
    if not isinstance(spawned_at, (int, float)) or not math.isfinite(spawned_at):
        raise ValueError(f"spawned_at is not a finite number: {spawned_at!r}")
    out, prev, seen = {}, spawned_at, set()
    for name, t in marks:
        if name in seen:
            raise ValueError(f"phase {name!r} repeats")
        if not isinstance(t, (int, float)) or not math.isfinite(t):
            raise ValueError(f"mark {name!r} is not a finite number: {t!r}")
        if t < prev:
            raise ValueError(f"mark {name!r} is earlier than the one before it")
        seen.add(name)
        out[name] = t - prev
        prev = t
    out["total"] = prev - spawned_at
    return out
