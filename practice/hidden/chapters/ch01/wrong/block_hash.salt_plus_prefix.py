# The salt shifts the chain's starting point: a number added to the prefix.
return hash((prefix + self.salt, tuple(token_ids)))
