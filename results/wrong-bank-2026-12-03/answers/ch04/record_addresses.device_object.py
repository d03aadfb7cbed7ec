        # why: records the device as the torch.device object rather than its string, so records differ from TensorAddress.of.
        if not isinstance(tensors, dict):
            raise TypeError(f"tensors must be a dict, got {type(tensors).__name__}")
        for k, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{k}: expected a torch.Tensor, got {type(t).__name__}")
        self.recorded = {k: TensorAddress(t.data_ptr(), tuple(t.shape), t.dtype, t.device, t.untyped_storage())
                         for k, t in tensors.items()}
