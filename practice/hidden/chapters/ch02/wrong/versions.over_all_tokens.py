# Counts positions over prompt plus output instead of over the output tokens.
self.token_versions.append(version)
end = self.num_tokens
if self.spans and self.spans[-1]["version"] == version:
    self.spans[-1]["end"] = end
else:
    self.spans.append({"version": version, "start": end - 1, "end": end})
if self.return_logprob:
    self.output_logprobs.append(self.next_logprob)
    self.next_logprob = None
