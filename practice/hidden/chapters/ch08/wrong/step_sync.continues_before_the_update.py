# Pauses and continues at once, then updates: the update lands while requests run.
if not isinstance(version, str) or not version:
    raise ValueError(f"the version label must be a non-empty string, got {version!r}")
t0 = time.perf_counter()
if pause_mode is not None:
    self.engine.pause_generation(pause_mode)
    self.engine.continue_generation()
phases = {"pause": 1e3 * (time.perf_counter() - t0)}
t1 = time.perf_counter()
ms, nbytes = self._update(named_tensors, version)
_add(phases, ms)
phases["continue"] = 1e3 * (time.perf_counter() - t1)
return {"phases_ms": phases, "bytes": nbytes}
