# Checks every shape first and skips a name with no view only when copying: a tied
# lm_head.weight (its view is None) fails with an AttributeError instead of being skipped.
pairs = list(named_tensors)
for name, t in pairs:
    if name not in self.views:
        raise KeyError(f"checkpoint tensor {name!r} matches no parameter of this model")
    if self.views[name].shape != t.shape:
        raise ValueError(f"{name}: checkpoint tensor has shape {tuple(t.shape)}, "
                         f"expected {tuple(self.views[name].shape)}")
dsts, srcs = [], []
for name, t in pairs:
    if self.views[name] is not None:
        dsts.append(self.views[name])
        srcs.append(t)
if dsts:
    torch._foreach_copy_(dsts, srcs)
