# Splits each output over the ranks with `/`: equal values, but float row counts.
if shard_id not in range(len(self.output_sizes)):
    raise ValueError(f"no output {shard_id!r} in this layer")
per_rank = [size / self.tp_size for size in self.output_sizes]
return sum(per_rank[:shard_id]), per_rank[shard_id]
