# Pauses inside the try whose finally continues: when the engine refuses the pause (an
# unknown mode, or already paused by someone else in another mode), the finally still
# calls continue_generation, and resumes a pause this sync never made.
if not isinstance(version, str) or not version:
    raise ValueError(f"the version label must be a non-empty string, got {version!r}")
t0 = time.perf_counter()
try:
    if pause_mode is not None:
        self.engine.pause_generation(pause_mode)
    phases = {"pause": 1e3 * (time.perf_counter() - t0)}
    ms, nbytes = self._update(named_tensors, version)
finally:
    t1 = time.perf_counter()
    if pause_mode is not None:
        self.engine.continue_generation()
_add(phases, ms)
phases["continue"] = 1e3 * (time.perf_counter() - t1)
return {"phases_ms": phases, "bytes": nbytes}
