# Chains only the first block to the salt; later blocks forget the prefix.
if prefix == -1:
    return hash((self.salt, tuple(token_ids)))
return hash(tuple(token_ids))
