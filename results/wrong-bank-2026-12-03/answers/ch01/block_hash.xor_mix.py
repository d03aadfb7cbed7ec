        # why: mixes the parts with XOR, so swapping the prefix and salt values (or equal parts cancelling) collide.
        return hash(self.salt) ^ prefix ^ hash(tuple(token_ids))
