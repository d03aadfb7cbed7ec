# Divides the size by tp_size but not the offset: the earlier outputs' full sizes.
if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
    raise ValueError(f"unknown shard {shard_id!r}")
return sum(self.output_sizes[:shard_id]), self.output_sizes[shard_id] // self.tp_size
