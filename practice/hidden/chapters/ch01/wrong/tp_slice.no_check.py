# Silently drops the remainder when the dimension does not divide.
size = loaded.shape[dim] // self.tp_size
return loaded.narrow(dim, self.tp_rank * size, size)
