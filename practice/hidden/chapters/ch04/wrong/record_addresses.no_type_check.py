# Trusts its input: a list where a tensor belongs fails later, far from the cause.
self.recorded = {name: TensorAddress(getattr(t, "data_ptr", lambda: 0)(), tuple(getattr(t, "shape", ())),
                                     getattr(t, "dtype", None), str(getattr(t, "device", "cpu")),
                                     t.untyped_storage() if isinstance(t, torch.Tensor) else None)
                 for name, t in dict(tensors).items()}
