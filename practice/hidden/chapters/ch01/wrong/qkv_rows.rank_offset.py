# Places the shard where this rank's heads sit in the checkpoint, not in the rank's own weight.
q_rows = self.total_num_heads // self.tp_size * self.head_dim
kv_rows = self.total_num_kv_heads // self.tp_size * self.head_dim
start = {"q": 0, "k": q_rows, "v": q_rows + kv_rows}
if shard_id not in start:
    raise ValueError(f"unknown shard {shard_id!r}")
rows = q_rows if shard_id == "q" else kv_rows
return start[shard_id] + self.tp_rank * rows, rows
