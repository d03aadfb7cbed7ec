# "end" as the last token of the run, not one past it.
self.token_versions.append(version)
last = len(self.token_versions) - 1
if self.spans and self.spans[-1]["version"] == version:
    self.spans[-1]["end"] = last
else:
    self.spans.append({"version": version, "start": last, "end": last})
if self.return_logprob:
    self.output_logprobs.append(self.next_logprob)
    self.next_logprob = None
