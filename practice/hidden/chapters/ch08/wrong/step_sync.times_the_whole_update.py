# Times the update as one block: the engine's own phases are lost and replaced by one made-up "update".
if not isinstance(version, str) or not version:
    raise ValueError(f"the version label must be a non-empty string, got {version!r}")
t0 = time.perf_counter()
if pause_mode is not None:
    self.engine.pause_generation(pause_mode)
phases = {"pause": 1e3 * (time.perf_counter() - t0)}
try:
    t = time.perf_counter()
    _, nbytes = self._update(named_tensors, version)
    phases["update"] = 1e3 * (time.perf_counter() - t)
finally:
    t1 = time.perf_counter()
    if pause_mode is not None:
        self.engine.continue_generation()
phases["continue"] = 1e3 * (time.perf_counter() - t1)
return {"phases_ms": phases, "bytes": nbytes}
