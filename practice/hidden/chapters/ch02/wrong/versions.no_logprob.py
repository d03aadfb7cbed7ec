# Tags the token and keeps the spans but forgets the logprob the sampler left for it.
self.token_versions.append(version)
end = len(self.token_versions)
if self.spans and self.spans[-1]["version"] == version:
    self.spans[-1]["end"] = end
else:
    self.spans.append({"version": version, "start": end - 1, "end": end})
