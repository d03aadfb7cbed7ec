        # why: checks each value while recording, so a bad value late in the dict leaves a partly filled record behind.
        if not isinstance(tensors, dict):
            raise TypeError(f"tensors must be a dict, got {type(tensors).__name__}")
        self.recorded = {}
        for k, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{k}: expected a torch.Tensor, got {type(t).__name__}")
            self.recorded[k] = TensorAddress(t.data_ptr(), tuple(t.shape), t.dtype, str(t.device),
                                             t.untyped_storage())
