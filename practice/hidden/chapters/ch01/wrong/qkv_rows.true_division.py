# Divides the heads with `/`: the right numbers, but floats (16.0 rows), which no index,
# narrow or slice of a weight accepts.
heads_per_rank = self.total_num_heads / self.tp_size
kv_heads_per_rank = self.total_num_kv_heads / self.tp_size
q_rows = heads_per_rank * self.head_dim
kv_rows = kv_heads_per_rank * self.head_dim
if shard_id == "q":
    return 0, q_rows
if shard_id == "k":
    return q_rows, kv_rows
if shard_id == "v":
    return q_rows + kv_rows, kv_rows
raise ValueError(f"unknown shard {shard_id!r}")
