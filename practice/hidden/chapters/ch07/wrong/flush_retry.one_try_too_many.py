# Counts from zero: makes tries + 1 calls before giving up.
if tries < 1:
    raise ValueError(f"tries must be at least 1, not {tries}")
attempt = 0
while True:
    try:
        self.flush_cache()
        return attempt + 1
    except EngineError as exc:
        if not exc.retryable or attempt == tries:
            raise
    attempt += 1
    time.sleep(interval_s)
