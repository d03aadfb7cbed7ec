        # why: assumes multi-head attention, giving k and v as many heads as q.
        heads = self.total_num_heads // self.tp_size
        rows = heads * self.head_dim
        if shard_id == "q":
            return 0, rows
        if shard_id == "k":
            return rows, rows
        if shard_id == "v":
            return 2 * rows, rows
        raise ValueError(f"shard id {shard_id!r} is not one of q, k, v")
