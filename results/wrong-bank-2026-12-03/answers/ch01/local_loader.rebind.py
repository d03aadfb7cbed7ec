        # why: builds the new weight with torch.cat and binds it to param.data, so the parameter's storage moves.
        start, rows = self.shard_rows(shard_id)
        expected = (rows,) + tuple(param.shape[1:])
        check_shape(f"{getattr(param, 'param_name', 'parameter')}[{shard_id}]", local, expected)
        param.data = torch.cat([param.data[:start], local.to(param.dtype), param.data[start + rows:]], dim=0)
