# Tags every token with the version that made the request's first token.
self.token_versions.append(self.token_versions[0] if self.token_versions else version)
if self.return_logprob:
    self.output_logprobs.append(self.next_logprob)
    self.next_logprob = None
