# Every rank keeps the first block.
n = loaded.shape[dim]
if n % self.tp_size:
    raise ValueError(f"dimension {dim} does not split into {self.tp_size} parts")
return loaded.narrow(dim, 0, n // self.tp_size)
