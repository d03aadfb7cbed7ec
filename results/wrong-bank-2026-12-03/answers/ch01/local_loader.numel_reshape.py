        # why: checks the element count and reshapes, so a transposed or wrongly shaped shard with the right size is accepted.
        start, rows = self.shard_rows(shard_id)
        target = param.data.narrow(0, start, rows)
        if local.numel() != target.numel():
            raise ValueError(f"{getattr(param, 'param_name', 'parameter')}[{shard_id}]: shape {tuple(local.shape)}, "
                             f"expected {tuple(target.shape)}")
        target.copy_(local.reshape(target.shape))
