# Assumes every output has the same size (true for gate and up, not in general).
if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
    raise ValueError(f"unknown shard {shard_id!r}")
rows = self.out_features // len(self.output_sizes)
return shard_id * rows, rows
