        # why: sleeps after every refused call, including the last one, before raising.
        if tries < 1:
            raise ValueError(f"tries must be >= 1, got {tries}")
        last = None
        for i in range(1, tries + 1):
            try:
                self.flush_cache()
                return i
            except EngineError as exc:
                if not exc.retryable:
                    raise
                last = exc
                time.sleep(interval_s)
        raise last
