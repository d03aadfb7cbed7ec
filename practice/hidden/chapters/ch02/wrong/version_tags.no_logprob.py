# Tags the token but forgets the logprob the sampler left for it.
self.token_versions.append(version)
