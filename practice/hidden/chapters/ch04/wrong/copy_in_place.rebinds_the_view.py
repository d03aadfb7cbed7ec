# Points each view at the new tensor instead of writing into the memory it views.
for name, t in named_tensors:
    if name not in self.views:
        raise KeyError(f"checkpoint tensor {name!r} matches no parameter of this model")
    view = self.views[name]
    if view is None:
        continue
    if view.shape != t.shape:
        raise ValueError(f"{name}: checkpoint tensor has shape {tuple(t.shape)}, expected {tuple(view.shape)}")
    view.data = t.to(view.dtype)
