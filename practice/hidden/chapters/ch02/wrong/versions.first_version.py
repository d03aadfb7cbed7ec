# Tags every token with the version that made the request's first token.
version = self.token_versions[0] if self.token_versions else version
self.token_versions.append(version)
end = len(self.token_versions)
if self.spans and self.spans[-1]["version"] == version:
    self.spans[-1]["end"] = end
else:
    self.spans.append({"version": version, "start": end - 1, "end": end})
if self.return_logprob:
    self.output_logprobs.append(self.next_logprob)
    self.next_logprob = None
