# Assumes as many key/value heads as query heads (multi-head attention): wrong under GQA/MQA.
q_rows = self.total_num_heads // self.tp_size * self.head_dim
if shard_id == "q":
    return 0, q_rows
if shard_id == "k":
    return q_rows, q_rows
if shard_id == "v":
    return 2 * q_rows, q_rows
raise ValueError(f"unknown shard {shard_id!r}")
