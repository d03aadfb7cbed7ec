        # why: floors the block size and never checks divisibility, silently dropping the leftover rows.
        size = loaded.shape[dim] // self.tp_size
        return loaded.narrow(dim, self.tp_rank * size, size)
