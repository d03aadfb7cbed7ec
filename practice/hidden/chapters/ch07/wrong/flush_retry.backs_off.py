# Backs off exponentially (the interval doubles after each refusal) instead of retrying every
# interval_s: the 60 tries of slime's pace stretch from a minute to years.
if tries < 1:
    raise ValueError(f"tries must be at least 1, not {tries}")
delay = interval_s
for attempt in range(1, tries + 1):
    try:
        self.flush_cache()
        return attempt
    except EngineError as exc:
        if not exc.retryable or attempt == tries:
            raise
    time.sleep(delay)
    delay *= 2
raise AssertionError("unreachable")
