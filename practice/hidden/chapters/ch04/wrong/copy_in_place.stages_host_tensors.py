# Moves every host tensor to the device first and then copies it into its view: a second
# device copy of each tensor (all of them held until the grouped copy), double the memory.
grouped = {}
for name, t in named_tensors:
    if name not in self.views:
        raise KeyError(f"checkpoint tensor {name!r} matches no parameter of this model")
    view = self.views[name]
    if view is None:
        continue
    if view.shape != t.shape:
        raise ValueError(f"{name}: checkpoint tensor has shape {tuple(t.shape)}, expected {tuple(view.shape)}")
    dsts, srcs = grouped.setdefault(t.dtype, ([], []))
    dsts.append(view)
    srcs.append(t)
for dsts, srcs in grouped.values():
    torch._foreach_copy_(dsts, [s.to(d.device, non_blocking=True) for d, s in zip(dsts, srcs)])
