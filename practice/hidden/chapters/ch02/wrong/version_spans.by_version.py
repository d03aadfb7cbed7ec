# One span per version: a version that comes back is merged with its first run.
spans: dict = {}
for i, v in enumerate(self.token_versions):
    if v in spans:
        spans[v]["end"] = i + 1
    else:
        spans[v] = {"version": v, "start": i, "end": i + 1}
return list(spans.values())
