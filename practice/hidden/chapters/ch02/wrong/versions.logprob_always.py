# Keeps a logprob for every token, also when the request did not ask for logprobs.
self.token_versions.append(version)
end = len(self.token_versions)
if self.spans and self.spans[-1]["version"] == version:
    self.spans[-1]["end"] = end
else:
    self.spans.append({"version": version, "start": end - 1, "end": end})
self.output_logprobs.append(self.next_logprob)
self.next_logprob = None
