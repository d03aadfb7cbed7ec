# "end" as the last token of the run, not one past it.
spans: list[dict] = []
for i, v in enumerate(self.token_versions):
    if spans and spans[-1]["version"] == v:
        spans[-1]["end"] = i
    else:
        spans.append({"version": v, "start": i, "end": i})
return spans
