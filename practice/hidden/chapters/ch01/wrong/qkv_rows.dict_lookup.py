# Right rows, but an unknown shard id escapes as a KeyError instead of the promised ValueError.
q_rows = self.total_num_heads // self.tp_size * self.head_dim
kv_rows = self.total_num_kv_heads // self.tp_size * self.head_dim
return {"q": (0, q_rows), "k": (q_rows, kv_rows), "v": (q_rows + kv_rows, kv_rows)}[shard_id]
