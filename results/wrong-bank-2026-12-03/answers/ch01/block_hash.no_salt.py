        # why: chains the prefix and the tokens but leaves the salt out, so a weight update does not invalidate old blocks.
        return hash((prefix, tuple(token_ids)))
