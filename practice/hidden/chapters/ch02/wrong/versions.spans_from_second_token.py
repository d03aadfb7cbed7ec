# Rebuilds the runs from the tags, but from the second tag on: the first token is left out.
self.token_versions.append(version)
runs = []
for i, v in enumerate(self.token_versions[1:], start=1):
    if runs and runs[-1]["version"] == v:
        runs[-1]["end"] = i + 1
    else:
        runs.append({"version": v, "start": i, "end": i + 1})
self.spans[:] = runs
if self.return_logprob:
    self.output_logprobs.append(self.next_logprob)
    self.next_logprob = None
