        # why: calls the engine's update_weights_from_tensor directly instead of the sync's own update step, so subclasses' transports are bypassed.
        if not isinstance(version, str) or not version:
            raise ValueError(f"version must be a non-empty str, got {version!r}")
        t = time.perf_counter()
        if pause_mode is not None:
            self.engine.pause_generation(pause_mode)
        pause_ms = 1e3 * (time.perf_counter() - t)
        try:
            result = self.engine.update_weights_from_tensor(named_tensors, weight_version=version)
            phases, nbytes = dict(result["timings_ms"]), result["bytes"]
        finally:
            t = time.perf_counter()
            if pause_mode is not None:
                self.engine.continue_generation()
            continue_ms = 1e3 * (time.perf_counter() - t)
        return {"phases_ms": {"pause": pause_ms, **phases, "continue": continue_ms}, "bytes": nbytes}
