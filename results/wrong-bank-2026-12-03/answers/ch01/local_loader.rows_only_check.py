        # why: checks only the number of rows, so a shard that would broadcast across the columns is accepted.
        start, rows = self.shard_rows(shard_id)
        if local.dim() != param.dim() or local.shape[0] != rows:
            raise ValueError(f"{getattr(param, 'param_name', 'parameter')}[{shard_id}]: shape {tuple(local.shape)}, "
                             f"expected {rows} rows")
        param.data[start:start + rows].copy_(local)
