# Sends the weights without their label: the engine keeps serving under the old version name.
if not isinstance(version, str) or not version:
    raise ValueError(f"the version label must be a non-empty string, got {version!r}")
t0 = time.perf_counter()
if pause_mode is not None:
    self.engine.pause_generation(pause_mode)
phases = {"pause": 1e3 * (time.perf_counter() - t0)}
try:
    result = self.engine.update_weights_from_tensor(named_tensors)
    ms, nbytes = dict(result["timings_ms"]), result["bytes"]
finally:
    t1 = time.perf_counter()
    if pause_mode is not None:
        self.engine.continue_generation()
_add(phases, ms)
phases["continue"] = 1e3 * (time.perf_counter() - t1)
return {"phases_ms": phases, "bytes": nbytes}
