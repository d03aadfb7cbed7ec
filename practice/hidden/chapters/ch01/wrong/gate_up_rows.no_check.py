# Right rows for 0 and 1, but any other id slips through (IndexError, or rows for -1).
first = sum(size // self.tp_size for size in self.output_sizes[:shard_id])
return first, self.output_sizes[shard_id] // self.tp_size
