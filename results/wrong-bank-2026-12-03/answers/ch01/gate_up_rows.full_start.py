        # why: divides the shard's rows by tp_size but computes the start from the full (unsplit) sizes of earlier outputs.
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard id {shard_id!r} is not an index into {self.output_sizes}")
        rows = self.output_sizes[shard_id] // self.tp_size
        start = sum(self.output_sizes[:shard_id])
        return start, rows
