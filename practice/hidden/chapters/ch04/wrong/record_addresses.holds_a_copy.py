# Holds a copy's storage, not the tensor's own: the original memory is still free to reuse.
if not isinstance(tensors, dict):
    raise TypeError(f"expected a dict of name -> tensor, got {type(tensors).__name__}")
for name, t in tensors.items():
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
self.recorded = {name: TensorAddress(t.data_ptr(), tuple(t.shape), t.dtype, str(t.device),
                                     t.clone().untyped_storage())
                 for name, t in tensors.items()}
