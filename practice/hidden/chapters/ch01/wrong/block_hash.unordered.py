# A set forgets the order of the tokens.
return hash((self.salt, prefix, frozenset(token_ids)))
