# Runs out of tries and returns as if the flush had happened.
if tries < 1:
    raise ValueError(f"tries must be at least 1, not {tries}")
for attempt in range(1, tries + 1):
    try:
        self.flush_cache()
        return attempt
    except EngineError as exc:
        if not exc.retryable:
            raise
    time.sleep(interval_s)
return tries
