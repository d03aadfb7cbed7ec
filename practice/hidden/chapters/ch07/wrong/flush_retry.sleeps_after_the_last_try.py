# Sleeps after every refused call, the last one too, before it raises: a flush that gives up
# waits one more interval (a second, at slime's pace) for nothing.
if tries < 1:
    raise ValueError(f"tries must be at least 1, not {tries}")
last = None
for attempt in range(1, tries + 1):
    try:
        self.flush_cache()
        return attempt
    except EngineError as exc:
        if not exc.retryable:
            raise
        last = exc
    time.sleep(interval_s)
raise last
