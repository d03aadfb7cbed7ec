return hash((self.salt, tuple(token_ids)))
