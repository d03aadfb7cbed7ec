        # why: records each tensor with TensorAddress.of, which holds no storage, so the ABA hole stays open.
        if not isinstance(tensors, dict):
            raise TypeError(f"tensors must be a dict, got {type(tensors).__name__}")
        for k, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{k}: expected a torch.Tensor, got {type(t).__name__}")
        self.recorded = {k: TensorAddress.of(t) for k, t in tensors.items()}
