# Each block's own salted hash, chained to the previous one by XOR: blocks swapped collide.
return prefix ^ hash((self.salt, tuple(token_ids)))
