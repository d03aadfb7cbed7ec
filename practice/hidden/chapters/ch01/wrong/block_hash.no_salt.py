return hash((prefix, tuple(token_ids)))
