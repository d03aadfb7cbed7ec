# Copies into a fresh tensor (a clone of the view), so the weights never see the values.
grouped = {}
for name, t in named_tensors:
    if name not in self.views:
        raise KeyError(f"checkpoint tensor {name!r} matches no parameter of this model")
    view = self.views[name]
    if view is None:
        continue
    if view.shape != t.shape:
        raise ValueError(f"{name}: checkpoint tensor has shape {tuple(t.shape)}, expected {tuple(view.shape)}")
    dsts, srcs = grouped.setdefault((t.device, t.dtype), ([], []))
    dsts.append(view.clone())
    srcs.append(t)
for dsts, srcs in grouped.values():
    torch._foreach_copy_(dsts, srcs)
