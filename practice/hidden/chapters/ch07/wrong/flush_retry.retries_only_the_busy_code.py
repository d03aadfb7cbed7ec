# Retries only the refusal the docstring names (400 requests_in_flight), not every retryable error:
# a 503 paused is raised at once, and a non-retryable requests_in_flight is retried.
if tries < 1:
    raise ValueError(f"tries must be at least 1, not {tries}")
for attempt in range(1, tries + 1):
    try:
        self.flush_cache()
        return attempt
    except EngineError as exc:
        if exc.code != "requests_in_flight" or attempt == tries:
            raise
    time.sleep(interval_s)
raise AssertionError("unreachable")
