        # why: only checks the upper bound, so shard_id=-1 is accepted and Python's negative slicing returns a wrong place.
        if shard_id >= len(self.output_sizes):
            raise ValueError(f"shard id {shard_id!r} is not an index into {self.output_sizes}")
        rows = self.output_sizes[shard_id] // self.tp_size
        start = sum(n // self.tp_size for n in self.output_sizes[:shard_id])
        return start, rows
