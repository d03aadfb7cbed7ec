# Retries every error, a wrong key's 403 included, instead of raising what cannot get better.
if tries < 1:
    raise ValueError(f"tries must be at least 1, not {tries}")
for attempt in range(1, tries + 1):
    try:
        self.flush_cache()
        return attempt
    except EngineError:
        if attempt == tries:
            raise
    time.sleep(interval_s)
raise AssertionError("unreachable")
