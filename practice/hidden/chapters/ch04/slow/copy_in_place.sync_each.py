# Correct but slow: one copy and one device synchronization per tensor.
pairs = list(named_tensors)  # read once; every check before the first write
for name, t in pairs:
    if name not in self.views:
        raise KeyError(f"checkpoint tensor {name!r} matches no parameter of this model")
    view = self.views[name]
    if view is not None and view.shape != t.shape:
        raise ValueError(f"{name}: checkpoint tensor has shape {tuple(t.shape)}, expected {tuple(view.shape)}")
for name, t in pairs:
    view = self.views[name]
    if view is not None:
        view.copy_(t)
        if view.is_cuda:
            torch.cuda.synchronize()
