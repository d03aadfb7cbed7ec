# Trusts the marks: a clock going backwards gives a negative phase, a repeated name overwrites.
phases = {}
previous = spawned_at
for name, at in marks:
    phases[name] = at - previous
    previous = at
phases["total"] = previous - spawned_at
return phases
