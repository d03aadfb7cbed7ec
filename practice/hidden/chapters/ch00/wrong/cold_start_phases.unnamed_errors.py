# Refuses what it must, but every refusal just says "bad marks": the caller is not told which mark.
if not math.isfinite(spawned_at):
    raise ValueError("bad marks")
phases: dict[str, float] = {}
previous = spawned_at
for name, at in marks:
    if name == "total" or name in phases:
        raise ValueError("bad marks")
    if not math.isfinite(at):
        raise ValueError("bad marks")
    if at < previous:
        raise ValueError("bad marks")
    phases[name] = at - previous
    previous = at
phases["total"] = previous - spawned_at
return phases
