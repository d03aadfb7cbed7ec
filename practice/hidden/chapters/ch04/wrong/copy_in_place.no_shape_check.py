# Trusts the caller's validation: a broadcastable tensor is silently spread over the view.
grouped = {}
for name, t in named_tensors:
    if name not in self.views:
        raise KeyError(f"checkpoint tensor {name!r} matches no parameter of this model")
    view = self.views[name]
    if view is None:
        continue
    dsts, srcs = grouped.setdefault((t.device, t.dtype), ([], []))
    dsts.append(view)
    srcs.append(t)
for (device, _), (dsts, srcs) in grouped.items():
    if device == dsts[0].device:
        torch._foreach_copy_(dsts, srcs)
    else:
        for dst, src in zip(dsts, srcs):
            dst.copy_(src, non_blocking=True)
