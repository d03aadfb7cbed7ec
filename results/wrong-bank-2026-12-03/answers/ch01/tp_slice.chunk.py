        # why: uses torch.chunk, which gives uneven blocks (or fewer of them) instead of refusing a size that does not divide.
        return torch.chunk(loaded, self.tp_size, dim=dim)[self.tp_rank]
