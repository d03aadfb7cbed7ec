        # why: folds the tokens into their sum to keep the key small, so blocks with the same tokens in another order share a hash.
        return hash((self.salt, prefix, sum(token_ids), len(token_ids)))
