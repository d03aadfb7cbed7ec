# Forgets that each rank holds only 1/tp_size of the heads.
q_rows = self.total_num_heads * self.head_dim
kv_rows = self.total_num_kv_heads * self.head_dim
if shard_id == "q":
    return 0, q_rows
if shard_id == "k":
    return q_rows, kv_rows
if shard_id == "v":
    return q_rows + kv_rows, kv_rows
raise ValueError(f"unknown shard {shard_id!r}")
