# A span per token: runs of equal versions are never extended.
self.token_versions.append(version)
end = len(self.token_versions)
self.spans.append({"version": version, "start": end - 1, "end": end})
if self.return_logprob:
    self.output_logprobs.append(self.next_logprob)
    self.next_logprob = None
