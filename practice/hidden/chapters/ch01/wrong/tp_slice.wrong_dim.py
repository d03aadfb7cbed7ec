# Always slices the rows, whatever dimension the layer splits.
n = loaded.shape[0]
if n % self.tp_size:
    raise ValueError(f"dimension 0 does not split into {self.tp_size} parts")
size = n // self.tp_size
return loaded.narrow(0, self.tp_rank * size, size)
