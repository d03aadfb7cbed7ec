# Resumes after a failed update, then raises an error of its own instead of the engine's:
# the caller can no longer tell a refused update (UpdateError) from a busy engine.
if not isinstance(version, str) or not version:
    raise ValueError(f"the version label must be a non-empty string, got {version!r}")
t0 = time.perf_counter()
if pause_mode is not None:
    self.engine.pause_generation(pause_mode)
phases = {"pause": 1e3 * (time.perf_counter() - t0)}
try:
    ms, nbytes = self._update(named_tensors, version)
except Exception as exc:
    if pause_mode is not None:
        self.engine.continue_generation()
    raise RuntimeError(f"weight sync to {version!r} failed: {exc}") from exc
t1 = time.perf_counter()
if pause_mode is not None:
    self.engine.continue_generation()
_add(phases, ms)
phases["continue"] = 1e3 * (time.perf_counter() - t1)
return {"phases_ms": phases, "bytes": nbytes}
