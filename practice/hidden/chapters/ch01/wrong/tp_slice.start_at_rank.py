# Starts the slice at index tp_rank instead of tp_rank * size.
n = loaded.shape[dim]
if n % self.tp_size:
    raise ValueError(f"dimension {dim} does not split into {self.tp_size} parts")
return loaded.narrow(dim, self.tp_rank, n // self.tp_size)
