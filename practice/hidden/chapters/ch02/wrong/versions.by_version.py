# One span per version: a version that comes back is merged with its first run.
self.token_versions.append(version)
end = len(self.token_versions)
same = [s for s in self.spans if s["version"] == version]
if same:
    same[0]["end"] = end
else:
    self.spans.append({"version": version, "start": end - 1, "end": end})
if self.return_logprob:
    self.output_logprobs.append(self.next_logprob)
    self.next_logprob = None
