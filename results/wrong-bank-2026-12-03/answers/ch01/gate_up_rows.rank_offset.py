        # why: adds this rank's offset, as if the fused weight were indexed globally, though the answer is the same on every rank.
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard id {shard_id!r} is not an index into {self.output_sizes}")
        rows = self.output_sizes[shard_id] // self.tp_size
        start = sum(n // self.tp_size for n in self.output_sizes[:shard_id]) + self.tp_rank * rows
        return start, rows
