# Times the pause and the continue on the wall clock (time.time), which jumps when the
# system's clock is set, instead of a monotonic clock.
if not isinstance(version, str) or not version:
    raise ValueError(f"the version label must be a non-empty string, got {version!r}")
t0 = time.time()
if pause_mode is not None:
    self.engine.pause_generation(pause_mode)
phases = {"pause": 1e3 * (time.time() - t0)}
try:
    ms, nbytes = self._update(named_tensors, version)
finally:
    t1 = time.time()
    if pause_mode is not None:
        self.engine.continue_generation()
_add(phases, ms)
phases["continue"] = 1e3 * (time.time() - t1)
return {"phases_ms": phases, "bytes": nbytes}
