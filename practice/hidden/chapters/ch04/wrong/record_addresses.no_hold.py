# Records the integers only: freed memory can come back at the recorded address (ABA).
if not isinstance(tensors, dict):
    raise TypeError(f"expected a dict of name -> tensor, got {type(tensors).__name__}")
for name, t in tensors.items():
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
self.recorded = {name: TensorAddress.of(t) for name, t in tensors.items()}
