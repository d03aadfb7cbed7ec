        # why: keeps the tensor object itself as the "storage", which a later rebind of param.data frees under it.
        if not isinstance(tensors, dict):
            raise TypeError(f"tensors must be a dict, got {type(tensors).__name__}")
        for k, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{k}: expected a torch.Tensor, got {type(t).__name__}")
        self.recorded = {k: TensorAddress(t.data_ptr(), tuple(t.shape), t.dtype, str(t.device), t)
                         for k, t in tensors.items()}
