# Starts the continue's timer right after the pause, before the update: "continue" then
# holds the whole update as well as the resume.
if not isinstance(version, str) or not version:
    raise ValueError(f"the version label must be a non-empty string, got {version!r}")
t0 = time.perf_counter()
if pause_mode is not None:
    self.engine.pause_generation(pause_mode)
t1 = time.perf_counter()
phases = {"pause": 1e3 * (t1 - t0)}
try:
    ms, nbytes = self._update(named_tensors, version)
finally:
    if pause_mode is not None:
        self.engine.continue_generation()
_add(phases, ms)
phases["continue"] = 1e3 * (time.perf_counter() - t1)
return {"phases_ms": phases, "bytes": nbytes}
