# One version per request: the version the request ended with.
if not self.token_versions:
    return []
return [{"version": self.token_versions[-1], "start": 0, "end": len(self.token_versions)}]
