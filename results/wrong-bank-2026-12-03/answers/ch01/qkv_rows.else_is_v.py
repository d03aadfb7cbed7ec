        # why: treats any id that is not q or k as v instead of refusing it.
        q = self.total_num_heads // self.tp_size * self.head_dim
        kv = self.total_num_kv_heads // self.tp_size * self.head_dim
        if shard_id == "q":
            return 0, q
        if shard_id == "k":
            return q, kv
        return q + kv, kv
