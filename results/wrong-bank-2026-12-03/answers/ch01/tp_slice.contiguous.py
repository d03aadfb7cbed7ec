        # why: makes the slice contiguous to be safe, which copies it when splitting columns (dim 1).
        n = loaded.shape[dim]
        if n % self.tp_size:
            raise ValueError(f"dimension {dim} ({n}) is not divisible by tp_size ({self.tp_size})")
        size = n // self.tp_size
        return loaded.narrow(dim, self.tp_rank * size, size).contiguous()
