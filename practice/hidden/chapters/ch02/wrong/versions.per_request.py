# One span per request: the version the request ended with, over every token.
self.token_versions.append(version)
self.spans[:] = [{"version": version, "start": 0, "end": len(self.token_versions)}]
if self.return_logprob:
    self.output_logprobs.append(self.next_logprob)
    self.next_logprob = None
