if not isinstance(tensors, dict):
    raise TypeError(f"expected a dict of name -> tensor, got {type(tensors).__name__}")
for name, t in tensors.items():
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
# Records the address of the storage (what is held), not of the tensor: the same for a
# tensor at the start of its storage, another address for a view further in.
self.recorded = {}
for name, t in tensors.items():
    storage = t.untyped_storage()
    self.recorded[name] = TensorAddress(storage.data_ptr(), tuple(t.shape), t.dtype, str(t.device), storage)
