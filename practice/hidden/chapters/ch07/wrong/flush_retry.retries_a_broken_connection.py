# Treats a broken connection as one more thing to wait out: it is retried like a busy engine.
if tries < 1:
    raise ValueError(f"tries must be at least 1, not {tries}")
for attempt in range(1, tries + 1):
    try:
        self.flush_cache()
        return attempt
    except Exception as exc:
        if (isinstance(exc, EngineError) and not exc.retryable) or attempt == tries:
            raise
    time.sleep(interval_s)
raise AssertionError("unreachable")
