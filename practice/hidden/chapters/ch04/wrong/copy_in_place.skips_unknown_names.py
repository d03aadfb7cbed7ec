# Skips a name it does not know instead of refusing it: a typo'd update "succeeds".
grouped = {}
for name, t in named_tensors:
    view = self.views.get(name)
    if view is None:
        continue
    if view.shape != t.shape:
        raise ValueError(f"{name}: checkpoint tensor has shape {tuple(t.shape)}, expected {tuple(view.shape)}")
    dsts, srcs = grouped.setdefault((t.device, t.dtype), ([], []))
    dsts.append(view)
    srcs.append(t)
for dsts, srcs in grouped.values():
    torch._foreach_copy_(dsts, srcs)
