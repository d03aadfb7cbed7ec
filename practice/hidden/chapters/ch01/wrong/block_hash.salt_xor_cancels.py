# The salt and the previous block's hash both go in by XOR: from the second block on,
# the salt is in twice and cancels.
return hash(tuple(token_ids)) ^ prefix ^ self.salt
