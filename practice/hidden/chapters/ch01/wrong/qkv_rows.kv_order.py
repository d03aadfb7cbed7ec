# Stacks k and v before q.
q_rows = self.total_num_heads // self.tp_size * self.head_dim
kv_rows = self.total_num_kv_heads // self.tp_size * self.head_dim
if shard_id == "k":
    return 0, kv_rows
if shard_id == "v":
    return kv_rows, kv_rows
if shard_id == "q":
    return 2 * kv_rows, q_rows
raise ValueError(f"unknown shard {shard_id!r}")
