        # why: splits the q heads over the ranks but keeps every kv head on each rank.
        q = self.total_num_heads // self.tp_size * self.head_dim
        kv = self.total_num_kv_heads * self.head_dim
        if shard_id == "q":
            return 0, q
        if shard_id == "k":
            return q, kv
        if shard_id == "v":
            return q + kv, kv
        raise ValueError(f"shard id {shard_id!r} is not one of q, k, v")
