# Ignores the pause mode: updates under running requests and never pauses or continues.
if not isinstance(version, str) or not version:
    raise ValueError(f"the version label must be a non-empty string, got {version!r}")
t0 = time.perf_counter()
phases = {"pause": 1e3 * (time.perf_counter() - t0)}
ms, nbytes = self._update(named_tensors, version)
t1 = time.perf_counter()
_add(phases, ms)
phases["continue"] = 1e3 * (time.perf_counter() - t1)
return {"phases_ms": phases, "bytes": nbytes}
