        # why: checks only that version is truthy, so a non-string label such as 7 is accepted.
        if not version:
            raise ValueError(f"version must be a non-empty str, got {version!r}")
        t = time.perf_counter()
        if pause_mode is not None:
            self.engine.pause_generation(pause_mode)
        pause_ms = 1e3 * (time.perf_counter() - t)
        try:
            phases, nbytes = self._update(named_tensors, version)
        finally:
            t = time.perf_counter()
            if pause_mode is not None:
                self.engine.continue_generation()
            continue_ms = 1e3 * (time.perf_counter() - t)
        return {"phases_ms": {"pause": pause_ms, **phases, "continue": continue_ms}, "bytes": nbytes}
