# Adds this rank's position in the checkpoint to the offset.
if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
    raise ValueError(f"unknown shard {shard_id!r}")
rows = self.output_sizes[shard_id] // self.tp_size
first = sum(size // self.tp_size for size in self.output_sizes[:shard_id])
return first + self.tp_rank * rows, rows
