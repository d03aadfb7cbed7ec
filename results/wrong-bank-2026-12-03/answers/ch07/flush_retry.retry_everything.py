        # why: retries on every EngineError, not only retryable ones.
        if tries < 1:
            raise ValueError(f"tries must be >= 1, got {tries}")
        for i in range(1, tries + 1):
            try:
                self.flush_cache()
                return i
            except EngineError:
                if i == tries:
                    raise
                time.sleep(interval_s)
